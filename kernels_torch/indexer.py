"""DSA lightning indexer, PyTorch twin of ``reference_jax.indexer`` (same names, arguments and shape letters).

Spec 4.1-4.3 and section 9 (``docs/spec.md``). Notable:

* Score ``I[t, s] = sum_j w[t, j] * HI^-1/2 * ReLU(KI^-1/2 * q_I[t, j] . k_I[s])`` in fp32 (fp64 for fp64 inputs),
  from bf16 projections allowed. The constants do not change the selection but do change the KL loss (spec 4.2),
  so they stay.
* ReLU ties: keys where every head has ``q . k <= 0`` score exactly 0. ``torch.topk`` leaves the order of ties
  unspecified, so :func:`topk_indices` sorts explicitly (stable sort on the reversed key axis): higher score first,
  among equal scores the larger key index first (spec 9). Identical to the JAX reference, index for index.
* Masked keys get ``-inf`` before selection (else a row near the start selects future keys); slots past the visible
  count are ``-1``, so a row with fewer than k visible keys attends to all of them (spec 9).
* No RoPE in K3.1 (``indexer_rope == "none"``, a config choice, never hard-coded: spec 9); ``"half"`` /
  ``"interleaved"`` rotate the leading ``qk_rope_head_dim`` channels of q_I and k_I by position within the document
  (:func:`apply_rope`, in :meth:`Indexer.projections`, so the cudnn backend gets rotated inputs too).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels_torch.common import causal_document_mask, check_activation_dtype, check_cu_seqlens, compute_dtype
from kernels_torch.kv_cache import cached_causal_mask, key_count, write_rows
from kimi.config import KimiConfig
from kimi.rope import INDEXER_ROPE_THETA, ROPE_STYLES, check_rope_args, document_positions, rope_tables

__all__ = [
    "indexer_scores",
    "topk_indices",
    "sparse_mask",
    "LayerNorm",
    "Indexer",
    "INDEXER_ROPE_THETA",
    "rope_positions",
    "rope_tables",
    "apply_rope",
]


SCORE_CHUNK_BYTES = 1 << 29  # largest [B, rows, HI, S] logits tensor of one query-row chunk (512 MiB)


class _ChunkedScores(torch.autograd.Function):
    """``sum_j w[t,j] * ReLU(c * q[t,j] . k[s])`` in query-row chunks; the backward recomputes each chunk's logits,
    so neither pass keeps a ``[B, T, HI, S]`` tensor (137 GB in fp32 at T = S = 32K, H_I = 32)."""

    @staticmethod
    def forward(ctx, q, k, w, c, rows):  # q [B,T,HI,KI], k [B,S,KI], w [B,T,HI] (scaled), all one float dtype
        ctx.save_for_backward(q, k, w)
        ctx.c, ctx.rows = c, rows
        out = q.new_empty(q.shape[0], q.shape[1], k.shape[1])
        for t0 in range(0, q.shape[1], rows):
            rt = slice(t0, t0 + rows)
            logits = torch.einsum("btjk,bsk->btjs", q[:, rt], k) * c  # [B, C, HI, S]
            # "+ 0.0" canonicalises -0.0 to +0.0, as the JAX twin (equal scores must tie, whatever their sign bit)
            out[:, rt] = torch.einsum("btj,btjs->bts", w[:, rt], torch.relu(logits)) + 0.0
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, w = ctx.saved_tensors
        c, rows = ctx.c, ctx.rows
        need_q, need_k, need_w = ctx.needs_input_grad[:3]
        dq = torch.empty_like(q) if need_q else None
        dk = torch.zeros_like(k) if need_k else None
        dw = torch.empty_like(w) if need_w else None
        for t0 in range(0, q.shape[1], rows):
            rt = slice(t0, t0 + rows)
            logits = torch.einsum("btjk,bsk->btjs", q[:, rt], k) * c
            if need_w:
                dw[:, rt] = torch.einsum("bts,btjs->btj", dout[:, rt], torch.relu(logits))
            if need_q or need_k:
                # d/dlogits = dout[t,s] * w[t,j] where logits > 0 (ReLU's gradient is 0 at 0, as torch.relu's)
                dlogits = (dout[:, rt, None, :] * w[:, rt, :, None]).masked_fill_(logits <= 0, 0.0) * c
                if need_q:
                    dq[:, rt] = torch.einsum("btjs,bsk->btjk", dlogits, k)
                if need_k:
                    dk += torch.einsum("btjs,btjk->bsk", dlogits, q[:, rt])
        return dq, dk, dw, None, None


def indexer_scores(
    q_I: torch.Tensor, k_I: torch.Tensor, weights: torch.Tensor, *, chunk_bytes: int = SCORE_CHUNK_BYTES
) -> torch.Tensor:
    """Lightning-indexer scores (spec 4.2), unmasked.

    Args:
        q_I: ``[B, T, HI, KI]``; k_I: ``[B, S, KI]`` (one key per token); weights: ``[B, T, HI]``.
        chunk_bytes: bound on the per-head logits ``[B, rows, HI, S]`` of one chunk of query rows. Each row's score
            is the same sum in any chunking (up to the matmul's rounding order); the backward recomputes the logits
            chunk by chunk, so memory is O(rows x HI x S) beyond the ``[B, T, S]`` result (gradients reach q_I, k_I
            and weights).

    Returns:
        ``[B, T, S]`` ``sum_j weights[t,j] * HI^-1/2 * ReLU(KI^-1/2 * q_I[t,j] . k_I[s])``, fp32 (fp64 when any input
        is fp64).
    """
    dt = compute_dtype(q_I, k_I, weights)
    B, T, HI, KI = q_I.shape
    S = k_I.shape[1]
    rows = max(1, chunk_bytes // max(1, B * HI * S * torch.finfo(dt).bits // 8))
    w = weights.to(dt) * (HI**-0.5)  # [B, T, HI]
    return _ChunkedScores.apply(q_I.to(dt), k_I.to(dt), w, KI**-0.5, rows)


def topk_indices(scores: torch.Tensor, mask: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-k key indices per query in the canonical order (spec 9), masked keys never selected.

    Args:
        scores: ``[B, T, S]``; mask: ``[T, S]`` or ``[B, T, S]`` bool (True = visible); topk: >= 1.

    Returns:
        ``[B, T, min(topk, S)]`` int32: score descending, equal scores by key index descending, -1 past the visible
        keys.

    Raises:
        ValueError: ``topk`` < 1, or a mask shape other than ``[T, S]`` / ``[B, T, S]``.
    """
    if topk < 1:
        raise ValueError(f"topk: got {topk}, expected an integer >= 1")
    B, T, S = scores.shape
    if tuple(mask.shape) not in ((T, S), (B, T, S)):
        raise ValueError(
            f"mask: got shape {tuple(mask.shape)}, expected {(T, S)} or {(B, T, S)} (scores {tuple(scores.shape)})"
        )
    mask = mask.to(torch.bool).expand(B, T, S)
    k = min(topk, S)
    masked = scores.masked_fill(~mask, float("-inf"))  # -inf before selection: a future key must never be selected
    # torch.topk's tie order is unspecified: a *stable* descending sort on the reversed key axis keeps, among equal
    # scores, the reversed order, i.e. the larger original key index first.
    _, rev_idx = torch.sort(masked.flip(-1), dim=-1, descending=True, stable=True)
    idx = (S - 1 - rev_idx[..., :k]).to(torch.int64)
    picked_visible = torch.gather(mask, -1, idx)  # visible keys (finite scores) fill a prefix
    return torch.where(picked_visible, idx, -1).to(torch.int32)


def sparse_mask(topk_indices: torch.Tensor, S: int) -> torch.Tensor:
    """``[B, T, S]`` bool, True at the keys listed in ``topk_indices`` ``[B, T, k]`` (-1 slots ignored)."""
    B, T, _ = topk_indices.shape
    idx = torch.where(topk_indices < 0, S, topk_indices).to(torch.int64)  # -1 -> spare column S, dropped below
    out = torch.zeros(B, T, S + 1, dtype=torch.bool, device=topk_indices.device)
    out.scatter_(-1, idx, True)
    return out[..., :S]


# ------------------------------------------------------------------------------------------------ optional RoPE


def rope_positions(T: int, cu_seqlens=None) -> np.ndarray:
    """Position of every token inside its document, ``[T]`` int64 (``t - cu[n]`` in document n; ``t`` without
    ``cu_seqlens``). Twin of ``reference_jax.indexer.rope_positions``."""
    if cu_seqlens is None:
        return document_positions(T, None)
    return document_positions(T, check_cu_seqlens(torch.as_tensor(cu_seqlens).cpu(), T).numpy())


def apply_rope(
    x: torch.Tensor, positions, rope_dim: int, style: str, theta: float = INDEXER_ROPE_THETA
) -> torch.Tensor:
    """Rotate the first ``rope_dim`` channels of ``x`` ``[B, T, KI]`` or ``[B, T, HI, KI]`` by position (DeepSeek-V3.2
    indexer RoPE). Twin of ``reference_jax.indexer.apply_rope``: ``"half"`` pairs ``i`` with ``i + rope_dim/2``,
    ``"interleaved"`` pairs ``2i`` with ``2i+1``, ``"none"`` returns ``x``; pair ``(a, b)`` becomes
    ``(a cos - b sin, a sin + b cos)``. Rotation in fp32 (fp64 for fp64 ``x``), result in ``x.dtype``.

    Raises:
        ValueError: an unknown ``style``, an odd ``rope_dim`` or one larger than ``KI``, ``positions`` not ``[T]``.
    """
    T = x.shape[1]
    check_rope_args(style, rope_dim, T, x.shape[-1], positions)
    if style == "none":
        return x
    dt = compute_dtype(x)
    shape = (1, T) + (1,) * (x.ndim - 3) + (-1,)
    cos, sin = (torch.from_numpy(a).to(x.device, dt).reshape(shape) for a in rope_tables(positions, rope_dim, theta))
    xr = x[..., :rope_dim].to(dt)
    half = rope_dim // 2
    a, b = (xr[..., 0::2], xr[..., 1::2]) if style == "interleaved" else (xr[..., :half], xr[..., half:])
    ra, rb = a * cos - b * sin, a * sin + b * cos
    rot = torch.stack([ra, rb], dim=-1).flatten(-2) if style == "interleaved" else torch.cat([ra, rb], dim=-1)
    return torch.cat([rot.to(x.dtype), x[..., rope_dim:]], dim=-1)


class LayerNorm(nn.Module):
    """LayerNorm with ``weight`` and ``bias`` ``[dim]`` (checkpoint ``k_norm``), computed in fp32 (fp64 for fp64
    input) and cast back to the input dtype (DeepSeek's indexer ``k_norm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = compute_dtype(x)
        y = F.layer_norm(x.to(dt), (x.shape[-1],), self.weight.to(dt), self.bias.to(dt), self.eps)
        return y.to(x.dtype)


class Indexer(nn.Module):
    """The DSA lightning indexer of one K3.1 layer (``self_attn.indexer.*``, spec 4.1); twin of the JAX ``Indexer``.

    Params: ``wq_b.weight`` ``[HI*KI, q_lora_rank]`` (``[HI*KI, D]`` when q_lora_rank is None), ``wk.weight``
    ``[KI, D]``, ``k_norm.weight``/``k_norm.bias`` ``[KI]`` (LayerNorm, eps ``rms_norm_eps``, fp32),
    ``weights_proj.weight`` ``[HI, D]`` (applied in fp32).

    ``forward(x, c_q, cu_seqlens=None) -> (topk_indices, scores)``: x ``[B, T, D]``, c_q ``[B, T, q_lora_rank]``;
    topk_indices ``[B, T, min(index_topk, T)]`` int32, scores ``[B, T, T]`` fp32 (unmasked); selection mask = causal
    & same document. With ``cache_k`` ``[B, S_max, KI]`` (``cache_pos``, ``lengths`` ``[B]``: see
    ``kernels_torch.cache``) the new keys are written into it in place and scored with the cached ones, S =
    ``max(cache_pos + lengths)``.

    Raises:
        ValueError: at construction, an ``indexer_rope`` other than none/half/interleaved, or with RoPE a
            ``qk_rope_head_dim`` that is odd or larger than ``index_head_dim``; at forward, malformed ``cu_seqlens``
            or non-float ``x`` / ``c_q``.
    """

    def __init__(self, config: KimiConfig):
        super().__init__()
        c = config
        if c.indexer_rope not in ROPE_STYLES:
            raise ValueError(f"indexer_rope: got {c.indexer_rope!r}, expected one of {list(ROPE_STYLES)}")
        if c.indexer_rope != "none" and (c.qk_rope_head_dim % 2 or not 0 < c.qk_rope_head_dim <= c.index_head_dim):
            raise ValueError(
                f"qk_rope_head_dim: got {c.qk_rope_head_dim} with indexer_rope={c.indexer_rope!r}, expected an even "
                f"number in [2, index_head_dim={c.index_head_dim}] (the rotated leading channels of the indexer)"
            )
        self.config = c
        D, HI, KI = c.hidden_size, c.index_n_heads, c.index_head_dim
        q_in = c.q_lora_rank if c.q_lora_rank is not None else D
        self.wq_b = nn.Linear(q_in, HI * KI, bias=False)
        self.wk = nn.Linear(D, KI, bias=False)
        self.k_norm = LayerNorm(KI, c.rms_norm_eps)
        self.weights_proj = nn.Linear(D, HI, bias=False)

    def projections(
        self, x: torch.Tensor, c_q: torch.Tensor, cu_seqlens=None, positions=None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q_I`` ``[B, T, HI, KI]``, ``k_I`` ``[B, T, KI]`` (both in x's dtype; RoPE applied when
        ``config.indexer_rope`` is set, by position within each ``cu_seqlens`` document) and ``weights`` ``[B, T, HI]``
        (fp32, fp64 for fp64 x; unscaled) -- the inputs of :func:`indexer_scores` (also used by the cudnn backend).

        ``positions``: the RoPE position of every token, ``[T]`` int (numpy or a CPU tensor), in place of the ones
        ``cu_seqlens`` gives: a slice of a longer row (a context-parallel shard) passes its global positions.

        Raises:
            ValueError: both ``cu_seqlens`` and ``positions`` given; ``positions`` not ``[T]``.
        """
        B, T, D = x.shape
        HI, KI = self.config.index_n_heads, self.config.index_head_dim
        if positions is not None and cu_seqlens is not None:
            raise ValueError("positions: given with cu_seqlens, expected one of them (positions already place tokens)")
        q_I = self.wq_b(c_q).view(B, T, HI, KI)  # [B, T, HI, KI]
        k_I = self.k_norm(self.wk(x))  # [B, T, KI]
        if self.config.indexer_rope != "none":  # DeepSeek-V3.2 style: the leading qk_rope_head_dim dims, after k_norm
            # [T], restarting at every document
            pos = rope_positions(T, cu_seqlens) if positions is None else np.asarray(positions, dtype=np.int64)
            q_I = apply_rope(q_I, pos, self.config.qk_rope_head_dim, self.config.indexer_rope)
            k_I = apply_rope(k_I, pos, self.config.qk_rope_head_dim, self.config.indexer_rope)
        dt = compute_dtype(x)  # weights_proj in fp32 (fp64 for fp64 x)
        weights = F.linear(x.to(dt), self.weights_proj.weight.to(dt))  # [B, T, HI]
        return q_I, k_I, weights

    def forward(self, x: torch.Tensor, c_q: torch.Tensor, cu_seqlens=None, cache_k=None, cache_pos=None, lengths=None):
        c = self.config
        check_activation_dtype(x, "Indexer")
        check_activation_dtype(c_q, "Indexer", "c_q")
        B, T, D = x.shape
        if cu_seqlens is not None:
            check_cu_seqlens(cu_seqlens, T, B)
        if cache_k is not None and c.indexer_rope != "none":
            raise NotImplementedError(
                f"indexer_rope={c.indexer_rope!r} with a decode cache: the cached keys would need their absolute "
                "positions; run without a cache (a full forward), or with indexer_rope='none' (K3.1)"
            )
        q_I, k_I, weights = self.projections(x, c_q, cu_seqlens)
        if cache_k is not None:  # keys = the cached ones then this call's (kernels_torch.cache); written in place
            S = key_count(cache_pos, lengths)
            keys = write_rows(cache_k, k_I, cache_pos, lengths)[:, :S]  # [B, S, KI]
            scores = indexer_scores(q_I, keys, weights)  # [B, T, S]
            mask = cached_causal_mask(cache_pos, T, S, device=x.device)
            return topk_indices(scores, mask, c.index_topk), scores
        scores = indexer_scores(q_I, k_I, weights)  # [B, T, S=T]
        mask = causal_document_mask(T, cu_seqlens, device=x.device)  # [T, S]
        return topk_indices(scores, mask, c.index_topk), scores
