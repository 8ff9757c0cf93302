"""Lightning-indexer KL distillation, PyTorch twin of ``reference_jax.distill`` (same names, arguments, letters).

Spec 4.4 and 10.5 (``docs/spec.md``: teacher normalisation, gradient isolation). The math and the choices (target =
head-summed attention over the key set the loss covers, L1-normalised, fp32, no gradient; ``L_I = sum_t KL``, summed
over queries as DeepSeek-V3.2 writes it; the sparse stage's teacher is the per-head softmax over ``S_t``) are
documented in the reference module. Two forms here:

* Dense twins (:func:`attention_target`, :func:`indexer_kl`, :func:`indexer_recall`, :func:`warmup_loss`,
  :func:`sparse_loss`): readable, ``[B, H, T, S]`` logits, for the eager / sdpa backends at CPU sizes. (SDPA never
  exposes its probabilities, so both dense backends build the target the same explicit way.)
* Memory-bounded forms for long sequences: :func:`warmup_kl_chunked` computes the dense warm-up target in query-row
  chunks from the attention logits and their lse (passed in from a flash forward, or reduced per chunk), and its
  backward recomputes each chunk, so no ``[T, S, H]`` tensor ever exists (32K tokens: 96 heads x 32K x 32K x 4 B
  = 412 GB); :func:`sparse_kl_gathered` runs the sparse stage on the selected rows only (``[T, H, k]`` per chunk),
  reusing the sparse forward's lse, which is taken over exactly ``S_t`` (an lse over another key set would
  normalise the teacher wrongly);
  :func:`indexer_scores_at` gives the student's scores at the selected keys without the ``[T, S]`` score matrix;
  :func:`sparse_recall` gives the recall of a selection from the sparse lse and a chunked dense lse (no ``[T, S]``).

:func:`mla_queries_keys` recomputes a ``GatedMLA`` layer's q and k from its weights (through ``layer.project``), so the
layer's forward stays untouched.
"""

from __future__ import annotations

import torch

from kernels_torch.common import compute_dtype, segment_ids

__all__ = [
    "attention_target",
    "indexer_kl",
    "indexer_recall",
    "warmup_loss",
    "sparse_loss",
    "mla_queries_keys",
    "warmup_kl_chunked",
    "sparse_kl_gathered",
    "indexer_scores_at",
    "sparse_recall",
    "CHUNK_BYTES",
]

CHUNK_BYTES = 1 << 28  # bound on one chunk's fp32 logits [B, H, rows, S] in the chunked forms (256 MiB)


def _mask3(mask: torch.Tensor, B: int, T: int, S: int) -> torch.Tensor:
    if tuple(mask.shape) not in ((T, S), (B, T, S)):
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected {(T, S)} or {(B, T, S)}")
    return mask.to(torch.bool).expand(B, T, S)


# ----------------------------------------------------------------------------------------------------------------
# dense twins of the reference
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def attention_target(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Head-summed, L1-normalised MLA attention probabilities (spec 4.4); twin of the reference function.

    Args:
        q: ``[B, T, H, K]``; k: ``[B, S, H, K]`` (expanded form). mask: ``[T, S]`` or ``[B, T, S]`` bool, the key set
        the loss covers. scale: ``config.mla_softmax_scale``.

    Returns:
        ``[B, T, S]`` fp32 (fp64 for fp64 inputs), rows summing to 1 over the mask, empty rows all 0; no gradient.

    Raises:
        ValueError: a mask of the wrong shape.
    """
    B, T, H, _ = q.shape
    S = k.shape[1]
    m = _mask3(mask, B, T, S)[:, None]  # [B, 1, T, S]
    dt = compute_dtype(q, k)
    logits = torch.einsum("bthk,bshk->bhts", q.to(dt), k.to(dt)) * scale  # [B, H, T, S]
    logits = logits.masked_fill(~m, float("-inf"))
    row_max = logits.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))  # empty row: no NaN
    e = torch.exp(logits - row_max).masked_fill(~m, 0.0)
    denom = e.sum(-1, keepdim=True)
    p = (e / torch.where(denom > 0, denom, torch.ones_like(denom))).sum(1)  # [B, T, S] summed over heads
    total = p.sum(-1, keepdim=True)
    return p / torch.where(total > 0, total, torch.ones_like(total))


def indexer_kl(target: torch.Tensor, index_scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-query ``KL(target_t || softmax(I_t))`` over the masked keys; twin of the reference function.

    Args:
        target: ``[B, T, S]`` (:func:`attention_target` over the same mask). index_scores: ``[B, T, S]`` (unmasked).
        mask: ``[T, S]`` or ``[B, T, S]`` bool.

    Returns:
        ``[B, T]`` fp32 (fp64 for fp64 scores), >= 0; empty rows 0 with 0 gradient.

    Raises:
        ValueError: a mask of the wrong shape.
    """
    B, T, S = index_scores.shape
    m = _mask3(mask, B, T, S)
    dt = compute_dtype(index_scores, target)
    I = index_scores.to(dt).masked_fill(~m, float("-inf"))
    row_max = I.detach().amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(I - row_max).masked_fill(~m, 0.0)
    denom = e.sum(-1, keepdim=True)
    log_q = torch.where(m, I - row_max - torch.log(torch.where(denom > 0, denom, torch.ones_like(denom))), 0.0)
    p = target.to(dt)
    log_p = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
    return torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def indexer_recall(target: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """``[B, T]`` share of the dense target's mass on the selected keys (``selected`` ``[B, T, S]`` bool)."""
    return torch.where(selected, target, 0.0).sum(-1)


def warmup_loss(
    q: torch.Tensor, k: torch.Tensor, index_scores: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense warm-up ``(sum_t KL, kl [B, T])`` over every visible key; twin of the reference function."""
    kl = indexer_kl(attention_target(q, k, mask, scale), index_scores, mask)
    return kl.sum(), kl


def sparse_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    index_scores: torch.Tensor,
    mask: torch.Tensor,
    selected: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse stage ``(sum_t KL over S_t, kl [B, T])`` with ``S_t = mask & selected``; twin of the reference."""
    B, T, S = index_scores.shape
    subset = _mask3(mask, B, T, S) & selected
    kl = indexer_kl(attention_target(q, k, subset, scale), index_scores, subset)
    return kl.sum(), kl


def mla_queries_keys(layer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A ``kernels_torch.mla.GatedMLA`` layer's expanded-form ``(q, k, c_q)`` for its normalised input x ``[B, T, D]``:
    q, k ``[B, T, H, Kn+R]`` (``k_pe`` broadcast to every head), c_q ``[B, T, q_lora_rank]``; twin of the reference's
    ``mla_queries_keys`` (spec 3.2 steps 1-4), through ``layer.project`` and ``layer.kv_b_proj``."""
    c = layer.config
    B, T, _ = x.shape
    H, Kn, R = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    c_q, q, _, _, c_kv, k_pe = layer.project(x)
    k_nope = layer.kv_b_proj(c_kv).view(B, T, H, -1)[..., :Kn]
    k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, T, H, R)], dim=-1)
    return q, k, c_q


# ----------------------------------------------------------------------------------------------------------------
# memory-bounded forms
# ----------------------------------------------------------------------------------------------------------------


def _rows_per_chunk(B: int, H: int, S: int, dt: torch.dtype, chunk_bytes: int) -> int:
    return max(1, chunk_bytes // max(1, B * H * S * torch.finfo(dt).bits // 8))


def _chunk_logits(q, k, rt, scale, dt):
    """``[B, H, C, S]`` fp32 logits of query rows ``rt``: k ``[B, S, H, K]`` (per-head keys) or ``[B, S, K]`` (one
    key shared by all heads: the absorbed MLA form)."""
    if k.ndim == 3:
        return torch.einsum("bthk,bsk->bhts", q[:, rt].to(dt), k.to(dt)) * scale
    return torch.einsum("bthk,bshk->bhts", q[:, rt].to(dt), k.to(dt)) * scale


def _chunk_target(logits, lse, vis):
    """Per-head probabilities from logits and lse, summed over heads and L1-normalised: ``[B, C, S]``."""
    p = torch.exp(logits - lse[..., None]).masked_fill(~vis[:, None], 0.0).sum(1)  # [B, C, S]
    total = p.sum(-1, keepdim=True)
    return p / torch.where(total > 0, total, torch.ones_like(total))


def _chunk_log_softmax(I, vis):
    I = I.masked_fill(~vis, float("-inf"))
    row_max = I.amax(-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    e = torch.exp(I - row_max).masked_fill(~vis, 0.0)
    denom = e.sum(-1, keepdim=True)
    return torch.where(vis, I - row_max - torch.log(torch.where(denom > 0, denom, torch.ones_like(denom))), 0.0)


class _WarmupKL(torch.autograd.Function):
    """Per-row warm-up KL (and recall) in query-row chunks; gradient to the indexer scores only.

    Forward, per chunk of C rows: logits ``[B, H, C, S]`` -> lse (given, or reduced here) -> target ``[B, C, S]`` ->
    KL per row. Backward recomputes the chunk's target from the saved lse (``dI = dkl * (softmax(I) - p)``), so the
    largest temporaries are ``[B, H, C, S]`` and the ``[B, T, S]`` scores/gradient, never ``[B, H, T, S]``."""

    @staticmethod
    def forward(ctx, q, k, index_scores, scale, seg, lse, selected, rows):
        B, T, H, _ = q.shape
        S = index_scores.shape[-1]
        dt = compute_dtype(q, k, index_scores)
        kl = index_scores.new_zeros(B, T, dtype=dt)
        recall = index_scores.new_zeros(B, T, dtype=dt) if selected is not None else None
        lse_all = q.new_empty(B, H, T, dtype=dt)
        s_idx = torch.arange(S, device=q.device)
        for t0 in range(0, T, rows):
            rt = slice(t0, min(T, t0 + rows))
            t_idx = torch.arange(rt.start, rt.stop, device=q.device)
            vis = ((s_idx[None, :] <= t_idx[:, None]) & (seg[rt, None] == seg[None, :S]))[None].expand(B, -1, -1)
            logits = _chunk_logits(q, k, rt, scale, dt).masked_fill(~vis[:, None], float("-inf"))
            if lse is None:
                lse_c = torch.logsumexp(logits, -1)
                lse_c = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
            else:
                lse_c = lse[:, :, rt].to(dt)
            lse_all[:, :, rt] = lse_c
            p = _chunk_target(logits, lse_c, vis)
            del logits
            log_q = _chunk_log_softmax(index_scores[:, rt].to(dt), vis)
            log_p = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
            kl[:, rt] = torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)
            if selected is not None:
                recall[:, rt] = torch.where(selected[:, rt], p, 0.0).sum(-1)
        ctx.save_for_backward(q, k, index_scores, seg, lse_all)
        ctx.scale, ctx.rows, ctx.dt = scale, rows, dt
        ctx.mark_non_differentiable(*(x for x in (recall,) if x is not None))
        return kl, recall

    @staticmethod
    def backward(ctx, dkl, _drecall):
        q, k, index_scores, seg, lse_all = ctx.saved_tensors
        if not ctx.needs_input_grad[2]:
            return (None,) * 8
        B, T, _, _ = q.shape
        S = index_scores.shape[-1]
        dt = ctx.dt
        dI = torch.zeros_like(index_scores, dtype=dt)
        s_idx = torch.arange(S, device=q.device)
        for t0 in range(0, T, ctx.rows):
            rt = slice(t0, min(T, t0 + ctx.rows))
            t_idx = torch.arange(rt.start, rt.stop, device=q.device)
            vis = ((s_idx[None, :] <= t_idx[:, None]) & (seg[rt, None] == seg[None, :S]))[None].expand(B, -1, -1)
            logits = _chunk_logits(q, k, rt, ctx.scale, dt).masked_fill(~vis[:, None], float("-inf"))
            p = _chunk_target(logits, lse_all[:, :, rt], vis)
            del logits
            soft = torch.exp(_chunk_log_softmax(index_scores[:, rt].to(dt), vis)).masked_fill(~vis, 0.0)
            dI[:, rt] = dkl[:, rt, None].to(dt) * (soft - p)  # an empty row: soft = p = 0, zero gradient
        return None, None, dI.to(index_scores.dtype), None, None, None, None, None


def warmup_kl_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    index_scores: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    *,
    lse: torch.Tensor | None = None,
    topk_indices: torch.Tensor | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Dense warm-up KL per query, in query-row chunks (memory O(B H C S), never ``[B, H, T, S]``).

    Equal to ``indexer_kl(attention_target(q, k, mask, scale), index_scores, mask)`` with ``mask`` = causal & same
    document, up to rounding.

    Args:
        q: ``[B, T, H, K]`` queries (expanded ``[q_nope ‖ q_pe]``, or absorbed ``[W_UKᵀ q_nope ‖ q_pe]``).
        k: ``[B, S, H, K]`` per-head keys, or ``[B, S, K]`` one key shared by all heads (absorbed ``[c ‖ k_pe]``); no
            gradient is taken through q or k (the teacher).
        index_scores: ``[B, T, S]`` the indexer's scores (the student; gradient flows here).
        scale: ``config.mla_softmax_scale`` (192^-1/2 in both MLA forms, spec 3.3).
        cu_seqlens: ``[N+1]`` packed-document offsets (B = 1) or None.
        lse: optional ``[B, H, T]`` natural-log logsumexp of the **dense causal** attention (from a flash forward);
            None reduces it per chunk. Never pass an lse taken over another key set: the
            teacher must sum to 1 over exactly the keys the loss covers.
        topk_indices: optional ``[B, T, k]`` int (-1 padded): also return the recall of that selection.
        chunk_bytes: bound on one chunk's fp32 logits.

    Returns:
        ``(kl [B, T], recall [B, T] or None)``, fp32 (fp64 for fp64 inputs); recall has no gradient.

    Raises:
        ValueError: shapes that do not agree (naming the tensor), malformed ``cu_seqlens``.
    """
    B, T, H, Kd = q.shape
    S = index_scores.shape[-1]
    if tuple(index_scores.shape) != (B, T, S) or S != T:
        raise ValueError(f"index_scores: got shape {tuple(index_scores.shape)}, expected {(B, T, T)}")
    if k.shape[0] != B or k.shape[1] != S or k.shape[-1] != Kd or k.ndim not in (3, 4):
        raise ValueError(f"k: got shape {tuple(k.shape)}, expected {(B, S, H, Kd)} or {(B, S, Kd)}")
    if lse is not None and tuple(lse.shape) != (B, H, T):
        raise ValueError(f"lse: got shape {tuple(lse.shape)}, expected {(B, H, T)}")
    seg = segment_ids(cu_seqlens, T, device=q.device)
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens: given with batch size {B}, expected batch size 1")
    selected = None
    if topk_indices is not None:
        from kernels_torch.indexer import sparse_mask

        selected = sparse_mask(topk_indices, S)
    dt = compute_dtype(q, k, index_scores)
    rows = _rows_per_chunk(B, H, S, dt, chunk_bytes)
    return _WarmupKL.apply(q.detach(), k.detach(), index_scores, scale, seg, lse, selected, rows)


def indexer_scores_at(
    q_I: torch.Tensor, k_I: torch.Tensor, weights: torch.Tensor, topk_indices: torch.Tensor, rows: int = 1024
) -> torch.Tensor:
    """The indexer's scores at the selected keys only (spec 4.2), ``[B, T, k]``, without the ``[B, T, S]`` matrix.

    Args:
        q_I: ``[B, T, HI, KI]``; k_I: ``[B, S, KI]``; weights: ``[B, T, HI]`` (unscaled ``weights_proj(x)``).
        topk_indices: ``[B, T, k]`` int, -1 slots allowed (their score is 0 and must be masked by the caller).
        rows: query rows per chunk (memory ``[B, rows, k, KI]``).

    Returns:
        ``[B, T, k]`` fp32 (fp64 for fp64 inputs) ``sum_j w[t,j] HI^-1/2 ReLU(KI^-1/2 q_I[t,j] . k_I[idx])``;
        differentiable in q_I, k_I and weights.
    """
    dt = compute_dtype(q_I, k_I, weights)
    B, T, HI, KI = q_I.shape
    w = weights.to(dt) * HI**-0.5
    out = []
    b_idx = torch.arange(B, device=q_I.device)[:, None, None]
    for t0 in range(0, T, rows):
        rt = slice(t0, t0 + rows)
        idx = topk_indices[:, rt].long().clamp(min=0)  # [B, C, k]
        k_sel = k_I.to(dt)[b_idx, idx]  # [B, C, k, KI]
        dots = torch.einsum("btjd,btsd->btjs", q_I[:, rt].to(dt), k_sel) * KI**-0.5  # [B, C, HI, k]
        out.append(torch.einsum("btj,btjs->bts", w[:, rt], torch.relu(dots)) + 0.0)
    return torch.cat(out, dim=1)


def sparse_kl_gathered(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    scores_at: torch.Tensor,
    scale: float,
    *,
    lse: torch.Tensor | None = None,
    rows: int = 256,
) -> torch.Tensor:
    """Sparse-stage KL per query over the selected keys, from the gathered latent rows (the sparse MLA's layout).

    Args:
        q: ``[N, H, D]`` absorbed queries ``[W_UKᵀ q_nope ‖ q_pe]`` (packed tokens, as ``dsa_cudnn.sparse_mla``).
        kv: ``[N, D]`` latent rows ``[c ‖ k_pe]`` (one KV head).
        topk_indices: ``[N, k]`` int global row ids, -1 = unused slot (the causal/document mask is already in them).
        scores_at: ``[N, k]`` the indexer's scores at those slots (:func:`indexer_scores_at`, from a detached input).
        scale: ``config.mla_softmax_scale``.
        lse: optional ``[N, H]`` natural-log lse **of the sparse forward** (over exactly these slots); None
            recomputes it.
        rows: query rows per chunk (memory ``[rows, H, k]``).

    Returns:
        ``[N]`` fp32 (fp64 for fp64 inputs) ``KL(p_{t,S_t} || softmax(I_{t,S_t}))``; rows with no valid slot give 0.
        Gradient reaches ``scores_at`` only.

    Raises:
        ValueError: shapes that do not agree.
    """
    N, H, D = q.shape
    if tuple(kv.shape) != (kv.shape[0], D) or tuple(scores_at.shape) != tuple(topk_indices.shape):
        raise ValueError(
            f"kv / scores_at: got {tuple(kv.shape)} / {tuple(scores_at.shape)}, expected [S, {D}] / "
            f"{tuple(topk_indices.shape)}"
        )
    if lse is not None and tuple(lse.shape) != (N, H):
        raise ValueError(f"lse: got shape {tuple(lse.shape)}, expected {(N, H)}")
    dt = compute_dtype(q, kv, scores_at)
    S = kv.shape[0]
    out = []
    for t0 in range(0, N, rows):
        rt = slice(t0, t0 + rows)
        idx = topk_indices[rt].long()
        valid = (idx >= 0) & (idx < S)  # [C, k]
        with torch.no_grad():
            logits = torch.einsum("chd,ckd->chk", q[rt].to(dt), kv.to(dt)[idx.clamp(0, S - 1)]) * scale
            logits = logits.masked_fill(~valid[:, None], float("-inf"))
            if lse is None:
                lse_c = torch.logsumexp(logits, -1)
                lse_c = torch.where(torch.isfinite(lse_c), lse_c, torch.zeros_like(lse_c))
            else:
                lse_c = lse[rt].to(dt)
            p = _chunk_target(logits, lse_c, valid)  # [C, k]
            log_p = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
        log_q = _chunk_log_softmax(scores_at[rt].to(dt), valid)
        out.append(torch.where(p > 0, p * (log_p - log_q), 0.0).sum(-1))
    return torch.cat(out) if out else scores_at.new_zeros(0, dtype=dt)


@torch.no_grad()
def sparse_recall(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    cu_seqlens: torch.Tensor | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> torch.Tensor:
    """Recall of a sparse selection from the sparse forward's lse: the share of the dense head-summed attention mass
    on ``S_t``, without any ``[T, S]`` tensor.

    Each head's dense probabilities sum to 1 over the visible keys, so the L1-normalised head sum is their mean over
    heads and its mass on ``S_t`` is ``(1/H) sum_h exp(lse_S[t, h] - lse_dense[t, h])``; ``lse_dense`` (over every
    causal key of the document) is reduced here in query-row chunks of ``[C, H, t1]`` logits. Equal to
    ``indexer_recall(attention_target(q, k, mask), selected)`` up to rounding.

    Args:
        q: ``[N, H, D]`` absorbed queries; kv: ``[N, D]`` latent rows (as :func:`sparse_kl_gathered`).
        lse: ``[N, H]`` natural-log lse of the sparse forward over exactly ``S_t`` (+inf on a row without a slot).
        scale: ``config.mla_softmax_scale``. cu_seqlens: ``[M+1]`` packed documents over the N rows, or None.
        chunk_bytes: bound on one chunk's fp32 logits.

    Returns:
        ``[N]`` fp32 (fp64 for fp64 inputs) in [0, 1] (clamped: the two lse come from different kernels); no gradient.

    Raises:
        ValueError: shapes that do not agree, malformed ``cu_seqlens``.
    """
    N, H, D = q.shape
    if tuple(kv.shape) != (N, D) or tuple(lse.shape) != (N, H):
        raise ValueError(f"kv / lse: got {tuple(kv.shape)} / {tuple(lse.shape)}, expected {(N, D)} / {(N, H)}")
    seg = segment_ids(cu_seqlens, N, device=q.device)
    dt = compute_dtype(q, kv, lse)
    rows = _rows_per_chunk(1, H, max(N, 1), dt, chunk_bytes)
    out = q.new_zeros(N, dtype=dt)
    for t0 in range(0, N, rows):
        t1 = min(N, t0 + rows)
        vis = (torch.arange(t1, device=q.device)[None, :] <= torch.arange(t0, t1, device=q.device)[:, None]) & (
            seg[t0:t1, None] == seg[None, :t1]
        )  # [C, t1]
        logits = torch.einsum("chd,sd->chs", q[t0:t1].to(dt), kv[:t1].to(dt)) * scale
        lse_dense = torch.logsumexp(logits.masked_fill(~vis[:, None], float("-inf")), -1)  # [C, H]
        del logits
        lse_s = lse[t0:t1].to(dt)
        ok = torch.isfinite(lse_s) & torch.isfinite(lse_dense)
        out[t0:t1] = torch.where(ok, torch.exp(torch.where(ok, lse_s - lse_dense, 0.0)), 0.0).mean(-1)
    return out.clamp(0.0, 1.0)
