"""The language-model loss on the torch path: twin of ``reference_jax.loss`` (same names, arguments, semantics).

Mean next-token cross-entropy over packed documents: position t predicts token t + 1 only when both lie in the same
document (``cu_seqlens``) and the same row; the last token of every document (and of every row) has no target and
is left out of the mean. Computed in fp32 (fp64 for fp64 logits), natural log.

:func:`linear_cross_entropy` is a torch-only speed path with no JAX twin: the summed cross-entropy of
``hidden @ weight.T`` computed in row chunks, so the ``[N, vocab]`` logits never exist at once (what
``KimiK3Model.loss`` and ``kimi train`` use). It equals the dense ``F.cross_entropy`` of the
model's logits, which the reference computes.
"""

from __future__ import annotations

import torch

from kernels_torch.common import check_range_async, compute_dtype, segment_ids
from kimi.tokenizer import IGNORE_INDEX

__all__ = ["next_token_targets", "lm_loss", "linear_cross_entropy", "default_chunk_size"]


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


# ------------------------------------------------------------------------------------------ fused linear + CE

CHUNK_BYTES = 1 << 30  # default chunk: rows whose fp32 logits take at most this many bytes (1 GiB)


def default_chunk_size(vocab_size: int) -> int:
    """Rows per chunk of :func:`linear_cross_entropy` when none is given: the fp32 logits of one chunk take at most
    :data:`CHUNK_BYTES` (1638 rows -> 1536, a multiple of 128 for the matmul tiles, at the real vocab 163840)."""
    rows = max(1, CHUNK_BYTES // (4 * vocab_size))
    return rows - rows % 128 if rows >= 128 else rows


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int = IGNORE_INDEX,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of the logits ``hidden @ weight.T`` without materialising them: equal to
    ``F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=ignore_index, reduction="sum")``.

    The fused linear cross-entropy (the idea of Liger-Kernel's ``LigerFusedLinearCrossEntropy`` and of Wijmans et
    al. 2024, "Cut Your Losses in Large-Vocabulary Language Models"; our own plain-torch code): ``chunk_size`` rows
    at a time, the logits chunk ``hidden_c @ weight.T`` is formed in the weights' dtype (the rounding of the model's
    ``h @ w.t()``), upcast to fp32 (fp64 for fp64 inputs) for the log-softmax and the NLL, and, when a gradient is
    needed, the gradients are computed **in the forward**: ``dlogits = softmax - onehot`` (zero on ignored rows),
    cast to the weights' dtype as autograd casts it, ``dhidden_c = dlogits @ weight`` and
    ``dweight += dlogits.T @ hidden_c`` (accumulated in fp32, cast at the end). Only ``dhidden`` ``[N, D]`` and
    ``dweight`` ``[V, D]`` are kept; the backward scales them by the incoming gradient. No ``[N, V]`` tensor exists
    beyond one chunk.

    Memory (bytes, beyond the inputs): ``chunk_size * V * (2 + 4 + 2)`` transient for the bf16 logits, their fp32
    copy (reused for the softmax) and the bf16 ``dlogits``; plus ``N * D * 2`` for ``dhidden``, ``V * D * 4`` for
    the fp32 ``dweight`` accumulator (with a ``V * D * 2`` per-chunk product beside it; ``V * D * 2`` kept) when
    gradients are needed. At N = 32768, V = 163840,
    D = 7168, bf16: ~3 GB transient per 1536-row chunk and ~3.3 GB kept, against ~64 GB for the full logits, their
    fp32 copy and both gradients. Cost: the full path's three matmuls (forward, two backward) and no more.

    Args:
        hidden: ``[N, D]`` float (bf16, fp16, fp32 or fp64), the final-norm output. weight: ``[V, D]``, the same
            dtype and device (``lm_head.weight``, or the embedding when tied). labels: ``[N]`` int64 target ids in
            ``[0, V)``, or ``ignore_index`` for rows without a target. ignore_index: the no-target value (-100).
        chunk_size: rows per chunk (any positive int; > N means one chunk); None: :func:`default_chunk_size`.

    Returns:
        A scalar: the sum of ``-log softmax(logits[n])[labels[n]]`` over the rows with a target, in nats, fp32
        (fp64 for fp64 inputs). With every row ignored (or N = 0) it is 0 and the gradients are zero, as in
        ``F.cross_entropy(..., reduction="sum")``. Differentiable in ``hidden`` and ``weight`` (each only if it
        requires grad; gradients are computed in the forward only when grad mode is on and one of them requires
        grad). Not twice differentiable.

    Raises:
        ValueError: ``hidden`` / ``weight`` not 2-D floating tensors of one dtype and device with the same ``D``;
            ``labels`` not ``[N]`` int64 on that device, or a label outside ``[0, V)`` other than ``ignore_index``;
            ``chunk_size`` not a positive int.
    """
    _check_linear_ce(hidden, weight, labels, ignore_index, chunk_size)
    C = default_chunk_size(weight.shape[0]) if chunk_size is None else int(chunk_size)
    needs = (hidden.requires_grad, weight.requires_grad) if torch.is_grad_enabled() else (False, False)
    return _LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, C, needs)


def _check_linear_ce(hidden, weight, labels, ignore_index, chunk_size) -> None:
    for name, x in (("hidden", hidden), ("weight", weight)):
        if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
            got = f"shape {tuple(x.shape)} dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(
                f"{name}: got {got}, expected a 2-D floating tensor ({'[N, D]' if name == 'hidden' else '[V, D]'})"
            )
    N, D = hidden.shape
    if weight.shape[1] != D:
        raise ValueError(
            f"weight: got shape {tuple(weight.shape)}, expected [V, D] with D = {D} like hidden {tuple(hidden.shape)}"
        )
    if weight.dtype != hidden.dtype or weight.device != hidden.device:
        raise ValueError(
            f"weight: got {weight.dtype} on {weight.device}, expected hidden's dtype and device ({hidden.dtype} on "
            f"{hidden.device})"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or tuple(labels.shape) != (N,):
        got = (
            f"shape {tuple(labels.shape)} dtype {labels.dtype}"
            if isinstance(labels, torch.Tensor)
            else type(labels).__name__
        )
        raise ValueError(f"labels: got {got}, expected [N] = [{N}] int64")
    if labels.device != hidden.device:
        raise ValueError(f"labels: got device {labels.device}, expected hidden's device {hidden.device}")
    if isinstance(chunk_size, bool) or not (chunk_size is None or (isinstance(chunk_size, int) and chunk_size >= 1)):
        raise ValueError(f"chunk_size: got {chunk_size!r}, expected a positive int or None")
    V = weight.shape[0]
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if labels.device.type != "cpu":  # no host sync in a training step: a device-side assertion
        check_range_async(~bad, f"labels: expected ids in [0, {V}) or ignore_index={ignore_index}")
    elif N and bool(bad.any()):
        value = int(labels[bad][0])
        raise ValueError(f"labels: got {value}, expected ids in [0, {V}) or ignore_index={ignore_index}")


class _LinearCrossEntropy(torch.autograd.Function):
    """Forward: the summed NLL and (when asked) both gradients, chunk by chunk; backward: scale them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size, needs):
        need_h, need_w = needs
        cdt = compute_dtype(hidden, weight)  # fp32, fp64 for fp64 inputs
        N = hidden.shape[0]
        total = torch.zeros((), dtype=cdt, device=hidden.device)
        dhidden = torch.empty_like(hidden) if need_h else None
        dweight = torch.zeros(weight.shape, dtype=cdt, device=weight.device) if need_w else None
        for start in range(0, N, chunk_size):
            h = hidden[start : start + chunk_size]  # [C, D]
            y = labels[start : start + chunk_size]  # [C]
            valid = y != ignore_index
            safe = torch.where(valid, y, torch.zeros_like(y))[:, None]  # [C, 1], ignored rows point at id 0
            x = (h @ weight.t()).to(cdt)  # [C, V]: rounded in the weights' dtype, then upcast (the model's logits)
            lse = torch.logsumexp(x, dim=-1)  # [C]
            nll = lse - x.gather(1, safe)[:, 0]
            total += torch.where(valid, nll, torch.zeros_like(nll)).sum()
            if need_h or need_w:
                p = x.sub_(lse[:, None]).exp_()  # softmax, in place of the fp32 logits
                p.scatter_add_(1, safe, -valid[:, None].to(cdt))  # - onehot(target)
                dlogits = p.mul_(valid[:, None]).to(weight.dtype)  # 0 on ignored rows; autograd's cast
                del x, p
                if need_h:
                    dhidden[start : start + chunk_size] = dlogits @ weight  # [C, D]
                if need_w:
                    dweight += dlogits.t() @ h  # [V, D], rounded per chunk in the weights' dtype, summed in cdt
                del dlogits
        ctx.save_for_backward(dhidden, None if dweight is None else dweight.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad_total):
        dhidden, dweight = ctx.saved_tensors
        # bf16 * 0-dim fp32: computed in fp32, rounded once to bf16
        gh = None if dhidden is None else dhidden * grad_total
        gw = None if dweight is None else dweight * grad_total
        return gh, gw, None, None, None, None
