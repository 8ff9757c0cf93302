"""The ``cudnn`` backend of the MLA/DSA layers on SM90 (H200): indexer + top-k, sparse MLA forward and backward.

Spec 3.3 (absorbed MLA), 4.2-4.3 (indexer, selection), 9 (``docs/spec.md``); kernel facts: ``docs/kernels.md``.
Pieces, all on CUDA, bf16 activations:

* :func:`indexer_topk_cudnn`: lightning-indexer scores with cuDNN FE ``indexer_forward_wrapper`` (bf16 q_I/k_I, fp32
  weights, fp32 accumulation, ratio 1), then ``indexer_top_k_wrapper``, in **query-row chunks** of one document:
  the score buffer is ``[chunk_rows, doc_len]`` fp32 (plus the top-k radix scratch, 2 more words per element), never
  ``[T, T]``. Global key ids, ``-1`` padding, a valid length per row.
* :class:`SparseMLAFunction`: absorbed sparse MLA (d_qk = 576, d_v = 512, one latent KV head); forward is
  ``kernels_torch.ops.sparse_mla.sparse_mla_fwd`` (FlashMLA's SM90 kernels where the ``flash_mla`` module imports,
  else our Triton kernel; the layer's ``sparse_kernel`` or ``$KIMI_SPARSE_KERNEL`` forces one), backward is cuDNN FE
  ``sparse_attention_backward_wrapper`` on the native 96 heads, fed the forward's natural-log, KV-only lse.
* :func:`gated_mla_forward`: what ``GatedMLA.forward`` runs under ``backend="cudnn"``.

Footguns:

* Scale constants (they change the KL loss, not the selection; spec 4.2, 3.3). cuDNN's indexer computes ``sm_scale *
  sum_j w_j * ReLU(q_j . k)``; ReLU is positively homogeneous, so ``sm_scale = (H_I * D_I)^-1/2`` gives exactly our
  ``sum_j w_j H_I^-1/2 ReLU(D_I^-1/2 q_j . k)``. The MLA softmax scale stays ``config.mla_softmax_scale`` = 192^-1/2,
  never 576^-1/2.
* Tie-break (spec 9). The top-k kernel is run with ``tie_break=2``: among keys whose score equals the k-th one, the
  larger key index wins -- the project's canonical rule, so the selected **set** is the canonical one (exactly, when
  the fp32 scores are bitwise equal). The **slot order** is the kernel's (not score-sorted); nothing downstream
  depends on it. The radix order keeps +0 above -0 (our scores are sums starting at +0, so ReLU zeros are +0).
* Rows with <= k visible keys select all of them (ids ascending), then ``-1`` (so DSA equals dense MLA below k; spec 9);
  masked keys are never selected (a future key selected would leak the future): the indexer writes ``-inf`` above the
  diagonal and the top-k reads only ``seq_lens`` columns.
* lse is natural-log (cuDNN's backward wants that; the Triton kernel converts from base 2 itself).
* The indexer is **frozen** under this backend: hard top-k gives it no gradient. ``GatedMLA`` sets
  ``requires_grad=False`` on its parameters and the indexer runs under ``torch.no_grad()``.
* Packed documents: contiguous documents only (``cu_seqlens``, or a block-diagonal causal mask that
  :func:`cu_seqlens_from_mask` turns into one). A mask with a hole inside a document is refused: use ``sdpa``.

Under ``torch.compile`` (``kernels_torch.compile``) the indexer top-k and the sparse forward / backward run as the
``kimi::`` ops ``kimi::indexer_topk``, ``kimi::sparse_mla`` and ``kimi::sparse_mla_backward`` (below; CPU twins on CPU
tensors), the absorbed ``W_UK`` / ``W_UV`` products as einsums, and the FlashMLA padded-query layout is not used (the
inputs are contiguous ``[T, H, 576]``, copied into FlashMLA's layout by the op). Eager calls run the kernels directly.

Shapes that the fast kernels do not take (d_qk != 576 or d_v != 512; H_I not in {16, 32, 64} or D_I != 128, e.g. the
``tiny`` preset) run the same algorithm with torch ops on the GPU (fp32 scores, gathered sparse attention); the
cuDNN top-k is used in both cases. MLA layers without an indexer use torch SDPA in the expanded form.

Imports of ``cudnn`` / ``triton`` happen inside the functions, so CPU machines never need them.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from kernels_torch import kernel_choice
from kernels_torch.common import causal_document_mask, check_cu_seqlens, compute_dtype, effective_weight
from kernels_torch.indexer import indexer_scores, topk_indices
from kernels_torch.ops.custom import own, trace_constant
from kernels_torch.ops.linears import headwise_matmul
from kernels_torch.ops.sparse_mla import padded_q, sparse_mla_fwd_reference, wants_padded_q

__all__ = [
    "require_cudnn",
    "cu_seqlens_from_mask",
    "indexer_topk_cudnn",
    "indexer_scores_cudnn",
    "SparseMLAFunction",
    "sparse_mla",
    "gated_mla_forward",
    "CUDNN_INDEXER_HEADS",
    "CUDNN_INDEXER_DIM",
    "SPARSE_D_QK",
    "SPARSE_D_V",
    "MAX_TOPK",
    "sort_topk_slots",
]

CUDNN_INDEXER_HEADS = (16, 32, 64)  # SM90 indexer_forward: qhead_per_kv_head in {16, 32, 64}
CUDNN_INDEXER_DIM = 128  # ... and head_dim 128
SPARSE_D_QK, SPARSE_D_V = 576, 512  # Triton forward / cuDNN backward: absorbed MLA only
MAX_TOPK = 2048  # indexer_top_k_wrapper: 0 < top_k <= 2048
CHUNK_BYTES = 1 << 30  # default budget of one row chunk: fp32 scores + 2 words/element of top-k radix scratch


def _import(name: str):
    """``importlib.import_module``; a seam that the CPU tests replace to simulate a missing package."""
    return importlib.import_module(name)


def _dsa():
    """``cudnn.deepseek_sparse_attention`` (the submodule must be imported explicitly)."""
    return _import("cudnn.deepseek_sparse_attention")


def require_cudnn(x: torch.Tensor, what: str = "x") -> None:
    """Check everything ``backend="cudnn"`` needs, and name **all** that is missing in one error.

    Needs: CUDA (``torch.cuda.is_available()`` and ``x`` on a CUDA device), bf16 activations, and the ``gpu``
    extra (``pip install 'kimi-k3[gpu]'``: nvidia-cudnn-frontend with its CUTLASS DSL, which its DSA indexer top-k
    imports at the first call, plus Triton).

    Raises:
        RuntimeError: listing each missing requirement and what to do instead.
    """
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"CUDA (torch.cuda.is_available() is False; torch {torch.__version__})")
    elif x.device.type != "cuda":
        missing.append(f"CUDA tensors ({what} is on {x.device}; move the model and inputs to 'cuda')")
    if x.dtype != torch.bfloat16:
        missing.append(
            f"bfloat16 activations ({what} is {x.dtype}; load the model with dtype=torch.bfloat16, "
            "e.g. `kimi compare --dtype bfloat16`)"
        )
    missing += list(_missing_modules())
    if missing:
        raise RuntimeError(
            "backend='cudnn' needs "
            + "; ".join(missing)
            + ". Use backend='eager' or 'sdpa' where these are not available."
        )


@trace_constant  # under torch.compile: probed once, while tracing (importlib is no graph op)
def _missing_modules() -> tuple[str, ...]:
    """What :func:`require_cudnn` lists for the modules of the ``gpu`` extra that do not import."""
    missing = []
    for mod, why in (
        ("cudnn.deepseek_sparse_attention", "cuDNN Frontend >= 1.30 (nvidia-cudnn-frontend)"),
        (  # imported by cudnn.api_base at the indexer's first call, not with the package
            "cutlass",
            "the CUTLASS DSL (module cutlass: nvidia-cutlass-dsl, a dependency of nvidia-cudnn-frontend that a "
            "--no-deps install leaves out; cuDNN Frontend's DSA indexer top-k imports it)",
        ),
        ("triton", "Triton"),
    ):
        try:
            _import(mod)
        except Exception as e:  # ImportError, or a broken install raising at import
            missing.append(
                f"the gpu extra: {why} does not import ({type(e).__name__}: {e}); pip install 'kimi-k3[gpu]'"
            )
    return tuple(missing)


def cu_seqlens_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Turn a ``[T, T]`` (or ``[1, T, T]``) bool attention mask into ``cu_seqlens`` ``[N+1]`` int64, if it is a
    block-diagonal causal mask of contiguous documents -- the only masks the sparse kernels can express.

    Raises:
        ValueError: any other mask (a hole inside a document, a non-causal entry, a batch of masks), naming the first
            offending query row and saying to use the ``sdpa`` backend.
    """
    m = mask.to(torch.bool)
    if m.ndim == 3 and m.shape[0] == 1:
        m = m[0]
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(
            f"mask: got shape {tuple(mask.shape)}, expected [T, T] (the cudnn backend takes one packed "
            "row of contiguous documents); use backend='sdpa' for general masks"
        )
    T = m.shape[0]
    if T == 0:
        return torch.zeros(1, dtype=torch.int64)
    # a document starts at row t iff row t sees exactly its own key; its first visible key is the document start
    first = torch.where(m.any(-1), m.float().argmax(-1), torch.arange(T, device=m.device))  # [T]
    starts = torch.nonzero(first == torch.arange(T, device=m.device)).flatten()
    cu = torch.cat([starts, torch.tensor([T], device=m.device)]).to(torch.int64)
    if int(cu[0]) != 0:
        cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=m.device), cu])
    expected = causal_document_mask(T, cu, device=m.device)
    bad = (expected != m).any(-1)
    if bool(bad.any()):
        t = int(torch.nonzero(bad)[0])
        raise ValueError(
            f"mask: row {t} is not a contiguous causal document (a hole inside a document, or keys "
            "outside it); the cudnn backend supports packed contiguous documents only (cu_seqlens). "
            "Use backend='sdpa' for this mask."
        )
    return cu.cpu()


# ----------------------------------------------------------------------------------------------------------
# indexer + top-k
# ----------------------------------------------------------------------------------------------------------


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _default_chunk_rows(doc_len: int, cols: int, chunk_bytes: int) -> int:
    """Rows per chunk: ``rows * cols * 12`` bytes (fp32 scores + 2 int32 radix words) within ``chunk_bytes``."""
    rows = max(128, (chunk_bytes // (12 * max(cols, 1))) // 128 * 128)
    return min(rows, doc_len)


def _doc_bounds(T: int, cu_seqlens) -> list[tuple[int, int]]:
    if cu_seqlens is None:
        return [(0, T)]
    cu = check_cu_seqlens(cu_seqlens, T).tolist()
    return list(zip(cu[:-1], cu[1:]))


class _ScoreChunks:
    """Indexer scores of row chunks, ``[rows, cols]`` fp32, ``-inf`` at keys after the query (within one document).

    cuDNN path: BSHD ``q [1, C, H_I, 128]``, ``k [1, cols, 1, 128]``, ``w [1, C, H_I]`` fp32 with ``q_causal_offsets``
    = the chunk's first row inside the document, so row r sees keys ``<= offset + r``. Keys are read from a copy of
    ``k_I`` zero-padded at the end, so ``cols`` can be rounded up to a multiple of 128 for every chunk of a document
    (one top-k compilation per document length bucket; the extra keys are after every query, hence ``-inf``).
    """

    def __init__(self, q_I, k_I, weights, pad_cols: int, use_cudnn: bool):
        T, HI, KI = q_I.shape
        self.q_I, self.weights, self.use_cudnn = q_I, weights, use_cudnn
        self.k_pad = torch.zeros(T + pad_cols, KI, dtype=k_I.dtype, device=k_I.device)
        self.k_pad[:T] = k_I
        self.sm_scale = (HI * KI) ** -0.5
        if use_cudnn:
            self.fwd = _dsa().indexer_forward_wrapper

    def __call__(self, doc_start: int, r0: int, r1: int, cols: int, offsets: torch.Tensor) -> torch.Tensor:
        """Scores of rows ``[r0, r1)`` against keys ``[doc_start, doc_start + cols)``; ``offsets`` = ``[r0 - doc_start]``
        int32 on the device."""
        q = self.q_I[r0:r1]  # [C, HI, KI]
        k = self.k_pad[doc_start : doc_start + cols]  # [cols, KI]
        w = self.weights[r0:r1]  # [C, HI] fp32
        if self.use_cudnn:
            res = self.fwd(
                q[None], k[None, :, None, :], w[None], ratio=1, sm_scale=self.sm_scale, q_causal_offsets=offsets
            )
            # [C, cols] fp32, -inf above the diagonal; add_(0.0) makes -0.0 (a negative weight times an all-ReLU-zero
            # key) +0.0 in place, so the top-k sees equal scores as ties whatever their sign bit (spec 9)
            return res["scores"][0].add_(0.0)
        # torch twin (shapes the cuDNN kernel does not take): kernels_torch.indexer's formula, in fp32 as cuDNN
        s = indexer_scores(q[None].float(), k[None].float(), w[None].float())[0]  # [C, cols]
        t = torch.arange(r0 - doc_start, r1 - doc_start, device=q.device)[:, None]
        return s.masked_fill(torch.arange(cols, device=q.device)[None, :] > t, float("-inf"))


def _check_indexer_args(q_I, k_I, weights, topk):
    if q_I.ndim != 3 or k_I.ndim != 2 or weights.ndim != 2:
        raise ValueError(
            f"q_I/k_I/weights: got shapes {tuple(q_I.shape)}, {tuple(k_I.shape)}, {tuple(weights.shape)}; "
            "expected [T, H_I, D_I], [T, D_I], [T, H_I]"
        )
    T, HI, KI = q_I.shape
    if tuple(k_I.shape) != (T, KI) or tuple(weights.shape) != (T, HI):
        raise ValueError(
            f"k_I/weights: got shapes {tuple(k_I.shape)}, {tuple(weights.shape)}, expected "
            f"{(T, KI)} and {(T, HI)} to match q_I {tuple(q_I.shape)}"
        )
    if not 0 < topk <= MAX_TOPK:
        raise ValueError(f"topk: got {topk}, expected 1 <= topk <= {MAX_TOPK} (cuDNN indexer_top_k_wrapper)")
    require_cudnn(q_I, "q_I")
    if k_I.dtype != torch.bfloat16:
        raise TypeError(f"k_I: got dtype {k_I.dtype}, expected torch.bfloat16")


def _indexer_chunks(q_I, k_I, weights, topk, cu_seqlens, chunk_rows, chunk_bytes, on_chunk):
    """Drive the row chunks of every document; ``on_chunk(r0, r1, doc_start, cols, scores)`` consumes each."""
    T, HI, KI = q_I.shape
    docs = _doc_bounds(T, cu_seqlens)
    use_cudnn = HI in CUDNN_INDEXER_HEADS and KI == CUDNN_INDEXER_DIM
    max_cols = _round_up(max(b - a for a, b in docs), 128)
    scores_of = _ScoreChunks(q_I, k_I, weights.float().contiguous(), max_cols, use_cudnn)
    # the chunk's first row inside its document, one int32 per row, on the device (sliced per chunk, no syncs)
    offsets_all = torch.arange(T, dtype=torch.int32, device=q_I.device)
    for a, b in docs:
        cols = _round_up(b - a, 128)
        rows = chunk_rows or _default_chunk_rows(b - a, cols, chunk_bytes)
        for r0 in range(a, b, rows):
            r1 = min(b, r0 + rows)
            scores = scores_of(a, r0, r1, cols, offsets_all[r0 - a : r0 - a + 1])
            on_chunk(r0, r1, a, cols, scores)


def indexer_topk_cudnn(
    q_I: torch.Tensor,
    k_I: torch.Tensor,
    weights: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None = None,
    chunk_rows: int | None = None,
    *,
    chunk_bytes: int = CHUNK_BYTES,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning-indexer top-k (spec 4.2-4.3) with cuDNN FE kernels, in query-row chunks.

    Args:
        q_I: ``[T, H_I, D_I]`` bf16 CUDA (``wq_b(c_q)``); k_I: ``[T, D_I]`` bf16 (``k_norm(wk(x))``);
        weights: ``[T, H_I]`` (``weights_proj(x)``, fp32; **unscaled**: the ``H_I^-1/2`` and ``D_I^-1/2`` constants are
            applied here).
        topk: k (``config.index_topk``), 1..2048.
        cu_seqlens: ``[N+1]`` packed contiguous documents, or None (one sequence).
        chunk_rows: query rows per chunk; default: as many as keep ``rows * doc_len * 12`` bytes within
            ``chunk_bytes`` (1 GiB), at least 128. Extra memory is O(chunk_rows x doc_len), never O(T^2).

    Returns:
        ``topk_indices`` ``[T, topk]`` int32 global key ids (the valid ones first, then ``-1``) and ``topk_length``
        ``[T]`` int32 = min(topk, visible keys). The selected set follows the canonical tie rule (higher score, then
        the larger key index); the slot order is the kernel's (ascending ids for rows with <= topk visible keys) and
        can change from call to call: :func:`sort_topk_slots` makes it reproducible.

    Raises:
        RuntimeError: CUDA, bf16 or the ``gpu`` extra missing (:func:`require_cudnn`).
        ValueError: shapes, ``topk`` outside 1..2048, malformed ``cu_seqlens``.
    """
    _check_indexer_args(q_I, k_I, weights, topk)
    T = q_I.shape[0]
    top_k_fn = _dsa().indexer_top_k_wrapper
    idx_out = torch.full((T, topk), -1, dtype=torch.int32, device=q_I.device)
    pos = torch.arange(T, dtype=torch.int32, device=q_I.device)

    def on_chunk(r0, r1, a, cols, scores):
        k_eff = min(topk, cols)
        seq_lens = pos[r0:r1] - a + 1  # visible keys of each row (its document prefix)
        res = top_k_fn(scores, seq_lens, k_eff, return_val=False, tie_break=2)  # 2: larger column wins ties
        local = res["indices"]  # [C, k_eff] local column ids, -1 past the visible keys
        # document-local column -> global key id (the first document's columns already are global ids)
        idx_out[r0:r1, :k_eff] = torch.where(local >= 0, local + a, local) if a else local

    _indexer_chunks(q_I, k_I, weights, topk, cu_seqlens, chunk_rows, chunk_bytes, on_chunk)
    doc_start = torch.zeros(T, dtype=torch.int32, device=q_I.device)
    for a, b in _doc_bounds(T, cu_seqlens):
        doc_start[a:b] = a
    topk_length = torch.clamp(pos - doc_start + 1, max=topk).to(torch.int32)
    return idx_out, topk_length


def sort_topk_slots(topk_indices: torch.Tensor) -> torch.Tensor:
    """``topk_indices`` ``[T, k]`` int32 with each row's ids ascending and its ``-1`` slots last (same sets).

    cuDNN's top-k returns the selected set in a slot order that changes from call to call (measured on the H200:
    6,144 of 8,192 rows at S = 8K). The sparse attention accumulates in slot order, so an unsorted forward is not
    bitwise reproducible, and activation recomputation (``torch.utils.checkpoint``) then sees MoE routing flip at
    near-ties and refuses the recomputed tensors. Sorting costs about 0.55 ms at S = 8K (H200), <1% of a DSA layer's
    forward + backward.
    """
    big = torch.iinfo(torch.int32).max
    ids = torch.where(topk_indices < 0, big, topk_indices).sort(dim=-1).values
    return torch.where(ids == big, -1, ids)


def indexer_scores_cudnn(
    q_I: torch.Tensor,
    k_I: torch.Tensor,
    weights: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """The scores that :func:`indexer_topk_cudnn` ranks, as a dense ``[T, T]`` fp32 tensor (``-inf`` where masked).

    For validation only (quadratic memory); same arguments and errors as :func:`indexer_topk_cudnn`.
    """
    _check_indexer_args(q_I, k_I, weights, 1)
    T = q_I.shape[0]
    out = torch.full((T, T), float("-inf"), dtype=torch.float32, device=q_I.device)

    def on_chunk(r0, r1, a, cols, scores):
        n = min(cols, T - a)
        out[r0:r1, a : a + n] = scores[:, :n]  # other documents are masked below

    _indexer_chunks(q_I, k_I, weights, 1, cu_seqlens, chunk_rows, CHUNK_BYTES, on_chunk)
    return out.masked_fill(~causal_document_mask(T, cu_seqlens, device=q_I.device), float("-inf"))


# ----------------------------------------------------------------------------------------------------------
# sparse MLA
# ----------------------------------------------------------------------------------------------------------


class SparseMLAFunction(torch.autograd.Function):
    """Absorbed sparse MLA with autograd: ``out = softmax(scale * q . kv[idx]) kv[idx, :512]`` per head.

    ``apply(q [T, H, 576] bf16, kv [S, 576] bf16, indices [T, K] int32 global (-1 skipped), topk_length [T] int32,
    sm_scale, kernel=None, return_lse=False)`` -> ``out [T, H, 512]`` bf16, or with ``return_lse`` ``(out, lse)``,
    lse ``[T, H]`` fp32 natural-log over exactly the valid slots (+inf on a row without one; non-differentiable: the
    indexer distillation's sparse stage reuses it, ``kernels_torch.distill.sparse_kl_gathered``). Forward:
    ``sparse_mla_fwd(backend=kernel)`` (FlashMLA or Triton; saves out and the natural-log lse);
    backward: cuDNN FE ``sparse_attention_backward_wrapper`` (no attention sink: ``attn_sink = -inf``; atomics, so
    not bitwise deterministic). Gradients for q and kv only.
    """

    @staticmethod
    def forward(ctx, q, kv, indices, topk_length, sm_scale, kernel=None, return_lse=False):
        from kernels_torch.ops.sparse_mla import sparse_mla_fwd

        out, _, lse = sparse_mla_fwd(q, kv, indices, sm_scale, topk_length, backend=kernel)
        ctx.save_for_backward(q, kv, indices, topk_length, out, lse)
        ctx.sm_scale = float(sm_scale)
        if not return_lse:
            return out
        lse_out = lse.detach().float().clone()  # its own storage: the saved lse stays the backward's
        ctx.mark_non_differentiable(lse_out)
        return out, lse_out

    @staticmethod
    def backward(ctx, dout, *_):
        q, kv, indices, topk_length, out, lse = ctx.saved_tensors
        sink = torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
        res = _dsa().sparse_attention_backward_wrapper(
            q,
            kv,
            out.contiguous(),  # FlashMLA's out / lse are [:, :H] views of its 128-head outputs
            dout.to(q.dtype).contiguous(),
            lse.contiguous(),
            sink,
            indices,
            softmax_scale=ctx.sm_scale,
            topk_length=topk_length,
        )
        return res["dq"], res["dkv"], None, None, None, None, None


def _sparse_mla_torch(q, kv, indices, topk_length, sm_scale, d_v, rows_per_chunk=256, return_lse=False):
    """Differentiable torch twin of :class:`SparseMLAFunction` for any d_qk / d_v (fp32 softmax, gathered keys);
    with ``return_lse`` also the detached natural-log lse ``[T, H]`` (fp32, fp64 for fp64 q; +inf on empty rows)."""
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    pos = torch.arange(K, device=q.device)
    dt = compute_dtype(q)  # fp32 (fp64 for fp64 inputs)
    outs, lses = [], []
    for t0 in range(0, T, rows_per_chunk):
        t1 = min(T, t0 + rows_per_chunk)
        idx = indices[t0:t1].long()
        valid = (idx >= 0) & (idx < S) & (pos[None, :] < topk_length[t0:t1, None].long())  # [C, K]
        sel = kv[idx.clamp(0, S - 1)].to(dt)  # [C, K, D]
        logits = torch.einsum("chd,ckd->chk", q[t0:t1].to(dt), sel) * sm_scale
        logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
        empty = ~valid.any(-1)  # rows with no valid key give 0, never NaN (also in backward)
        if return_lse:
            lses.append(torch.logsumexp(logits.detach(), -1).masked_fill(empty[:, None], float("inf")))
        logits = logits.masked_fill(empty[:, None, None], 0.0)
        p = torch.softmax(logits, dim=-1).masked_fill(empty[:, None, None], 0.0)
        outs.append(torch.einsum("chk,ckv->chv", p, sel[..., :d_v]).to(q.dtype))
    out = torch.cat(outs) if outs else q.new_zeros(0, H, d_v)
    if not return_lse:
        return out
    return out, (torch.cat(lses) if lses else q.new_zeros(0, H, dtype=dt))


def sparse_mla(q, kv, indices, topk_length, sm_scale, d_v=SPARSE_D_V, kernel=None, return_lse=False):
    """Sparse absorbed MLA with autograd: :class:`SparseMLAFunction` for d_qk = 576, d_v = 512 (the real dims),
    else the torch twin. Shapes as in :class:`SparseMLAFunction`; ``kernel`` picks the forward (``"flash_mla"``,
    ``"triton"``, ``"auto"`` or None: ``$KIMI_SPARSE_KERNEL``, then auto). ``return_lse``: also return the detached
    natural-log lse ``[T, H]`` of the forward (fp32; over exactly the valid slots, +inf on a row without one)."""
    if q.shape[-1] == SPARSE_D_QK and d_v == SPARSE_D_V and q.dtype == torch.bfloat16:
        if torch.compiler.is_compiling():  # FlashMLA / Triton forward, cuDNN backward: one node each
            out, lse = _sparse_mla_op(q, kv, indices, topk_length, float(sm_scale), d_v, kernel)
            return (out, lse.detach()) if return_lse else out
        return SparseMLAFunction.apply(q, kv, indices, topk_length, sm_scale, kernel, return_lse)
    kernel_choice.record("sparse_mla_fwd", "torch")
    return _sparse_mla_torch(q, kv, indices, topk_length, sm_scale, d_v, return_lse=return_lse)


# ----------------------------------------------------------------------------------------------------------
# custom ops for torch.compile (kernels_torch.ops.custom): the indexer top-k and the sparse MLA forward/backward
# ----------------------------------------------------------------------------------------------------------
# Each op runs the GPU kernels above on CUDA tensors and a torch twin of the same contract on CPU tensors (the twins
# are what the CPU tests check the ops' registration with: torch.library.opcheck, fake shapes, gradients).


def _indexer_topk_torch(q_I, k_I, weights, topk, cu_seqlens):
    """CPU twin of :func:`indexer_topk_cudnn` + :func:`sort_topk_slots`: dense fp32 (fp64) scores
    (``kernels_torch.indexer.indexer_scores``), the causal document mask, the canonical top-k
    (``kernels_torch.indexer.topk_indices``: higher score, then the larger key index), slots ascending, ``-1`` last."""
    T = q_I.shape[0]
    scores = indexer_scores(q_I[None], k_I[None], weights[None])[0]  # [T, T], +0.0 canonical zeros
    mask = causal_document_mask(T, cu_seqlens, device=q_I.device)
    idx = topk_indices(scores[None], mask, topk)[0]  # [T, min(topk, T)]
    if idx.shape[1] < topk:
        idx = F.pad(idx, (0, topk - idx.shape[1]), value=-1)
    return sort_topk_slots(idx), mask.sum(-1).clamp(max=topk).to(torch.int32)


@torch.library.custom_op("kimi::indexer_topk", mutates_args=())
def _indexer_topk_op(
    q_I: torch.Tensor, k_I: torch.Tensor, weights: torch.Tensor, topk: int, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen indexer's selection: :func:`indexer_topk_cudnn` then :func:`sort_topk_slots` on CUDA (the cuDNN
    indexer and top-k), :func:`_indexer_topk_torch` on the CPU. ``q_I [T, H_I, D_I]``, ``k_I [T, D_I]``, ``weights
    [T, H_I]``, ``cu_seqlens [N+1]`` or None -> ``(indices [T, topk] int32 ascending with -1 last, topk_length [T]
    int32)``. No gradient (hard top-k)."""
    if q_I.is_cuda:
        idx, tlen = indexer_topk_cudnn(q_I, k_I, weights, topk, cu_seqlens)
        return sort_topk_slots(idx), tlen
    return _indexer_topk_torch(q_I, k_I, weights, topk, cu_seqlens)


@_indexer_topk_op.register_fake
def _(q_I, k_I, weights, topk, cu_seqlens):
    T = q_I.shape[0]
    return q_I.new_empty(T, topk, dtype=torch.int32), q_I.new_empty(T, dtype=torch.int32)


def _sparse_mla_backward_torch(dout, q, kv, out, lse, indices, topk_length, sm_scale):
    """CPU twin of cuDNN's ``sparse_attention_backward_wrapper``: the softmax backward from the forward's ``out`` and
    natural-log ``lse`` (FlashAttention's: ``P = exp(s - lse)``, ``dS = P (dP - rowsum(dout * out))``), in the compute
    dtype; ``dq [T, H, D]`` in q's dtype and ``dkv [S, D]`` in kv's (summed over every query that selected a row)."""
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    d_v = out.shape[-1]
    dt = compute_dtype(q, kv)
    idx = indices.long()
    valid = (idx >= 0) & (idx < S) & (torch.arange(K, device=q.device)[None, :] < topk_length[:, None].long())
    rows = idx.clamp(0, S - 1)
    sel = kv.to(dt)[rows].masked_fill(~valid[..., None], 0.0)  # [T, K, D]
    qf, do = q.to(dt), dout.to(dt)
    logits = torch.einsum("thd,tkd->thk", qf, sel) * sm_scale
    p = torch.exp(logits - lse.to(dt)[..., None]).masked_fill(~valid[:, None, :], 0.0)  # 0 on empty rows (lse +inf)
    dp = torch.einsum("thv,tkv->thk", do, sel[..., :d_v])
    ds = p * (dp - (do * out.to(dt)).sum(-1, keepdim=True)) * sm_scale  # [T, H, K]
    dq = torch.einsum("thk,tkd->thd", ds, sel)
    dsel = torch.einsum("thk,thd->tkd", ds, qf)
    dsel[..., :d_v] += torch.einsum("thk,thv->tkv", p, do)
    dsel = dsel.masked_fill(~valid[..., None], 0.0)
    dkv = torch.zeros(S, D, dtype=dt, device=q.device).index_add_(0, rows.reshape(-1), dsel.reshape(T * K, D))
    return dq.to(q.dtype), dkv.to(kv.dtype)


@torch.library.custom_op("kimi::sparse_mla", mutates_args=())
def _sparse_mla_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor,
    sm_scale: float,
    d_v: int,
    kernel: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`SparseMLAFunction`'s forward: ``q [T, H, D]``, ``kv [S, D]``, ``indices [T, K]`` int32 (global ids,
    -1 skipped), ``topk_length [T]`` int32 -> ``(out [T, H, d_v]`` in q's dtype, ``lse [T, H]`` fp32 (fp64 for fp64
    q), natural-log, +inf on a row without a valid key), both contiguous. CUDA: ``sparse_mla_fwd`` (FlashMLA or
    Triton, ``kernel``; D = 576, d_v = 512, bf16); CPU: ``sparse_mla_fwd_reference`` (any D, d_v)."""
    if q.is_cuda:
        from kernels_torch.ops.sparse_mla import sparse_mla_fwd

        out, _, lse = sparse_mla_fwd(q, kv, indices, sm_scale, topk_length, d_v, backend=kernel)
    else:
        out, _, lse = sparse_mla_fwd_reference(q, kv, indices, sm_scale, topk_length, d_v)
    return own(out.to(q.dtype), (q, kv)), own(lse.to(compute_dtype(q)), (q, kv))


@_sparse_mla_op.register_fake
def _(q, kv, indices, topk_length, sm_scale, d_v, kernel):
    T, H, _ = q.shape
    return q.new_empty(T, H, d_v), q.new_empty(T, H, dtype=compute_dtype(q))


@torch.library.custom_op("kimi::sparse_mla_backward", mutates_args=())
def _sparse_mla_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    indices: torch.Tensor,
    topk_length: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:class:`SparseMLAFunction`'s backward, ``(dq [T, H, D]``, ``dkv [S, D])`` in q's and kv's dtypes: cuDNN FE's
    ``sparse_attention_backward_wrapper`` on CUDA (no attention sink; atomics, not bitwise reproducible),
    :func:`_sparse_mla_backward_torch` on the CPU."""
    if q.is_cuda:
        sink = torch.full((q.shape[1],), float("-inf"), dtype=torch.float32, device=q.device)
        res = _dsa().sparse_attention_backward_wrapper(
            q.contiguous(),
            kv.contiguous(),
            out.contiguous(),
            dout.to(q.dtype).contiguous(),
            lse.contiguous(),
            sink,
            indices.contiguous(),
            softmax_scale=sm_scale,
            topk_length=topk_length,
        )
        dq, dkv = res["dq"], res["dkv"].reshape(kv.shape)
    else:
        dq, dkv = _sparse_mla_backward_torch(dout, q, kv, out, lse, indices, topk_length, sm_scale)
    return own(dq, (dout, q, kv, out, lse)), own(dkv, (dout, q, kv, out, lse))


@_sparse_mla_backward_op.register_fake
def _(dout, q, kv, out, lse, indices, topk_length, sm_scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)


def _sparse_mla_setup(ctx, inputs, output):
    q, kv, indices, topk_length, sm_scale, d_v, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, kv, indices, topk_length, out, lse)  # as SparseMLAFunction
    ctx.sm_scale = sm_scale


def _sparse_mla_backward(ctx, dout, dlse):  # lse is a statistic: no gradient flows through it
    q, kv, indices, topk_length, out, lse = ctx.saved_tensors
    dq, dkv = _sparse_mla_backward_op(dout, q, kv, out, lse, indices, topk_length, ctx.sm_scale)
    return dq, dkv, None, None, None, None, None


_sparse_mla_op.register_autograd(_sparse_mla_backward, setup_context=_sparse_mla_setup)

CUSTOM_OPS = (_indexer_topk_op, _sparse_mla_op, _sparse_mla_backward_op)  # opcheck'd in tests


# ----------------------------------------------------------------------------------------------------------
# the layer
# ----------------------------------------------------------------------------------------------------------


def _dense_sdpa(q, k, v, cu_seqlens, scale):
    """Expanded-form causal attention with torch SDPA: q, k ``[B, T, H, K]``, v ``[B, T, H, V]`` -> ``[B, T, H, V]``."""
    T = q.shape[1]
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    if cu_seqlens is None:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:  # every row sees at least its own key, so no row is fully masked
        mask = causal_document_mask(T, cu_seqlens, device=q.device)
        o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return o.transpose(1, 2)


def _headwise(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("nhi,hio->nho", x, w)``: :func:`kernels_torch.ops.linears.headwise_matmul` (head-batched ``bmm`` on
    strided views, no copies) in eager mode; the einsum itself under ``torch.compile``, whose code generation picks
    the layouts (the eager function's ``bmm(out=...)`` on transposed views is no graph op)."""
    if torch.compiler.is_compiling():
        return torch.einsum("nhi,hio->nho", x, w.to(x.dtype))
    return headwise_matmul(x, w)


def gated_mla_forward(layer, x: torch.Tensor, cu_seqlens=None, return_aux: bool = False):
    """``GatedMLA.forward`` under ``backend="cudnn"`` (spec 3.2-3.3, 4).

    DSA layers: c_q -> frozen indexer (no grad) -> :func:`indexer_topk_cudnn`; absorbed query
    ``[W_UK^T q_nope || q_pe]`` ``[N, H, 576]`` and latent rows ``[kv_a_layernorm(c) || k_pe]`` ``[N, 576]``
    -> :func:`sparse_mla` -> W_UV -> sigmoid gate (fp32) -> o_proj. ``B > 1`` runs as ``B`` packed documents.
    MLA layers without an indexer: expanded form with torch SDPA (causal, or the document mask). A DSA layer whose
    indexer's ``index_topk`` selects every visible key and exceeds the top-k kernel's :data:`MAX_TOPK` (the dense
    warm-up's ``kimi_tools.distill.dense_selection``) is dense causal MLA (spec 4.3) and runs that SDPA path too,
    with ``topk_indices`` None in the aux.

    With ``layer.sparse_kl_aux`` set (``kimi_tools.distill.capture_dsa_inputs`` sets it), a sparse DSA layer's aux
    also holds what the indexer distillation's sparse stage needs, all detached, in the packed layout of the sparse
    forward (N = B * T rows): ``"q_abs"`` ``[N, H, L+R]``, ``"kv_rows"`` ``[N, L+R]``, ``"topk_global"`` ``[N, k]``
    int32 global row ids (-1 padded), ``"lse"`` ``[N, H]`` fp32, the sparse forward's natural-log lse over exactly
    those slots, and ``"c_q"`` ``[B, T, q_lora_rank]`` (the indexer's query input).

    Returns:
        ``[B, T, D]`` bf16, plus with ``return_aux`` ``{"topk_indices": [B, T, min(index_topk, T)] int32 (-1 padded),
        "index_scores": None}`` on DSA layers (the scores are never materialised). The selected set per row is the
        canonical one, as eager's, but the slots are in ascending key order (:func:`sort_topk_slots`), not eager's
        score order; the forward is bitwise reproducible.

    Raises:
        RuntimeError: CUDA, bf16 or the ``gpu`` extra missing. ValueError: malformed ``cu_seqlens``.
    """
    c = layer.config
    require_cudnn(x, "x")
    compiling = torch.compiler.is_compiling()
    B, T, D = x.shape
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, T, B)
    H, Kn, R, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
    scale = c.mla_softmax_scale  # (Kn + R)^-1/2 = 192^-1/2 in both forms (the same scores, spec 3.3)
    c_q, q, q_nope, q_pe, c_kv, k_pe = layer.project(x)

    aux: dict = {}
    index_topk = layer.indexer.config.index_topk if layer.kind == "dsa" else 0
    dense = layer.kind == "dsa" and index_topk > MAX_TOPK and index_topk >= T  # every visible key selected
    if layer.kind != "dsa" or dense:
        kvb = layer.kv_b_proj(c_kv).view(B, T, H, Kn + V)
        k = torch.cat([kvb[..., :Kn], k_pe[:, :, None, :].expand(B, T, H, R)], dim=-1)
        o = _dense_sdpa(q, k, kvb[..., Kn:], cu_seqlens, scale)  # [B, T, H, V]
        if dense:
            aux = {"topk_indices": None, "index_scores": None}
    else:
        N = B * T  # B sequences = B packed documents
        cu = cu_seqlens if cu_seqlens is not None or B == 1 else torch.arange(B + 1) * T
        topk = min(index_topk, T)
        with torch.no_grad():  # frozen indexer: hard top-k passes no gradient
            # RoPE (config.indexer_rope) is applied here, before the cuDNN call; positions restart per document
            q_I, k_I, weights = layer.indexer.projections(x.detach(), c_q.detach(), cu_seqlens)
            q_I, k_I, weights = q_I.reshape(N, *q_I.shape[2:]), k_I.reshape(N, -1), weights.reshape(N, -1)
            if compiling:  # the cuDNN indexer, top-k and slot sort: one node for the compiler
                idx, tlen = _indexer_topk_op(q_I, k_I, weights, topk, cu)
            else:
                idx, tlen = indexer_topk_cudnn(q_I, k_I, weights, topk, cu)
                idx = sort_topk_slots(idx)  # a reproducible forward: see sort_topk_slots
        w = effective_weight(layer.kv_b_proj).view(H, Kn + V, L)  # W + scale * B A under LoRA
        w_uk, w_uv = w[:, :Kn], w[:, Kn:]  # [H, Kn, L], [H, V, L]
        kernel = getattr(layer, "sparse_kernel", None)
        q_lat = _headwise(q_nope.reshape(N, H, Kn), w_uk)  # [N, H, L]: einsum "nhk,hkl->nhl", no copies
        q_rope = q_pe.reshape(N, H, R)
        # the sparse backward runs (and reads q) when any of its inputs needs a gradient: the KV rows count too
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_lat, q_rope, c_kv, k_pe))
        padded = not compiling and (L, R) == (SPARSE_D_V, SPARSE_D_QK - SPARSE_D_V)  # compiled: no in-place views
        if not needs_grad and padded and wants_padded_q(H, x.device, kernel):
            # FlashMLA reads 64 or 128 heads: write the absorbed queries straight into its padded layout, so the
            # forward copies nothing in or out. Not under autograd: cuDNN's backward stages contiguous q and out
            # anyway, so the copies would only move there, and the saved tensors would grow by the pad heads.
            q_abs = padded_q(N, H, L + R, dtype=q_lat.dtype, device=x.device)
            q_abs[..., :L] = q_lat
            q_abs[..., L:] = q_rope
        else:
            q_abs = torch.cat([q_lat, q_rope], dim=-1).contiguous()  # [N, H, L+R]
        kv_rows = torch.cat([c_kv, k_pe], dim=-1).reshape(N, L + R).contiguous()  # [N, L+R]: one latent KV head
        kl_aux = bool(getattr(layer, "sparse_kl_aux", False))
        o_lat = sparse_mla(q_abs, kv_rows, idx, tlen, scale, d_v=L, kernel=kernel, return_lse=kl_aux)
        if kl_aux:
            o_lat, lse = o_lat
        o = _headwise(o_lat, w_uv.transpose(1, 2)).view(B, T, H, V)  # einsum "nhl,hvl->nhv"
        idx_global = idx
        idx = idx.view(B, T, topk)
        if B > 1:  # the B sequences ran as packed documents: key ids back to positions within each sequence
            offset = (torch.arange(B, device=idx.device, dtype=idx.dtype) * T)[:, None, None]
            idx = torch.where(idx >= 0, idx - offset, idx)
        aux = {"topk_indices": idx, "index_scores": None}
        if kl_aux:  # the indexer distillation's sparse stage (kimi_tools.distill): the sparse forward's own rows
            aux.update(
                q_abs=q_abs.detach(), kv_rows=kv_rows.detach(), topk_global=idx_global, lse=lse, c_q=c_q.detach()
            )

    out = layer.gate_and_project_out(o, x)
    return (out, aux) if return_aux else out
