"""KDA layer forward + backward on one GPU: our ``backend='cudnn'`` KimiDeltaAttention against the same layer written
directly against fla's API, plus the kernel-only ``fla.ops.kda.chunk_kda`` time.

K3 layer shape: hidden D = 7168, H = 96 heads, head dim 128, gate_lower_bound = -5 (safe gate), full-rank output
gate, bf16 activations and projections, fp32 conv / A_log / dt_bias / o_norm. B = 1, T in ``--seq-lens``.
"layer_cudnn" / "layer_fla" = ``KimiDeltaAttention(cfg, i, backend="cudnn")`` (``kernels_torch.kda._kda_layer_fast``)
with ``kda_kernel="cudnn"`` (cuDNN's KDA op) / ``"fla"`` (``chunk_kda``); both also return the decode cache.
"layer_fla_direct" = :func:`fla_layer` on the same weight tensors: the projections, ``causal_conv1d`` + SiLU,
``chunk_kda`` with the fused gate and q/k L2 norm, ``rms_norm_gated`` (sigmoid), ``o_proj``; no cache output.
"rec_chunk_kda" / "rec_cudnn" = the recurrence alone as the layer runs it (chunk_kda with gate and norm fused; or fla's
L2 norms, ``fused_kda_gate`` and ``kda_recurrence_cudnn`` with its THD / state-layout conversions).
Also: the bf16 matmul ceiling of this run and the layer's projection FLOPs (6 T x weights: fwd + bwd), hence its
matmul floor in ms.
Times: median of CUDA-event-timed iterations (forward, then backward of <out, dout>), rounds of ours and fla
interleaved, after one warm-up per shape (the first chunk_kda call autotunes; shapes stay fixed per process).

    python3 benchmarks/kda_layer.py --seq-lens 8192 32768 --out benchmarks/results/kda_layer.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kernels_torch.kda as tk  # noqa: E402
from kimi.config import load_config  # noqa: E402


def fla_layer(m: tk.KimiDeltaAttention, x: torch.Tensor) -> torch.Tensor:
    """The K3 KDA layer written directly against fla-core's API on ``m``'s parameter tensors (no cache)."""
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.ops.kda import chunk_kda

    c = m.config
    B, T, _ = x.shape
    H, K = c.kda_num_heads, c.kda_head_dim

    def qkv(proj, conv):  # [B, T, H, K]
        y, _ = causal_conv1d(F.linear(x, proj.weight), weight=conv.weight.squeeze(1), activation="silu")
        return y.view(B, T, H, K)

    q, k, v = qkv(m.q_proj, m.q_conv1d), qkv(m.k_proj, m.k_conv1d), qkv(m.v_proj, m.v_conv1d)
    f = F.linear(F.linear(x, m.f_a_proj.weight), m.f_b_proj.weight).view(B, T, H, K)
    beta = F.linear(x, m.b_proj.weight).float().sigmoid()
    o, _ = chunk_kda(
        q,
        k,
        v,
        f,
        beta,
        use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=m.A_log,
        dt_bias=m.dt_bias,
        safe_gate=True,
        lower_bound=c.gate_lower_bound,
    )
    y = rms_norm_gated(
        o, F.linear(x, m.g_proj.weight).view(B, T, H, K), m.o_norm.weight, None, activation="sigmoid", eps=m.o_norm.eps
    )
    return F.linear(y.reshape(B, T, H * K), m.o_proj.weight)


def event_ms(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b)


def interleaved(fns: dict, rounds: int, reps: int) -> dict:
    """Median ms of each callable, measured in ``rounds`` rounds of ``reps`` calls each, callables interleaved."""
    times = {n: [] for n in fns}
    for _ in range(rounds):
        for n, fn in fns.items():
            times[n] += [event_ms(fn) for _ in range(reps)]
    return {n: statistics.median(t) for n, t in times.items()}


def matmul_ceiling() -> float:
    """bf16 8192^3 matmul TFLOP/s, measured in this run (the ceiling that the layer's matmul share is counted against)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    ms = statistics.median(event_ms(lambda: a @ b) for _ in range(10))
    return 2 * 8192**3 / (ms * 1e-3) / 1e12


def bench_seq(m, cfg, T: int, rounds: int, reps: int, ceiling: float) -> dict:
    from kernels_torch import kernel_choice

    H, K, D = cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True)
    dout = torch.randn(1, T, D, device="cuda", generator=gen).to(torch.bfloat16)
    params = [x, *m.parameters()]

    def step(forward):
        def run():
            for p in params:
                p.grad = None
            forward().backward(dout)

        return run

    def ours_with(kernel):
        def fwd():
            m.kda_kernel = kernel
            return m(x)[0]

        return fwd

    has_cudnn = tk.cudnn_kda_unavailable(x, K, K) is None
    layers = {"layer_fla": ours_with("fla"), "layer_fla_direct": lambda: fla_layer(m, x)}
    if has_cudnn:
        layers["layer_cudnn"] = ours_with("cudnn")
    # the recurrence alone, on tensors of the layer's shapes, each with what it needs around it inside the layer
    from fla.modules.norm.l2norm import l2norm as fla_l2norm
    from fla.ops.kda import chunk_kda
    from fla.ops.kda.gate import fused_kda_gate

    q, k, v, f = (
        torch.randn(1, T, H, K, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True) for _ in range(4)
    )
    beta = torch.rand(1, T, H, device="cuda", generator=gen).requires_grad_(True)
    do = torch.randn(1, T, H, K, device="cuda", generator=gen).to(torch.bfloat16)
    A_log, dt_bias = m.A_log.detach().float().requires_grad_(True), m.dt_bias.detach().float().requires_grad_(True)
    rec_in = (q, k, v, f, beta, A_log, dt_bias)

    def rec_fla():  # chunk_kda with the gate and the q/k L2 norm fused, as in the layer
        return chunk_kda(
            q,
            k,
            v,
            f,
            beta,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            safe_gate=True,
            lower_bound=cfg.gate_lower_bound,
        )[0]

    def rec_cudnn():  # what _kda_layer_fast runs: fla l2norm x2, fused_kda_gate (fp32), the cuDNN op (THD, states)
        g = fused_kda_gate(f, A_log, dt_bias, lower_bound=cfg.gate_lower_bound, output_dtype=torch.float32)
        return tk.kda_recurrence_cudnn(fla_l2norm(q), fla_l2norm(k), v, g, beta)[0]

    def fb(fn):
        def run():
            for p in rec_in:
                p.grad = None
            fn().backward(do)

        return run

    recs = {"rec_chunk_kda": rec_fla}
    if has_cudnn:
        recs["rec_cudnn"] = rec_cudnn
    fb_fns = {**{n: step(fn) for n, fn in layers.items()}, **{n: fb(fn) for n, fn in recs.items()}}
    fwd_fns = {**layers, **recs}

    t0 = time.perf_counter()
    for name, fn in fb_fns.items():  # warm-up (the first chunk_kda call autotunes, cuDNN compiles with NVRTC)
        fn()
        torch.cuda.synchronize()
        print(f"T={T}: warm-up {name} done at {time.perf_counter() - t0:.1f} s", flush=True)
    warm_s = time.perf_counter() - t0
    diffs = {}
    with torch.no_grad():  # the layers compute the same function
        ref = fla_layer(m, x).double()
        for name in layers:
            diffs[name] = float((layers[name]().double() - ref).norm() / ref.norm())
        if has_cudnn:
            a, b = rec_cudnn().double(), rec_fla().double()
            diffs["rec_cudnn_vs_chunk_kda"] = float((a - b).norm() / b.norm())
    kernel_choice.reset_used()
    ms = interleaved(fb_fns, rounds, reps)
    with torch.no_grad():
        ms_fwd = interleaved(fwd_fns, rounds, reps)
    used = kernel_choice.used()
    m.kda_kernel = None
    mm_params = sum(mod.weight.numel() for mod in m.modules() if isinstance(mod, torch.nn.Linear))
    proj_tflop = 6 * T * mm_params / 1e12  # fwd (2 flops per MAC) + bwd (4): the projections of the layer
    row = {
        "seq_len": T,
        "heads": H,
        "head_dim": K,
        "hidden": D,
        "batch": 1,
        **{f"ms_{n}_fwd_bwd": round(v, 3) for n, v in ms.items()},
        **{f"ms_{n}_fwd": round(v, 3) for n, v in ms_fwd.items()},
        **{f"rel_diff_{n}_vs_fla_direct": v for n, v in diffs.items()},
        "projection_tflop_fwd_bwd": round(proj_tflop, 2),
        "matmul_ceiling_tflops": round(ceiling, 1),
        "projection_floor_ms": round(proj_tflop / ceiling * 1e3, 2),
        "kernels_used": used,
        "warmup_s": round(warm_s, 1),
        "timed_iters": rounds * reps,
    }
    if has_cudnn:
        row["rec_speedup_fwd_bwd"] = round(ms["rec_chunk_kda"] / ms["rec_cudnn"], 3)
        row["rec_speedup_fwd"] = round(ms_fwd["rec_chunk_kda"] / ms_fwd["rec_cudnn"], 3)
        row["layer_speedup_cudnn_vs_fla"] = round(ms["layer_fla"] / ms["layer_cudnn"], 3)
        row["layer_matmul_share_of_ceiling"] = round(row["projection_floor_ms"] / ms["layer_cudnn"], 3)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining lengths after this many seconds")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kda_layer.json")
    args = ap.parse_args()
    t_start = time.perf_counter()
    ceiling = matmul_ceiling()
    print(f"bf16 matmul ceiling: {ceiling:.1f} TFLOP/s", flush=True)

    import fla
    import triton

    cfg = load_config("k3")
    i = cfg.kda_layers[0]
    with torch.device("cuda"):
        m = tk.KimiDeltaAttention(cfg, i, backend="cudnn")
    for mod in m.modules():  # checkpoint dtypes: projections bf16, the rest fp32
        if isinstance(mod, torch.nn.Linear):
            mod.weight.data = mod.weight.data.to(torch.bfloat16)
    result = {
        "what": "KDA layer fwd+bwd (backend='cudnn') with the cuDNN KDA op and with fla chunk_kda, the layer written "
        "directly against fla, and the recurrence alone (rec_*: with its L2 norms, gate and layout conversions)",
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fla": getattr(fla, "__version__", "?"),
        "config": {
            "hidden": cfg.hidden_size,
            "heads": cfg.kda_num_heads,
            "head_dim": cfg.kda_head_dim,
            "gate_lower_bound": cfg.gate_lower_bound,
            "use_full_rank_gate": cfg.use_full_rank_gate,
        },
        "rows": [],
        "skipped": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for T in args.seq_lens:
        if time.perf_counter() - t_start > args.budget_s:
            result["skipped"].append(T)
            continue
        print(f"T={T}: start at {time.perf_counter() - t_start:.1f} s", flush=True)
        row = bench_seq(m, cfg, T, args.rounds, args.reps, ceiling)
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in result["rows"]:
        print(json.dumps(r))
    if result["skipped"]:
        print("skipped (time budget):", result["skipped"])


if __name__ == "__main__":
    main()
