"""Kimi Delta Attention (KDA): the dense JAX reference (spec section 2 and its pitfalls 10.1, ``docs/spec.md``).

What is here, top to bottom:

* ``kda_gate`` (log-space decay, both forms), ``l2norm``, ``short_conv`` (depthwise causal conv + SiLU with a decode
  state), ``gated_rms_norm`` (FusedRMSNormGated, sigmoid);
* two forms of the gated delta rule with the same signature, as in fla ``fla/ops/kda/naive.py``:
  ``kda_recurrent`` (the equation of spec 2.2 step 7, one token at a time under ``lax.scan``) and ``kda_chunk``
  (the chunked WY algorithm of spec 2.3). Two independent forms place a bug in "equation" or "algorithm";
* the linen module ``KimiDeltaAttention`` and its decode cache ``KDACache``.

Shapes: q, k, g ``[B, T, H, K]``; v ``[B, T, H, V]``; beta ``[B, T, H]``; state ``S`` ``[N, H, K, V]`` (K-first, the
fla layout: row ``d_k`` is the one the decay ``exp(g[d_k])`` scales). Packed documents: ``cu_seqlens`` ``[N+1]`` with
``B == 1``; the conv window and the state reset at every document start (spec 2.4).

Numerics: gates, beta, norms and the state are fp32 (fp64 when the inputs are fp64); outputs come back in the input
dtype. Private helpers carry ``jax.jit`` only as a compile cache (see the note above ``_conv_one``); the math is plain
``jax.numpy`` with ``lax.scan`` over tokens. ``cu_seqlens`` must be concrete (numpy / a list), also under ``jit``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kimi.config import KimiConfig
from kimi.kda_gate import A_LOG_MAX, G_MIN  # the gate's saturation bounds, with their reasons
from reference_jax.common import Linear, check_activation_dtype, check_cu_seqlens, compute_dtype, rms_norm

__all__ = [
    "A_LOG_MAX",
    "G_MIN",
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
]

MODES = ("chunk", "recurrent")


# ------------------------------------------------------------------------------------------------ small helpers


def kda_gate(f: jax.Array, A_log: jax.Array, dt_bias: jax.Array, lower_bound: float | None = None) -> jax.Array:
    """KDA log-space decay gate ``g`` (spec 2.2 step 5; fla ``fla/ops/kda/gate.py``).

    Args:
        f: ``[B, T, H, K]`` raw ``f_b(f_a(x))`` reshaped per head.
        A_log: ``[H]`` canonical (already sliced, see :func:`kimi.checkpoint.slice_A_log`).
        dt_bias: ``[H*K]`` per-channel bias.
        lower_bound: ``gate_lower_bound`` (K3: -5.0) or None (Kimi-Linear).

    Returns:
        g ``[B, T, H, K]`` in fp32 (fp64 for fp64 ``f``):
        ``lb * sigmoid(exp(A_log[h]) * (f + dt_bias))`` in ``(lb, 0)`` when ``lower_bound`` is set, else
        ``-exp(A_log[h]) * softplus(f + dt_bias)``. The lower-bound form replaces the activation; it is not a clamp of
        the softplus form (spec 9).

        Saturation: ``A_log`` is capped at :data:`A_LOG_MAX` (rate ``exp(64) = 6.2e27``) and the softplus form is
        floored at :data:`G_MIN` (-1000, where ``exp(g)`` is exactly 0 in fp32 and fp64), so every finite input gives
        a finite ``g`` and finite gradients (0 where the gate is saturated). Both caps leave every input with
        ``A_log <= 64`` and ``g >= -1000`` bit for bit unchanged.

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
    x = f.astype(dt) + dt_bias.astype(dt).reshape(H, K)  # [B,T,H,K]
    # Saturation (see A_LOG_MAX, G_MIN): exp(A_log) overflows fp32 past A_log = 88.7, and inf * 0 is NaN in the
    # value (x = 0) and in the gradients (sigmoid' = 0 at saturation). Capping the rate keeps both finite.
    a = jnp.exp(jnp.minimum(A_log.astype(dt), A_LOG_MAX))[:, None]  # [H,1]: one rate per head, broadcast over K
    if lower_bound is None:
        return jnp.maximum(-a * jax.nn.softplus(x), G_MIN)
    return jnp.asarray(lower_bound, dt) * jax.nn.sigmoid(a * x)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """``x / sqrt(sum(x²) + eps)`` over the last axis, in fp32 (fp64 for fp64 input); spec 2.2 step 4 (fla's
    in-kernel l2norm, eps under the square root). Returns the compute dtype, not ``x.dtype``."""
    xf = x.astype(compute_dtype(x))
    return xf * jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def _conv_weight(weight: jax.Array, C: int) -> jax.Array:
    """Depthwise conv weight as ``[C, W]``; accepts the checkpoint's ``[C, 1, W]`` or a squeezed ``[C, W]`` (exporters
    differ)."""
    if weight.ndim == 3 and weight.shape[0] == C and weight.shape[1] == 1:
        return weight[:, 0, :]
    if weight.ndim == 2 and weight.shape[0] == C:
        return weight
    raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected [C, 1, W] or [C, W] with C={C}")


# The jax.jit decorations in this file only cache compilations across calls of the same shapes (eager op-by-op
# dispatch and an eager lax.scan recompile on every call); they change no numerics, and every public function stays
# plain jax.numpy and jit-compatible.
@jax.jit
def _conv_one(x: jax.Array, w: jax.Array, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One run without boundaries: x ``[B, T, C]``, w ``[C, W]`` (compute dtype), state ``[B, C, W-1]``."""
    T = x.shape[1]
    W = w.shape[1]
    xe = jnp.concatenate([jnp.swapaxes(state, 1, 2).astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
    xf = xe.astype(w.dtype)
    # Cross-correlation: tap i sees token t-(W-1)+i, so tap W-1 is the current token (spec 2.2 step 2).
    y = sum(w[:, i] * xf[:, i : i + T, :] for i in range(W))  # [B,T,C]
    new_state = jnp.swapaxes(xe[:, T:, :], 1, 2)  # [B, C, W-1]: the last W-1 pre-conv inputs
    return jax.nn.silu(y), new_state


def short_conv(
    x: jax.Array, weight: jax.Array, cu_seqlens=None, conv_state: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal conv1d (no bias) then SiLU, in fp32; spec 2.2 step 2 (fla ``ShortConvolution``).

    Args:
        x: ``[B, T, C]`` pre-conv projections.
        weight: ``[C, 1, W]`` (checkpoint) or ``[C, W]``; tap ``W-1`` multiplies the current token.
        cu_seqlens: ``[N+1]`` document offsets (B == 1) or None. Inputs before each document start count as zero
            (or come from that document's ``conv_state`` row).
        conv_state: ``[N, C, W-1]`` the last ``W-1`` *pre-conv* inputs before each sequence/document (N = B without
            ``cu_seqlens``), or None for zeros.

    Returns:
        ``(y, new_conv_state)``: y ``[B, T, C]`` in ``x.dtype`` (computed in fp32, fp64 for fp64 input);
        new_conv_state ``[N, C, W-1]`` in ``x.dtype``, the last ``W-1`` pre-conv inputs of each sequence/document
        (including rows of the old state when a document is shorter than ``W-1``).

    Raises:
        ValueError: bad ``weight`` / ``conv_state`` shapes or invalid ``cu_seqlens``.
    """
    if x.ndim != 3:
        raise ValueError(f"x: got shape {tuple(x.shape)}, expected [B, T, C]")
    B, T, C = x.shape
    w = _conv_weight(weight, C).astype(compute_dtype(x, weight))  # fp32 weights stay fp32 (spec 2.1: stored F32)
    W = w.shape[1]
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T, B)
    N = B if cu is None else len(cu) - 1
    if conv_state is None:
        conv_state = jnp.zeros((N, C, W - 1), x.dtype)
    elif tuple(conv_state.shape) != (N, C, W - 1):
        raise ValueError(f"conv_state: got shape {tuple(conv_state.shape)}, expected [N, C, W-1]=[{N}, {C}, {W - 1}]")
    if cu is None:
        y, new_state = _conv_one(x, w, conv_state)
    else:  # one run per document: the window restarts from that document's state (zeros by default)
        ys, states = [], []
        for n in range(N):
            y_n, s_n = _conv_one(x[:, cu[n] : cu[n + 1]], w, conv_state[n : n + 1])
            ys.append(y_n)
            states.append(s_n)
        y, new_state = jnp.concatenate(ys, axis=1), jnp.concatenate(states, axis=0)
    return y.astype(x.dtype), new_state.astype(x.dtype)


def gated_rms_norm(o: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """FusedRMSNormGated with sigmoid activation (spec 2.2 step 8): ``rmsnorm(o) * weight * sigmoid(gate)`` per head.

    o, gate ``[B, T, H, V]``; weight ``[V]`` shared by all heads. Norm first, then the gate; no mean subtraction.
    Returns fp32 (fp64 for fp64 input); the caller casts for ``o_proj``.
    """
    dt = compute_dtype(o, gate)
    return rms_norm(o.astype(dt), None, eps) * weight.astype(dt) * jax.nn.sigmoid(gate.astype(dt))


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


def _initial_state(initial_state, N, H, K, V, dt) -> jax.Array:
    if initial_state is None:
        return jnp.zeros((N, H, K, V), dt)
    if tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(
            f"initial_state: got shape {tuple(initial_state.shape)}, expected [N, H, K, V]=[{N}, {H}, {K}, {V}]"
        )
    return initial_state.astype(dt)


def _delta_step(S, q_t, k_t, v_t, g_t, b_t):
    """One token of spec 2.2 step 7. S ``[B,H,K,V]``; q_t (pre-scaled), k_t, g_t ``[B,H,K]``; v_t ``[B,H,V]``; b_t ``[B,H]``."""
    S = S * jnp.exp(g_t)[..., None]  # decay: row d_k of S scaled by exp(g[d_k])
    e = v_t - jnp.einsum("bhk,bhkv->bhv", k_t, S)  # prediction error against the *decayed* state
    S = S + jnp.einsum("bhk,bhv->bhkv", k_t, b_t[..., None] * e)  # rank-1 write
    o = jnp.einsum("bhk,bhkv->bhv", q_t, S)  # read from the *updated* state
    return S, o


@functools.partial(jax.jit, static_argnames="out_dtype")
def _scan_tokens(S0, q, k, v, g, beta, scale, out_dtype):
    """All runs start at t = 0 from S0 ``[B,H,K,V]``. Returns o ``[B,T,H,V]`` (out_dtype), S ``[B,H,K,V]``."""
    xs = [jnp.moveaxis(x.astype(S0.dtype), 1, 0) for x in (q, k, v, g, beta)]  # time-major [T, B, ...]
    xs[0] = xs[0] * scale.astype(S0.dtype)  # q pre-scaled: o_t = Sᵀ (scale q_t)
    S, o = jax.lax.scan(lambda S, inp: _delta_step(S, *inp), S0, tuple(xs))
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), S


@functools.partial(jax.jit, static_argnames="out_dtype")
def _scan_tokens_packed(S0, start, doc, q, k, v, g, beta, scale, out_dtype):
    """B = 1 with N documents: the state restarts from ``S0[doc]`` where ``start``; S ``[N,H,K,V]`` records each
    document's last state."""
    xs = [jnp.moveaxis(x.astype(S0.dtype), 1, 0) for x in (q, k, v, g, beta)]
    xs[0] = xs[0] * scale.astype(S0.dtype)

    def step(carry, inp):
        S, S_fin = carry
        is_start, n, q_t, k_t, v_t, g_t, b_t = inp
        S = jnp.where(is_start, S0[n][None], S)
        S, o = _delta_step(S, q_t, k_t, v_t, g_t, b_t)
        return (S, S_fin.at[n].set(S[0])), o

    (_, S), o = jax.lax.scan(step, (S0[:1], S0), (start, doc, *xs))
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), S


def kda_recurrent(q, k, v, g, beta, scale: float | None = None, initial_state=None, cu_seqlens=None):
    """Gated delta rule, one token at a time (spec 2.2 step 7; fla ``fla/ops/kda/naive.py``, recurrent form).

    For each token: ``S' = Diag(exp(g_t)) S``; ``e = v_t - S'ᵀ k_t``; ``S = S' + beta_t k_t eᵀ``; ``o_t = Sᵀ (scale q_t)``.

    Args:
        q, k: ``[B, T, H, K]``, already L2-normalised by the caller.
        v: ``[B, T, H, V]`` (any V).
        g: ``[B, T, H, K]`` log-space decay (``kda_gate``), beta ``[B, T, H]`` write strength (already sigmoided).
        scale: query scale, default ``K**-0.5``.
        initial_state: ``[N, H, K, V]`` or None (zeros).
        cu_seqlens: ``[N+1]`` document offsets with ``B == 1``, or None (then N = B). The state is reset to that
            document's ``initial_state`` row at every document start (spec 2.4).

    Returns:
        ``(o, S)``: o ``[B, T, H, V]`` in ``v.dtype``; S ``[N, H, K, V]`` final states in fp32 (fp64 for fp64 inputs).

    Raises:
        ValueError: inconsistent shapes or invalid ``cu_seqlens``.
    """
    B, T, H, K, V = _check_qkvgb(q, k, v, g, beta)
    dt = compute_dtype(q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T, B)
    N = B if cu is None else len(cu) - 1
    S0 = _initial_state(initial_state, N, H, K, V, dt)
    scale = jnp.asarray(scale, dt)
    if cu is None:
        return _scan_tokens(S0, q, k, v, g, beta, scale, out_dtype=v.dtype)
    doc = np.searchsorted(cu[1:], np.arange(T), side="right")  # [T] document of each token
    start = np.zeros(T, bool)
    start[cu[:-1]] = True  # first token of a document: the state restarts from that document's initial state
    return _scan_tokens_packed(
        S0, jnp.asarray(start), jnp.asarray(doc, jnp.int32), q, k, v, g, beta, scale, out_dtype=v.dtype
    )


# ------------------------------------------------------------------------------------------------ chunked form


@jax.jit  # one compile per [B, H, C, K, V] and dtype, whatever T is
def _chunk_step(S, q_c, k_c, v_c, g_c, b_c):
    """One chunk of spec 2.3. S ``[B,H,K,V]``; q_c (pre-scaled), k_c, g_c ``[B,H,C,K]``; v_c ``[B,H,C,V]``;
    b_c ``[B,H,C]``. Returns (S after the chunk, o_c ``[B,H,C,V]``)."""
    C = q_c.shape[-2]
    i = jnp.arange(C)
    causal = i[:, None] >= i[None, :]  # j <= i
    strict = i[:, None] > i[None, :]  # j < i
    G = jnp.cumsum(g_c, axis=-2)  # within-chunk cumulative log-decay, <= 0 and decreasing
    # Only differences G_i - G_j with j <= i are exponentiated (<= 0, so <= 1): the span of G over a chunk can
    # reach 64 * 5 = 320 > 88, and exp(-G) alone would overflow fp32 (spec 2.3). The j > i entries are
    # masked to -inf *before* exp. exp(G) below is exp(G_i - G_start) with G_start = 0, also a difference.
    diff = jnp.where(causal[:, :, None], G[..., :, None, :] - G[..., None, :, :], -jnp.inf)  # [B,H,C,C,K]
    decay = jnp.exp(diff)
    A_kk = jnp.einsum("bhik,bhjk,bhijk->bhij", k_c, k_c, decay) * b_c[..., :, None]
    A_kk = jnp.where(strict, A_kk, 0)  # beta_i k_i·(exp(G_i - G_j) k_j) for j < i
    A_qk = jnp.einsum("bhik,bhjk,bhijk->bhij", q_c, k_c, decay)  # j <= i (decay is 0 above the diagonal)
    # WY form: (I + A_kk) delta = beta (v - (exp(G) k) S), solved by forward substitution (unit lower triangular):
    # w = (I + A_kk)^-1 beta exp(G) k, u = (I + A_kk)^-1 beta v, delta = v_new = u - w S.
    L = jnp.eye(C, dtype=q_c.dtype) + A_kk
    w = jax.lax.linalg.triangular_solve(
        L, b_c[..., None] * (jnp.exp(G) * k_c), left_side=True, lower=True, unit_diagonal=True
    )
    u = jax.lax.linalg.triangular_solve(L, b_c[..., None] * v_c, left_side=True, lower=True, unit_diagonal=True)
    v_new = u - jnp.einsum("bhck,bhkv->bhcv", w, S)  # effective values written by the chunk
    o_c = jnp.einsum("bhck,bhkv->bhcv", q_c * jnp.exp(G), S) + jnp.einsum("bhij,bhjv->bhiv", A_qk, v_new)
    G_last = G[..., -1:, :]  # [B,H,1,K]
    S = S * jnp.exp(G_last)[..., 0, :, None] + jnp.einsum("bhck,bhcv->bhkv", jnp.exp(G_last - G) * k_c, v_new)
    return S, o_c


def _to_chunks(x, bounds, C: int):
    """``[B, T, H, ...]`` -> chunk-major ``[NT, B, H, C, ...]``. Each run ``(s, e)`` of
    ``bounds`` (a document, or the whole sequence) is zero-padded to a multiple of C on its own, so no chunk
    straddles a document boundary.

    The padding is inert: k = 0 and beta = 0 write nothing and g = 0 decays nothing, so the state passes through
    unchanged; the padded outputs are dropped by :func:`_from_chunks`."""
    parts = []
    for s, e in bounds:
        xs = x[:, s:e]
        nt = -(-(e - s) // C)
        xs = jnp.pad(xs, [(0, 0), (0, nt * C - (e - s))] + [(0, 0)] * (x.ndim - 2))
        parts.append(jnp.moveaxis(xs.reshape(x.shape[0], nt, C, *x.shape[2:]), (1, 3), (0, 2)))
    return jnp.concatenate(parts, axis=0)


@functools.partial(jax.jit, static_argnames=("bounds", "C", "dtype"))
def _chunk_inputs(q, k, v, g, beta, scale, bounds, C: int, dtype):
    """Cast to the compute dtype, pre-scale q, and lay all five inputs out in chunks (:func:`_to_chunks`)."""
    q = q.astype(dtype) * scale.astype(dtype)
    return tuple(_to_chunks(x.astype(dtype), bounds, C) for x in (q, k, v, g, beta))


@functools.partial(jax.jit, static_argnames=("bounds", "C", "dtype"))
def _from_chunks(o, bounds, C: int, dtype):
    """Inverse of :func:`_to_chunks` for the output: ``[NT, B, H, C, V]`` -> ``[B, T, H, V]`` in ``dtype``."""
    outs, c = [], 0
    for s, e in bounds:
        nt = -(-(e - s) // C)
        blk = jnp.moveaxis(o[c : c + nt], (0, 2), (1, 3))  # [B, nt, C, H, V]
        outs.append(blk.reshape(blk.shape[0], nt * C, *blk.shape[3:])[:, : e - s])
        c += nt
    return jnp.concatenate(outs, axis=1).astype(dtype)


def kda_chunk(q, k, v, g, beta, scale: float | None = None, initial_state=None, cu_seqlens=None, chunk_size: int = 64):
    """Gated delta rule, chunked WY algorithm (spec 2.3; fla ``fla/ops/kda/naive.py`` ``naive_chunk_kda`` and
    ``fla/ops/kda/chunk.py``). Same arguments, shapes, dtypes and errors as :func:`kda_recurrent`, plus ``chunk_size``
    (any positive integer; it need not divide T: the tail is zero-padded, which is inert).

    Per chunk of C tokens with ``G = cumsum(g)`` inside the chunk:
    ``A_kk[i,j] = beta_i Σ_d k_id k_jd exp(G_id - G_jd)`` (j < i); ``w, u = (I + A_kk)^-1 beta (exp(G) k, v)``;
    ``v_new = u - w S``; ``o = (scale q ⊙ exp(G)) S + A_qk v_new``; ``S <- Diag(exp(G_last)) S + (exp(G_last - G) k)ᵀ v_new``.
    Packed documents are run one at a time, so every chunk, the state and the cumulative decay restart at each
    document start.

    Raises:
        ValueError: inconsistent shapes, invalid ``cu_seqlens``, or ``chunk_size < 1``.
    """
    B, T, H, K, V = _check_qkvgb(q, k, v, g, beta)
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size: got {chunk_size}, expected a positive integer")
    dt = compute_dtype(q, k, v, g, beta)
    scale = K**-0.5 if scale is None else scale
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T, B)
    N = B if cu is None else len(cu) - 1
    S0 = _initial_state(initial_state, N, H, K, V, dt)
    C = int(chunk_size)
    bounds = ((0, T),) if cu is None else tuple((int(a), int(b)) for a, b in zip(cu[:-1], cu[1:]))
    # [NT, B, H, C, *] each; q pre-scaled
    qc, kc, vc, gc, bc = _chunk_inputs(q, k, v, g, beta, jnp.asarray(scale, dt), bounds, C, dt)
    outs, finals, c = [], [], 0
    for n, (s, e) in enumerate(bounds):
        S = S0 if cu is None else S0[n][None]  # every document restarts from its own initial state
        for _ in range(-(-(e - s) // C)):  # the inter-chunk recurrence: the state is handed from chunk to chunk
            S, o_c = _chunk_step(S, qc[c], kc[c], vc[c], gc[c], bc[c])
            outs.append(o_c)
            c += 1
        finals.append(S)
    o = _from_chunks(jnp.stack(outs), bounds, C, v.dtype)
    return o, (finals[0] if cu is None else jnp.concatenate(finals, axis=0))


# ------------------------------------------------------------------------------------------------ the layer


class KDACache(NamedTuple):
    """Decode cache of one KDA layer (spec 2.4): conv_q, conv_k, conv_v ``[N, P, W-1]`` the last ``W-1`` pre-conv
    projections (``P = H*K``); S ``[N, H, K, V]`` the recurrent state in fp32 (fp64 under x64)."""

    conv_q: jax.Array
    conv_k: jax.Array
    conv_v: jax.Array
    S: jax.Array


class ShortConvolution(nn.Module):
    """Depthwise causal conv + SiLU with one parameter ``weight`` ``[P, 1, W]`` (checkpoint ``*_conv1d.weight``)."""

    channels: int
    kernel_size: int

    @nn.compact
    def __call__(self, x, cu_seqlens=None, conv_state=None):
        w = self.param("weight", nn.initializers.normal(self.kernel_size**-0.5), (self.channels, 1, self.kernel_size))
        return short_conv(x, w, cu_seqlens, conv_state)


class GatedRMSNorm(nn.Module):
    """KDA ``o_norm``: :func:`gated_rms_norm` with one parameter ``weight`` ``[V]`` shared by all heads."""

    dim: int
    eps: float

    @nn.compact
    def __call__(self, o, gate):
        return gated_rms_norm(o, gate, self.param("weight", nn.initializers.ones, (self.dim,)), self.eps)


def _log_uniform_1_16(key, shape, dtype=jnp.float32):
    return jnp.log(jax.random.uniform(key, shape, dtype, 1.0, 16.0))


class KimiDeltaAttention(nn.Module):
    """One KDA layer (spec 2.2). Parameters are the checkpoint's canonical names under ``self_attn.``
    (``kimi.layout.param_layout``): ``q_proj``/``k_proj``/``v_proj``/``f_a_proj``/``f_b_proj``/``b_proj``/``o_proj``
    (and ``g_proj``, or ``g_a_proj`` + ``g_b_proj`` when ``use_full_rank_gate`` is False) as ``{name: {weight}}``;
    ``q_conv1d``/``k_conv1d``/``v_conv1d`` ``{weight [P,1,W]}``; ``dt_bias`` ``[P]``; ``A_log`` ``[H]`` (canonical,
    sliced: see :func:`kimi.checkpoint.slice_A_log`); ``o_norm`` ``{weight [K]}``.

    ``__call__(x, cu_seqlens=None, cache=None, mode="chunk") -> (out, new_cache)``: x ``[B, T, D]`` the layer's
    normalised input; out ``[B, T, D]`` in ``x.dtype``; new_cache a :class:`KDACache` with N rows (N = B, or the number
    of documents with ``cu_seqlens``). Prefill then T = 1 decode calls with the returned cache equal one prefill.

    Raises:
        ValueError: ``layer_idx`` not a KDA layer, unknown ``mode``, bad ``cu_seqlens`` or cache shapes, ``x`` not a
            float array (bf16, fp16, fp32, fp64).
    """

    config: KimiConfig
    layer_idx: int

    def setup(self):
        c = self.config
        if c.layer_type(self.layer_idx) != "kda":
            raise ValueError(
                f"layer_idx: got {self.layer_idx} ({c.layer_type(self.layer_idx)}), expected a KDA layer {list(c.kda_layers)}"
            )
        H, K, D, W, R = c.kda_num_heads, c.kda_head_dim, c.hidden_size, c.short_conv_kernel_size, c.kda_gate_rank
        P = H * K
        self.q_proj, self.k_proj, self.v_proj = Linear(P, D), Linear(P, D), Linear(P, D)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConvolution(P, W) for _ in range(3))
        self.f_a_proj, self.f_b_proj = Linear(R, D), Linear(P, R)
        self.dt_bias = self.param("dt_bias", nn.initializers.normal(1.0), (P,))
        self.A_log = self.param("A_log", _log_uniform_1_16, (H,))  # canonical [H]: the stored [128] is sliced on load
        self.b_proj = Linear(H, D)
        if c.use_full_rank_gate:
            self.g_proj = Linear(P, D)
        else:
            self.g_a_proj, self.g_b_proj = Linear(R, D), Linear(P, R)
        self.o_norm = GatedRMSNorm(K, c.rms_norm_eps)
        self.o_proj = Linear(D, P)

    def __call__(self, x, cu_seqlens=None, cache: KDACache | None = None, mode: str = "chunk"):
        check_activation_dtype(x, "KimiDeltaAttention")
        if mode not in MODES:
            raise ValueError(f"mode: got {mode!r}, expected one of {list(MODES)}")
        c = self.config
        B, T, _ = x.shape
        H, K = c.kda_num_heads, c.kda_head_dim
        cq, ck, cv, S0 = (None,) * 4 if cache is None else cache
        q, cq = self.q_conv1d(self.q_proj(x), cu_seqlens, cq)  # [B,T,P]
        k, ck = self.k_conv1d(self.k_proj(x), cu_seqlens, ck)
        v, cv = self.v_conv1d(self.v_proj(x), cu_seqlens, cv)
        q = l2norm(q.reshape(B, T, H, K))  # [B,T,H,K] fp32
        k = l2norm(k.reshape(B, T, H, K))
        v = v.reshape(B, T, H, K)  # [B,T,H,V] (V = K = head_dim for this layer)
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).reshape(B, T, H, K), self.A_log, self.dt_bias, c.gate_lower_bound)
        beta = jax.nn.sigmoid(
            self.b_proj(x).astype(compute_dtype(x))
        )  # [B,T,H]: the one and only sigmoid on beta (twice breaks prefill == decode)
        recurrence = kda_chunk if mode == "chunk" else kda_recurrent
        o, S = recurrence(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu_seqlens)  # o [B,T,H,V]
        gate = self.g_proj(x) if c.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        y = self.o_norm(o, gate.reshape(B, T, H, K)).astype(x.dtype).reshape(B, T, H * K)
        return self.o_proj(y), KDACache(cq, ck, cv, S)
