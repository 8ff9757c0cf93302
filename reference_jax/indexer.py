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
* No RoPE in K3.1 (``indexer_rope == "none"``); the other config values raise NotImplementedError (case 11). No
  Hadamard rotation: it is orthonormal and an fp32 oracle must not add tie noise (spec 4.2).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimi.config import KimiConfig
from reference_jax.cache import cached_causal_mask, write_rows
from reference_jax.common import Linear, causal_document_mask, check_cu_seqlens, compute_dtype

__all__ = ["indexer_scores", "topk_indices", "sparse_mask", "layer_norm", "LayerNorm", "Indexer"]

_HI = jax.lax.Precision.HIGHEST


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
    # "+ 0.0" turns -0.0 (negative weights times an all-ReLU-zero key) into +0.0: top-k orders -0.0 below +0.0
    # while both frameworks' tie rule must see them as the same score (spec 9: ties -> larger key index first).
    return jnp.einsum("btj,btjs->bts", w, jax.nn.relu(logits), precision=_HI) + 0.0


def topk_indices(scores: jax.Array, mask: jax.Array, topk: int) -> jax.Array:
    """Top-k key indices per query in the canonical order (spec 9), masked keys never selected.

    Args:
        scores: ``[B, T, S]`` indexer scores (any float dtype).
        mask: ``[T, S]`` or ``[B, T, S]`` bool, True = key visible (causal and same document).
        topk: the indexer's k (``config.index_topk``), >= 1.

    Returns:
        ``[B, T, min(topk, S)]`` int32: visible keys by score descending, equal scores by key index descending;
        slots beyond the row's number of visible keys hold -1.

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
    # Masked keys get -inf *before* selection (case 8).
    masked = jnp.where(mask, scores, -jnp.inf)
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

    Raises:
        NotImplementedError: ``config.indexer_rope`` other than "none" (K3.1 has no indexer RoPE; case 11).
        ValueError: malformed ``cu_seqlens``.
    """

    config: KimiConfig

    @nn.compact
    def __call__(self, x: jax.Array, c_q: jax.Array, cu_seqlens=None, cache_k=None, cache_pos=None, lengths=None):
        c = self.config
        if c.indexer_rope != "none":
            raise NotImplementedError(
                f"indexer_rope: got {c.indexer_rope!r}; only 'none' (Kimi K3.1) is implemented in the reference indexer"
            )
        B, T, D = x.shape
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
        HI, KI = c.index_n_heads, c.index_head_dim
        q_I = Linear(HI * KI, c_q.shape[-1], name="wq_b")(c_q).reshape(B, T, HI, KI)  # [B, T, HI, KI]
        k_I = LayerNorm(KI, c.rms_norm_eps, name="k_norm")(Linear(KI, D, name="wk")(x))  # [B, T, KI]
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
