"""Lightning-indexer KL distillation (DeepSeek-V3.2's two stages): the dense, readable reference.

Spec 4.4 (indexer training losses), 4.2 (scores: the constants matter here, since the KL compares their softmax),
10.5 (teacher normalisation, gradient isolation); all in ``docs/spec.md``. Notable:

* **Target.** ``p[t, s] = sum_h softmax_h(scale * q_h[t] . k_h[s])`` over the key set the loss covers, divided by its
  row sum (L1 normalisation; each head's row sums to 1, so this is the head mean). Computed in fp32 (fp64 for fp64
  inputs), never differentiated (``stop_gradient``): the indexer is the student, the attention the teacher.
* **Dense warm-up** (:func:`warmup_loss`): the key set is every visible (causal, same-document) key. **Sparse stage**
  (:func:`sparse_loss`): the key set is the selected set ``S_t`` only -- the teacher is the attention the sparse model
  actually runs (a per-head softmax over ``S_t``, i.e. the sparse forward's own lse), and the student is
  ``softmax(I[t, S_t])``; both distributions sum to 1 over ``S_t``. (Renormalising the *dense* head sum over ``S_t``
  would be a different target whenever heads put different mass on ``S_t``; Megatron-LM's DSA loss also masks the
  logits per head before the softmax.)
* **Reduction.** ``L_I = sum_t KL(p_t || softmax(I_t))``: summed over query tokens (and batch rows), as the
  DeepSeek-V3.2 paper writes it. Megatron-LM averages instead; divide by the number of rows to get its value. Rows
  with no key in the set give 0 loss and 0 gradient.
* **Recall** (:func:`indexer_recall`): the share of the dense target's mass on the selected keys, per query.

Everything here is a pure function of tensors; :func:`mla_queries_keys` recomputes the expanded-form q and k of a
``GatedMLA`` layer from its parameters, so the layer's forward stays untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi.config import KimiConfig
from reference_jax.common import compute_dtype, linear, rms_norm

__all__ = [
    "attention_target",
    "indexer_kl",
    "indexer_recall",
    "warmup_loss",
    "sparse_loss",
    "mla_queries_keys",
]

_HI = jax.lax.Precision.HIGHEST


def _mask3(mask: jax.Array, B: int, T: int, S: int) -> jax.Array:
    if mask.shape not in ((T, S), (B, T, S)):
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected {(T, S)} or {(B, T, S)}")
    return jnp.broadcast_to(mask.astype(jnp.bool_), (B, T, S))


def attention_target(q: jax.Array, k: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
    """The distillation target: MLA attention probabilities summed over heads, L1-normalised per query (spec 4.4).

    Args:
        q: ``[B, T, H, K]`` queries (expanded form ``[q_nope ‖ q_pe]``).
        k: ``[B, S, H, K]`` keys ``[k_nope ‖ k_pe]``.
        mask: ``[T, S]`` or ``[B, T, S]`` bool, the key set the loss covers (causal & same document; ``& selected``
            in the sparse stage).
        scale: the MLA softmax scale ``config.mla_softmax_scale`` = (qk_nope + qk_rope)^-1/2.

    Returns:
        ``[B, T, S]`` fp32 (fp64 for fp64 inputs), each row summing to 1 over the masked keys, 0 elsewhere; a row with
        no key in the mask is all 0. Gradients are stopped.

    Raises:
        ValueError: a mask of the wrong shape.
    """
    B, T, H, _ = q.shape
    S = k.shape[1]
    m = _mask3(mask, B, T, S)[:, None]  # [B, 1, T, S]
    dt = compute_dtype(q, k)
    logits = jnp.einsum("bthk,bshk->bhts", q.astype(dt), k.astype(dt), precision=_HI) * scale  # [B, H, T, S]
    logits = jnp.where(m, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # an empty row: max -inf -> 0, no NaN
    e = jnp.where(m, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p_heads = e / jnp.where(denom > 0, denom, 1.0)  # [B, H, T, S] per-head softmax
    p = jnp.sum(p_heads, axis=1)  # [B, T, S] summed over heads
    total = jnp.sum(p, axis=-1, keepdims=True)
    return jax.lax.stop_gradient(p / jnp.where(total > 0, total, 1.0))  # L1-normalised


def indexer_kl(target: jax.Array, index_scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Per-query ``KL(target_t || softmax(I_t))`` with the softmax taken over the masked keys only.

    Args:
        target: ``[B, T, S]`` from :func:`attention_target` over the same ``mask`` (rows sum to 1 or are all 0).
        index_scores: ``[B, T, S]`` the indexer's scores ``I`` (unmasked; used as logits, the spec 4.2 constants
            included).
        mask: ``[T, S]`` or ``[B, T, S]`` bool, the key set the loss covers.

    Returns:
        ``[B, T]`` in fp32 (fp64 for fp64 scores), >= 0; rows with no key in the mask give 0 (and 0 gradient).
        Terms with ``target == 0`` contribute 0 (``0 log 0 = 0``).

    Raises:
        ValueError: a mask of the wrong shape.
    """
    B, T, S = index_scores.shape
    m = _mask3(mask, B, T, S)
    dt = compute_dtype(index_scores, target)
    I = jnp.where(m, index_scores.astype(dt), -jnp.inf)
    row_max = jax.lax.stop_gradient(jnp.max(I, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    e = jnp.where(m, jnp.exp(I - row_max), 0.0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    log_q = jnp.where(m, I - row_max - jnp.log(jnp.where(denom > 0, denom, 1.0)), 0.0)  # log softmax over the mask
    p = target.astype(dt)
    log_p = jnp.log(jnp.where(p > 0, p, 1.0))
    return jnp.sum(jnp.where(p > 0, p * (log_p - log_q), 0.0), axis=-1)  # [B, T]


def indexer_recall(target: jax.Array, selected: jax.Array) -> jax.Array:
    """Share of the dense target's mass that falls on the selected keys, per query.

    Args:
        target: ``[B, T, S]`` dense target (:func:`attention_target` over all visible keys).
        selected: ``[B, T, S]`` bool (``reference_jax.indexer.sparse_mask(topk_indices, S)``).

    Returns:
        ``[B, T]`` in [0, 1]; 1 for rows with at most ``index_topk`` visible keys, 0 for rows with no visible key.
    """
    return jnp.sum(jnp.where(selected, target, 0.0), axis=-1)


def warmup_loss(
    q: jax.Array, k: jax.Array, index_scores: jax.Array, mask: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """Dense warm-up loss ``L_I = sum_t KL(p_t || softmax(I_t))`` over all visible keys (spec 4.4).

    Args:
        q, k: ``[B, T, H, K]``, ``[B, S, H, K]`` the layer's expanded-form queries and keys (teacher; no gradient).
        index_scores: ``[B, T, S]`` the indexer's scores (student).
        mask: ``[T, S]`` or ``[B, T, S]`` bool, causal & same document.
        scale: ``config.mla_softmax_scale``.

    Returns:
        ``(loss, kl)``: the scalar sum over queries and batch rows, and the per-query ``[B, T]`` KL.
    """
    kl = indexer_kl(attention_target(q, k, mask, scale), index_scores, mask)
    return jnp.sum(kl), kl


def sparse_loss(
    q: jax.Array, k: jax.Array, index_scores: jax.Array, mask: jax.Array, selected: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """Sparse-stage loss ``L_I = sum_t KL(p_{t,S_t} || softmax(I_{t,S_t}))`` (spec 4.4).

    The teacher is the sparse attention itself: a per-head softmax over ``S_t`` (= ``mask & selected``), summed over
    heads and L1-normalised; the student's softmax also runs over ``S_t`` only. The caller passes indexer scores
    computed from a **detached** layer input (the LM loss alone trains the model), so this loss reaches only the
    indexer's parameters.

    Args:
        q, k: as in :func:`warmup_loss`. index_scores: ``[B, T, S]``. mask: ``[T, S]`` or ``[B, T, S]`` causal &
        document. selected: ``[B, T, S]`` bool, the indexer's selection (``sparse_mask(topk_indices, S)``).
        scale: ``config.mla_softmax_scale``.

    Returns:
        ``(loss, kl)`` as in :func:`warmup_loss`.
    """
    B, T, S = index_scores.shape
    subset = _mask3(mask, B, T, S) & selected  # re-apply the causal mask after selection (spec 4.3)
    kl = indexer_kl(attention_target(q, k, subset, scale), index_scores, subset)
    return jnp.sum(kl), kl


def mla_queries_keys(params: dict, x: jax.Array, config: KimiConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Recompute a ``GatedMLA`` layer's expanded-form queries and keys (spec 3.2 steps 1-4) from its parameters.

    Args:
        params: the layer's ``self_attn`` parameter tree (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj`` or
            ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``; each ``{"weight": ...}``).
        x: ``[B, T, D]`` the layer's normalised input (``input_layernorm`` output).
        config: the model config.

    Returns:
        ``(q, k, c_q)``: q ``[B, T, H, Kn+R]``, k ``[B, T, H, Kn+R]`` (the shared NoPE ``k_pe`` broadcast to every
        head), c_q ``[B, T, q_lora_rank]`` (the indexer's query input; x itself without q-LoRA), all in x's dtype.
    """
    c = config
    B, T, _ = x.shape
    H, Kn, R, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.kv_lora_rank
    w = lambda name: params[name]["weight"]  # noqa: E731
    if c.q_lora_rank is None:
        c_q = x
        q = linear(x, w("q_proj"))
    else:
        c_q = rms_norm(linear(x, w("q_a_proj")), w("q_a_layernorm"), c.mla_norm_eps)
        q = linear(c_q, w("q_b_proj"))
    q = q.reshape(B, T, H, Kn + R)
    kv = linear(x, w("kv_a_proj_with_mqa"))  # [B, S, L+R]
    c_kv = rms_norm(kv[..., :L], w("kv_a_layernorm"), c.mla_norm_eps)
    k_pe = kv[..., L:]  # NoPE: neither normalised nor rotated
    k_nope = linear(c_kv, w("kv_b_proj")).reshape(B, T, H, -1)[..., :Kn]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe[:, :, None, :], (B, T, H, R))], axis=-1)
    return q, k, c_q
