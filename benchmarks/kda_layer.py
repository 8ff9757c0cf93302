"""KDA layer forward + backward on one GPU: our ``backend='cudnn'`` KimiDeltaAttention against the same layer written
directly against fla's API, plus the kernel-only ``fla.ops.kda.chunk_kda`` time.

K3 layer shape: hidden D = 7168, H = 96 heads, head dim 128, gate_lower_bound = -5 (safe gate), full-rank output
gate, bf16 activations and projections, fp32 conv / A_log / dt_bias / o_norm. B = 1, T in ``--seq-lens``.
"ours" = ``KimiDeltaAttention(cfg, i, backend="cudnn")`` (``kernels_torch.kda._kda_layer_fla``), which also returns the
decode cache (conv states and the final recurrent state). "fla" = :func:`fla_layer` on the same weight tensors:
the projections, ``causal_conv1d`` + SiLU, ``chunk_kda`` with the fused gate and q/k L2 norm, ``rms_norm_gated``
(sigmoid), ``o_proj``; no cache output (a training layer). ratio = ms_fla / ms_ours (target >= 0.95).
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


def bench_seq(m, cfg, T: int, rounds: int, reps: int) -> dict:
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

    ours = step(lambda: m(x)[0])
    fla = step(lambda: fla_layer(m, x))
    # kernel only: chunk_kda on tensors of the layer's shapes (gate and L2 norm fused, as in the layer)
    from fla.ops.kda import chunk_kda

    q, k, v, f = (
        torch.randn(1, T, H, K, device="cuda", generator=gen).to(torch.bfloat16).requires_grad_(True) for _ in range(4)
    )
    beta = torch.rand(1, T, H, device="cuda", generator=gen).requires_grad_(True)
    do = torch.randn(1, T, H, K, device="cuda", generator=gen).to(torch.bfloat16)

    def kern():
        return chunk_kda(
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
            lower_bound=cfg.gate_lower_bound,
        )[0]

    def kern_fb():
        for p in (q, k, v, f, beta, m.A_log, m.dt_bias):
            p.grad = None
        kern().backward(do)

    t0 = time.perf_counter()
    for name, fn in (("ours", ours), ("fla", fla), ("chunk_kda", kern_fb)):  # warm-up (the first call autotunes)
        fn()
        torch.cuda.synchronize()
        print(f"T={T}: warm-up {name} done at {time.perf_counter() - t0:.1f} s", flush=True)
    warm_s = time.perf_counter() - t0
    with torch.no_grad():  # the two layers compute the same function
        a, b = m(x)[0], fla_layer(m, x)
        diff = float((a.double() - b.double()).norm() / b.double().norm())
        kern()
    ms = interleaved({"ours": ours, "fla": fla, "kernel": kern_fb}, rounds, reps)
    with torch.no_grad():
        ms_fwd = interleaved({"ours": lambda: m(x), "fla": lambda: fla_layer(m, x), "kernel": kern}, rounds, reps)
    return {
        "seq_len": T,
        "heads": H,
        "head_dim": K,
        "hidden": D,
        "batch": 1,
        "ms_ours": round(ms["ours"], 3),
        "ms_fla": round(ms["fla"], 3),
        "ratio": round(ms["fla"] / ms["ours"], 4),
        "ms_chunk_kda_fwd_bwd": round(ms["kernel"], 3),
        "ms_ours_fwd": round(ms_fwd["ours"], 3),
        "ms_fla_fwd": round(ms_fwd["fla"], 3),
        "ms_chunk_kda_fwd": round(ms_fwd["kernel"], 3),
        "rel_diff_ours_vs_fla_out": diff,
        "warmup_s": round(warm_s, 1),
        "timed_iters": rounds * reps,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining lengths after this many seconds")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kda_layer.json")
    args = ap.parse_args()
    t_start = time.perf_counter()

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
        "what": "KDA layer fwd+bwd, ours (backend='cudnn') vs the same layer written against fla; ratio = ms_fla / ms_ours",
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
        row = bench_seq(m, cfg, T, args.rounds, args.reps)
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{'seq_len':>8} {'ms_ours':>9} {'ms_fla':>9} {'ratio':>6} {'kda_fb':>8} {'ours_f':>8} {'fla_f':>8} {'kda_f':>8} {'diff':>8}"
    )
    for r in result["rows"]:
        print(
            f"{r['seq_len']:>8} {r['ms_ours']:>9.2f} {r['ms_fla']:>9.2f} {r['ratio']:>6.3f} {r['ms_chunk_kda_fwd_bwd']:>8.2f} "
            f"{r['ms_ours_fwd']:>8.2f} {r['ms_fla_fwd']:>8.2f} {r['ms_chunk_kda_fwd']:>8.2f} {r['rel_diff_ours_vs_fla_out']:>8.1e}"
        )
    if result["skipped"]:
        print("skipped (time budget):", result["skipped"])


if __name__ == "__main__":
    main()
