"""Kimi Delta Attention (KDA): the PyTorch twin of ``reference_jax/kda.py`` (spec ``architecture.md`` section 2).

Same functions, argument names, shapes and dtypes as the reference: ``kda_gate``, ``l2norm``, ``short_conv``,
``kda_recurrent`` (the equation, one token at a time), ``kda_chunk`` (the chunked WY algorithm, pure torch),
``gated_rms_norm``, ``KDACache`` and the module ``KimiDeltaAttention`` (the checkpoint's padded ``A_log`` is sliced by
the loader, ``kimi.checkpoint.slice_A_log``).

Shapes: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; state ``S`` ``[N, H, K, V]`` (K-first, fla
layout). Packed documents: ``cu_seqlens`` ``[N+1]`` with ``B == 1``.

Backends: ``eager`` and ``sdpa`` both run the pure-torch algorithm (the backend only matters for attention layers).
``cudnn`` (CUDA, bf16 activations, the ``gpu`` extra) runs the chunk mode of the layer on GPU kernels (see
:func:`_kda_layer_fast`, the only code here that cannot be tested on CPU): fla-core's short conv and gated RMSNorm
around the recurrence, and the recurrence itself on cuDNN Frontend's KDA op (``torch.ops.cudnn.kimi_delta_attention_fwd``,
SM90 engine ``kda_hopper_cuda``, :func:`kda_recurrence_cudnn`) or on fla-core's ``chunk_kda``. The layer's
``kda_kernel`` attribute or ``$KIMI_KDA_KERNEL`` (``auto`` | ``cudnn`` | ``fla``; ``kernels_torch.kernel_choice``) picks
one; ``auto`` takes cuDNN where it imports and takes the shape (K = V = 128), else fla. ``mode="recurrent"`` (decode)
stays on the pure-torch recurrence. The eager and sdpa backends never touch fla or cuDNN, also on CUDA.

Numerics: activations may be bf16; gates, beta, norms and the state are fp32 (fp64 for fp64 inputs). g and beta are
never narrowed to bf16 (case 2).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import threading
from typing import NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from kernels_torch import kernel_choice
from kernels_torch.common import check_activation_dtype, check_cu_seqlens, compute_dtype, rms_norm
from kernels_torch.ops.linears import shared_input_linears
from kimi.config import KimiConfig

__all__ = [
    "A_LOG_MAX",
    "G_MIN",
    "BACKENDS",
    "MODES",
    "kda_gate",
    "l2norm",
    "short_conv",
    "kda_recurrent",
    "kda_chunk",
    "gated_rms_norm",
    "KDACache",
    "ShortConvolution",
    "GatedRMSNorm",
    "KimiDeltaAttention",
    "kda_recurrence_cudnn",
    "kda_recurrence_cudnn_fused",
    "cudnn_kda_unavailable",
    "cudnn_kda_pieces",
]

BACKENDS = ("eager", "sdpa", "cudnn")
MODES = ("chunk", "recurrent")

# Gate saturation constants (the same in reference_jax/kda.py and kernels_torch/kda.py; a test checks they agree).
# A_LOG_MAX caps the per-head rate exp(A_log) at exp(64) = 6.2e27: finite in fp32 (which overflows past 88.7) with
# room for the gradient |lower_bound| / 4 * rate. Past it the lower-bound gate is a step function of f + dt_bias in
# any float format. Trained checkpoints have A_log near log(1..16).
A_LOG_MAX = 64.0
# G_MIN floors the softplus form: exp(-1000) is exactly 0 in fp32 and fp64 (fp64 underflows below -745), so no decay
# changes, and g stays finite, which the chunk form's cumulative sums need (a -inf or 1e30 there gives NaN).
G_MIN = -1000.0


# ------------------------------------------------------------------------------------------------ small helpers


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None = None
) -> torch.Tensor:
    """KDA log-space decay gate ``g`` (spec 2.2 step 5; fla ``fla/ops/kda/gate.py``).

    Args:
        f: ``[B, T, H, K]`` raw ``f_b(f_a(x))`` reshaped per head.
        A_log: ``[H]`` canonical (already sliced, see :func:`kimi.checkpoint.slice_A_log`).
        dt_bias: ``[H*K]``.
        lower_bound: ``gate_lower_bound`` (K3: -5.0) or None (Kimi-Linear).

    Returns:
        g ``[B, T, H, K]`` fp32 (fp64 for fp64 ``f``): ``lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` when
        ``lower_bound`` is set (a different function from a clamped softplus, case 1), else
        ``-exp(A_log[h]) * softplus(f + dt_bias)`` (exact softplus, no linear threshold). ``A_log`` is capped at
        :data:`A_LOG_MAX` and the softplus form floored at :data:`G_MIN` (as the reference: finite values and
        gradients for every finite input, 0 gradients where saturated; unchanged below the caps).

    Raises:
        ValueError: ``f`` not 4-D, ``A_log`` not ``[H]`` or ``dt_bias`` not ``[H*K]``.
    """
    if f.ndim != 4:
        raise ValueError(f"f: got shape {tuple(f.shape)}, expected [B, T, H, K]")
    H, K = f.shape[-2:]
    if tuple(A_log.shape) != (H,):
        raise ValueError(
            f"A_log: got shape {tuple(A_log.shape)}, expected [H]=[{H}] (slice the checkpoint's padded A_log with slice_A_log)"
        )
    if tuple(dt_bias.shape) != (H * K,):
        raise ValueError(f"dt_bias: got shape {tuple(dt_bias.shape)}, expected [H*K]=[{H * K}]")
    dt = compute_dtype(f)
    x = f.to(dt) + dt_bias.to(dt).reshape(H, K)  # [B,T,H,K]
    # Saturation (see A_LOG_MAX, G_MIN): exp(A_log) overflows fp32 past A_log = 88.7, and inf * 0 is NaN in the
    # value (x = 0) and in the gradients (sigmoid' = 0 at saturation). Capping the rate keeps both finite.
    a = torch.exp(A_log.to(dt).clamp(max=A_LOG_MAX))[:, None]  # [H,1]: one rate per head
    if lower_bound is None:
        sp = torch.logaddexp(x, torch.zeros((), dtype=dt, device=x.device))  # softplus without F's threshold
        return (-a * sp).clamp(min=G_MIN)
    return lower_bound * torch.sigmoid(a * x)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x²) + eps)`` over the last axis in fp32 (fp64 for fp64 input); spec 2.2 step 4."""
    xf = x.to(compute_dtype(x))
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def _conv_weight(weight: torch.Tensor, C: int) -> torch.Tensor:
    """Depthwise conv weight as ``[C, W]``; accepts ``[C, 1, W]`` (checkpoint) or ``[C, W]`` (case 17)."""
    if weight.ndim == 3 and weight.shape[0] == C and weight.shape[1] == 1:
        return weight[:, 0, :]
    if weight.ndim == 2 and weight.shape[0] == C:
        return weight
    raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected [C, 1, W] or [C, W] with C={C}")


def _conv_one(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One run without boundaries: x ``[B, T, C]``, w ``[C, W]`` (compute dtype), state ``[B, C, W-1]``."""
    T, W = x.shape[1], w.shape[1]
    xe = torch.cat([state.transpose(1, 2).to(x.dtype), x], dim=1)  # [B, W-1+T, C]
    xf = xe.to(w.dtype)
    y = sum(w[:, i] * xf[:, i : i + T, :] for i in range(W))  # tap W-1 = current token (spec 2.2 step 2)
    return F.silu(y), xe[:, T:, :].transpose(1, 2)  # new state: the last W-1 pre-conv inputs [B, C, W-1]


def short_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d (no bias) then SiLU, in fp32; spec 2.2 step 2 (fla ``ShortConvolution``).

    Args:
        x: ``[B, T, C]``; weight ``[C, 1, W]`` or ``[C, W]``; cu_seqlens ``[N+1]`` (B == 1) or None;
        conv_state: ``[N, C, W-1]`` the last ``W-1`` pre-conv inputs before each sequence/document, or None (zeros).

    Returns:
        ``(y, new_conv_state)``: y ``[B, T, C]`` in ``x.dtype``; new_conv_state ``[N, C, W-1]`` in ``x.dtype``.

    Raises:
        ValueError: bad ``weight`` / ``conv_state`` shapes or invalid ``cu_seqlens``.
    """
    if x.ndim != 3:
        raise ValueError(f"x: got shape {tuple(x.shape)}, expected [B, T, C]")
    B, T, C = x.shape
    w = _conv_weight(weight, C).to(compute_dtype(x, weight))
    W = w.shape[1]
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T, B).tolist()
    N = B if cu is None else len(cu) - 1
    if conv_state is None:
        conv_state = x.new_zeros(N, C, W - 1)
    elif tuple(conv_state.shape) != (N, C, W - 1):
        raise ValueError(f"conv_state: got shape {tuple(conv_state.shape)}, expected [N, C, W-1]=[{N}, {C}, {W - 1}]")
    if cu is None:
        y, new_state = _conv_one(x, w, conv_state)
    else:  # one run per document, each starting from its own state row
        parts = [_conv_one(x[:, cu[n] : cu[n + 1]], w, conv_state[n : n + 1]) for n in range(N)]
        y, new_state = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=0)
    return y.to(x.dtype), new_state.to(x.dtype)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """FusedRMSNormGated, sigmoid (spec 2.2 step 8): ``rmsnorm(o) * weight * sigmoid(gate)`` per head over V.
    o, gate ``[B, T, H, V]``, weight ``[V]``. Returns fp32 (fp64 for fp64 input)."""
    dt = compute_dtype(o, gate)
    return rms_norm(o.to(dt), None, eps) * weight.to(dt) * torch.sigmoid(gate.to(dt))


# ------------------------------------------------------------------------------------------------ the recurrence


def _check_qkvgb(q, k, v, g, beta) -> tuple[int, int, int, int, int]:
    if q.ndim != 4:
        raise ValueError(f"q: got shape {tuple(q.shape)}, expected [B, T, H, K]")
    B, T, H, K = q.shape
    for name, x, want in (("k", k, (B, T, H, K)), ("g", g, (B, T, H, K)), ("beta", beta, (B, T, H))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: got shape {tuple(x.shape)}, expected {list(want)} (q is {list(q.shape)})")
    if v.ndim != 4 or tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"v: got shape {tuple(v.shape)}, expected [B, T, H, V] with B, T, H = {B}, {T}, {H}")
    return B, T, H, K, v.shape[-1]


def _initial_state(initial_state, N, H, K, V, dt, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(N, H, K, V, dtype=dt, device=device)
    if tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(
            f"initial_state: got shape {tuple(initial_state.shape)}, expected [N, H, K, V]=[{N}, {H}, {K}, {V}]"
        )
    return initial_state.to(dt)


def _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """What both forms check and set up: shapes, the compute dtype, ``cu_seqlens`` (as a list of boundaries or None),
    the initial state ``[N,H,K,V]``, the inputs cast to the compute dtype with q pre-scaled, and o's dtype (v's)."""
    B, T, H, K, V = _check_qkvgb(q, k, v, g, beta)
    dt = compute_dtype(q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T, B).tolist()
    N = B if cu is None else len(cu) - 1
    S0 = _initial_state(initial_state, N, H, K, V, dt, q.device)
    q, k, v_c, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    return (q * scale, k, v_c, g, beta), S0, cu, v.dtype


def _delta_step(S, q_t, k_t, v_t, g_t, b_t):
    """One token of spec 2.2 step 7. S ``[B,H,K,V]``; q_t (pre-scaled), k_t, g_t ``[B,H,K]``; v_t ``[B,H,V]``; b_t ``[B,H]``."""
    S = S * torch.exp(g_t)[..., None]  # decay: row d_k scaled by exp(g[d_k])
    e = v_t - torch.einsum("bhk,bhkv->bhv", k_t, S)  # error against the *decayed* state
    S = S + torch.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * e)  # rank-1 write
    return S, torch.einsum("bhk,bhkv->bhv", q_t, S)  # read from the *updated* state


def kda_recurrent(q, k, v, g, beta, scale: float | None = None, initial_state=None, cu_seqlens=None):
    """Gated delta rule one token at a time (spec 2.2 step 7; fla ``fla/ops/kda/naive.py``). Twin of
    ``reference_jax.kda.kda_recurrent``: q, k ``[B,T,H,K]`` (L2-normalised), v ``[B,T,H,V]``, g ``[B,T,H,K]``, beta
    ``[B,T,H]``, initial_state ``[N,H,K,V]``; returns o ``[B,T,H,V]`` in ``v.dtype`` and S ``[N,H,K,V]`` fp32/fp64.

    Raises:
        ValueError: inconsistent shapes or invalid ``cu_seqlens``.
    """
    (q, k, v, g, beta), S0, cu, out_dtype = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    B, T, H, V = v.shape
    o = torch.empty(B, T, H, V, dtype=v.dtype, device=q.device)
    bounds = [(0, T)] if cu is None else list(zip(cu[:-1], cu[1:]))
    finals = []
    for n, (s, e) in enumerate(bounds):
        S = S0 if cu is None else S0[n : n + 1]  # the state restarts at every document start
        for t in range(s, e):
            S, o[:, t] = _delta_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        finals.append(S)
    return o.to(out_dtype), torch.cat(finals, dim=0)


# ------------------------------------------------------------------------------------------------ chunked form


def _chunk_step(q_c, k_c, v_c, g_c, b_c, S, causal, strict, eye):
    """One chunk of the WY algorithm: q_c, k_c, g_c ``[B,H,C,K]``, v_c ``[B,H,C,V]``, b_c ``[B,H,C]``, S ``[B,H,K,V]``
    the state entering the chunk. Returns (o_c ``[B,H,C,V]``, S leaving the chunk)."""
    G = g_c.cumsum(-2)  # within-chunk cumulative log-decay, <= 0
    # Exponentiate only G_i - G_j with j <= i (masked to -inf before exp): exp(-G) alone overflows fp32 once the
    # span passes 88, and with g >= -5 it reaches 320 over 64 tokens (spec 2.3, case 6). exp(G) = exp(G - 0).
    diff = (G[..., :, None, :] - G[..., None, :, :]).masked_fill(~causal[:, :, None], float("-inf"))
    decay = diff.exp()  # [B,H,C,C,K]
    A_kk = torch.einsum("bhik,bhjk,bhijk->bhij", k_c, k_c, decay) * b_c[..., :, None]
    A_kk = A_kk.masked_fill(~strict, 0.0)
    A_qk = torch.einsum("bhik,bhjk,bhijk->bhij", q_c, k_c, decay)
    L = eye + A_kk  # (I + A_kk) delta = beta (v - (exp(G) k) S): forward substitution, unit lower triangular
    w = torch.linalg.solve_triangular(L, b_c[..., None] * (G.exp() * k_c), upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(L, b_c[..., None] * v_c, upper=False, unitriangular=True)
    v_new = u - torch.einsum("bhck,bhkv->bhcv", w, S)
    o_c = torch.einsum("bhck,bhkv->bhcv", q_c * G.exp(), S) + torch.einsum("bhij,bhjv->bhiv", A_qk, v_new)
    G_last = G[..., -1:, :]
    S = S * G_last.exp()[..., 0, :, None] + torch.einsum("bhck,bhcv->bhkv", (G_last - G).exp() * k_c, v_new)
    return o_c, S


def _chunk_run(q, k, v, g, beta, S0, C: int):
    """Chunked algorithm over one run without boundaries (all in the compute dtype, q pre-scaled).
    q, k, g ``[B,T,H,K]``; v ``[B,T,H,V]``; beta ``[B,T,H]``; S0 ``[B,H,K,V]``. Returns o ``[B,T,H,V]``, S.

    Under autograd each chunk is recomputed in the backward (``torch.utils.checkpoint``) rather than keeping its
    ``[B,H,C,C,K]`` decay tensors: those are 200 MB per chunk at H = 96, K = 128 in fp32, i.e. tens of GB per layer
    at 8K tokens. Same values and gradients, one more forward of the chunk in the backward."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = -(-T // C)
    pad = NT * C - T

    # Zero padding at the end is inert (k = 0, beta = 0 write nothing; g = 0 decays nothing).
    def chunks(x):  # [B,T,H,...] -> [B,H,NT,C,...]
        x = F.pad(x, [0, 0] * (x.ndim - 2) + [0, pad])
        return x.reshape(B, NT, C, *x.shape[2:]).movedim(3, 1)

    qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, beta))  # [B,H,NT,C,*]
    i = torch.arange(C, device=q.device)
    causal = i[:, None] >= i[None, :]  # j <= i
    strict = i[:, None] > i[None, :]  # j < i
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    recompute = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v, g, beta, S0))
    S = S0
    outs = []
    for n in range(NT):
        step_in = (qc[:, :, n], kc[:, :, n], vc[:, :, n], gc[:, :, n], bc[:, :, n], S, causal, strict, eye)
        if recompute:
            o_c, S = torch.utils.checkpoint.checkpoint(_chunk_step, *step_in, use_reentrant=False)
        else:
            o_c, S = _chunk_step(*step_in)
        outs.append(o_c)
    o = torch.stack(outs, dim=2).reshape(B, H, NT * C, V).transpose(1, 2)[:, :T]
    return o, S


def kda_chunk(q, k, v, g, beta, scale: float | None = None, initial_state=None, cu_seqlens=None, chunk_size: int = 64):
    """Gated delta rule, chunked WY algorithm in pure torch (spec 2.3; fla ``fla/ops/kda/naive.py``
    ``naive_chunk_kda``, ``fla/ops/kda/chunk.py``). Twin of ``reference_jax.kda.kda_chunk``: same arguments, shapes,
    dtypes and errors as :func:`kda_recurrent`, plus ``chunk_size`` (need not divide T: each run's tail is
    zero-padded, which is inert). Packed documents run one at a time, so chunks, state and cumulative decay restart
    at each document start.

    Raises:
        ValueError: inconsistent shapes, invalid ``cu_seqlens``, or ``chunk_size < 1``.
    """
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size: got {chunk_size}, expected a positive integer")
    (q, k, v, g, beta), S0, cu, out_dtype = _prepare(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if cu is None:
        o, S = _chunk_run(q, k, v, g, beta, S0, int(chunk_size))
    else:
        parts = [
            _chunk_run(*(x[:, s:e] for x in (q, k, v, g, beta)), S0[n : n + 1], int(chunk_size))
            for n, (s, e) in enumerate(zip(cu[:-1], cu[1:]))
        ]
        o, S = torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts], dim=0)
    return o.to(out_dtype), S


# ------------------------------------------------------------------------------------------------ cudnn backend (GPU)
# Everything below this line up to "the layer" runs only on CUDA with fla-core installed (the ``gpu`` extra); the
# pure-torch functions above stay the oracle. fla imports are lazy so CPU machines never need the package.

GPU_EXTRA_HINT = "pip install 'kimi-k3[gpu]' (fla-core>=0.6, nvidia-cudnn-frontend)"


def _cudnn_missing(x: torch.Tensor) -> list[str]:
    """What ``backend='cudnn'`` lacks for activations ``x``: the ``gpu`` extra (fla), CUDA tensors, bf16 activations."""
    missing = []
    if importlib.util.find_spec("fla") is None:
        missing.append(f"the gpu extra (fla-core is not importable; {GPU_EXTRA_HINT})")
    if not x.is_cuda:
        missing.append(f"CUDA tensors (x is on {x.device})")
    if x.dtype != torch.bfloat16:
        missing.append(f"bfloat16 activations (x is {x.dtype})")
    return missing


def _fla_conv_state(state: torch.Tensor | None) -> torch.Tensor | None:
    """Our conv state ``[N, C, W-1]`` (last W-1 pre-conv inputs, oldest first) as fla's ``[N, C, W]``.

    Footgun: fla's ``causal_conv1d`` keeps a full kernel-width window and reads only its last ``W-1`` columns as the
    inputs before the sequence start (column 0 is never read), so we pad one zero column in front."""
    return None if state is None else F.pad(state, (1, 0))


_CUDNN_CONV_MODULE = "cudnn.ops"  # cudnn.ops.causal_conv1d: CuTe DSL (nvidia-cutlass-dsl), bf16, width 4, SiLU
CUDNN_CONV_WIDTH = 4  # the only kernel width cuDNN FE 1.32's causal_conv1d route takes


def _cudnn_causal_conv1d():
    """``cudnn.ops.causal_conv1d`` (cuDNN Frontend); a seam for the CPU tests, which replace it by a torch stand-in."""
    return importlib.import_module(_CUDNN_CONV_MODULE).causal_conv1d


def cudnn_short_conv_unavailable(x: torch.Tensor, W: int) -> str | None:
    """Why cuDNN's ``causal_conv1d`` cannot run KDA's short convolution on activations ``x`` with kernel width ``W``,
    as a reason string, or None when it can (as far as can be told before the call: the CuTe DSL route may still
    decline at the call with ``NotImplementedError``, e.g. without the CUTLASS DSL or on an unlisted device)."""
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not importable"
    try:
        _cudnn_causal_conv1d()
    except Exception as e:  # ImportError / AttributeError (another cuDNN FE version), or a broken install
        return f"cudnn.ops.causal_conv1d is not there ({type(e).__name__}: {e})"
    if not x.is_cuda:
        return f"x is on {x.device}"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}; cuDNN's route takes bfloat16 activations"
    if W != CUDNN_CONV_WIDTH:
        return f"kernel width W={W}; cuDNN's route takes W = {CUDNN_CONV_WIDTH}"
    return None


def conv_final_state(
    x: torch.Tensor, conv_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None, W: int
) -> torch.Tensor:
    """The new conv state of :func:`short_conv`: the last ``W-1`` pre-conv inputs of each sequence or document,
    oldest first, ``[N, C, W-1]`` in ``x.dtype``; a position before a document's start reads that document's
    ``conv_state`` row (zeros without one). A gather of ``N * (W-1)`` rows, no sync.

    Args:
        x: ``[B, T, C]``; conv_state ``[N, C, W-1]`` or None; cu_seqlens ``[N+1]`` int on any device (B == 1, already
            validated) or None (B sequences of T).
    """
    B, T, C = x.shape
    x2 = x.reshape(B * T, C)
    if cu_seqlens is None:
        cu = torch.arange(0, B * T + 1, T, device=x.device)
    else:
        cu = torch.as_tensor(cu_seqlens).to(device=x.device, dtype=torch.int64)
    N = cu.numel() - 1
    start, end = cu[:-1, None], cu[1:, None]
    pos = end - (W - 1) + torch.arange(W - 1, device=x.device)  # [N, W-1]: the last W-1 positions, oldest first
    inside = pos >= start
    vals = x2[pos.clamp(min=0)].transpose(1, 2)  # [N, C, W-1]
    if conv_state is None:
        return vals.masked_fill(~inside[:, None, :], 0)
    j = (pos - start + (W - 1)).clamp(0, W - 2)  # position start - 1 is the state's last column, W - 2
    from_state = conv_state.to(x.dtype).gather(2, j[:, None, :].expand(N, C, W - 1))
    return torch.where(inside[:, None, :], vals, from_state)


def short_conv_cudnn(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`short_conv` (depthwise causal conv1d without bias, then SiLU; spec 2.2 step 2) on cuDNN Frontend's
    ``cudnn.ops.causal_conv1d`` (CuTe DSL kernels, fp32 accumulation, with their own backward for x and the filter;
    the filter gradient accumulates with atomics unless ``torch.use_deterministic_algorithms`` is on).

    Args:
        x: ``[B, T, C]`` bf16 CUDA, channel-last (passed as its zero-copy ``[B, C, T]`` transpose, the op's layout).
        weight: ``[C, 1, W]`` or ``[C, W]``, fp32 or bf16, W = 4.
        cu_seqlens: ``[N+1]`` (B == 1, packed documents; validated by the caller; taken as int32 on x's device) or
            None. conv_state: ``[N, C, W-1]`` (the last ``W-1`` inputs before each document, oldest first) or None.

    Returns:
        ``(y [B, T, C] bf16, new_conv_state [N, C, W-1] bf16)`` as :func:`short_conv`; the new state is gathered from
        x here (:func:`conv_final_state`), not by the op.

    Raises:
        ValueError: shapes; NotImplementedError from cuDNN where its route declines (the layer then runs fla's).
    """
    B, T, C = x.shape
    w = _conv_weight(weight, C).contiguous()
    W = w.shape[1]
    cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens).to(device=x.device, dtype=torch.int32)
    N = B if cu is None else cu.numel() - 1
    if conv_state is not None:
        if tuple(conv_state.shape) != (N, C, W - 1):
            raise ValueError(
                f"conv_state: got shape {tuple(conv_state.shape)}, expected [N, C, W-1]=[{N}, {C}, {W - 1}]"
            )
        conv_state = conv_state.to(x.dtype)
    y = _cudnn_causal_conv1d()(
        x.contiguous().transpose(1, 2), w, activation="silu", cu_seqlens=cu, initial_states=conv_state
    )
    return y.transpose(1, 2), conv_final_state(x, conv_state, cu, W)


CUDNN_KDA_HEAD_DIM = 128  # kda_hopper_cuda: K = V = 128, default scale K^-1/2
CUDNN_KDA_PLAN_SM90 = "kda_hopper_cuda"  # the only SM90 KDA engine with a backward (NVRTC: needs CUDA headers)
_CUDNN_KDA_OP = "cudnn.linear_attention.ops.kda"  # importing it registers torch.ops.cudnn.kimi_delta_attention_fwd


def _cudnn_kda_op():
    """``torch.ops.cudnn.kimi_delta_attention_fwd`` (importing cuDNN FE's KDA module registers it); a seam for the
    CPU tests, which replace it by a torch stand-in."""
    importlib.import_module(_CUDNN_KDA_OP)
    return torch.ops.cudnn.kimi_delta_attention_fwd


def cudnn_kda_unavailable(x: torch.Tensor, K: int, V: int, lower_bound: float | None = -5.0) -> str | None:
    """Why the cuDNN KDA op cannot run the recurrence for activations ``x`` with head dims K, V and the gate's
    ``lower_bound`` (``gate_lower_bound``; None = the unbounded softplus gate), as a reason string, or None when it
    can. The SM90 engine is validated at the bounded gate only: with the softplus gate (log-decay far below -5) its
    output is NaN (measured on the H200, 2026-11-30), so that gate runs on fla."""
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not importable"
    try:
        importlib.import_module(_CUDNN_KDA_OP)
    except Exception as e:  # ImportError, or a broken install raising at import
        return f"{_CUDNN_KDA_OP} does not import ({type(e).__name__}: {e})"
    if not x.is_cuda:
        return f"x is on {x.device}"
    major = torch.cuda.get_device_capability(x.device)[0]
    if major not in (9, 10):
        return f"device capability {major}.x has no cuDNN KDA engine with a backward (SM90 or SM100)"
    if (K, V) != (CUDNN_KDA_HEAD_DIM, CUDNN_KDA_HEAD_DIM):
        return f"head dims K={K}, V={V}; the SM90 engine takes K = V = {CUDNN_KDA_HEAD_DIM}"
    if lower_bound is None or not -5.0 <= lower_bound < 0:
        return (
            f"gate_lower_bound={lower_bound}: the cuDNN engine needs a bounded gate (lower bound in [-5, 0)); "
            "with the unbounded softplus gate it returns NaN"
        )
    return None


def _cudnn_plan_name(device: torch.device) -> str | None:
    """The engine pinned on this device: ``kda_hopper_cuda`` on SM90 (so that a decline fails loudly instead of
    falling to the slow ``kda_cutile`` engine), cuDNN's own choice elsewhere. ``$KIMI_KDA_CUDNN_PLAN`` overrides
    (empty: cuDNN's choice)."""
    import os

    env = os.environ.get("KIMI_KDA_CUDNN_PLAN")
    if env is not None:
        return env or None
    return CUDNN_KDA_PLAN_SM90 if torch.cuda.get_device_capability(device)[0] == 9 else None


_CUDNN_KDA_SM90_HOST = "cudnn.linear_attention.hopper.cuda_host"  # kda_hopper_cuda's forward launcher
_PIECES_LOCK = threading.RLock()  # re-entrant: a block nested in the same thread sets its own split, then the outer's


def _cudnn_kda_host():
    """``(module, None)``: cuDNN FE's SM90 forward launcher module, which has ``pieces_per_sequence``; or
    ``(None, why)`` where it does not import or lacks that function (another cuDNN FE version, or none)."""
    try:
        host = importlib.import_module(_CUDNN_KDA_SM90_HOST)
        host.pieces_per_sequence  # noqa: B018  (only its presence is checked here)
    except Exception as e:  # ImportError, AttributeError, or a broken install raising at import
        return None, f"{type(e).__name__}: {e}"
    return host, None


def _kda_pieces_choice(pieces: str | None) -> str:
    """``kernel_choice.resolve("kda_pieces", pieces)``, checked: a forced ``"one"`` needs the launcher function.

    Raises:
        ValueError: a value outside ``kernel_choice.CHOICES["kda_pieces"]`` (argument or ``$KIMI_KDA_PIECES``).
        RuntimeError: ``"one"`` forced where the installed cuDNN FE has no such launcher function (another version).
    """
    choice = kernel_choice.resolve("kda_pieces", pieces)
    if choice == "one":
        host, missing = _cudnn_kda_host()
        if host is None:
            raise RuntimeError(
                f"kda_pieces: got 'one', but {_CUDNN_KDA_SM90_HOST}.pieces_per_sequence is not there ({missing}); "
                "this cuDNN FE version splits sequences its own way: use 'cudnn'"
            )
    return choice


class _OnePiece:
    """cuDNN's ``pieces_per_sequence`` with ``P = 1``: one CTA per (sequence, head), no walk-back. Keeps the function
    it replaced (``heuristic``), so that a ``"cudnn"`` block nested inside can put cuDNN's own split back."""

    def __init__(self, heuristic):
        self.heuristic = heuristic

    def __call__(self, total_tokens: int, n_seqs: int, n_heads: int) -> int:
        return 1


@contextlib.contextmanager
def cudnn_kda_pieces(pieces: str | None = None):
    """Run cuDNN KDA calls inside the block with the forward's sequence split ``pieces`` (``kernel_choice`` op
    ``kda_pieces``: ``"one"``, ``"cudnn"``, ``"auto"`` = ``"one"``; None: ``$KIMI_KDA_PIECES``, then auto). Yields the
    choice that applies, recorded by the caller.

    cuDNN FE 1.32's SM90 forward (``kda_hopper_cuda``, ``hopper/cuda_host.py``) launches ``P`` CTAs per (sequence,
    head) from its module function ``pieces_per_sequence`` (``P = 264 // (N * H)``, at most the 16-token chunks). A
    piece after the first begins by walking back over the tokens before it until its decay bound (per chunk, the
    slowest channel's ``sum_t g * log2(e) + 3.5 < 0``) proves the carried state negligible; one channel that hardly
    decays stalls the bound and the piece redoes its predecessors' work. ``"one"`` sets ``P = 1`` for the calls in the
    block (one CTA walks the sequence; exactly the recurrence, no walk-back) by replacing that function, and
    ``"cudnn"`` puts cuDNN's own function there (it is the one there unless this block is nested in a ``"one"``
    block); either way under one lock, held for the whole block (other threads' blocks wait: no thread launches with
    another's split), and the function found on entry is restored on exit, also on an exception. The backward engine
    has no pieces. Only the SM90 engine calls that function: elsewhere (SM100, or another engine pinned by
    ``$KIMI_KDA_CUDNN_PLAN``) the split recorded is the one requested, not one that ran. Measured: ``kernel_choice``'s
    docstring.

    Raises:
        ValueError: a value outside ``kernel_choice.CHOICES["kda_pieces"]``.
        RuntimeError: ``"one"`` forced where the installed cuDNN FE has no such launcher function (another version).
    """
    choice = _kda_pieces_choice(pieces)
    host, _ = _cudnn_kda_host()
    if host is None:  # auto or 'cudnn' on a cuDNN FE without that launcher: its own split, nothing to patch
        yield "cudnn"
        return
    split = "cudnn" if choice == "cudnn" else "one"
    with _PIECES_LOCK:
        found = host.pieces_per_sequence  # read under the lock: never another thread's patch
        heuristic = found.heuristic if isinstance(found, _OnePiece) else found
        host.pieces_per_sequence = _OnePiece(heuristic) if split == "one" else heuristic
        try:
            yield split
        finally:
            host.pieces_per_sequence = found


def _cudnn_kda_args(q, v, initial_state, cu_seqlens, plan_name):
    """What both cuDNN calls share, in the op's terms: ``(B, T, H, K, V, cu, S0, plan_name)`` with ``cu`` int32
    ``[N+1]`` on q's device (``[0, T, 2T, ...]`` for B sequences), ``S0`` None or the initial state as the op's V-first
    fp32 ``[N, H, V, K]`` (one transposing copy, only when a state is given), and the resolved plan name."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=q.device)
    else:
        cu = torch.as_tensor(cu_seqlens).to(device=q.device, dtype=torch.int32)
    N = cu.numel() - 1
    S0 = None
    if initial_state is not None:
        if tuple(initial_state.shape) != (N, H, K, V):
            raise ValueError(
                f"initial_state: got shape {tuple(initial_state.shape)}, expected [N, H, K, V]=[{N}, {H}, {K}, {V}]"
            )
        S0 = initial_state.float().transpose(-1, -2).contiguous()  # K-first -> the op's V-first [N, H, V, K]
    if plan_name == "default":
        plan_name = _cudnn_plan_name(q.device)
    return B, T, H, K, V, cu, S0, plan_name


def kda_recurrence_cudnn(
    q, k, v, g, beta, initial_state=None, cu_seqlens=None, plan_name: str | None = "default", pieces: str | None = None
):
    """The KDA recurrence (spec 2.2 step 7) on cuDNN Frontend's KDA op, with autograd.

    Args:
        q, k: ``[B, T, H, K]`` bf16, already L2-normalised (the SM90 backward takes no in-kernel norm).
        v: ``[B, T, H, V]`` bf16. g: ``[B, T, H, K]`` fp32 log-space decay (<= 0). beta: ``[B, T, H]`` fp32, post-sigmoid
            (the SM90 backward engine needs fp32 beta: bf16 gets "no engine proposed a plan").
        initial_state: ``[N, H, K, V]`` fp32 (our K-first layout) or None (zeros).
        cu_seqlens: ``[N+1]`` int (B == 1, packed documents, the state resets at each start) or None (B sequences).
        plan_name: cuDNN plan to pin; ``"default"``: ``kda_hopper_cuda`` on SM90 (:func:`_cudnn_plan_name`).
        pieces: the SM90 forward's sequence split (:func:`cudnn_kda_pieces`; None: ``$KIMI_KDA_PIECES``, then
            ``"one"``); recorded in ``kernel_choice.used()["kda_pieces"]``.

    Returns:
        ``o [B, T, H, V]`` bf16 and the final state ``[N, H, K, V]`` fp32 (K-first). Scale ``K^-1/2`` (the only one the
        SM90 backward takes). The op's layout is THD (``[B*T, H, *]``, a free view of our contiguous ``[B, T, H, *]``)
        with V-first states ``[N, H, V, K]``: the states are transposed here, inside autograd (one copy of
        ``N*H*K*V`` fp32 each way, 6.3 MB per sequence at H = 96, K = V = 128; none in when there is no initial state).

    Raises:
        ValueError: shapes; RuntimeError / ``cudnn.cudnnGraphNotSupportedError`` from cuDNN when no engine takes it.
    """
    op = _cudnn_kda_op()
    B, T, H, K, V, cu, S0, plan_name = _cudnn_kda_args(q, v, initial_state, cu_seqlens, plan_name)
    with cudnn_kda_pieces(pieces) as split:
        o, S, _ = op(
            q.reshape(B * T, H, K),
            k.reshape(B * T, H, K),
            v.reshape(B * T, H, V),
            g.reshape(B * T, H, K),
            beta.reshape(B * T, H),
            cu,
            K**-0.5,
            initial_state=S0,
            output_final_state=True,
            plan_name=plan_name,
        )
    kernel_choice.record("kda_pieces", split)
    return o.view(B, T, H, V), S.transpose(-1, -2).contiguous()


def kda_recurrence_cudnn_fused(
    q,
    k,
    v,
    f,
    beta_logits,
    A_log,
    dt_bias,
    lower_bound: float,
    initial_state=None,
    cu_seqlens=None,
    plan_name: str | None = "default",
    pieces: str | None = None,
):
    """Forward only: spec 2.2 steps 4-7 (q/k L2 norm, the lower-bound gate, the beta sigmoid, the recurrence) in one
    call of cuDNN Frontend's KDA op, which applies the three input maps to each staged tile inside its forward kernel
    (``use_qk_l2norm_in_kernel``, ``safe_gate`` with ``a_log`` / ``dt_bias`` / ``gate_lower_bound``,
    ``use_beta_sigmoid_in_kernel``; cuDNN FE 1.32 ``hopper/cuda_kernels/kda_fused_sm90.cu``). Same function as
    :func:`kda_recurrence_cudnn` on ``l2norm(q)``, ``l2norm(k)``, ``kda_gate(f, A_log, dt_bias, lower_bound)`` and
    ``sigmoid(beta_logits)``: the kernel computes ``x * rsqrt(sum(x^2) + 1e-6)`` in fp32 rounded to bf16 (as fla's
    ``l2norm``), ``lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` in fp32 with A_log capped at :data:`A_LOG_MAX` here
    (as :func:`kda_gate`), and ``sigmoid`` in fp32 (fast-math ``exp`` throughout).

    No autograd: the SM90 backward engine (``kda_hopper_cuda``) declines every one of these fusions, so this serves
    inference and prefill; training uses :func:`kda_recurrence_cudnn` with the maps computed outside.

    Args:
        q, k: ``[B, T, H, K]`` bf16, raw (the conv outputs, not normalised). v: ``[B, T, H, V]`` bf16.
        f: ``[B, T, H, K]`` raw gate input ``f_b(f_a(x))`` (bf16 or fp32; passed to the op as fp32, the dtype the kernel
            reads). beta_logits: ``[B, T, H]`` pre-sigmoid ``b_proj(x)`` (passed as fp32).
        A_log: ``[H]`` (canonical, sliced). dt_bias: ``[H*K]``. lower_bound: ``gate_lower_bound`` in [-5, 0).
        initial_state, cu_seqlens, plan_name, pieces: as :func:`kda_recurrence_cudnn`.

    Returns:
        ``o [B, T, H, V]`` bf16 and the final state ``[N, H, K, V]`` fp32 (K-first), as :func:`kda_recurrence_cudnn`.

    Raises:
        RuntimeError: gradients are needed (grad mode on and an input that requires grad).
        ValueError: shapes, or ``lower_bound`` outside [-5, 0); cuDNN's errors as :func:`kda_recurrence_cudnn`.
    """
    tensors = (q, k, v, f, beta_logits, A_log, dt_bias, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        raise RuntimeError(
            "kda_recurrence_cudnn_fused is forward only (the SM90 backward engine takes none of the in-kernel "
            "L2 norm / gate / beta sigmoid): run it under torch.no_grad(), or use kda_recurrence_cudnn"
        )
    if lower_bound is None or not -5.0 <= lower_bound < 0:
        raise ValueError(f"lower_bound: got {lower_bound}, expected a gate_lower_bound in [-5, 0) (the safe gate)")
    op = _cudnn_kda_op()
    B, T, H, K, V, cu, S0, plan_name = _cudnn_kda_args(q, v, initial_state, cu_seqlens, plan_name)
    if tuple(f.shape) != (B, T, H, K) or tuple(beta_logits.shape) != (B, T, H):
        raise ValueError(
            f"f, beta_logits: got shapes {tuple(f.shape)}, {tuple(beta_logits.shape)}, expected "
            f"[B, T, H, K]=[{B}, {T}, {H}, {K}] and [B, T, H]=[{B}, {T}, {H}]"
        )
    if tuple(A_log.shape) != (H,) or tuple(dt_bias.shape) != (H * K,):
        raise ValueError(
            f"A_log, dt_bias: got shapes {tuple(A_log.shape)}, {tuple(dt_bias.shape)}, expected [H]=[{H}], [H*K]=[{H * K}]"
        )
    with cudnn_kda_pieces(pieces) as split:
        o, S, _ = op(
            q.reshape(B * T, H, K),
            k.reshape(B * T, H, K),
            v.reshape(B * T, H, V),
            f.reshape(B * T, H, K).float(),  # no copy when f is fp32; else the cast the kernel would make anyway
            beta_logits.reshape(B * T, H).float(),
            cu,
            K**-0.5,
            initial_state=S0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_beta_sigmoid_in_kernel=True,
            safe_gate=True,
            gate_lower_bound=float(lower_bound),
            a_log=A_log.float().clamp(max=A_LOG_MAX),  # the eager gate's cap (kda_gate)
            dt_bias=dt_bias.float().reshape(H, K),
            plan_name=plan_name,
        )
    kernel_choice.record("kda_pieces", split)
    return o.view(B, T, H, V), S.transpose(-1, -2).contiguous()


_FALLBACK_WARNED: set[str] = set()


def _warn_fallback(message: str) -> None:
    """One warning per distinct message: a kernel that declined and the one that runs instead."""
    if message not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(message)
        import warnings

        warnings.warn(f"KDA: {message}", stacklevel=3)


def _short_conv_choice(layer: KimiDeltaAttention, x: torch.Tensor, states, W: int) -> tuple[str, bool]:
    """``(kernel, forced)``: the kernel of the ``cudnn`` layer's q/k/v short convolutions, ``"cudnn"`` or ``"fla"``
    (``kernel_choice.resolve("short_conv", layer.short_conv_kernel)``), and whether the user forced it. ``auto``:
    ``kernel_choice.SHORT_CONV_AUTO`` where it can run (:func:`cudnn_short_conv_unavailable`; and no conv state that
    needs a gradient, which only fla's computes), else fla.

    Raises:
        ValueError: a value outside ``kernel_choice.CHOICES["short_conv"]``.
        RuntimeError: ``cudnn`` forced where it cannot run (the reason named).
    """
    choice = kernel_choice.resolve("short_conv", getattr(layer, "short_conv_kernel", None))
    if choice == "fla":
        return "fla", True
    why = cudnn_short_conv_unavailable(x, W)
    if why is None and torch.is_grad_enabled() and any(st is not None and st.requires_grad for st in states):
        why = "a conv state requires a gradient (only fla's causal_conv1d computes one)"
    if choice == "cudnn":
        if why is not None:
            raise RuntimeError(f"short_conv_kernel: got 'cudnn', but cuDNN's causal_conv1d cannot run here: {why}")
        return "cudnn", True
    return ("cudnn" if why is None and kernel_choice.SHORT_CONV_AUTO == "cudnn" else "fla"), False


def _kda_prep_choice(layer: KimiDeltaAttention, x: torch.Tensor) -> str:
    """``"triton"``, ``"outside"`` or ``"in_kernel"``: where the cuDNN path computes the q/k L2 norm, the gate and the
    beta sigmoid (``kernel_choice.resolve("kda_prep", layer.kda_prep)``). ``auto``: ``outside`` (fla's functions;
    ours, ``triton``, measured no faster on the H200: kernel_choice's docstring).

    Raises:
        RuntimeError: ``in_kernel`` forced where gradients are needed (the SM90 backward takes none of the fusions);
            ``triton`` forced where it cannot run (the reason named).
    """
    prep = kernel_choice.resolve("kda_prep", getattr(layer, "kda_prep", None))
    if prep == "auto":  # in_kernel and triton measured no faster (kernel_choice's docstring); both are opt-in
        return "outside"
    if prep == "in_kernel":
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters())):
            raise RuntimeError(
                "kda_prep: got 'in_kernel', but gradients are needed and cuDNN's SM90 KDA backward takes none of the "
                "in-kernel L2 norm / gate / beta sigmoid; use 'triton', 'outside' or 'auto' for training (or run "
                "under torch.no_grad())"
            )
    elif prep == "triton":
        from kernels_torch.ops.kda_prep import triton_prep_unavailable

        why = triton_prep_unavailable(x) if x.is_cuda else f"x is on {x.device}"
        if why is not None:
            raise RuntimeError(f"kda_prep: got 'triton', but the Triton preparation cannot run here: {why}")
    return prep


def _kda_layer_fast(layer: KimiDeltaAttention, x: torch.Tensor, cu_seqlens, cache: KDACache | None):
    """``KimiDeltaAttention.forward`` in chunk mode on GPU kernels (``backend='cudnn'``, GPU only).

    Same math, arguments and returns as the eager layer (spec 2.2); the pieces:

    * short conv + SiLU, by :func:`_short_conv_choice` (``layer.short_conv_kernel``, ``$KIMI_SHORT_CONV_KERNEL``):
      ``fla`` (``fla.modules.causal_conv1d.causal_conv1d``, Triton) or ``cudnn`` (:func:`short_conv_cudnn`, cuDNN
      FE's ``causal_conv1d``; a decline at the call falls back to fla under ``auto`` with one warning, and raises when
      forced); both accumulate in fp32, output in x.dtype and reset at every ``cu_seqlens`` start; our weight
      ``[P, 1, W]`` is passed as ``[P, W]``. Recorded in ``kernel_choice.used()["short_conv"]``.
    * the recurrence, by ``kernel_choice.resolve("kda", layer.kda_kernel)``:

      - ``cudnn``: where the q/k L2 norm, the gate and the beta sigmoid run is ``kernel_choice.resolve("kda_prep",
        layer.kda_prep)`` (``$KIMI_KDA_PREP``): ``triton`` (:func:`kda_recurrence_cudnn` on the outputs of
        ``kernels_torch.ops.kda_prep``: ``l2norm_qk`` normalises q and k in one launch, ``kda_gate_lb`` computes the
        same gate, each with a one-launch backward; beta = sigmoid in fp32 in torch); ``outside``
        (:func:`kda_recurrence_cudnn`): q/k L2 norm with
        ``fla.modules.norm.l2norm`` (eps 1e-6, fp32 math, bf16 out), the gate in fp32 with
        ``fla.ops.kda.gate.fused_kda_gate`` (``lb * sigmoid(exp(A_log) * (f + dt_bias))``), beta = sigmoid in fp32,
        then the cuDNN op (the SM90 backward fuses none of these; they are computed outside, with their own backward
        kernels); ``in_kernel`` (:func:`kda_recurrence_cudnn_fused`, forward only): the op applies all three to its
        staged tiles, which saves the two L2-norm passes over q and k and the sigmoid kernels, yet measured slower
        on the H200 (3.52 against 3.13 ms at 8K tokens, 96 heads). ``auto``: ``outside`` (``triton`` measured no
        faster: 42.4 against 40.5 ms for the layer at 8K); a forced ``in_kernel``
        runs where no gradient is needed (grad mode off, or neither x nor a parameter requires grad) and raises
        otherwise. Recorded in ``kernel_choice.used()["kda_prep"]``. The SM90 forward's sequence split is
        ``kernel_choice.resolve("kda_pieces", layer.kda_pieces)`` (``$KIMI_KDA_PIECES``; auto: one piece per
        sequence, :func:`cudnn_kda_pieces`), recorded in ``kernel_choice.used()["kda_pieces"]``; a value outside the
        choices, or a forced ``one`` where cuDNN FE has no launcher function, raises (never taken for a decline).
      - ``fla``: ``fla.ops.kda.chunk_kda`` with ``use_qk_l2norm_in_kernel=True`` and ``use_gate_in_kernel=True`` (K3:
        ``safe_gate=True, lower_bound=lb``; Kimi-Linear: softplus), beta fp32.

      State ``[N, H, K, V]`` fp32 in both; ``auto`` falls back to fla (with one warning naming the reason) where cuDNN
      declines; a forced ``cudnn`` that cannot run raises.
    * output norm: ``fla.modules.norm.fused_norm_gate.rms_norm_gated`` with ``activation='sigmoid'``.
    * the six projections of x (q, k, v, f_a, b, g or g_a) run as one :func:`kernels_torch.ops.linears.
      shared_input_linears` node, whose backward sums x's gradients in the GEMMs (no elementwise adds); a
      projection that is not a plain ``nn.Linear`` (LoRA-wrapped by peft, or torchao's FP8 ``Float8Linear``, which
      the node's reading of ``.weight`` would bypass) makes them run one by one through their modules, as the eager
      layer.

    ``cu_seqlens`` (B == 1) may be int32 or int64 on any device. The kernel that ran is recorded in
    ``kernel_choice.used()["kda"]``.

    Returns:
        ``(out [B, T, D] bf16, KDACache)`` as the eager layer.

    Raises:
        RuntimeError: ``kda_kernel='cudnn'`` where the cuDNN op cannot run (with the reason); ``kda_prep='in_kernel'``
            where gradients are needed.
    """
    from fla.modules.causal_conv1d import causal_conv1d
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    c = layer.config
    B, T, _ = x.shape
    H, K = c.kda_num_heads, c.kda_head_dim
    P = H * K
    cu = cu_cpu = None
    if cu_seqlens is not None:
        cu_cpu = check_cu_seqlens(
            torch.as_tensor(cu_seqlens).cpu(), T, B
        )  # int64 on CPU: validated once, no sync later
        cu = cu_cpu.to(x.device)
    N = B if cu is None else cu.numel() - 1
    cq, ck, cv, S0 = (None,) * 4 if cache is None else cache
    W = layer.q_conv1d.weight.shape[-1]
    for name, st in (("conv_q", cq), ("conv_k", ck), ("conv_v", cv)):
        if st is not None and tuple(st.shape) != (N, P, W - 1):
            raise ValueError(f"cache.{name}: got shape {tuple(st.shape)}, expected [N, P, W-1]=[{N}, {P}, {W - 1}]")

    # the projections of x first (the GPU runs them while the host picks the kernels below): q, k, v, f_a, b and the
    # output gate's first, in one autograd node whose backward sums x's gradients inside the GEMMs
    # (kernels_torch.ops.linears); LoRA-wrapped and FP8 projections run their own forwards
    x_projs = [layer.q_proj, layer.k_proj, layer.v_proj, layer.f_a_proj, layer.b_proj]
    x_projs.append(layer.g_proj if c.use_full_rank_gate else layer.g_a_proj)
    if any(type(p) is not nn.Linear for p in x_projs):  # LoRA (peft) or FP8 (torchao's Float8Linear): own forwards
        xq, xk, xv, xf, b_logits, xg = (_linear(x, p) for p in x_projs)
    else:
        xq, xk, xv, xf, b_logits, xg = shared_input_linears(x, [p.weight for p in x_projs])

    choice = kernel_choice.resolve("kda", layer.kda_kernel)
    why = cudnn_kda_unavailable(x, K, K, c.gate_lower_bound) if choice != "fla" else None
    if choice == "cudnn" and why is not None:
        raise RuntimeError(f"kda_kernel: got 'cudnn', but the cuDNN KDA op cannot run here: {why}")

    conv_kernel, conv_forced = _short_conv_choice(layer, x, (cq, ck, cv), W)

    def conv(xp: torch.Tensor, conv1d: ShortConvolution, state):  # -> y [B, T, P], new state [N, P, W-1]
        nonlocal conv_kernel
        if conv_kernel == "cudnn":
            try:
                out = short_conv_cudnn(xp, conv1d.weight, cu, state)
                kernel_choice.record("short_conv", "cudnn")
                return out
            except NotImplementedError as e:  # cuDNN's route declined: fla for this and the other two
                if conv_forced:
                    raise RuntimeError(
                        f"short_conv_kernel: got 'cudnn', but cuDNN's causal_conv1d declined: {e}"
                    ) from e
                _warn_fallback(f"the cuDNN short conv declined ({type(e).__name__}: {e}); running fla's causal_conv1d")
                conv_kernel = "fla"
        kernel_choice.record("short_conv", "fla")
        y, final = causal_conv1d(
            x=xp,
            weight=_conv_weight(conv1d.weight, P),
            initial_state=_fla_conv_state(state),
            output_final_state=True,
            activation="silu",
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )
        return y, final[..., 1:]

    q, cq = conv(xq, layer.q_conv1d, cq)
    k, ck = conv(xk, layer.k_conv1d, ck)
    v, cv = conv(xv, layer.v_conv1d, cv)
    q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))  # v: [B,T,H,V], V = K
    f = _linear(xf, layer.f_b_proj).reshape(B, T, H, K)  # raw gate input; gated in fp32; b_logits [B,T,H]
    lb = c.gate_lower_bound
    S0f = None if S0 is None else S0.float()
    o = S = None
    if choice != "fla" and why is None:
        prep = _kda_prep_choice(layer, x)  # outside the try: a forced in_kernel under autograd raises, never falls back
        pieces = _kda_pieces_choice(getattr(layer, "kda_pieces", None))  # outside too: a bad or impossible value raises
        try:
            if prep == "in_kernel":
                o, S = kda_recurrence_cudnn_fused(
                    q, k, v, f, b_logits, layer.A_log, layer.dt_bias, lb, S0f, cu, pieces=pieces
                )
            elif prep == "triton":
                from kernels_torch.ops.kda_prep import kda_gate_lb, l2norm_qk

                g = kda_gate_lb(f, layer.A_log, layer.dt_bias, lb)  # fp32; A_log capped inside, as kda_gate
                beta = torch.sigmoid(b_logits.float())  # [B,T,H] fp32: the one sigmoid on beta (case 3)
                qn, kn = l2norm_qk(q, k)  # one launch for both, bf16 out
                o, S = kda_recurrence_cudnn(qn, kn, v, g, beta, S0f, cu, pieces=pieces)
            else:
                from fla.modules.norm.l2norm import l2norm as fla_l2norm
                from fla.ops.kda.gate import fused_kda_gate

                A_log = layer.A_log.float().clamp(max=A_LOG_MAX)  # the eager gate's cap: finite rate, finite gradients
                g = fused_kda_gate(f, A_log, layer.dt_bias.float(), lower_bound=lb, output_dtype=torch.float32)
                beta = torch.sigmoid(b_logits.float())  # [B,T,H] fp32: the one sigmoid on beta (case 3)
                o, S = kda_recurrence_cudnn(fla_l2norm(q), fla_l2norm(k), v, g, beta, S0f, cu, pieces=pieces)
            kernel_choice.record("kda", "cudnn")
            kernel_choice.record("kda_prep", prep)
        except Exception as e:  # a cuDNN decline (no engine / plan for this graph)
            if choice == "cudnn":
                raise
            _warn_fallback(f"the cuDNN op declined ({type(e).__name__}: {e}); running fla's chunk_kda")
    if o is None:
        from fla.ops.kda import chunk_kda

        o, S = chunk_kda(
            q,
            k,
            v,
            f,
            torch.sigmoid(b_logits.float()),  # [B,T,H] fp32: the one sigmoid on beta (case 3)
            scale=K**-0.5,
            initial_state=S0f,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=layer.A_log.float().clamp(max=A_LOG_MAX),  # the eager gate's cap: finite rate, finite gradients
            dt_bias=layer.dt_bias.float(),
            safe_gate=lb is not None,
            lower_bound=lb,
            cu_seqlens=cu,
            cu_seqlens_cpu=cu_cpu,
        )  # o [B,T,H,V] bf16, S [N,H,K,V] fp32
        kernel_choice.record("kda", "fla")
    gate = xg if c.use_full_rank_gate else _linear(xg, layer.g_b_proj)
    y = rms_norm_gated(
        o, gate.reshape(B, T, H, K), layer.o_norm.weight, None, activation="sigmoid", eps=layer.o_norm.eps
    )
    return _linear(y.reshape(B, T, P), layer.o_proj), KDACache(cq, ck, cv, S)


# ------------------------------------------------------------------------------------------------ the layer


class KDACache(NamedTuple):
    """Decode cache of one KDA layer (spec 2.4): conv_q, conv_k, conv_v ``[N, P, W-1]`` the last ``W-1`` pre-conv
    projections; S ``[N, H, K, V]`` the recurrent state (fp32, fp64 for fp64 inputs)."""

    conv_q: torch.Tensor
    conv_k: torch.Tensor
    conv_v: torch.Tensor
    S: torch.Tensor


class ShortConvolution(nn.Module):
    """Depthwise causal conv + SiLU; one parameter ``weight`` ``[P, 1, W]`` (checkpoint ``*_conv1d.weight``, fp32)."""

    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels, 1, kernel_size) * kernel_size**-0.5)

    def forward(self, x, cu_seqlens=None, conv_state=None):
        return short_conv(x, self.weight, cu_seqlens, conv_state)


class GatedRMSNorm(nn.Module):
    """KDA ``o_norm``: :func:`gated_rms_norm` with ``weight`` ``[V]`` shared by all heads."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o, gate):
        return gated_rms_norm(o, gate, self.weight, self.eps)


def _linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """``x Wᵀ`` in the activation dtype (as ``reference_jax.common.linear``): the weight follows ``x.dtype``.
    A layer that is not a plain ``nn.Linear`` runs its own forward: a LoRA-wrapped one (peft ``LoraLayer``, whose
    ``.weight`` is the base weight alone) and torchao's ``Float8Linear`` (``kernels_torch.fp8``: its forward runs the
    FP8 GEMMs; ``F.linear`` on its ``.weight`` would silently run bf16)."""
    if type(layer) is not nn.Linear:
        return layer(x)
    return F.linear(x, layer.weight.to(x.dtype))


class KimiDeltaAttention(nn.Module):
    """One KDA layer (spec 2.2), twin of ``reference_jax.kda.KimiDeltaAttention``.

    ``state_dict()`` keys are the canonical names under ``model.layers.{i}.self_attn.`` (``kimi.layout.param_layout``):
    ``q_proj.weight`` ... ``o_proj.weight``, ``q_conv1d.weight`` ``[P,1,W]``, ``dt_bias`` ``[P]``, ``A_log`` ``[H]``
    (sliced), ``o_norm.weight`` ``[K]``, and ``g_proj.weight`` or ``g_a_proj.weight`` + ``g_b_proj.weight``.

    ``forward(x, cu_seqlens=None, cache=None, mode="chunk") -> (out, new_cache)``: x ``[B, T, D]`` (bf16, fp32 or
    fp64), out ``[B, T, D]`` in ``x.dtype``, new_cache a :class:`KDACache` with N rows.

    Raises:
        ValueError: unknown ``backend`` or ``mode``, ``layer_idx`` not a KDA layer, bad shapes, ``x`` not a float
            tensor (bf16, fp16, fp32, fp64).
        RuntimeError: ``backend='cudnn'`` without the ``gpu`` extra (fla-core), CUDA tensors or bf16 activations (the
            message lists every missing one).
    """

    def __init__(self, config: KimiConfig, layer_idx: int, backend: str = "eager"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend: got {backend!r}, expected one of {list(BACKENDS)}")
        if config.layer_type(layer_idx) != "kda":
            raise ValueError(
                f"layer_idx: got {layer_idx} ({config.layer_type(layer_idx)}), expected a KDA layer {list(config.kda_layers)}"
            )
        self.config, self.layer_idx, self.backend = config, layer_idx, backend
        self.kda_kernel: str | None = None  # cudnn backend: recurrence kernel (kernels_torch.kernel_choice)
        self.kda_prep: str | None = None  # cudnn backend, cuDNN kernel: where the L2 norm / gate / beta sigmoid run
        self.kda_pieces: str | None = None  # cudnn backend, cuDNN kernel: the SM90 forward's sequence split
        self.short_conv_kernel: str | None = None  # cudnn backend: the q/k/v short convolutions (fla | cudnn)
        c = config
        H, K, D, W, R = c.kda_num_heads, c.kda_head_dim, c.hidden_size, c.short_conv_kernel_size, c.kda_gate_rank
        P = H * K
        lin = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_proj, self.k_proj, self.v_proj = lin(D, P), lin(D, P), lin(D, P)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConvolution(P, W) for _ in range(3))
        self.f_a_proj, self.f_b_proj = lin(D, R), lin(R, P)
        self.dt_bias = nn.Parameter(torch.randn(P))
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1.0, 16.0).log())  # canonical [H]; stored [128] is sliced
        self.b_proj = lin(D, H)
        if c.use_full_rank_gate:
            self.g_proj = lin(D, P)
        else:
            self.g_a_proj, self.g_b_proj = lin(D, R), lin(R, P)
        self.o_norm = GatedRMSNorm(K, c.rms_norm_eps)
        self.o_proj = lin(P, D)

    def forward(self, x, cu_seqlens=None, cache: KDACache | None = None, mode: str = "chunk"):
        check_activation_dtype(x, "KimiDeltaAttention")
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}, expected one of {list(MODES)}")
        if self.backend == "cudnn":
            missing = _cudnn_missing(x)
            if missing:
                raise RuntimeError(
                    "backend='cudnn' (KDA on cuDNN / fla kernels) needs "
                    + "; ".join(missing)
                    + "; use backend='eager' otherwise"
                )
            if mode == "chunk":
                return _kda_layer_fast(self, x, cu_seqlens, cache)
            # mode="recurrent" (decode) stays on the pure-torch recurrence below, on the GPU.
        c = self.config
        B, T, _ = x.shape
        H, K = c.kda_num_heads, c.kda_head_dim
        S0 = None if cache is None else cache.S
        q, k, v, g, beta, (cq, ck, cv) = self.recurrence_inputs(x, cu_seqlens, cache)
        recurrence = kda_chunk if mode == "chunk" else kda_recurrent
        o, S = recurrence(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu_seqlens)
        gate = _linear(x, self.g_proj) if c.use_full_rank_gate else _linear(_linear(x, self.g_a_proj), self.g_b_proj)
        y = self.o_norm(o, gate.reshape(B, T, H, K)).to(x.dtype).reshape(B, T, H * K)
        return _linear(y, self.o_proj), KDACache(cq, ck, cv, S)

    def recurrence_inputs(self, x, cu_seqlens=None, cache: KDACache | None = None):
        """Spec 2.2 steps 1-6 on the pure-torch path, the inputs of the delta rule (``forward`` calls it; so does
        context parallelism, ``kernels_torch.parallel.context``, for the state summary of a shard).

        Args: as :meth:`forward` (``cache.S`` is not read).

        Returns:
            ``(q, k, v, g, beta, (conv_q, conv_k, conv_v))``: q, k ``[B, T, H, K]`` L2-normalised fp32 (fp64 for
            fp64 x), v ``[B, T, H, V]`` in x's dtype, g ``[B, T, H, K]`` and beta ``[B, T, H]`` fp32/fp64, and the
            new conv windows ``[N, P, W-1]``.
        """
        c = self.config
        B, T, _ = x.shape
        H, K = c.kda_num_heads, c.kda_head_dim
        cq, ck, cv = (None,) * 3 if cache is None else cache[:3]
        q, cq = self.q_conv1d(_linear(x, self.q_proj), cu_seqlens, cq)  # [B,T,P]
        k, ck = self.k_conv1d(_linear(x, self.k_proj), cu_seqlens, ck)
        v, cv = self.v_conv1d(_linear(x, self.v_proj), cu_seqlens, cv)
        q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))  # v: [B,T,H,V] with V = K = head_dim
        f = _linear(_linear(x, self.f_a_proj), self.f_b_proj).reshape(B, T, H, K)
        g = kda_gate(f, self.A_log, self.dt_bias, c.gate_lower_bound)  # fp32, never narrowed (case 2)
        beta = torch.sigmoid(_linear(x, self.b_proj).to(compute_dtype(x)))  # [B,T,H]: the one sigmoid on beta (case 3)
        return l2norm(q), l2norm(k), v, g, beta, (cq, ck, cv)
