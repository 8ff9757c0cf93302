"""The functions of Kimi Delta Attention (KDA) in pure torch, twins of ``reference_jax/kda.py`` (spec section 2,
``docs/spec.md``): ``kda_gate``, ``l2norm``, ``short_conv``, ``kda_recurrent`` (the equation, one token at a time),
``kda_chunk`` (the chunked WY algorithm) and ``gated_rms_norm``, with the ``kimi::`` ops ``torch.compile`` runs them
as (``kernels_torch.ops.custom``).

They sit below both layers that use them: ``kernels_torch.kda`` (the module ``KimiDeltaAttention``, which re-exports
them) and ``kernels_torch.kda_cudnn`` (the GPU path, whose compiled ops run these on CPU tensors).

Shapes: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; state ``S`` ``[N, H, K, V]`` (K-first, fla
layout). Packed documents: ``cu_seqlens`` ``[N+1]`` with ``B == 1``. Numerics: activations may be bf16; gates,
beta, norms and the state are fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from kernels_torch.common import (
    check_cu_seqlens,
    compute_dtype,
    depthwise_conv_weight,
    rms_norm,
)
from kernels_torch.ops.custom import recompute_op
from kimi.kda_gate import A_LOG_MAX, G_MIN  # the gate's saturation bounds, with their reasons

__all__ = ["kda_gate", "l2norm", "short_conv", "kda_recurrent", "kda_chunk", "gated_rms_norm"]

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
        ``lower_bound`` is set (a different function from a clamped softplus; spec 9), else
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
    if cu_seqlens is not None and torch.compiler.is_compiling():  # a loop over documents: one op for the compiler
        return _short_conv_op(x, weight, cu_seqlens, conv_state)
    if x.ndim != 3:
        raise ValueError(f"x: got shape {tuple(x.shape)}, expected [B, T, C]")
    B, T, C = x.shape
    w = depthwise_conv_weight(weight, C).to(compute_dtype(x, weight))
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


def _short_conv_fake(x, weight, cu_seqlens, conv_state):
    B, T, C = x.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return x.new_empty(B, T, C), x.new_empty(N, C, weight.shape[-1] - 1)


# short_conv as one op for torch.compile (kernels_torch.ops.custom): the loop over documents reads cu_seqlens
_short_conv_op = recompute_op(
    "kimi::short_conv",
    short_conv,
    "(Tensor x, Tensor weight, Tensor? cu_seqlens, Tensor? conv_state) -> (Tensor, Tensor)",
    _short_conv_fake,
)


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
    # span exceeds 88, and with g >= -5 it reaches 320 over 64 tokens (spec 2.3). exp(G) = exp(G - 0).
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

    Under ``torch.compile`` it runs as the op ``kimi::kda_chunk`` (``kernels_torch.ops.custom``: this function, one
    node for the compiler, no graph break on the loops over documents and chunks).

    Raises:
        ValueError: inconsistent shapes, invalid ``cu_seqlens``, or ``chunk_size < 1``.
    """
    if torch.compiler.is_compiling():
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return _kda_chunk_op(q, k, v, g, beta, scale, initial_state, cu_seqlens, int(chunk_size))
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


def _kda_chunk_fake(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size):
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return v.new_empty(v.shape), q.new_empty(N, H, K, v.shape[-1], dtype=compute_dtype(q, k, v, g, beta))


# kda_chunk as one op for torch.compile (kernels_torch.ops.custom): loops over documents and chunks; the backward
# recomputes the recurrence under autograd, as the eager one does chunk by chunk (torch.utils.checkpoint)
_kda_chunk_op = recompute_op(
    "kimi::kda_chunk",
    kda_chunk,
    "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, Tensor? initial_state, Tensor? cu_seqlens, "
    "int chunk_size) -> (Tensor, Tensor)",
    _kda_chunk_fake,
)
