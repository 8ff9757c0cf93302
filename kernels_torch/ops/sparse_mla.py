"""Sparse MLA forward (DSA prefill) for SM90, with the FlashMLA ``flash_mla_sparse_fwd`` contract.

Notable:
* Absorbed MLA (spec 3.3, 4.3): every query head h of token t attends over one shared latent KV head,
  ``d_qk = 576 = 512 latent + 64 rope``, ``d_v = 512`` (the value is the first 512 columns of the key row),
  and only over the keys that the indexer selected for token t (all heads share that index set).
* Footgun: the softmax scale is ``192 ** -0.5`` (qk_nope + qk_rope of the expanded form), NOT ``576 ** -0.5``.
  The caller passes ``sm_scale``; nothing here defaults it.
* Footgun: ``lse`` is the **natural-log** log-sum-exp of the scaled logits (what the cuDNN sparse backward
  takes). The Triton kernel works in base 2 internally (exp2 with ``sm_scale * log2(e)`` folded in) and converts
  on the way out.
* Index ids that are ``< 0`` (``-1`` padding) or ``>= S_kv`` are skipped; with ``topk_length`` the entries at
  positions ``>= topk_length[t]`` are skipped even when they look valid. A row with no valid key gets
  ``out = 0``, ``lse = +inf``, ``max_logits = -inf``, never NaN.
* Kernels (``backend=``, or ``$KIMI_SPARSE_KERNEL``; ``kernels_torch.kernel_choice``): ``auto`` runs FlashMLA
  when a ``flash_mla`` module with ``flash_mla_sparse_fwd`` imports, the device is SM90 (its legacy kernels,
  ``use_legacy=True``) or SM100, ``d_qk = 576`` and ``H <= 128`` (heads padded to 64/128 with zero queries, which are
  inert; top-k padded to a multiple of 128 with skipped ids), else the Triton kernel below (CUDA tensors only).
  Each call records the kernel that ran (``kernel_choice.used()``).
  :func:`sparse_mla_fwd_reference` is the readable fp32 oracle (CPU or GPU).

Shapes (axis letters of ``docs/design.md``): ``T`` = S_q query tokens, ``S`` = S_kv key tokens, ``H`` heads,
``K`` selected keys per token (topk), ``D`` = d_qk = 576, ``V`` = d_v = 512.
"""

from __future__ import annotations

import math

import torch

from kernels_torch.common import compute_dtype

try:  # Triton is optional: the CPU CI machine has none; the reference works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

from kernels_torch import kernel_choice

try:  # FlashMLA is optional (the sgl-flash-mla wheel, installed with --no-deps; docs/kernels.md).
    from flash_mla import flash_mla_sparse_fwd as _flash_mla_sparse_fwd
except Exception:  # ImportError, or a broken build raising at import
    _flash_mla_sparse_fwd = None

__all__ = [
    "sparse_mla_fwd",
    "sparse_mla_fwd_kernel",
    "flash_mla_takes",
    "flash_mla_heads",
    "padded_q",
    "wants_padded_q",
    "sparse_mla_fwd_reference",
    "D_QK",
    "D_V",
    "D_ROPE",
    "TRITON_CONFIG",
]

D_QK = 576  # 512 latent (kv_lora_rank) + 64 rope
D_V = 512  # the value is the latent part of the key row
D_ROPE = D_QK - D_V
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

# Default launch configuration of the Triton kernel (measured on an H200: see benchmarks/README.md).
# block_h: heads per program (all heads of a token share its index set, so each gathered KV tile is reused
# by block_h heads); block_k: selected keys per tile.
# layout: "hk" computes S = Q.KV^T as [heads, keys] (Triton then has both warpgroups of a 64-head block compute
# the same S: it puts all warps of a chained dot on M); "kh" computes S^T = KV.Q^T as [keys, heads] and
# O^T = V^T.P^T, which splits a 128-key tile over the two warpgroups (see benchmarks/README.md for the timings).
TRITON_CONFIG = dict(layout="hk", block_h=64, block_k=64, num_warps=8, num_stages=2)


# ----------------------------------------------------------------------------------------------------------
# argument checks
# ----------------------------------------------------------------------------------------------------------


def _check_inputs(q, kv, indices, topk_length, d_v, *, fast: bool):
    """Validate and normalise the arguments; return ``q [T,H,D]``, ``kv [S,D]``, ``indices [T,K]``, ``topk_length``.

    Raises:
        TypeError / ValueError naming the argument, the value and the expectation.
    """
    for name, x in (("q", q), ("kv", kv), ("indices", indices)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: got {type(x).__name__}, expected a torch.Tensor")
    if q.ndim != 3:
        raise ValueError(f"q: got shape {tuple(q.shape)}, expected [S_q, H, d_qk] (3-D)")
    T, H, D = q.shape
    if kv.ndim == 3:
        if kv.shape[1] != 1:
            raise ValueError(
                f"kv: got shape {tuple(kv.shape)}, expected [S_kv, 1, d_qk] (one latent KV head) or [S_kv, d_qk]"
            )
        kv = kv[:, 0]
    elif kv.ndim != 2:
        raise ValueError(f"kv: got shape {tuple(kv.shape)}, expected [S_kv, 1, d_qk] or [S_kv, d_qk]")
    if kv.shape[-1] != D:
        raise ValueError(f"kv: got d_qk={kv.shape[-1]} (shape {tuple(kv.shape)}), expected d_qk={D} to match q")
    if indices.ndim == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"indices: got shape {tuple(indices.shape)}, expected [S_q, 1, K] or [S_q, K]")
        indices = indices[:, 0]
    elif indices.ndim != 2:
        raise ValueError(f"indices: got shape {tuple(indices.shape)}, expected [S_q, 1, K] or [S_q, K]")
    if indices.shape[0] != T:
        raise ValueError(f"indices: got {indices.shape[0]} rows (shape {tuple(indices.shape)}), expected S_q={T} rows")
    if not (isinstance(d_v, int) and 0 < d_v <= D):
        raise ValueError(f"d_v: got {d_v!r}, expected an int in (0, d_qk={D}]")
    if fast:
        if D != D_QK or d_v != D_V:
            raise ValueError(f"q/d_v: got d_qk={D}, d_v={d_v}, expected d_qk={D_QK}, d_v={D_V} (absorbed MLA)")
        for name, x in (("q", q), ("kv", kv)):
            if x.dtype != torch.bfloat16:
                raise TypeError(f"{name}: got dtype {x.dtype}, expected torch.bfloat16")
        if indices.dtype != torch.int32:
            raise TypeError(f"indices: got dtype {indices.dtype}, expected torch.int32")
    else:
        for name, x in (("q", q), ("kv", kv)):
            if not x.is_floating_point():
                raise TypeError(f"{name}: got dtype {x.dtype}, expected a floating dtype")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices: got dtype {indices.dtype}, expected torch.int32 (or int64)")
    if topk_length is not None:
        if not isinstance(topk_length, torch.Tensor):
            raise TypeError(
                f"topk_length: got {type(topk_length).__name__}, expected a torch.Tensor [S_q] int32 or None"
            )
        if topk_length.shape != (T,):
            raise ValueError(f"topk_length: got shape {tuple(topk_length.shape)}, expected [S_q]=[{T}]")
        if topk_length.dtype not in ((torch.int32,) if fast else (torch.int32, torch.int64)):
            raise TypeError(f"topk_length: got dtype {topk_length.dtype}, expected torch.int32")
    devs = {x.device for x in (q, kv, indices) + (() if topk_length is None else (topk_length,))}
    if len(devs) != 1:
        raise ValueError(
            f"q/kv/indices/topk_length: got tensors on devices {sorted(map(str, devs))}, expected one device"
        )
    if fast and q.device.type != "cuda":
        raise ValueError(f"q: on device {q.device}, expected a CUDA tensor (use sparse_mla_fwd_reference on CPU)")
    return q, kv, indices, topk_length


# ----------------------------------------------------------------------------------------------------------
# reference (the oracle)
# ----------------------------------------------------------------------------------------------------------


def sparse_mla_fwd_reference(q, kv, indices, sm_scale, topk_length=None, d_v=D_V, *, rows_per_chunk=None):
    """Readable sparse MLA forward: gather the selected KV rows, einsum, softmax in fp32 (fp64 for fp64 inputs).

    Args:
        q: ``[T, H, D]`` float (bf16 in the model), D = 576 for absorbed MLA.
        kv: ``[S, 1, D]`` or ``[S, D]``, same dtype family; the value is ``kv[..., :d_v]``.
        indices: ``[T, 1, K]`` or ``[T, K]`` int32 (int64 accepted) global key ids; ids ``< 0`` or ``>= S`` are skipped.
        sm_scale: softmax scale, ``192 ** -0.5`` for K3.1 (spec 3.3), not ``D ** -0.5``.
        topk_length: optional ``[T]`` int: entries at positions ``>= topk_length[t]`` are skipped.
        d_v: value width (512).
        rows_per_chunk: query rows per gather (default: about 512 MiB of gathered rows).

    Returns:
        ``(out [T, H, d_v], max_logits [T, H], lse [T, H])`` all in the compute dtype (fp32, or fp64 for fp64 q):
        out is NOT rounded to bf16, so it can serve as the oracle. lse is the natural-log log-sum-exp of
        ``sm_scale * q.k`` over the valid keys; a row without one gets out 0, lse +inf, max_logits -inf.

    Raises:
        TypeError / ValueError for wrong shapes, dtypes or mixed devices (naming the argument).
    """
    q, kv, indices, topk_length = _check_inputs(q, kv, indices, topk_length, d_v, fast=False)
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    dt = compute_dtype(q, kv)
    out = torch.zeros(T, H, d_v, dtype=dt, device=q.device)
    max_logits = torch.full((T, H), -math.inf, dtype=dt, device=q.device)
    lse = torch.full((T, H), math.inf, dtype=dt, device=q.device)
    if T == 0 or K == 0 or S == 0:
        return out, max_logits, lse
    kvf = kv.to(dt)  # [S, D]
    if rows_per_chunk is None:
        rows_per_chunk = max(1, (512 << 20) // (K * max(D, H) * kvf.element_size()))
    pos = torch.arange(K, device=q.device)
    for t0 in range(0, T, rows_per_chunk):
        t1 = min(T, t0 + rows_per_chunk)
        idx = indices[t0:t1].long()  # [C, K]
        valid = (idx >= 0) & (idx < S)
        if topk_length is not None:
            valid &= pos[None, :] < topk_length[t0:t1, None].long()
        kv_sel = kvf[idx.clamp(0, S - 1)]  # [C, K, D]
        kv_sel = kv_sel.masked_fill(~valid[:, :, None], 0.0)  # skipped rows may hold anything (NaN too)
        logits = torch.einsum("chd,ckd->chk", q[t0:t1].to(dt), kv_sel) * sm_scale  # [C, H, K]
        logits = logits.masked_fill(~valid[:, None, :], -math.inf)
        row_lse = torch.logsumexp(logits, dim=-1)  # [C, H]; -inf on rows without a valid key
        empty = torch.isneginf(row_lse)
        # exp(logits - (+inf)) = 0 on empty rows instead of exp(-inf - -inf) = NaN
        p = torch.exp(logits - row_lse.masked_fill(empty, math.inf)[..., None])  # [C, H, K]
        out[t0:t1] = torch.einsum("chk,ckv->chv", p, kv_sel[..., :d_v])
        max_logits[t0:t1] = logits.amax(dim=-1)
        lse[t0:t1] = row_lse.masked_fill(empty, math.inf)
    return out, max_logits, lse


# ----------------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------------

if triton is not None:
    # The two kernels (heads-on-M and keys-on-M) share their prologue, their KV gather and their epilogue: these
    # three @triton.jit helpers, which Triton inlines into each kernel.

    @triton.jit
    def _load_row(
        Q,
        TOPK_LEN,
        pid,
        H,
        K,
        head_start,
        stride_qt,
        stride_qh,
        N_HEAD_BLOCKS: tl.constexpr,
        HAS_TOPK_LEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        D_NOPE: tl.constexpr,
        D_PE: tl.constexpr,
    ):
        """Program ``pid`` -> its token ``t``, heads ``offs_h`` (``mask_h``: ``< H``), queries ``q_nope
        [BLOCK_H, D_NOPE]`` and ``q_pe [BLOCK_H, D_PE]`` (zero past H: inert, never stored), and ``n_keys`` (K, or
        ``topk_length[t]`` clamped to ``[0, K]``)."""
        t = (pid // N_HEAD_BLOCKS).to(tl.int64)
        offs_h = head_start + (pid % N_HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        q_ptr = Q + t * stride_qt + offs_h[:, None] * stride_qh
        q_nope = tl.load(q_ptr + tl.arange(0, D_NOPE)[None, :], mask=mask_h[:, None], other=0.0)
        q_pe = tl.load(q_ptr + D_NOPE + tl.arange(0, D_PE)[None, :], mask=mask_h[:, None], other=0.0)
        n_keys = K
        if HAS_TOPK_LEN:
            n_keys = tl.minimum(tl.maximum(tl.load(TOPK_LEN + t), 0), K)
        return t, offs_h, mask_h, q_nope, q_pe, n_keys

    @triton.jit
    def _gather_kv(
        KV,
        idx_row,
        k0,
        n_keys,
        S_kv,
        stride_kvs,
        BLOCK_K: tl.constexpr,
        D_NOPE: tl.constexpr,
        D_PE: tl.constexpr,
    ):
        """Key slots ``k0 .. k0 + BLOCK_K`` of one row -> ``valid [BLOCK_K]`` (inside n_keys and ``0 <= id < S_kv``),
        ``kv_nope [BLOCK_K, D_NOPE]`` and ``kv_pe [BLOCK_K, D_PE]`` (zero where not valid)."""
        offs_k = k0 + tl.arange(0, BLOCK_K)
        in_len = offs_k < n_keys
        idx = tl.load(idx_row + offs_k, mask=in_len, other=-1)
        valid = in_len & (idx >= 0) & (idx < S_kv)
        kv_ptr = KV + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kvs
        # skipped keys are never read (masked), so an out-of-range id cannot fault and garbage cannot leak
        kv_nope = tl.load(kv_ptr + tl.arange(0, D_NOPE)[None, :], mask=valid[:, None], other=0.0)
        kv_pe = tl.load(kv_ptr + D_NOPE + tl.arange(0, D_PE)[None, :], mask=valid[:, None], other=0.0)
        return valid, kv_nope, kv_pe

    @triton.jit
    def _online_softmax_step(s, m_i, l_i, KEY_AXIS: tl.constexpr):
        """One key tile of the online softmax (Milakov & Gimelshein 2018; FlashAttention-2 alg. 1), base 2.

        ``s``: the tile's scaled logits, keys on axis ``KEY_AXIS`` (-inf where not valid); ``m_i``, ``l_i``
        ``[BLOCK_H]``: running max and sum of ``exp2(s - m_i)``. Returns the new ``m_i``, ``l_i``, the factor
        ``alpha [BLOCK_H]`` by which the caller rescales its accumulator, and ``p = exp2(s - m_i)`` (``s``'s shape).
        """
        m_new = tl.maximum(m_i, tl.max(s, KEY_AXIS))
        # a head that has seen no valid key yet keeps m = -inf; subtract 0 then, never (-inf) - (-inf) = NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - tl.expand_dims(m_use, KEY_AXIS))
        l_i = l_i * alpha + tl.sum(p, KEY_AXIS)
        return m_new, l_i, alpha, p

    @triton.jit
    def _store_row_stats(LSE, MAX_LOGITS, t, stride_lt, offs_h, mask_h, m_i, l_i):
        """Store ``lse`` (natural log; +inf for a head without a valid key) and ``max_logits`` (-inf stays -inf)
        from the base-2 running max ``m_i`` and sum ``l_i``."""
        has_key = l_i > 0.0
        l_use = tl.where(has_key, l_i, 1.0)
        LN2: tl.constexpr = 0.6931471805599453
        lse = tl.where(has_key, (m_i + tl.log2(l_use)) * LN2, float("inf"))  # natural log
        tl.store(LSE + t * stride_lt + offs_h, lse, mask=mask_h)
        tl.store(MAX_LOGITS + t * stride_lt + offs_h, m_i * LN2, mask=mask_h)

    @triton.jit(do_not_specialize=["H", "S_kv", "K", "head_start"])
    def _sparse_mla_fwd_kernel(
        Q,
        KV,
        IDX,
        TOPK_LEN,
        OUT,
        MAX_LOGITS,
        LSE,
        H,
        S_kv,
        K,
        head_start,  # H: heads >= H are masked (the end of this launch's head range)
        stride_qt,
        stride_qh,
        stride_kvs,
        stride_it,
        stride_ot,
        stride_oh,
        stride_lt,
        qk_scale_log2,  # sm_scale * log2(e): logits live in base 2 inside the kernel
        N_HEAD_BLOCKS: tl.constexpr,
        HAS_TOPK_LEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
        D_NOPE: tl.constexpr,
        D_PE: tl.constexpr,
    ):
        # One program = one query token x BLOCK_H heads. The programs of one token are adjacent, so the KV
        # rows that the first one gathers are still in L2 for the next.
        # q [BLOCK_H, 512 + 64]; heads past H read as zero queries (inert, never stored)
        t, offs_h, mask_h, q_nope, q_pe, n_keys = _load_row(
            Q, TOPK_LEN, tl.program_id(0), H, K, head_start, stride_qt, stride_qh, N_HEAD_BLOCKS, HAS_TOPK_LEN,
            BLOCK_H, D_NOPE, D_PE,
        )  # fmt: skip
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max, base-2 units
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_H, D_NOPE], dtype=tl.float32)
        idx_row = IDX + t * stride_it
        for k0 in range(0, n_keys, BLOCK_K):
            # kv_nope [BLOCK_K, 512], kv_pe [BLOCK_K, 64]
            valid, kv_nope, kv_pe = _gather_kv(KV, idx_row, k0, n_keys, S_kv, stride_kvs, BLOCK_K, D_NOPE, D_PE)

            s = tl.dot(q_pe, tl.trans(kv_pe))
            s = tl.dot(q_nope, tl.trans(kv_nope), s)  # [BLOCK_H, BLOCK_K] fp32
            s = tl.where(valid[None, :], s * qk_scale_log2, float("-inf"))

            m_i, l_i, alpha, p = _online_softmax_step(s, m_i, l_i, 1)  # keys on axis 1
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(kv_nope.dtype), kv_nope, acc)  # V = the latent part of the key row

        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # acc is exactly 0 on heads without a valid key
        o_ptr = OUT + t * stride_ot + offs_h[:, None] * stride_oh + tl.arange(0, D_NOPE)[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=mask_h[:, None])
        _store_row_stats(LSE, MAX_LOGITS, t, stride_lt, offs_h, mask_h, m_i, l_i)

    @triton.jit(do_not_specialize=["H", "S_kv", "K", "head_start"])
    def _sparse_mla_fwd_kernel_t(
        Q,
        KV,
        IDX,
        TOPK_LEN,
        OUT,
        MAX_LOGITS,
        LSE,
        H,
        S_kv,
        K,
        head_start,
        stride_qt,
        stride_qh,
        stride_kvs,
        stride_it,
        stride_ot,
        stride_oh,
        stride_lt,
        qk_scale_log2,
        N_HEAD_BLOCKS: tl.constexpr,
        HAS_TOPK_LEN: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_K: tl.constexpr,
        D_NOPE: tl.constexpr,
        D_PE: tl.constexpr,
    ):
        # Transposed variant: S^T = KV_tile . Q^T ([keys, heads]) and O^T = V^T . P^T ([512, heads]).
        # Triton puts all warps of a chained dot on its M axis; with keys (not heads) on M, a 128-key tile
        # splits over two warpgroups instead of both warpgroups recomputing the same [64 heads, keys] scores.
        t, offs_h, mask_h, q_nope, q_pe, n_keys = _load_row(
            Q, TOPK_LEN, tl.program_id(0), H, K, head_start, stride_qt, stride_qh, N_HEAD_BLOCKS, HAS_TOPK_LEN,
            BLOCK_H, D_NOPE, D_PE,
        )  # fmt: skip
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([D_NOPE, BLOCK_H], dtype=tl.float32)  # O^T
        idx_row = IDX + t * stride_it
        for k0 in range(0, n_keys, BLOCK_K):
            valid, kv_nope, kv_pe = _gather_kv(KV, idx_row, k0, n_keys, S_kv, stride_kvs, BLOCK_K, D_NOPE, D_PE)
            s = tl.dot(kv_pe, tl.trans(q_pe))
            s = tl.dot(kv_nope, tl.trans(q_nope), s)  # [BLOCK_K, BLOCK_H]
            s = tl.where(valid[:, None], s * qk_scale_log2, float("-inf"))
            m_i, l_i, alpha, p = _online_softmax_step(s, m_i, l_i, 0)  # keys on axis 0
            acc = acc * alpha[None, :]
            acc = tl.dot(tl.trans(kv_nope), p.to(kv_nope.dtype), acc)
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[None, :]
        o_ptr = OUT + t * stride_ot + offs_h[None, :] * stride_oh + tl.arange(0, D_NOPE)[:, None]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=mask_h[None, :])
        _store_row_stats(LSE, MAX_LOGITS, t, stride_lt, offs_h, mask_h, m_i, l_i)


def _sparse_mla_fwd_triton(
    q,
    kv,
    indices,
    sm_scale,
    topk_length=None,
    *,
    layout=None,
    block_h=None,
    block_k=None,
    num_warps=None,
    num_stages=None,
    head_splits=None,
    return_kernels=False,
    _out=None,
):
    """Launch the Triton kernel on checked inputs ``q [T,H,576]``, ``kv [S,576]``, ``indices [T,K]`` (int32).

    ``head_splits``: optional list of ``(head_start, n_heads, block_h)`` launches covering ``[0, H)`` (e.g.
    ``[(0, 64, 64), (64, 32, 32)]`` for H = 96 without padded heads); default one launch of ``block_h`` blocks.
    """
    if triton is None:
        raise RuntimeError("sparse_mla_fwd: Triton is not installed; use sparse_mla_fwd_reference or install triton")
    cfg = dict(TRITON_CONFIG)
    for key, val in (
        ("layout", layout),
        ("block_h", block_h),
        ("block_k", block_k),
        ("num_warps", num_warps),
        ("num_stages", num_stages),
    ):
        if val is not None:
            cfg[key] = val
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[1]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    indices = indices.contiguous()
    if _out is not None:  # tests pass NaN-poisoned buffers so that an unwritten element fails
        out, max_logits, lse = _out
    else:
        out = torch.empty(T, H, D_V, dtype=q.dtype, device=q.device)
        max_logits = torch.empty(T, H, dtype=torch.float32, device=q.device)
        lse = torch.empty(T, H, dtype=torch.float32, device=q.device)
    kernels = []
    if T == 0:
        return (out, max_logits, lse, kernels) if return_kernels else (out, max_logits, lse)
    if K == 0 or S == 0:
        out.zero_(), max_logits.fill_(-math.inf), lse.fill_(math.inf)
        return (out, max_logits, lse, kernels) if return_kernels else (out, max_logits, lse)
    tl_len = topk_length.contiguous() if topk_length is not None else indices  # dummy pointer when absent
    splits = head_splits or [(0, H, cfg["block_h"])]
    for head_start, n_heads, bh in splits:
        n_blocks = triton.cdiv(n_heads, bh)
        kernel = _sparse_mla_fwd_kernel_t if cfg["layout"] == "kh" else _sparse_mla_fwd_kernel
        kernels.append(
            kernel[(T * n_blocks,)](
                q,
                kv,
                indices,
                tl_len,
                out,
                max_logits,
                lse,
                min(H, head_start + n_heads),
                S,
                K,
                head_start,
                q.stride(0),
                q.stride(1),
                kv.stride(0),
                indices.stride(0),
                out.stride(0),
                out.stride(1),
                lse.stride(0),
                float(sm_scale) * _LOG2E,
                N_HEAD_BLOCKS=n_blocks,
                HAS_TOPK_LEN=topk_length is not None,
                BLOCK_H=bh,
                BLOCK_K=cfg["block_k"],
                D_NOPE=D_V,
                D_PE=D_ROPE,
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
        )
    return (out, max_logits, lse, kernels) if return_kernels else (out, max_logits, lse)


def _flash_mla_arch(device: torch.device) -> str | None:
    """``"legacy"`` on SM90 (FlashMLA keeps its Hopper kernels under ``use_legacy=True``), ``"current"`` on SM100,
    None elsewhere (FlashMLA has no kernels there) or without CUDA."""
    if device.type != "cuda":
        return None
    major = torch.cuda.get_device_capability(device)[0]
    return {9: "legacy", 10: "current"}.get(major)


def flash_mla_heads(H: int) -> int:
    """The head count FlashMLA computes for ``H`` query heads: 64 for ``H <= 64``, else 128 (its two SM90 tilings).

    Raises:
        ValueError: ``H`` outside ``[0, 128]`` (FlashMLA has no tiling for more heads).
    """
    if not 0 <= H <= 128:
        raise ValueError(f"H: got {H} query heads, expected 0 <= H <= 128 (FlashMLA computes 64 or 128 heads)")
    return 64 if H <= 64 else 128


def copy_rows_wide(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape, same-dtype tensors whose last axis is contiguous, moved as 8-byte words.

    A copy between ``[T, H, D]`` views of different row strides (the 96 useful heads into or out of FlashMLA's
    128-head layout) is not contiguous, so torch runs it in its scalar copy kernel, one 2-byte element per thread
    step; viewed as int64 (a reinterpretation, bitwise the same copy) it moves 4 bf16 per step. Falls back to the
    plain copy where the last axis or the strides do not divide into 8-byte words, and for 0-d, conjugate or negated
    views and tensors under autograd (the reinterpretation records no gradient: the FlashMLA buffers have none)."""
    w = 8 // dst.element_size() if dst.element_size() in (1, 2, 4) else 0
    ok = (
        w > 0
        and dst.dim() > 0
        and not (torch.is_grad_enabled() and (dst.requires_grad or src.requires_grad))
        and not any(t.is_conj() or t.is_neg() for t in (dst, src))
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and all(t.stride(-1) == 1 and t.shape[-1] % w == 0 for t in (dst, src))
        and all(st % w == 0 for t in (dst, src) for st in t.stride()[:-1])
        and all(t.storage_offset() % w == 0 for t in (dst, src))
    )
    if ok:
        dst.view(torch.int64).copy_(src.view(torch.int64))
    else:
        dst.copy_(src)


def padded_q(T: int, H: int, D: int = D_QK, *, dtype=torch.bfloat16, device=None) -> torch.Tensor:
    """An uninitialised query tensor ``[T, H, D]`` laid out as FlashMLA reads it: heads ``:H`` of a row-major
    ``[T, flash_mla_heads(H), D]`` buffer whose pad heads are zero. Fill it in place (``q[..., :512] = ...``) and
    :func:`sparse_mla_fwd` hands the buffer to FlashMLA as it is, with no head-padding copy, and returns its
    ``[:, :H]`` output views (no copy back either). Any other ``[T, H, D]`` works too, through one padded copy.

    Costs ``T * (H_pad - H) * D`` more elements than a dense ``[T, H, D]`` (a third more at 96 heads).

    Raises:
        ValueError: ``H`` outside ``[0, 128]`` (:func:`flash_mla_heads`).
    """
    H_pad = flash_mla_heads(H)
    buf = torch.empty(T, H_pad, D, dtype=dtype, device=device)
    buf[:, H:].zero_()
    return buf[:, :H]


def _padded_parent(q: torch.Tensor, H_pad: int) -> torch.Tensor | None:
    """``q``'s FlashMLA-layout parent ``[T, H_pad, D]`` when ``q`` is heads ``:H`` of a row-major ``[T, H_pad, D]``
    buffer (:func:`padded_q`, or ``H == H_pad`` and contiguous), else None. Only the strides and the storage's extent
    are read: the pad heads' values only reach the pad heads' outputs (heads never mix), which are sliced away."""
    T, H, D = q.shape
    if T == 0 or q.stride(2) != 1 or q.stride(1) != D or (T > 1 and q.stride(0) != H_pad * D):
        return None
    if (q.storage_offset() + T * H_pad * D) * q.element_size() > q.untyped_storage().nbytes():
        return None  # the last row's pad heads would lie past the storage
    return q.as_strided((T, H_pad, D), (H_pad * D, D, 1))


def flash_mla_takes(q: torch.Tensor) -> str | None:
    """Why FlashMLA cannot run ``q`` [T, H, D] here (a reason string), or None when it can."""
    if _flash_mla_sparse_fwd is None:
        return "no flash_mla module with flash_mla_sparse_fwd imports (pip install --no-deps sgl-flash-mla)"
    if _flash_mla_arch(q.device) is None:
        cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else None
        return f"device {q.device} (capability {cap}) is neither SM90 nor SM100"
    if q.shape[1] > 128:
        return f"H = {q.shape[1]} > 128 heads (FlashMLA takes 64 or 128)"
    return None


FLASH_MLA_ROWS = 8192  # query rows per FlashMLA call: bounds the padded copies (q, out: ~1 GiB each at 128 heads)
_FLASH_MLA_TOPK_LENGTH = [True]  # False once the installed build refused the topk_length argument


def _sparse_mla_fwd_flash_mla(q, kv, indices, sm_scale, topk_length, rows=FLASH_MLA_ROWS):
    """FlashMLA path on checked inputs ``q [T,H,576]``, ``kv [S,576]``, ``indices [T,K]`` int32.

    * heads padded to 64 or 128 (:func:`flash_mla_heads`); the pad heads are inert (heads never mix: they only
      produce rows that are sliced away). When ``q`` already lies in that layout (:func:`padded_q`, or ``H`` is 64 or
      128 and ``q`` is contiguous) it goes to FlashMLA as it is, in one call, and the outputs are FlashMLA's own
      ``[:, :H]`` views (no copy either way). Otherwise ``q`` is copied into a zero-padded buffer in calls of ``rows``
      query rows (the copies stay O(rows), not O(T)) and the outputs are written into contiguous ``[T, H, *]``;
    * the top-k axis padded to a multiple of 128 with ``-1`` (skipped) ids (the SM90 kernels read 128-key blocks);
    * with ``topk_length``, the slots at positions ``>= topk_length[t]`` are set to ``-1`` as well: FlashMLA documents
      that a valid id past ``topk_length`` pointing to a NaN key row can still make its output NaN;
    * ``use_legacy=True`` on SM90; natural-log lse (the default of sgl-flash-mla 1.0.0, ``return_log2_lse=None``);
    * rows without a valid key are returned as ``out = 0``, ``max_logits = -inf``, ``lse = +inf`` (our contract, what
      the cuDNN backward needs), whatever FlashMLA writes there.
    """
    T, H, D = q.shape
    K = indices.shape[1]
    if T == 0 or K == 0 or kv.shape[0] == 0:  # nothing to launch: every row is empty
        return (
            q.new_zeros(T, H, D_V),
            torch.full((T, H), -math.inf, device=q.device),
            torch.full((T, H), math.inf, device=q.device),
        )
    H_pad = flash_mla_heads(H)
    K_pad = -(-K // 128) * 128  # SM90 FlashMLA wants topk a multiple of 128: pad with skipped ids
    kwargs = {"use_legacy": True} if _flash_mla_arch(q.device) == "legacy" else {}
    kv3 = kv[:, None, :].contiguous()
    pos = torch.arange(K_pad, device=indices.device, dtype=torch.int32)

    def call(qc, t0, t1):  # one FlashMLA call on query rows [t0, t1) of the [*, H_pad, D] layout
        idx = indices[t0:t1]
        if K_pad != K:
            idx = torch.nn.functional.pad(idx, (0, K_pad - K), value=-1)
        tl_c = None
        if topk_length is not None:
            tl_c = topk_length[t0:t1]
            idx = torch.where(pos[None, :] < tl_c[:, None], idx, -1)
        args = (qc, kv3, idx[:, None, :].contiguous(), float(sm_scale), D_V)
        if tl_c is not None and _FLASH_MLA_TOPK_LENGTH[0]:
            try:
                return _flash_mla_sparse_fwd(*args, topk_length=tl_c, **kwargs)
            except (RuntimeError, TypeError):  # a build without topk_length: the -1 slots above say the same
                _FLASH_MLA_TOPK_LENGTH[0] = False
        return _flash_mla_sparse_fwd(*args, **kwargs)

    parent = _padded_parent(q, H_pad)
    if parent is not None:  # already in FlashMLA's layout: one call, no copies
        o, m, lse_all = call(parent, 0, T)
        out, max_logits, lse = o[:, :H], m[:, :H], lse_all[:, :H]
    else:
        out = max_logits = lse = None
        q_pad = q.new_empty(min(T, rows), H_pad, D)  # one buffer for every call: pad heads zeroed once
        q_pad[:, H:].zero_()
        for t0 in range(0, T, rows):
            t1 = min(T, t0 + rows)
            copy_rows_wide(q_pad[: t1 - t0, :H], q[t0:t1])
            o_c, m_c, l_c = call(q_pad[: t1 - t0], t0, t1)
            if out is None:  # dtypes as FlashMLA returns them (bf16 out, fp32 statistics)
                out = torch.empty(T, H, D_V, dtype=o_c.dtype, device=q.device)
                max_logits = torch.empty(T, H, dtype=m_c.dtype, device=q.device)
                lse = torch.empty(T, H, dtype=l_c.dtype, device=q.device)
            copy_rows_wide(out[t0:t1], o_c[:, :H])
            max_logits[t0:t1] = m_c[:, :H]
            lse[t0:t1] = l_c[:, :H]
    # empty rows: FlashMLA's reference gives lse = +inf there too; normalise whatever the build wrote
    empty = torch.isneginf(max_logits) | torch.isneginf(lse) | torch.isposinf(lse)
    lse.masked_fill_(empty, math.inf)
    max_logits.masked_fill_(empty, -math.inf)
    return out, max_logits, lse


def sparse_mla_fwd_kernel(q: torch.Tensor, backend: str | None = "auto") -> str:
    """The kernel that :func:`sparse_mla_fwd` runs for ``q`` [T, H, 576] (CUDA) under ``backend``
    (``"auto"``, ``"flash_mla"``, ``"triton"``, or None: ``$KIMI_SPARSE_KERNEL``, default auto).

    Raises:
        ValueError: an unknown ``backend``. RuntimeError: ``"flash_mla"`` requested but it cannot run (says why).
    """
    choice = kernel_choice.resolve("sparse_mla_fwd", None if backend in (None, "auto") else backend)
    why = flash_mla_takes(q)
    if choice == "flash_mla":
        if why is not None:
            raise RuntimeError(f"backend: got 'flash_mla', but FlashMLA cannot run here: {why}")
        return "flash_mla"
    if choice == "triton":
        return "triton"
    return "flash_mla" if why is None else "triton"


def wants_padded_q(H: int, device: torch.device, backend: str | None = "auto") -> bool:
    """Whether a caller about to build ``[T, H, 576]`` queries on ``device`` for :func:`sparse_mla_fwd` under
    ``backend`` saves a head-padding copy by building them with :func:`padded_q`: FlashMLA will run and ``H`` is not
    already 64 or 128.

    Raises:
        ValueError / RuntimeError: as :func:`sparse_mla_fwd_kernel` (an unknown or impossible forced backend).
    """
    if H in (64, 128) or torch.device(device).type != "cuda":
        return False
    return sparse_mla_fwd_kernel(torch.empty(0, H, D_QK, device=device), backend) == "flash_mla"


def sparse_mla_fwd(q, kv, indices, sm_scale, topk_length=None, d_v=D_V, *, backend="auto"):
    """Sparse MLA forward with the FlashMLA ``flash_mla_sparse_fwd`` contract (spec 4.3, docs/kernels.md).

    Args:
        q: ``[T, H, 576]`` bf16, CUDA (absorbed queries: 512 latent + 64 rope). Built with :func:`padded_q`, FlashMLA
            reads it in place (no head-padding copy in, none out).
        kv: ``[S, 1, 576]`` or ``[S, 576]`` bf16 (the one latent KV head; value = ``kv[..., :512]``).
        indices: ``[T, 1, K]`` or ``[T, K]`` int32 global key ids; ``-1``, ``< 0`` and ``>= S`` are skipped.
        sm_scale: softmax scale; ``192 ** -0.5`` for K3.1 (spec 3.3), NOT ``576 ** -0.5``.
        topk_length: optional ``[T]`` int32; entries at positions ``>= topk_length[t]`` are skipped.
        d_v: must be 512.
        backend: ``"auto"`` (``$KIMI_SPARSE_KERNEL`` if set, else FlashMLA where it runs, else Triton),
            ``"flash_mla"`` or ``"triton"``; None is the same as ``"auto"``. The kernel that ran is recorded in
            ``kernels_torch.kernel_choice.used()``.

    Returns:
        ``out [T, H, 512]`` bf16, ``max_logits [T, H]`` fp32 (max of ``sm_scale * q.k``, -inf on empty rows),
        ``lse [T, H]`` fp32 natural-log log-sum-exp of the scaled logits (+inf on empty rows, where out is 0).
        From FlashMLA with ``q`` in its layout (:func:`padded_q`), the three are ``[:, :H]`` views of its
        ``flash_mla_heads(H)``-head outputs (strided, not contiguous).

    Raises:
        TypeError / ValueError naming the argument, value and expectation (shape, dtype, device, backend);
        RuntimeError if the requested backend cannot run here.
    """
    if backend not in (None, "auto", "flash_mla", "triton"):
        raise ValueError(f"backend: got {backend!r}, expected 'auto', 'flash_mla' or 'triton'")
    q, kv, indices, topk_length = _check_inputs(q, kv, indices, topk_length, d_v, fast=True)
    kernel = sparse_mla_fwd_kernel(q, backend)
    kernel_choice.record("sparse_mla_fwd", kernel)
    if kernel == "flash_mla":
        return _sparse_mla_fwd_flash_mla(q, kv, indices, sm_scale, topk_length)
    return _sparse_mla_fwd_triton(q, kv, indices, sm_scale, topk_length)
