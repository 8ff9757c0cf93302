"""SiTU-GLU activation on one GPU: the plain ops of ``kernels_torch.moe.situ`` (under autograd) against the fused
``kernels_torch.ops.situ.situ_glu`` (Triton kernels, and its torch twin), forward + backward, bf16.

Shapes: N = 8192 tokens x I = 33792 (the dense layer 0) and N = 65536 x I = 3072 (a routed expert's tokens, or a
shared expert's width per half). Time: median of CUDA-event-timed fwd+bwd calls after warm-up (``_timing.time_ms``).
GB/s: the bytes the fused kernels must move (forward reads a, b and writes out; backward reads dout, a, b and writes
da, db: 8 tensors of N x I bf16) over the time; the same count is used for every row, so it reads as "effective".
Saved MiB: what autograd keeps between forward and backward (``torch.autograd.graph.saved_tensors_hooks``), and the
peak extra memory of one fwd+bwd (``torch.cuda.max_memory_allocated`` minus the memory allocated before it).

    python benchmarks/situ_glu.py --out situ_glu.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import time_ms  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from kernels_torch import kernel_choice  # noqa: E402
from kernels_torch.moe import situ  # noqa: E402
from kernels_torch.ops.situ import situ_glu  # noqa: E402
from kimi.checkpoint import write_atomic  # noqa: E402

MIB = 1 << 20
SHAPES = ((8192, 33792), (65536, 3072))


def _saved_bytes(fn) -> int:
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


def _peak_extra(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench(n: int, i: int, dtype: torch.dtype) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.randn(n, i, device="cuda", generator=g) * 3).to(dtype).requires_grad_()
    b = (torch.randn(n, i, device="cuda", generator=g) * 12).to(dtype).requires_grad_()
    dout = torch.randn(n, i, device="cuda", generator=g).to(dtype)
    moved = 8 * n * i * a.element_size()
    impls = {
        "plain": lambda: situ(a, b, 4.0, 25.0),
        "fused_triton": lambda: situ_glu(a, b, 4.0, 25.0, kernel="triton"),
        "fused_torch": lambda: situ_glu(a, b, 4.0, 25.0, kernel="torch"),
    }
    rows = []
    for name, fwd in impls.items():

        def step(fwd=fwd):
            a.grad = b.grad = None
            fwd().backward(dout)

        fwd_ms, _ = time_ms(lambda fwd=fwd: fwd().detach(), target_s=0.5)
        ms, reps = time_ms(step, target_s=1.0)
        rows.append(
            {
                "impl": name,
                "N": n,
                "I": i,
                "dtype": str(dtype).removeprefix("torch."),
                "fwd_ms": round(fwd_ms, 4),
                "fwd_bwd_ms": round(ms, 4),
                "reps": reps,
                "effective_GBps": round(moved / (ms * 1e-3) / 1e9, 1),
                "saved_MiB": round(_saved_bytes(fwd) / MIB, 1),
                "peak_extra_MiB": round(_peak_extra(step) / MIB, 1),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="situ_glu.json", help="JSON file to write")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("situ_glu: needs a CUDA GPU", file=sys.stderr)
        return 2
    kernel_choice.reset_used()
    rows = []
    for n, i in SHAPES:
        rows += bench(n, i, getattr(torch, args.dtype))
        torch.cuda.empty_cache()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "kernels_used": kernel_choice.used(),
        "rows": rows,
    }
    out = Path(args.out)
    write_atomic(out, json.dumps(result, indent=1).encode())
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
