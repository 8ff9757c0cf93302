"""DSA lightning indexer (Kimi K3.1 Pro, DeepSeek-V3.2 math without RoPE): scores, canonical top-k, sparse mask.

Spec: ``../shared/spec/architecture.md`` section 4 (4.1 weights, 4.2 scoring, 4.3 selection) and section 9
(tie-break, rows with fewer visible keys than k). Notable:

* Score ``I[t, s] = sum_j w[t, j] * HI^-1/2 * ReLU(KI^-1/2 * q_I[t, j] . k_I[s])``, accumulated in fp32 (fp64 for fp64
  inputs). Both constants are positive, so they never change the selection, but they do change the KL training loss
  (case 10): keep them.
* ReLU ties: a key for which every head has ``q . k <= 0`` scores exactly 0, so exact ties are common. The order is
  canonical (spec 9): higher score first, among equal scores the larger key index first.
* Masked keys (future, other document) are set to ``-inf`` **before** selection (case 8); slots past the number of
  visible keys are ``-1`` (case 9). Callers must still re-apply the causal mask to the attention (see ``mla.py``).
* No RoPE in K3.1 (``indexer_rope == "none"``, case 11). ``"half"`` / ``"interleaved"`` rotate the leading
  ``qk_rope_head_dim`` channels of q_I and k_I (after ``k_norm``) by the token's position inside its document, as
  DeepSeek-V3.2's indexer (:func:`apply_rope`). No Hadamard rotation: it is orthonormal and an fp32 oracle must not
  add tie noise (spec 4.2).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kimi.config import KimiConfig
from kimi.rope import INDEXER_ROPE_THETA, check_rope_args, document_positions, rope_tables
from reference_jax.common import Linear, causal_document_mask, check_activation_dtype, check_cu_seqlens, compute_dtype
from reference_jax.kv_cache import cached_causal_mask, write_rows

__all__ = [
    "indexer_scores",
    "topk_indices",
    "sparse_mask",
    "layer_norm",
    "LayerNorm",
    "Indexer",
    "INDEXER_ROPE_THETA",
    "rope_positions",
    "rope_tables",
    "apply_rope",
]

_HI = jax.lax.Precision.HIGHEST


def _canonical_zero(x: jax.Array) -> jax.Array:
    """``x`` with -0.0 replaced by +0.0 (spec 9: equal scores tie, and -0.0 equals +0.0). ``x + 0.0`` does the same
    op by op, but XLA folds it away under ``jax.jit``; a ``where`` on ``x == 0`` survives."""
    return jnp.where(x == 0, jnp.zeros_like(x), x)


def indexer_scores(q_I: jax.Array, k_I: jax.Array, weights: jax.Array) -> jax.Array:
    """Lightning-indexer scores (spec 4.2), unmasked.

    Args:
        q_I: ``[B, T, HI, KI]`` indexer queries.
        k_I: ``[B, S, KI]`` indexer keys (one per token, shared by all indexer heads).
        weights: ``[B, T, HI]`` per-head weights (``weights_proj(x)``, fp32).

    Returns:
        ``[B, T, S]`` scores ``sum_j weights[t,j] * HI^-1/2 * ReLU(KI^-1/2 * q_I[t,j] . k_I[s])`` in fp32 (fp64 when
        any input is fp64). No masking is applied here.
    """
    dt = compute_dtype(q_I, k_I, weights)
    HI, KI = q_I.shape[-2:]
    # [B, T, HI, S]: per-head dot products, scaled by KI^-1/2 inside the ReLU (a positive factor, so equivalently outside)
    logits = jnp.einsum("btjk,bsk->btjs", q_I.astype(dt), k_I.astype(dt), precision=_HI) * (KI**-0.5)
    w = weights.astype(dt) * (HI**-0.5)  # [B, T, HI]
    # -0.0 (negative weights times an all-ReLU-zero key) becomes +0.0: top-k orders -0.0 below +0.0. A where, not
    # "+ 0.0", which XLA folds away under jit
    # while both frameworks' tie rule must see them as the same score (spec 9: ties -> larger key index first).
    return _canonical_zero(jnp.einsum("btj,btjs->bts", w, jax.nn.relu(logits), precision=_HI))


def topk_indices(scores: jax.Array, mask: jax.Array, topk: int) -> jax.Array:
    """Top-k key indices per query in the canonical order (spec 9), masked keys never selected.

    Args:
        scores: ``[B, T, S]`` indexer scores (any float dtype).
        mask: ``[T, S]`` or ``[B, T, S]`` bool, True = key visible (causal and same document).
        topk: the indexer's k (``config.index_topk``), >= 1.

    Returns:
        ``[B, T, min(topk, S)]`` int32: visible keys by score descending, equal scores by key index descending
        (``-0.0`` and ``+0.0`` are equal scores); slots beyond the row's number of visible keys hold -1.

    Raises:
        ValueError: ``topk`` < 1, or a mask whose shape does not broadcast to ``scores``.
    """
    if topk < 1:
        raise ValueError(f"topk: got {topk}, expected an integer >= 1")
    B, T, S = scores.shape
    if mask.shape not in ((T, S), (B, T, S)):
        raise ValueError(
            f"mask: got shape {tuple(mask.shape)}, expected {(T, S)} or {(B, T, S)} (scores {scores.shape})"
        )
    mask = jnp.broadcast_to(mask, (B, T, S))
    k = min(topk, S)
    # Masked keys get -inf *before* selection (case 8). "+ 0.0" makes -0.0 equal +0.0 here, whatever the caller
    # passes: lax.top_k orders -0.0 below +0.0, while the tie rule (spec 9) sees one score.
    masked = jnp.where(mask, _canonical_zero(scores), -jnp.inf)
    # lax.top_k puts the lower index first among ties; run it on the reversed key axis so that the larger original
    # key index wins ties (canonical order, spec 9), then map positions back.
    _, rev_idx = jax.lax.top_k(masked[..., ::-1], k)
    idx = (S - 1 - rev_idx).astype(jnp.int32)
    # Every visible key has a finite score, so visible keys fill a prefix; anything past it is a masked key -> -1.
    picked_visible = jnp.take_along_axis(mask, idx, axis=-1)
    return jnp.where(picked_visible, idx, -1).astype(jnp.int32)


def sparse_mask(topk_indices: jax.Array, S: int) -> jax.Array:
    """``[B, T, S]`` bool, True at the selected keys of ``topk_indices`` ``[B, T, k]`` (-1 slots are ignored)."""
    B, T, _ = topk_indices.shape
    idx = jnp.where(topk_indices < 0, S, topk_indices)  # -1 -> a spare column S, dropped below
    out = jnp.zeros((B, T, S + 1), jnp.bool_)
    out = out.at[jnp.arange(B)[:, None, None], jnp.arange(T)[None, :, None], idx].set(True)
    return out[..., :S]


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis computed in fp32 (fp64 for fp64 input), cast back to ``x.dtype`` (DeepSeek's
    indexer ``k_norm``)."""
    dt = compute_dtype(x)
    xf = x.astype(dt)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps) * weight.astype(dt) + bias.astype(dt)
    return y.astype(x.dtype)


# ------------------------------------------------------------------------------------------------ optional RoPE


def rope_positions(T: int, cu_seqlens=None) -> np.ndarray:
    """Position of every token inside its document, ``[T]`` int64: ``t`` without ``cu_seqlens``, ``t - cu[n]`` in
    document n (RoPE restarts at every packed document, as a separate run would)."""
    return document_positions(T, None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, T))


def apply_rope(x: jax.Array, positions, rope_dim: int, style: str, theta: float = INDEXER_ROPE_THETA) -> jax.Array:
    """Rotate the first ``rope_dim`` channels of ``x`` by their token's position (DeepSeek-V3.2 indexer RoPE, which
    rotates the leading 64 of the 128 indexer dims; spec 9 ``indexer_rope``).

    Args:
        x: ``[B, T, KI]`` (keys) or ``[B, T, HI, KI]`` (queries), any float dtype.
        positions: ``[T]`` int, see :func:`rope_positions`.
        rope_dim: rotated channels (``config.qk_rope_head_dim``), even and ``<= KI``.
        style: ``"half"`` pairs channel ``i`` with ``i + rope_dim/2`` (GPT-NeoX / rotate-half; DeepSeek-V3.2's indexer,
            ``interleaved=False``); ``"interleaved"`` pairs ``2i`` with ``2i+1`` (GPT-J / complex multiplication);
            ``"none"`` returns ``x`` unchanged. Pair ``(a, b)`` at frequency ``i`` becomes
            ``(a cos - b sin, a sin + b cos)`` with angle ``positions[t] * theta^(-2i/rope_dim)``.

    Returns:
        ``x``'s shape and dtype; the rotation runs in fp32 (fp64 for fp64 ``x``), the other channels pass unchanged.

    Raises:
        ValueError: an unknown ``style``, an odd ``rope_dim`` or one larger than ``KI``, ``positions`` not ``[T]``.
    """
    T = x.shape[1]
    check_rope_args(style, rope_dim, T, x.shape[-1], positions)
    if style == "none":
        return x
    dt = compute_dtype(x)
    cos, sin = (
        jnp.asarray(a, dt).reshape((1, T) + (1,) * (x.ndim - 3) + (-1,))
        for a in rope_tables(positions, rope_dim, theta)
    )
    xr = x[..., :rope_dim].astype(dt)
    half = rope_dim // 2
    a, b = (xr[..., 0::2], xr[..., 1::2]) if style == "interleaved" else (xr[..., :half], xr[..., half:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    rot = jnp.stack([ra, rb], axis=-1).reshape(xr.shape) if style == "interleaved" else jnp.concatenate([ra, rb], -1)
    return jnp.concatenate([rot.astype(x.dtype), x[..., rope_dim:]], axis=-1)


class LayerNorm(nn.Module):
    """LayerNorm with params ``weight`` and ``bias`` ``[dim]`` (checkpoint names ``k_norm.weight/bias``)."""

    dim: int
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        w = self.param("weight", nn.initializers.ones, (self.dim,))
        b = self.param("bias", nn.initializers.zeros, (self.dim,))
        return layer_norm(x, w, b, self.eps)


class Indexer(nn.Module):
    """The DSA lightning indexer of one K3.1 layer (``self_attn.indexer.*``, spec 4.1).

    Params: ``wq_b.weight`` ``[HI*KI, q_lora_rank]`` (``[HI*KI, D]`` when q_lora_rank is None), ``wk.weight``
    ``[KI, D]``, ``k_norm.weight``/``k_norm.bias`` ``[KI]`` (LayerNorm, eps ``rms_norm_eps``, fp32),
    ``weights_proj.weight`` ``[HI, D]`` (applied in fp32).

    Call ``(x, c_q, cu_seqlens=None) -> (topk_indices, scores)``:
        x: ``[B, T, D]`` the layer's normalised input; c_q: ``[B, T, q_lora_rank]`` = ``q_a_layernorm(q_a_proj(x))``;
        cu_seqlens: ``[N+1]`` packed-document offsets (B = 1) or None.
        topk_indices ``[B, T, min(index_topk, T)]`` int32 (canonical order, -1 padded), scores ``[B, T, T]`` fp32
        (unmasked). Selection mask = causal & same document. With ``cache_k`` ``[B, S_max, KI]`` (``cache_pos``,
        ``lengths`` ``[B]``: see ``reference_jax.cache``) the keys are the cached ones plus this call's, S =
        ``max(cache_pos + lengths)``, and the call returns ``(topk_indices, scores, new_cache_k)``.

    ``config.indexer_rope`` "half" / "interleaved" rotates the leading ``qk_rope_head_dim`` channels of q_I and k_I
    by position within the document (:func:`apply_rope`); "none" (K3.1) leaves them unrotated.

    Raises:
        ValueError: malformed ``cu_seqlens``, non-float ``x`` / ``c_q``, a ``qk_rope_head_dim`` that is odd or larger
            than ``index_head_dim`` when RoPE is on.
    """

    config: KimiConfig

    @nn.compact
    def __call__(self, x: jax.Array, c_q: jax.Array, cu_seqlens=None, cache_k=None, cache_pos=None, lengths=None):
        c = self.config
        check_activation_dtype(x, "Indexer")
        check_activation_dtype(c_q, "Indexer", "c_q")
        B, T, D = x.shape
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
        HI, KI = c.index_n_heads, c.index_head_dim
        q_I = Linear(HI * KI, c_q.shape[-1], name="wq_b")(c_q).reshape(B, T, HI, KI)  # [B, T, HI, KI]
        k_I = LayerNorm(KI, c.rms_norm_eps, name="k_norm")(Linear(KI, D, name="wk")(x))  # [B, T, KI]
        if c.indexer_rope != "none":  # DeepSeek-V3.2 style: rotate the leading qk_rope_head_dim dims (after k_norm)
            if cache_k is not None:
                raise NotImplementedError(
                    f"indexer_rope={c.indexer_rope!r} with a decode cache: the cached keys would need their absolute "
                    "positions; run without a cache (a full forward), or with indexer_rope='none' (K3.1)"
                )
            pos = rope_positions(T, cu_seqlens)  # [T], restarting at every document
            q_I = apply_rope(q_I, pos, c.qk_rope_head_dim, c.indexer_rope)
            k_I = apply_rope(k_I, pos, c.qk_rope_head_dim, c.indexer_rope)
        # weights_proj runs in fp32 (fp64 for fp64 x), as DeepSeek's `weights_proj(x.float())`.
        weights = Linear(HI, D, name="weights_proj")(x.astype(compute_dtype(x)))  # [B, T, HI]
        if cache_k is not None:  # keys = the cached ones then this call's (reference_jax.cache)
            index_k = write_rows(cache_k, k_I, cache_pos, lengths)  # [B, S_max, KI]
            S = index_k.shape[1]  # the whole capacity, masked
            scores = indexer_scores(q_I, index_k, weights)  # [B, T, S]
            return topk_indices(scores, cached_causal_mask(cache_pos, T, S), c.index_topk), scores, index_k
        scores = indexer_scores(q_I, k_I, weights)  # [B, T, S=T]
        mask = causal_document_mask(T, cu_seqlens)  # [T, S]
        return topk_indices(scores, mask, c.index_topk), scores
