"""Benchmark: context parallelism (CP = 2, NCCL) of the first four real-dimension K3.1 layers at 64K and 128K tokens,
against one GPU at half the length. Written for the two-GPU machine (``nvidia-h200-x2``); **not run yet**.

The model is benchmark 5's (``train_step_4layers.build``: ``k3.1-pro`` truncated to 4 layers, KDA, KDA, KDA, DSA,
routed experts shrunk to ``--experts`` with ``--experts-per-token`` active, every other dimension real, random bf16
weights), ``backend="cudnn"`` (KDA on fla's Triton kernels), activation recomputation per decoder layer. One step =
forward + backward of the cross-entropy of the bf16 logits against random targets, CUDA-event timed after two
warm-ups, median of ``--repeats``.

* CP rows (both ranks): the row of ``T`` tokens is split in two contiguous shards (``kernels_torch.parallel.context``);
  one packed document spans both ranks (the KDA state and conv windows cross the boundary). Reported: ms per step
  (the slower rank), tokens/s per GPU = T / 2 / step time, peak memory per GPU (each rank).
* Baseline rows (rank 0 alone, rank 1 waits): the same model on one GPU at ``T / 2`` tokens (the same tokens per
  GPU), the layer's own ``cudnn`` path.

Caveat, in the output as ``dsa_backend``: under CP the DSA layer runs its ``sdpa`` path (the ``cudnn`` DSA layer is
refused under CP: its cuDNN indexer/top-k driver takes whole documents of one rank), which forms ``[T/2, T]`` fp32
indexer scores and a dense mask: expect it to dominate the time and memory, and an ``oom`` row at 128K. The baseline
runs cuDNN's sparse DSA. So the comparison measures today's CP, not the best CP.

    torchrun --nproc-per-node 2 benchmarks/cp_4layers.py --seq-lens 65536 131072 --out results/cp_4layers.json

Writes ``{"device", "torch", "date", "world_size", "rows": [...]}``; rows with ``mode`` (cp2 / one_gpu),
``seq_len`` (global tokens of the step), ``tokens_per_gpu``, ``ms``, ``tokens_per_s_per_gpu``, ``peak_gib`` (list per
rank), ``status``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import time_ms  # noqa: E402
from train_step_4layers import build, recompute_layers  # noqa: E402

from kernels_torch.mla import GatedMLA  # noqa: E402
from kernels_torch.parallel.context import ContextParallel  # noqa: E402
from kimi.config import load_config  # noqa: E402


def one_step_fn(model, ids, cu, target, cp: ContextParallel | None):
    """A closure running forward + backward of one step (CP: on this rank's shard)."""

    def step():
        if cp is not None:
            ids_l, cu_l = cp.shard(ids, cu)
            tgt = cp.shard_like(target[None])[0]
        else:
            ids_l, cu_l, tgt = ids, cu, target
        logits = model(ids_l, cu_l)
        loss = torch.nn.functional.cross_entropy(logits[0], tgt)
        loss.backward()
        model.zero_grad(set_to_none=True)

    return step


def run_row(cfg, T: int, repeats: int, cp_world: int, dsa_backend: str) -> dict:
    """One measurement; ``cp_world`` 1 = this GPU alone on T tokens."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row = {"seq_len": T, "tokens_per_gpu": T // cp_world, "dsa_backend": dsa_backend if cp_world > 1 else "cudnn"}
    model = cp = None
    try:
        torch.manual_seed(0)
        model = build(cfg, "cudnn")
        if cp_world > 1:
            for m in model.modules():  # the cudnn DSA layer is refused under CP (module docstring)
                if isinstance(m, GatedMLA):
                    m.backend = dsa_backend
            cp = ContextParallel(model)
        recompute_layers(model)
        g = torch.Generator(device="cuda").manual_seed(1)
        V = cfg.vocab_size
        ids = torch.randint(0, V, (1, T), device="cuda", generator=g)  # the same on every rank
        target = torch.randint(0, V, (T,), device="cuda", generator=g)
        cu = torch.tensor([0, T // 8, T], dtype=torch.int64)  # a short document, then one crossing the ranks
        ms = time_ms(one_step_fn(model, ids, cu, target, cp), warmup=2, min_reps=repeats, max_reps=repeats)[0]
        row.update(ms=ms, status="ok")
    except torch.OutOfMemoryError:
        row.update(ms=None, status="oom")
    except Exception as e:  # noqa: BLE001 - record the failure, keep benchmarking
        row.update(ms=None, status=f"error: {type(e).__name__}: {e}"[:300])
    if cp is not None:
        cp.remove()
    row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 131072])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--experts-per-token", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dsa-backend", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "cp_4layers.json")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    cfg = (
        load_config("k3.1-pro")
        .truncated(4)
        .replace(num_experts=args.experts, num_experts_per_token=args.experts_per_token)
    )
    rows = []
    for T in args.seq_lens:
        row = run_row(cfg, T, args.repeats, world, args.dsa_backend)
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        ok = all(r["status"] == "ok" for r in gathered)
        ms = max(r["ms"] for r in gathered) if ok else None
        rows.append(
            {
                "mode": f"cp{world}",
                **{k: row[k] for k in ("seq_len", "tokens_per_gpu", "dsa_backend")},
                "ms": ms,
                "tokens_per_s_per_gpu": T / world / ms * 1e3 if ok else None,
                "peak_gib": [r["peak_gib"] for r in gathered],
                "status": "ok" if ok else "; ".join(sorted({r["status"] for r in gathered if r["status"] != "ok"})),
            }
        )
        if rank == 0:  # the baseline: one GPU at the same tokens per GPU
            base = run_row(cfg, T // world, args.repeats, 1, "cudnn")
            rows.append(
                {
                    "mode": "one_gpu",
                    **{k: base[k] for k in ("seq_len", "tokens_per_gpu", "dsa_backend", "ms", "status")},
                    "tokens_per_s_per_gpu": base["seq_len"] / base["ms"] * 1e3 if base["ms"] else None,
                    "peak_gib": [base["peak_gib"]],
                }
            )
            for r in rows[-2:]:
                print(json.dumps(r), flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            doc = {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "date": time.strftime("%Y-%m-%d"),
                "world_size": world,
                "rows": rows,
            }
            args.out.write_text(json.dumps(doc, indent=1))
        dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
