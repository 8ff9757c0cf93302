"""The host copy rate of activation offload: device -> pinned host and back, GB/s, from 1 MB to 1 GB (CUDA only).

``kimi train --offload-activations`` (``kernels_torch.activation_memory.save_on_host``) copies each saved tensor into a
pinned host tensor by a ``non_blocking`` copy on a side CUDA stream in the forward, and back on the compute stream
when the backward reads it. This measures those two copies as the hooks issue them, per size:

* ``d2h``: device -> pinned host on a side stream (``torch.empty(..., pin_memory=True)``, torch's caching host
  allocator, warm), alone;
* ``h2d``: pinned host -> device on the current stream, alone;
* ``d2h_under_compute``: the side-stream copy while the compute stream runs bf16 matmuls (8192^3, enough of them to
  outlast the copy): the rate the forward sees when the copy hides behind compute, and ``compute_slowdown``, the
  matmuls' time with the copy beside them over their time alone.

Each rate is bytes / time of the median of ``--repeats`` copies timed with CUDA events on the copy's stream
(1 GB = 10^9 bytes). Writes ``{"device", "torch", "date", "rows": [{"mb", "d2h_gbps", "h2d_gbps",
"d2h_under_compute_gbps", "compute_slowdown"}]}`` to ``--out`` and prints a table.

    python benchmarks/offload_copy.py --out results/offload_copy.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

SIZES_MB = (1, 4, 16, 64, 256, 1024)


def _time(stream: torch.cuda.Stream, fn, repeats: int) -> float:
    """Median seconds of ``fn()`` enqueued on ``stream``, timed with events on it (after one warm-up)."""
    times = []
    for r in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            fn()
            end.record(stream)
        end.synchronize()
        if r:
            times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def measure(mb: int, repeats: int) -> dict:
    n = mb * 10**6 // 2
    dev = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
    back = torch.empty_like(dev)
    side, main = torch.cuda.Stream(), torch.cuda.current_stream()
    nbytes = n * 2
    d2h = _time(side, lambda: host.copy_(dev, non_blocking=True), repeats)
    h2d = _time(main, lambda: back.copy_(host, non_blocking=True), repeats)
    assert torch.equal(back, dev), "the round trip changed the values"
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    k = max(1, int(d2h / 1.4e-3) + 1)  # an 8192^3 bf16 matmul takes about 1.4 ms on an H100 / H200

    def compute():
        for _ in range(k):
            a @ a

    alone = _time(main, compute, repeats)
    under, with_copy = [], []
    for r in range(repeats + 1):
        c0, c1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c0.record(main)
        compute()
        c1.record(main)
        side.wait_event(c0)
        with torch.cuda.stream(side):
            s0.record(side)
            host.copy_(dev, non_blocking=True)
            s1.record(side)
        torch.cuda.synchronize()
        if r:
            under.append(s0.elapsed_time(s1) * 1e-3)
            with_copy.append(c0.elapsed_time(c1) * 1e-3)
    return {
        "mb": mb,
        "d2h_gbps": nbytes / d2h / 1e9,
        "h2d_gbps": nbytes / h2d / 1e9,
        "d2h_under_compute_gbps": nbytes / statistics.median(under) / 1e9,
        "compute_slowdown": statistics.median(with_copy) / alone,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=int, nargs="+", default=list(SIZES_MB), help="copy sizes, MB (10^6 bytes)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "offload_copy.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("offload_copy: needs a CUDA device (it measures device <-> pinned host copies)", file=sys.stderr)
        return 2
    if any(s < 1 for s in args.sizes_mb) or args.repeats < 1:
        ap.error(f"--sizes-mb/--repeats: got {args.sizes_mb}/{args.repeats}, expected positive integers")
    rows = [measure(mb, args.repeats) for mb in args.sizes_mb]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
           "rows": rows}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1))
    print(f"{out['device']}, torch {out['torch']}\n{'MB':>6} {'D2H GB/s':>9} {'H2D GB/s':>9} {'D2H+mm GB/s':>12} "
          f"{'mm slowdown':>11}")  # fmt: skip
    for r in rows:
        print(
            f"{r['mb']:>6} {r['d2h_gbps']:>9.1f} {r['h2d_gbps']:>9.1f} {r['d2h_under_compute_gbps']:>12.1f} "
            f"{r['compute_slowdown']:>11.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
