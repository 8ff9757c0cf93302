"""Each rank's peak host memory while it loads its shards of a real-dimension checkpoint, beside the checkpoint's size.

For each world size, gloo ranks on the CPU (``torch.multiprocessing``) build the model on ``meta``, shard it with
FSDP2 (``kernels_torch.parallel.parallelize.parallelize``: every decoder layer and the root ``Shard(0)`` over all ranks, the
stacked routed experts by expert), materialise it (``to_empty``) and fill it with
``kernels_torch.parallel.load.load_sharded``. A rank reports its bytes read, the bytes it owns (in the model dtype),
and its resident memory: ``VmHWM`` of ``/proc/self/status`` (the peak resident set, anonymous and file pages)
after ``/proc/self/clear_refs`` reset it just before ``to_empty``, minus ``VmRSS`` at that moment ("grown"), and the
absolute peak. ``--one-process`` adds ``kernels_torch.model.load_model`` (the whole model in one process) as the
baseline. ``--export DIR`` then has every world write the loaded model with
``kernels_torch.parallel.export.export_sharded`` (each rank its own files) and compares the files byte for byte with
the checkpoint's (its weights are the checkpoint's, which ``save_model`` writes back unchanged). Prints tables and
writes JSON.

    kimi init --preset k3.1-pro --layers 2 --set num_experts=16 --out /tmp/k31_2l
    python benchmarks/sharded_load.py --checkpoint /tmp/k31_2l --world 2 4 --one-process --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_peak() -> bool:
    """Reset VmHWM to the current resident set (Linux >= 4.0); False where the kernel refuses it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rank(rank: int, world: int, port: int, ckpt: str, dtype: str, out: str, export: str | None) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        from kernels_torch.model import KimiK3Model, cast_model
        from kernels_torch.parallel.fsdp import init_mesh
        from kernels_torch.parallel.load import load_sharded
        from kernels_torch.parallel.parallelize import parallelize
        from kimi.checkpoint import CheckpointReader

        reader = CheckpointReader(ckpt)
        with torch.device("meta"):
            model = cast_model(KimiK3Model(reader.config), getattr(torch, dtype))
        parallelize(model, init_mesh(dp=world, cp=1))
        dist.barrier()
        reset = _reset_peak()
        before = _status("VmRSS")
        t0 = time.perf_counter()
        model.to_empty(device="cpu")
        stats = load_sharded(model, reader)
        wall = time.perf_counter() - t0
        rec = {
            "world": world,
            "rank": rank,
            "owned_bytes": stats.owned_bytes,
            "bytes_read": stats.bytes_read,
            "rss_before": before,
            "peak_rss": _status("VmHWM"),
            "grown": _status("VmHWM") - before,
            "load_s": round(wall, 2),
            "peak_reset": reset,
        }
        if export:
            from kernels_torch.parallel.export import export_sharded

            dist.barrier()
            _reset_peak()
            before = _status("VmRSS")
            t0 = time.perf_counter()
            rec["export_files"] = export_sharded(model, f"{export}/world{world}")
            rec["export_s"] = round(time.perf_counter() - t0, 2)
            rec["export_grown"] = _status("VmHWM") - before
        Path(out, f"{world}_{rank}.json").write_text(json.dumps(rec))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _one(ckpt: str, dtype: str, out: str) -> None:
    from kernels_torch.model import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    import kimi.checkpoint  # noqa: F401 - imported before the reset, as the ranks import theirs

    reset = _reset_peak()
    before = _status("VmRSS")
    t0 = time.perf_counter()
    model = load_model(ckpt, dtype=getattr(torch, dtype))
    wall = time.perf_counter() - t0
    owned = sum(p.numel() * p.element_size() for p in model.parameters())
    rec = {"world": 1, "rank": 0, "owned_bytes": owned, "bytes_read": None, "rss_before": before,
           "peak_rss": _status("VmHWM"), "grown": _status("VmHWM") - before, "load_s": round(wall, 2),
           "how": "load_model", "peak_reset": reset}  # fmt: skip
    Path(out, "1_0.json").write_text(json.dumps(rec))


def _same_bytes(a: Path, b: Path, piece: int = 64 * 2**20) -> bool:
    if not b.is_file() or a.stat().st_size != b.stat().st_size:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(piece), fb.read(piece)
            if x != y:
                return False
            if not x:
                return True


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    from kimi.arrays import numpy_dtype
    from kimi.checkpoint import CheckpointReader
    from kimi.layout import stored_layout

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--world", type=int, nargs="*", default=[2, 4])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--one-process", action="store_true", help="also kernels_torch.model.load_model in one process")
    p.add_argument("--json", default=None)
    p.add_argument(
        "--export",
        default=None,
        help="folder: each world also writes the loaded model with export_sharded into DIR/world{N}; the files are "
        "compared byte for byte with the checkpoint's (the weights are the checkpoint's own, so save_model would "
        "write the same files)",
    )
    a = p.parse_args(argv)
    reader = CheckpointReader(a.checkpoint)
    cfg = reader.config
    size = sum((Path(a.checkpoint) / f).stat().st_size for f in reader.files)
    largest = max(s.numel * numpy_dtype(s.dtype).itemsize for s in stored_layout(cfg))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        if a.one_process:
            proc = ctx.Process(target=_one, args=(a.checkpoint, a.dtype, tmp))
            proc.start()
            proc.join()
            rows.append(json.loads(Path(tmp, "1_0.json").read_text()))
        for world in a.world:
            mp.spawn(_rank, args=(world, _port(), a.checkpoint, a.dtype, tmp, a.export), nprocs=world, join=True)
            rows += [json.loads(Path(tmp, f"{world}_{r}.json").read_text()) for r in range(world)]
    head = (
        f"checkpoint {a.checkpoint}: {cfg.num_hidden_layers} layers, {cfg.num_experts} experts, "
        f"{cfg.quant_method or 'bf16'} experts; files {size / GIB:.3f} GiB; largest stored tensor "
        f"{largest / GIB:.3f} GiB; model dtype {a.dtype}"
    )
    print(head)
    print("| world | rank | owned GiB | read GiB | peak RSS GiB | grown GiB | bound 1.1 x (owned + largest) | load s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        bound = 1.1 * (r["owned_bytes"] + largest)
        read = "-" if r["bytes_read"] is None else f"{r['bytes_read'] / GIB:.3f}"
        print(
            f"| {r['world']} | {r['rank']} | {r['owned_bytes'] / GIB:.3f} | {read} | {r['peak_rss'] / GIB:.3f} | "
            f"{r['grown'] / GIB:.3f} | {bound / GIB:.3f} | {r['load_s']} |"
        )
    same = {}
    if a.export:
        print("| world | rank | files written | export s | grown while exporting GiB |")
        print("|---|---|---|---|---|")
        for r in rows:
            if "export_files" in r:
                print(f"| {r['world']} | {r['rank']} | {len(r['export_files'])} | {r['export_s']} | "
                      f"{r['export_grown'] / GIB:.3f} |")  # fmt: skip
        for world in a.world:
            names = sorted([*reader.files, "config.json", "model.safetensors.index.json"])
            same[world] = all(_same_bytes(Path(a.checkpoint, n), Path(a.export, f"world{world}", n)) for n in names)
            print(f"world {world}: export byte-identical to the checkpoint's {len(names)} files: {same[world]}")
    if a.json:
        Path(a.json).write_text(
            json.dumps(
                {
                    "checkpoint_bytes": size,
                    "largest_stored_bytes": largest,
                    "dtype": a.dtype,
                    "config": {"layers": cfg.num_hidden_layers, "experts": cfg.num_experts, "quant": cfg.quant_method},
                    "rows": rows,
                    "export_identical": same,
                },
                indent=1,
            )  # fmt: skip
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
