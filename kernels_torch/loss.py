"""The language-model loss on the torch path: twin of ``reference_jax.loss`` (same names, arguments, semantics).

Mean next-token cross-entropy over packed documents: position t predicts token t + 1 only when both lie in the same
document (``cu_seqlens``) and the same row; the last token of every document (and of every row) has no target and
is left out of the mean. Computed in fp32 (fp64 for fp64 logits), natural log.
"""

from __future__ import annotations

import torch

from kernels_torch.common import compute_dtype, segment_ids

__all__ = ["next_token_targets", "lm_loss"]


def next_token_targets(input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None):
    """Targets and their mask for :func:`lm_loss`.

    Args:
        input_ids: ``[B, T]`` integer token ids. cu_seqlens: ``[N+1]`` document offsets (B = 1), or None (each row
            one document).

    Returns:
        ``(targets [B, T] int64, valid [B, T] bool)``: ``targets[:, t] = input_ids[:, t+1]`` where ``valid``
        (t + 1 < T and in the same document), 0 elsewhere.

    Raises:
        ValueError: ``input_ids`` not ``[B, T]``; malformed ``cu_seqlens`` (``kernels_torch.common.check_cu_seqlens``).
    """
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids: got shape {tuple(input_ids.shape)}, expected [B, T]")
    B, T = input_ids.shape
    seg = segment_ids(cu_seqlens, T, device=input_ids.device) if cu_seqlens is not None else None
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens: given with batch size {B}, expected batch size 1 (documents packed in one row)")
    targets = torch.zeros_like(input_ids, dtype=torch.int64)
    targets[:, :-1] = input_ids[:, 1:]
    valid = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    valid[:, :-1] = True
    if seg is not None:
        valid[:, :-1] &= (seg[1:] == seg[:-1])[None]
    return targets, valid


def lm_loss(logits: torch.Tensor, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy ``-log softmax(logits[t])[ids[t+1]]`` over the valid positions of
    :func:`next_token_targets` (natural log, nats per token).

    Args:
        logits: ``[B, T, vocab]`` (any float dtype; reduced in fp32, fp64 for fp64). input_ids: ``[B, T]``.
        cu_seqlens: ``[N+1]`` (B = 1) or None.

    Returns:
        A scalar tensor in the compute dtype (fp32 / fp64), differentiable in ``logits``.

    Raises:
        ValueError: mismatched shapes, or no position with a target (every document one token long).
    """
    if logits.ndim != 3 or tuple(logits.shape[:2]) != tuple(input_ids.shape):
        raise ValueError(
            f"logits: got shape {tuple(logits.shape)}, expected [B, T, vocab] with [B, T] = {tuple(input_ids.shape)}"
        )
    targets, valid = next_token_targets(input_ids, cu_seqlens)
    n = int(valid.sum())
    if n == 0:
        raise ValueError("input_ids: no next-token target (every document is one token long); expected T >= 2")
    x = logits.to(compute_dtype(logits))
    nll = torch.logsumexp(x, dim=-1) - x.gather(-1, targets[..., None])[..., 0]  # [B, T]
    return torch.where(valid, nll, torch.zeros_like(nll)).sum() / n
