"""KDA layer forward + backward on one GPU: our ``backend='cudnn'`` KimiDeltaAttention against the same layer written
directly against fla's API, plus the kernel-only ``fla.ops.kda.chunk_kda`` time.

K3 layer shape: hidden D = 7168, H = 96 heads, head dim 128, gate_lower_bound = -5 (safe gate), full-rank output gate,
bf16 activations and projections, fp32 conv / A_log / dt_bias / o_norm. B = 1, T in ``--seq-lens``. "layer_cudnn" /
"layer_fla" = ``KimiDeltaAttention(cfg, i, backend="cudnn")`` (``kernels_torch.kda_cudnn.kda_layer_forward``) with
``kda_kernel="cudnn"`` (cuDNN's KDA op) / ``"fla"`` (``chunk_kda``); both also return the decode cache.
"layer_fla_direct" = :func:`fla_layer` on the same weight tensors: the projections, ``causal_conv1d`` + SiLU,
``chunk_kda`` with the fused gate and q/k L2 norm, ``rms_norm_gated`` (sigmoid), ``o_proj``; no cache output.
"rec_chunk_kda" / "rec_cudnn" = the recurrence alone as the layer runs it (chunk_kda with gate and norm fused; or fla's
L2 norms, ``fused_kda_gate`` and ``kda_recurrence_cudnn`` with its THD / state-layout conversions). "layer_cudnn" is the
default (``kda_prep``, ``kda_pieces`` and ``short_conv_kernel`` auto: fla's norms and gate, one piece per sequence,
``kernel_choice.SHORT_CONV_AUTO``'s short convolution); "layer_cudnn_conv_cudnn" / "layer_cudnn_conv_fla" the same with
the short convolutions forced to cuDNN FE's ``causal_conv1d`` / fla's; "layer_cudnn_split_cudnn" /
"rec_cudnn_split_cudnn" the same with cuDNN's own sequence split (``kda_pieces='cudnn'``, the default until one piece
per sequence measured faster, ``kernels_torch.kernel_choice``); "profile_layer_cudnn": one profiled fwd+bwd of
"layer_cudnn", GPU ms per kernel category (``PROFILE_CATEGORIES``) and the 30 largest kernels, and under "idle" where
the GPU waits during one step (``_timing.idle_report``: kernel time against the span, the longest gaps, and the
synchronising host calls). Two variants of the cuDNN path (``kda_prep``): ``outside`` (the L2 norms, gate and beta
sigmoid computed around the op; the only one with a backward on SM90, so every fwd+bwd row) and ``in_kernel`` (the op's
own fusions; forward only): "layer_cudnn_fwd" / "layer_cudnn_in_kernel_fwd" and "rec_cudnn_fwd" /
"rec_cudnn_in_kernel_fwd". Preparations (``kda_prep``): "rec_cudnn" / "layer_cudnn" use fla's L2 norm and gate;
"rec_cudnn_triton" / "layer_cudnn_triton" use ours (``kernels_torch.ops.kda_prep``); "layer_cudnn" is ``auto`` (ours
where Triton imports).
"breakdown_ms" (cuDNN only): the op alone on ready inputs with the layer's gate distribution and with g uniform in
(-5, 0) (the distribution of the 2026-11-30 measurement), the op with one piece per sequence (cuDNN's launcher splits a
sequence over P = 264 // (N*H) CTAs, each piece walking back until the decay bound proves the earlier state negligible:
channels that hardly decay defeat that bound), and the pieces around it (fla l2norm of q and k, fused_kda_gate:
"prep_l2norm_qk_*" / "prep_gate_*", the L2 norms' backward through ``.float().sum()`` as an earlier run timed them
(``results/kda_layer_pass7.json``); and "prep_{fla,triton}_{l2norm_qk,gate}_{fwd,fwd_bwd}": both
preparations with the backward fed bf16 / fp32 output gradients as inside the layer, with "prep_*_gbps": the minimum
bytes moved (bf16 q/k/dq/dk/f/df, fp32 g/dg) over the time; "prep_triton_sweep_ms": our kernels under other launch
shapes, ``kernels_torch.ops.kda_prep.TRITON_CONFIG``, unless ``--no-prep-sweep``);
"gate_stats": the share of (16-token chunk, head) pairs whose slowest-decaying channel makes the walk-back bound
stall (per-chunk bound max_k sum_t g * log2(e) + 3.5 >= 0: cuDNN FE 1.32 ``kda_fused_sm90.cu``).
Also: the bf16 matmul ceiling of this run and the layer's projection FLOPs (6 T x weights: fwd + bwd), hence its
matmul floor in ms.
Times: median of CUDA-event-timed iterations (forward, then backward of <out, dout>), rounds of ours and fla
interleaved, after one warm-up per shape (the first chunk_kda call autotunes; shapes stay fixed per process), each
iteration started from an idle GPU; "ms_fwd_bwd_back_to_back": the default layers and recurrences once more with the
iterations issued back to back (``_timing.back_to_back_ms``, triton's ``do_bench``), as in a model step where the
host's launch work hides behind the GPU's.

    python3 benchmarks/kda_layer.py --seq-lens 8192 32768 --out benchmarks/results/kda_layer.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # _timing
from _timing import back_to_back_ms, categorise, idle_report, kernel_ms, time_ms  # noqa: E402

import kernels_torch.kda as tk  # noqa: E402
import kernels_torch.kda_cudnn as kc  # noqa: E402
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


def stall_share(g: torch.Tensor, chunk: int = 16) -> float:
    """Share of (chunk, head) pairs of ``g [1, T, H, K]`` whose per-chunk decay bound does not shrink the dropped
    state in cuDNN's seed walk-back: max over channels of the chunk's summed log-decay, times log2(e), plus the 3.5
    mixing allowance, is >= 0 (cuDNN FE 1.32 ``kda_fused_sm90.cu``, kLogEps / kMixLog2)."""
    T, H, K = g.shape[1:]
    n = T // chunk
    if n == 0:
        return 0.0
    s = g[0, : n * chunk].float().reshape(n, chunk, H, K).sum(1).amax(-1)  # [n, H]
    return float((s * 1.4426950408889634 + 3.5 >= 0).float().mean())


def op_breakdown(q, k, v, f, beta, A_log, dt_bias, g_layer, g_unif, do, cfg, sweep: bool = True) -> dict:
    """Milliseconds of the pieces of the cuDNN recurrence at this shape (each timed alone, median of a few calls):
    the op on ready inputs (pre-normalised q/k, fp32 g, fp32 beta) with the layer's gate and with g uniform in (-5, 0),
    forward and forward+backward; the forward with one piece per sequence (cuDNN's launcher patched for the call);
    fla's l2norm of q and k and fused_kda_gate, forward and forward+backward; both preparations side by side
    (:func:`prep_compare`)."""
    import importlib

    from fla.modules.norm.l2norm import l2norm as fla_l2norm
    from fla.ops.kda.gate import fused_kda_gate

    lb = cfg.gate_lower_bound
    with torch.no_grad():
        qn, kn = fla_l2norm(q), fla_l2norm(k)
    leaves = [t.detach().clone().requires_grad_(True) for t in (qn, kn, v, beta)]
    out = {}

    def op_fb(g, pieces="cudnn"):
        gl = g.detach().clone().requires_grad_(True)

        def run():
            for t in (*leaves, gl):
                t.grad = None
            kc.kda_recurrence_cudnn(*leaves[:3], gl, leaves[3], pieces=pieces)[0].backward(do)

        return run

    def op_f(g, pieces="cudnn"):
        def run():
            with torch.no_grad():
                kc.kda_recurrence_cudnn(qn, kn, v, g, beta, pieces=pieces)

        return run

    # "op_*": cuDNN's own sequence split; "op_*_P1": one piece per sequence (kda_pieces='one', the default)
    for name, g in (("op_layer_gate", g_layer), ("op_uniform_gate", g_unif)):
        out[f"{name}_fwd"] = round(time_ms(op_f(g), warmup=2)[0], 3)
        out[f"{name}_fwd_bwd"] = round(time_ms(op_fb(g), warmup=2)[0], 3)
        out[f"{name}_P1_fwd"] = round(time_ms(op_f(g, "one"), warmup=2)[0], 3)
        out[f"{name}_P1_fwd_bwd"] = round(time_ms(op_fb(g, "one"), warmup=2)[0], 3)
    try:
        host = importlib.import_module(kc._CUDNN_KDA_SM90_HOST)
        out["pieces_per_sequence_default"] = host.pieces_per_sequence(q.shape[1], 1, q.shape[2])
    except Exception as e:  # noqa: BLE001  (reported, not fatal)
        out["pieces_error"] = f"{type(e).__name__}: {e}"
    ql, kl, fl = (t.detach().clone().requires_grad_(True) for t in (q, k, f))
    Al, dl = A_log.detach().clone().requires_grad_(True), dt_bias.detach().clone().requires_grad_(True)

    def l2_fb():
        for t in (ql, kl):
            t.grad = None
        (fla_l2norm(ql).float().sum() + fla_l2norm(kl).float().sum()).backward()

    def gate_fb():
        for t in (fl, Al, dl):
            t.grad = None
        fused_kda_gate(fl, Al, dl, lower_bound=lb, output_dtype=torch.float32).backward(g_layer)

    with torch.no_grad():
        out["prep_l2norm_qk_fwd"] = round(time_ms(lambda: (fla_l2norm(q), fla_l2norm(k)), warmup=2)[0], 3)
        out["prep_gate_fwd"] = round(
            time_ms(lambda: fused_kda_gate(f, A_log, dt_bias, lower_bound=lb, output_dtype=torch.float32), warmup=2)[0],
            3,
        )
    out["prep_l2norm_qk_fwd_bwd"] = round(time_ms(l2_fb, warmup=2)[0], 3)
    out["prep_gate_fwd_bwd"] = round(time_ms(gate_fb, warmup=2)[0], 3)
    out.update(prep_compare(q, k, f, A_log, dt_bias, g_layer, lb, sweep))
    return out


def prep_compare(q, k, f, A_log, dt_bias, dg, lb, sweep: bool) -> dict:
    """fla's and our (Triton) L2 norm of q and k and lower-bound gate, forward and forward+backward, the backward
    fed fixed output gradients (bf16 dq/dk for the norms, the fp32 ``dg`` for the gate) as inside the layer; the
    achieved GB/s over the minimum traffic; with ``sweep``, our kernels under a few other launch shapes."""
    from fla.modules.norm.l2norm import l2norm as fla_l2norm
    from fla.ops.kda.gate import fused_kda_gate

    from kernels_torch.ops import kda_prep as kp

    n = q.numel()  # elements of each of q, k, f
    gb = {  # minimum bytes: bf16 2, fp32 4 (rstd and the parameters are negligible)
        "l2norm_qk_fwd": 2 * n * (2 + 2),
        "l2norm_qk_fwd_bwd": 2 * n * (2 + 2) + 2 * n * (2 + 2 + 2),
        "gate_fwd": n * (2 + 4),
        "gate_fwd_bwd": n * (2 + 4) + n * (2 + 4 + 2),
    }
    gen = torch.Generator(device="cuda").manual_seed(1)
    dq, dk = (torch.randn(q.shape, device="cuda", generator=gen).to(q.dtype) for _ in range(2))
    ql, kl, fl = (t.detach().clone().requires_grad_(True) for t in (q, k, f))
    Al, dl = A_log.detach().clone().requires_grad_(True), dt_bias.detach().clone().requires_grad_(True)
    A_cap = A_log.detach().clamp(max=tk.A_LOG_MAX)
    impls = {
        "fla": (
            lambda a, b: (fla_l2norm(a), fla_l2norm(b)),
            lambda x, A, d: fused_kda_gate(x, A.clamp(max=tk.A_LOG_MAX), d, lower_bound=lb, output_dtype=torch.float32),
        ),
        "triton": (kp.l2norm_qk, lambda x, A, d: kp.kda_gate_lb(x, A, d, lb)),
    }
    out = {}

    def timed(name, fn):
        ms = time_ms(fn, warmup=2)[0]
        out[f"prep_{name}"] = round(ms, 3)
        piece = name.split("_", 1)[1]
        out[f"prep_{name}_gbps"] = round(gb[piece] / (ms * 1e-3) / 1e9, 1)

    def l2_fb(l2):
        def run():
            ql.grad = kl.grad = None
            torch.autograd.backward(l2(ql, kl), [dq, dk])

        return run

    def gate_fb(gate):
        def run():
            fl.grad = Al.grad = dl.grad = None
            gate(fl, Al, dl).backward(dg)

        return run

    for impl, (l2, gate) in impls.items():
        with torch.no_grad():
            timed(f"{impl}_l2norm_qk_fwd", lambda: l2(q, k))
            timed(f"{impl}_gate_fwd", lambda: gate(f, A_cap, dt_bias))
        timed(f"{impl}_l2norm_qk_fwd_bwd", l2_fb(l2))
        timed(f"{impl}_gate_fwd_bwd", gate_fb(gate))
    out["prep_triton_config"] = dict(kp.TRITON_CONFIG)
    if sweep:
        out["prep_triton_sweep_ms"] = prep_sweep(l2_fb(kp.l2norm_qk), gate_fb(impls["triton"][1]))
    return out


def prep_sweep(l2_fb, gate_fb) -> dict:
    """fwd+bwd ms of our L2 norm and gate under other launch shapes (``TRITON_CONFIG`` restored after)."""

    from kernels_torch.ops import kda_prep as kp

    base = dict(kp.TRITON_CONFIG)
    out = {}
    try:
        for bm in (4, 8, 16, 32):
            for w in (2, 4, 8):
                kp.TRITON_CONFIG.update(base, l2_block_m=bm, l2_warps=w)
                out[f"l2norm_qk block_m={bm} warps={w}"] = round(time_ms(l2_fb, warmup=2)[0], 3)
        for bm in (16, 32, 64):
            for tiles in (4, 8, 16):
                for w in (4, 8):
                    kp.TRITON_CONFIG.update(base, gate_block_m=bm, gate_tiles=tiles, gate_warps=w)
                    out[f"gate block_m={bm} tiles={tiles} warps={w}"] = round(time_ms(gate_fb, warmup=2)[0], 3)
    except Exception as e:  # noqa: BLE001  (a sweep point that does not compile is reported, not fatal)
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        kp.TRITON_CONFIG.clear()
        kp.TRITON_CONFIG.update(base)
    return out


PROFILE_CATEGORIES = (  # kernel-name substrings (lower case) of the cuDNN layer's fwd+bwd, first match wins
    # first: cuDNN FE's conv kernels are named kernel_cutlass_*conv1d_bul(k_bwd)* and would match the op and matmuls
    ("short conv", ("conv",)),
    ("cuDNN KDA op", ("kda_fused", "k_prep", "k_scan", "k_bwd", "k_meta")),
    ("matmuls", ("gemm", "nvjet", "cutlass", "xmma", "wgmma")),
    ("q/k L2 norm", ("l2norm", "l2_norm")),
    ("gate", ("gate_fwd", "gate_bwd", "kda_gate")),
    ("gated RMSNorm", ("norm",)),
    ("copies and fills", ("copy", "fill", "memcpy", "memset", "cat")),
    ("elementwise and reductions", ("elementwise", "reduce", "vectorized")),
)


def bench_seq(m, cfg, T: int, rounds: int, reps: int, ceiling: float, sweep: bool = True) -> dict:
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

    def ours_with(kernel, prep=None, pieces=None, conv=None):
        def fwd():
            m.kda_kernel, m.kda_prep, m.kda_pieces, m.short_conv_kernel = kernel, prep, pieces, conv
            return m(x)[0]

        return fwd

    has_cudnn = kc.cudnn_kda_unavailable(x, K, K) is None
    layers = {"layer_fla": ours_with("fla"), "layer_fla_direct": lambda: fla_layer(m, x)}
    if has_cudnn:
        layers["layer_cudnn"] = ours_with("cudnn")  # auto: fla's l2norm and fused_kda_gate, one piece per sequence
        layers["layer_cudnn_split_cudnn"] = ours_with("cudnn", None, "cudnn")  # cuDNN's own sequence split
        layers["layer_cudnn_triton"] = ours_with("cudnn", "triton")
        if kc.cudnn_short_conv_unavailable(x, m.q_conv1d.weight.shape[-1]) is None:  # the short convs forced
            layers["layer_cudnn_conv_cudnn"] = ours_with("cudnn", None, None, "cudnn")  # cuDNN FE's causal_conv1d
            layers["layer_cudnn_conv_fla"] = ours_with("cudnn", None, None, "fla")  # fla's causal_conv1d
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

    def rec_cudnn(pieces=None):  # what kda_layer_forward runs: fla l2norm x2, fused_kda_gate (fp32), the cuDNN op
        g = fused_kda_gate(f, A_log, dt_bias, lower_bound=cfg.gate_lower_bound, output_dtype=torch.float32)
        return kc.kda_recurrence_cudnn(fla_l2norm(q), fla_l2norm(k), v, g, beta, pieces=pieces)[0]

    def rec_cudnn_triton():  # the same with our Triton preparation (kda_prep='triton')
        from kernels_torch.ops.kda_prep import kda_gate_lb, l2norm_qk

        g = kda_gate_lb(f, A_log, dt_bias, cfg.gate_lower_bound)
        return kc.kda_recurrence_cudnn(*l2norm_qk(q, k), v, g, beta)[0]

    def rec_cudnn_in_kernel():  # forward only: the op normalises q/k, gates f and applies the sigmoid to beta logits
        return kc.kda_recurrence_cudnn_fused(q, k, v, f, beta_logits, A_log, dt_bias, cfg.gate_lower_bound)[0]

    beta_logits = torch.logit(beta.detach())  # the same beta, as the logits the fused variant takes

    def fb(fn):
        def run():
            for p in rec_in:
                p.grad = None
            fn().backward(do)

        return run

    recs = {"rec_chunk_kda": rec_fla}
    if has_cudnn:
        recs["rec_cudnn"] = rec_cudnn
        recs["rec_cudnn_split_cudnn"] = lambda: rec_cudnn("cudnn")
        recs["rec_cudnn_triton"] = rec_cudnn_triton
    fb_fns = {**{n: step(fn) for n, fn in layers.items()}, **{n: fb(fn) for n, fn in recs.items()}}
    fwd_fns = {**layers, **recs}
    if has_cudnn:  # forward-only row of the in_kernel variant (the others are in ``layers``)
        fwd_fns["layer_cudnn_in_kernel"] = ours_with("cudnn", "in_kernel")
        fwd_fns["rec_cudnn_in_kernel"] = rec_cudnn_in_kernel

    t0 = time.perf_counter()
    for name, fn in fb_fns.items():  # warm-up (the first chunk_kda call autotunes, cuDNN compiles with NVRTC)
        fn()
        torch.cuda.synchronize()
        print(f"T={T}: warm-up {name} done at {time.perf_counter() - t0:.1f} s", flush=True)
    with torch.no_grad():  # the forward-only variants compile their own cubins
        for name in ("layer_cudnn_in_kernel", "rec_cudnn_in_kernel"):
            if name in fwd_fns:
                fwd_fns[name]()
                torch.cuda.synchronize()
                print(f"T={T}: warm-up {name} (fwd) done at {time.perf_counter() - t0:.1f} s", flush=True)
    warm_s = time.perf_counter() - t0
    diffs = {}
    with torch.no_grad():  # the layers compute the same function
        ref = fla_layer(m, x).double()
        for name in layers:
            diffs[name] = float((layers[name]().double() - ref).norm() / ref.norm())
        if has_cudnn:
            a, b = rec_cudnn().double(), rec_fla().double()
            diffs["rec_cudnn_vs_chunk_kda"] = float((a - b).norm() / b.norm())
            a = rec_cudnn_in_kernel().double()
            diffs["rec_cudnn_in_kernel_vs_chunk_kda"] = float((a - b).norm() / b.norm())
            a = rec_cudnn_triton().double()
            diffs["rec_cudnn_triton_vs_chunk_kda"] = float((a - b).norm() / b.norm())
            diffs["layer_cudnn_in_kernel"] = float(
                (fwd_fns["layer_cudnn_in_kernel"]().double() - ref).norm() / ref.norm()
            )
    kernel_choice.reset_used()
    ms = interleaved(fb_fns, rounds, reps)
    with torch.no_grad():
        ms_fwd = interleaved(fwd_fns, rounds, reps)
    used = kernel_choice.used()
    m.kda_kernel = m.kda_prep = m.kda_pieces = m.short_conv_kernel = None
    profile = {}
    if has_cudnn:  # one profiled fwd+bwd of the default cuDNN layer: where its GPU time goes, per kernel
        # the same step timed on its own (the interleaved rows alternate with other variants' allocations)
        profile["ms_alone"] = round(time_ms(fb_fns["layer_cudnn"], target_s=2.0, warmup=2, min_reps=10)[0], 3)
        print(f"T={T}: layer_cudnn alone {profile['ms_alone']} ms", flush=True)
        profile |= categorise(kernel_ms(fb_fns["layer_cudnn"]), PROFILE_CATEGORIES)
        print(f"T={T}: layer_cudnn profile {json.dumps(profile['ms'])}", flush=True)
        try:  # a profile (2026-12-01) had the kernels add up to 6% less than the timed step: where does the GPU wait?
            profile["idle"] = idle_report(fb_fns["layer_cudnn"])
            print(f"T={T}: layer_cudnn idle {json.dumps(profile['idle'])}", flush=True)
        except Exception as e:  # noqa: BLE001  (a diagnostic: its failure is reported, not fatal)
            profile["idle_error"] = f"{type(e).__name__}: {e}"
    # the same steps issued back to back (triton's do_bench): the host's launch work of one step overlaps the GPU work
    # of the step before, as in a model's step; the interleaved rows start each step from an idle GPU
    b2b_names = [n for n in ("layer_cudnn", "layer_fla", "rec_cudnn", "rec_chunk_kda") if n in fb_fns]
    ms_b2b = {n: round(back_to_back_ms(fb_fns[n], rep_ms=1500), 3) for n in b2b_names}
    print(f"T={T}: back to back {json.dumps(ms_b2b)}", flush=True)
    breakdown, gate_stats = {}, {}
    if has_cudnn:
        A_sat = A_log.detach().clamp(max=tk.A_LOG_MAX)
        g_layer = fused_kda_gate(f.detach(), A_sat, dt_bias.detach(), lower_bound=cfg.gate_lower_bound).float()
        g_unif = -5 * torch.rand(g_layer.shape, device="cuda", generator=gen)
        gate_stats = {"layer_gate": stall_share(g_layer), "uniform_gate": stall_share(g_unif)}
        breakdown = op_breakdown(q, k, v, f, beta, A_sat, dt_bias.detach(), g_layer, g_unif, do, cfg, sweep)
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
        "breakdown_ms": breakdown,
        "gate_stats": gate_stats,
        "profile_layer_cudnn": profile,
        "ms_fwd_bwd_back_to_back": ms_b2b,
        "warmup_s": round(warm_s, 1),
        "timed_iters": rounds * reps,
    }
    if has_cudnn:
        row["rec_speedup_fwd_bwd"] = round(ms["rec_chunk_kda"] / ms["rec_cudnn"], 3)
        row["rec_speedup_fwd"] = round(ms_fwd["rec_chunk_kda"] / ms_fwd["rec_cudnn"], 3)
        row["rec_speedup_fwd_in_kernel"] = round(ms_fwd["rec_chunk_kda"] / ms_fwd["rec_cudnn_in_kernel"], 3)
        row["layer_speedup_fwd_in_kernel_vs_outside"] = round(
            ms_fwd["layer_cudnn"] / ms_fwd["layer_cudnn_in_kernel"], 3
        )
        row["rec_speedup_fwd_bwd_split_cudnn"] = round(ms["rec_chunk_kda"] / ms["rec_cudnn_split_cudnn"], 3)
        row["layer_speedup_one_piece_vs_split_cudnn"] = round(ms["layer_cudnn_split_cudnn"] / ms["layer_cudnn"], 3)
        row["layer_speedup_cudnn_vs_fla"] = round(ms["layer_fla"] / ms["layer_cudnn"], 3)
        row["rec_speedup_fwd_bwd_triton_prep"] = round(ms["rec_chunk_kda"] / ms["rec_cudnn_triton"], 3)
        row["rec_speedup_fwd_triton_prep"] = round(ms_fwd["rec_chunk_kda"] / ms_fwd["rec_cudnn_triton"], 3)
        row["layer_speedup_cudnn_triton_vs_fla"] = round(ms["layer_fla"] / ms["layer_cudnn_triton"], 3)
        row["layer_speedup_cudnn_triton_vs_outside"] = round(ms["layer_cudnn"] / ms["layer_cudnn_triton"], 3)
        if "layer_cudnn_conv_cudnn" in ms:
            row["layer_speedup_conv_cudnn_vs_conv_fla"] = round(
                ms["layer_cudnn_conv_fla"] / ms["layer_cudnn_conv_cudnn"], 3
            )
        row["layer_matmul_share_of_ceiling"] = round(row["projection_floor_ms"] / ms["layer_cudnn"], 3)
        row["rec_speedup_fwd_bwd_back_to_back"] = round(ms_b2b["rec_chunk_kda"] / ms_b2b["rec_cudnn"], 3)
        row["layer_speedup_cudnn_vs_fla_back_to_back"] = round(ms_b2b["layer_fla"] / ms_b2b["layer_cudnn"], 3)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip the remaining lengths after this many seconds")
    ap.add_argument(
        "--no-prep-sweep", action="store_true", help="skip timing our Triton preparation under other launch shapes"
    )
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
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
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
        row = bench_seq(m, cfg, T, args.rounds, args.reps, ceiling, sweep=not args.no_prep_sweep)
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
