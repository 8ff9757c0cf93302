"""KDA's short convolution (depthwise causal conv1d, width 4, + SiLU) on one GPU: fla's ``causal_conv1d`` (Triton,
what the ``cudnn`` backend's KDA layer calls today) against cuDNN Frontend's ``cudnn.ops.causal_conv1d`` (CuTe DSL;
bf16 activations, fp32 filter, dense or ``cu_seqlens``-packed, with its own backward), forward and forward+backward.

Why: benchmark 3's profile of one KDA layer at 8K tokens gives the three convolutions 3.2 ms of 37.4 (fla's backward
kernel 2.4 ms: about 1 TB/s, a third of what its bytes need), the largest part of the layer that is neither a matmul
nor the recurrence (``benchmarks/results/kda_layer_pass10b.log``).

Shapes: one ``[1, T, C]`` bf16 tensor, C = H * K = 12288 (K3.1 Pro's q, k or v), T = 8192 and 32768; weight ``[C, 4]``
fp32 (the checkpoint's dtype). The layer runs three such calls. Time: median of CUDA-event-timed calls after warm-up
(``_timing.time_ms``). GB/s: the bytes a fused kernel must move over the time (forward: read x, write y; backward:
read x and dy, write dx; 2 bytes an element), the same count for every row. Errors: relative Frobenius error of y, dx
and dw against the eager fp64 function ``kernels_torch.kda.short_conv`` (T = 8192 only; packed rows with 3 documents).

    python benchmarks/short_conv.py --out short_conv.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _timing import time_ms  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

from kernels_torch.kda import short_conv  # noqa: E402

C, W = 12288, 4


def variants(cu: torch.Tensor | None) -> dict:
    """name -> f(x [1, T, C] bf16, w [C, W] fp32) -> y [1, T, C]."""
    from fla.modules.causal_conv1d import causal_conv1d

    out = {}

    def fla(final_state: bool):
        def run(x, w):
            return causal_conv1d(
                x=x, weight=w, activation="silu", output_final_state=final_state, cu_seqlens=cu, cu_seqlens_cpu=None
            )[0]

        return run

    out["fla"] = fla(True)  # as the layer calls it today (its final state is the decode cache)
    out["fla_no_final_state"] = fla(False)
    try:
        from cudnn.ops import causal_conv1d as cudnn_conv

        def cudnn_run(x, w):  # [B, C, T] as the zero-copy transpose of our channel-last [B, T, C]
            return cudnn_conv(x.transpose(1, 2), w, activation="silu", cu_seqlens=cu).transpose(1, 2)

        def cudnn_det(x, w):  # its deterministic dweight schedule (keyed on torch's deterministic mode)
            torch.use_deterministic_algorithms(True, warn_only=True)
            try:
                return cudnn_run(x, w)
            finally:
                torch.use_deterministic_algorithms(False)

        out["cudnn"] = cudnn_run
        out["cudnn_deterministic"] = cudnn_det
    except ImportError as e:  # the row says why
        print(f"cudnn.ops.causal_conv1d unavailable: {e}", flush=True)
    return out


def bench(T: int, packed: bool, check: bool) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(1, T, C, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(C, W, device="cuda", generator=gen) * 0.5).requires_grad_(True)
    dy = torch.randn(1, T, C, device="cuda", generator=gen).to(torch.bfloat16)
    cu = None
    if packed:  # three documents of uneven lengths: the state resets at each start
        cu = torch.tensor([0, T // 3 + 5, T - T // 5, T], dtype=torch.int32, device="cuda")
    ref = None
    if check:
        xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
        yd = short_conv(xd, wd, cu_seqlens=None if cu is None else cu.cpu())[0]
        yd.backward(dy.double())
        ref = (yd.detach(), xd.grad, wd.grad)
    elem = T * C
    rows = []
    for name, fn in variants(cu).items():
        row = {"seq_len": T, "channels": C, "packed": packed, "variant": name}
        try:
            t0 = time.perf_counter()
            y = fn(x, w)  # first call: Triton autotuning / CuTe DSL compilation
            y.backward(dy)
            torch.cuda.synchronize()
            row["first_call_s"] = round(time.perf_counter() - t0, 2)
            if ref is not None:
                x.grad = w.grad = None
                y = fn(x, w)
                y.backward(dy)
                for label, got, want in (("y", y, ref[0]), ("dx", x.grad, ref[1]), ("dw", w.grad, ref[2])):
                    row[f"rel_err_{label}"] = float((got.double() - want).norm() / want.norm())
            with torch.no_grad():
                row["ms_fwd"] = round(time_ms(lambda: fn(x, w), warmup=2, min_reps=10)[0], 4)

            def fwd_bwd():
                x.grad = w.grad = None
                fn(x, w).backward(dy)

            row["ms_fwd_bwd"] = round(time_ms(fwd_bwd, warmup=2, min_reps=10)[0], 4)
            row["ms_bwd"] = round(row["ms_fwd_bwd"] - row["ms_fwd"], 4)
            row["gbps_fwd"] = round(2 * elem * 2 / row["ms_fwd"] / 1e6, 1)
            row["gbps_fwd_bwd"] = round(5 * elem * 2 / row["ms_fwd_bwd"] / 1e6, 1)
        except Exception as e:  # noqa: BLE001  (a variant that cannot run is a row with its reason)
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "short_conv.json")
    args = ap.parse_args()
    result = {
        "what": __doc__.split("\n\n")[0],
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": [],
    }
    for T in args.seq_lens:
        for packed in (False, True):
            result["rows"] += bench(T, packed, check=T <= 8192)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'T':>6} {'packed':>6} {'variant':<22} {'fwd ms':>8} {'fwd+bwd ms':>10} {'GB/s':>7}  errors y/dx/dw")
    for r in result["rows"]:
        errs = "/".join(f"{r[k]:.1e}" for k in ("rel_err_y", "rel_err_dx", "rel_err_dw") if k in r)
        print(
            f"{r['seq_len']:>6} {r['packed']!s:>6} {r['variant']:<22} {r.get('ms_fwd', float('nan')):>8.3f} "
            f"{r.get('ms_fwd_bwd', float('nan')):>10.3f} {r.get('gbps_fwd_bwd', float('nan')):>7.0f}  "
            f"{errs or r.get('error', '')}"
        )


if __name__ == "__main__":
    main()
