"""The language-model loss in the reference (the oracle for ``kernels_torch.loss``, same names and semantics).

Mean next-token cross-entropy over packed documents: position t predicts token t + 1 only when both lie in the same
document (``cu_seqlens``) and the same row; the last token of every document (and of every row) has no target and
is left out of the mean. Computed in fp32 (fp64 for fp64 logits, under ``jax.enable_x64``), natural log.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from reference_jax.common import segment_ids

__all__ = ["next_token_targets", "lm_loss"]


def next_token_targets(input_ids, cu_seqlens=None):
    """``(targets [B, T] int32, valid [B, T] bool)``: ``targets[:, t] = input_ids[:, t+1]`` where ``valid``
    (t + 1 < T and the same document), 0 elsewhere. ``input_ids`` ``[B, T]`` int; ``cu_seqlens`` ``[N+1]`` (B = 1)
    or None.

    Raises:
        ValueError: ``input_ids`` not ``[B, T]``; ``cu_seqlens`` with B > 1 or malformed.
    """
    ids = jnp.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids: got shape {tuple(ids.shape)}, expected [B, T]")
    B, T = ids.shape
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens: given with batch size {B}, expected batch size 1 (documents packed in one row)")
    targets = jnp.concatenate([ids[:, 1:], jnp.zeros((B, 1), ids.dtype)], axis=1)
    valid = jnp.arange(T) < T - 1  # [T]
    if cu_seqlens is not None:
        seg = segment_ids(cu_seqlens, T)
        valid = valid & (seg == jnp.concatenate([seg[1:], seg[-1:]]))
    return targets, jnp.broadcast_to(valid[None], (B, T))


def lm_loss(logits, input_ids, cu_seqlens=None):
    """Mean next-token cross-entropy ``-log softmax(logits[t])[ids[t+1]]`` over the valid positions of
    :func:`next_token_targets` (natural log, nats per token).

    Args:
        logits: ``[B, T, vocab]``; input_ids: ``[B, T]``; cu_seqlens: ``[N+1]`` (B = 1) or None.

    Returns:
        A scalar in fp32 (fp64 for fp64 logits).

    Raises:
        ValueError: mismatched shapes, or no position with a target (every document one token long).
    """
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(np.shape(input_ids)):
        raise ValueError(
            f"logits: got shape {tuple(logits.shape)}, expected [B, T, vocab] with [B, T] = {tuple(np.shape(input_ids))}"
        )
    targets, valid = next_token_targets(input_ids, cu_seqlens)
    n = int(valid.sum())
    if n == 0:
        raise ValueError("input_ids: no next-token target (every document is one token long); expected T >= 2")
    x = logits.astype(jnp.float64 if logits.dtype == jnp.float64 else jnp.float32)
    nll = jax.nn.logsumexp(x, axis=-1) - jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return jnp.where(valid, nll, 0.0).sum() / n
