"""Memory of one rank for the real K3.1 Pro under the parallel layouts ``kimi train`` supports, computed by the code:
the model built on the ``meta`` device and sharded exactly as the trainer shards it
(``kimi_tools.train.parallel.TrainParallel.setup``: ``kernels_torch.parallel.parallelize.parallelize`` over a
``ParallelMesh``, bf16 mixed precision with fp32 sharded masters, the checkpoint's fp32 tensors whole), in one process
per layout under a fake process group (``torch.testing._internal.distributed.fake_pg``: no communication, every
collective a no-op), then each parameter's local shard counted on rank 0 (the rank FSDP2's uneven chunks give the
most).

Bytes per local element: a trainable parameter 16 B (fp32 master 4, fp32 gradient 4, AdamW's two fp32 moments 8:
``kimi train``'s LM stage: everything but the DSA indexers and the router bias); a frozen one its stored dtype (bf16 2,
fp32 4). On top while a layer runs, its gathered bf16 parameters and their bf16 gradients (``unit_gb``: the largest
FSDP2 unit, 4 B per element), and activations (not counted here). Units: GB = 10^9 bytes, GiB = 2^30 bytes.

    python benchmarks/parallel_memory.py                       # the default layouts, a table and results/*.json
    python benchmarks/parallel_memory.py --layouts 512:64 1024:128   # WORLD:EP (dp = WORLD, cp = 1)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LAYOUTS = ["64:8", "256:64", "512:64", "512:64:2", "1024:128"]


def one(world: int, ep: int, cp: int, layers: int | None) -> dict:
    """The rank-0 counts of one layout (run in its own process: one fake process group per process)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    sys.path.insert(0, str(ROOT))
    from kernels_torch.model import KimiK3Model
    from kernels_torch.parallel.fsdp import fp32_compute_params, init_mesh
    from kernels_torch.parallel.parallelize import ParallelPolicy, parallelize
    from kimi.config import load_config
    from kimi.layout import param_layout
    from kimi_tools.train.stages import LMStage

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    cfg = load_config("k3.1-pro")
    cfg = cfg.truncated(layers) if layers else cfg
    fp32 = {s.name for s in param_layout(cfg) if s.dtype == "float32"}
    with torch.device("meta"):
        model = KimiK3Model(cfg)
    stage = LMStage(cfg)
    for n, p in model.named_parameters():  # the checkpoint's dtypes (kernels_torch.model.cast_model's rule)
        p.data = p.data.to(torch.float32 if n in fp32 else torch.bfloat16)
        p.requires_grad_(stage.trainable(n))
    ignored = set(fp32_compute_params(model, torch.bfloat16))
    policy = ParallelPolicy(param_dtype=torch.bfloat16, gradient_divide_factor=1.0)
    parallelize(model, init_mesh(dp=world // cp, cp=cp, ep=ep), policy, ignored_params=ignored)
    states = params = 0
    for p in model.parameters():
        local = (p.to_local() if isinstance(p, DTensor) else p).numel()
        params += local
        states += local * (16 if p.requires_grad else p.element_size())
    # a layer's gathered parameters: the dense ones whole, its routed experts this rank's ep share (global numel / ep)
    unit = max(
        sum(p.numel() // (ep if ".experts." in n else 1) for n, p in layer.named_parameters())
        for layer in model.model.layers
    )
    return {
        "world": world,
        "dp": world // cp,
        "cp": cp,
        "ep": ep,
        "efsdp": world // ep,
        "layers": cfg.num_hidden_layers,
        "total_params": sum(p.numel() for p in model.parameters()),
        "rank0_params": params,
        "rank0_states_gb": states / 1e9,
        "rank0_states_gib": states / 2**30,
        "unit_gb": unit * 4 / 1e9,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS, help="WORLD:EP[:CP] (dp = WORLD / CP)")
    ap.add_argument("--layers", type=int, help="the first N layers only (default all 93)")
    ap.add_argument("--one", nargs=3, type=int, help=argparse.SUPPRESS)  # WORLD EP CP, in a child process
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "parallel_memory.json")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(*args.one, args.layers)))
        return 0
    rows = []
    for spec in args.layouts:
        world, ep, cp = ([*map(int, spec.split(":")), 1])[:3]
        cmd = [sys.executable, __file__, "--one", str(world), str(ep), str(cp)]
        cmd += ["--layers", str(args.layers)] if args.layers else []
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if r.returncode:
            print(r.stderr[-2000:], file=sys.stderr)
            return r.returncode
        row = json.loads(r.stdout.strip().splitlines()[-1])
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print(f"\n{'world':>6} {'dp':>5} {'cp':>3} {'ep':>4} {'efsdp':>5} {'params/rank':>12} {'states GB':>10} "
          f"{'GiB':>7} {'+unit GB':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['world']:>6} {r['dp']:>5} {r['cp']:>3} {r['ep']:>4} {r['efsdp']:>5} {r['rank0_params'] / 1e9:>11.2f}B "
            f"{r['rank0_states_gb']:>10.1f} {r['rank0_states_gib']:>7.1f} {r['unit_gb']:>8.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
