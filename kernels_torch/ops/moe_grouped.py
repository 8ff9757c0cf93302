"""Grouped routed experts: the (token, expert) pairs of a MoE layer sorted by expert, then one grouped GEMM per
projection over all experts (torchtitan's ``GroupedExperts`` over ``torch._grouped_mm``). No per-expert Python loop and
no host sync: counts, offsets and the permutation are computed on the device with static shapes.

The data flow for ``N`` tokens with ``k`` picks each (``P = N k`` pairs; pair ``p = n k + slot``), spec 5.3 steps 4-6:

1. :func:`expert_layout`: a stable sort of the ``P`` expert ids gives each pair its row in the grouped buffer (rows of
   expert 0 first, token order within an expert); ``offsets [E]`` int32 are the cumulative row ends that
   ``torch._grouped_mm`` takes. With ``align > 1`` each expert's group starts at a multiple of ``align`` rows (what
   FP8 grouped GEMMs ask for); the buffer then has the static ``R = P + E (align - 1)`` rows rounded up to a multiple
   of ``align`` (FP8's weight-gradient GEMM reads the rows transposed, ``[*, R]``: a row stride of 16 bytes), and rows
   that hold no pair are zero on input and never read on output.
2. :func:`permute_rows`: ``x[row(p)] = z[p // k]``. Its backward is a gather-sum over each token's ``k`` rows in fp32
   (deterministic, unlike an ``index_add_`` of bf16 rows with atomics).
3. :func:`grouped_mm` three times with the activation between (in ``kernels_torch.moe``).
4. :func:`combine_rows`: ``r[n] = sum_slot w[n, slot] * y[row(n k + slot)]`` with each expert output in the activation
   dtype (the rounding the checkpoint reference applies), weighted by the fp32 router weight and summed in fp32, in
   slot order (the readable loop sums in expert order: equal up to fp32 rounding). Backward: ``dy[row(p)] = w[p] dr[n]``
   in the activation dtype and ``dw[p] = <y[row(p)], dr[n]>`` in fp32.

Kernels: the gather-sums of 2 and 4 and the backward of 4 are Triton kernels on CUDA (and under ``TRITON_INTERPRET=1``
on a CPU, for tests), each with a torch twin of the same arithmetic (``kernel="torch"``, any device and fp64; it
materialises the ``[N, k, D]`` gathered rows). ``torch._grouped_mm`` runs on CUDA (bf16, fp16, fp32) and on the CPU (fp32,
bf16); :func:`grouped_mm` falls back to one ``F.linear`` per expert where it cannot (fp64, or rows whose stride is not
a multiple of 16 bytes), which reads the offsets on the host.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels_torch.common import compute_dtype
from kernels_torch.ops.custom import own

try:  # Triton is optional: the CPU CI machine has none; the torch twins work without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

__all__ = [
    "ExpertLayout",
    "expert_layout",
    "grouped_mm",
    "grouped_mm_supported",
    "permute_rows",
    "combine_rows",
    "unpermute_rows",
]

_TRITON_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class ExpertLayout(NamedTuple):
    """Where each (token, expert) pair sits in the expert-grouped buffer (from :func:`expert_layout`).

    ``row_of_pair [P]`` int64 (pair ``p = n k + slot`` -> its row), ``order [P]`` int64 (the pair at each sorted
    position: expert-major, token order within an expert), ``offsets [E]`` int32 (cumulative row ends of the groups,
    as ``torch._grouped_mm`` takes them), ``rows`` (``R``, the buffer's static row count), ``k`` (picks per token) and
    ``align`` (group starts are multiples of it)."""

    row_of_pair: torch.Tensor
    order: torch.Tensor
    offsets: torch.Tensor
    rows: int
    k: int
    align: int


def expert_layout(ids: torch.Tensor, num_experts: int, align: int = 1) -> ExpertLayout:
    """The grouped layout of ``ids`` ``[N, k]`` (expert of each pick, in ``[0, num_experts)``), computed on the
    device without a host sync: a stable sort by expert (token order within an expert), the per-expert counts by
    ``searchsorted`` on the sorted ids (``bincount`` would read the maximum on the host), and each group's start
    rounded up to a multiple of ``align``.

    Raises:
        ValueError: ``ids`` not 2-D integer, ``num_experts < 1`` or ``align < 1``. (Ids outside the range are not
            checked here: that would be a host sync; the router only makes valid ones.)
    """
    if ids.ndim != 2 or ids.is_floating_point() or ids.is_complex():
        raise ValueError(f"ids: got shape {tuple(ids.shape)} dtype {ids.dtype}, expected [N, k] integer expert ids")
    if num_experts < 1:
        raise ValueError(f"num_experts: got {num_experts}, expected a positive integer")
    if align < 1:
        raise ValueError(f"align: got {align}, expected a positive integer (rows per group start)")
    N, k = ids.shape
    P = N * k
    flat = ids.reshape(-1).long()  # [P]
    sorted_ids, order = torch.sort(flat, stable=True)  # order[j]: the pair at sorted position j
    bounds = torch.arange(num_experts + 1, device=ids.device, dtype=sorted_ids.dtype)
    starts = torch.searchsorted(sorted_ids, bounds)  # [E + 1]: first sorted position of each expert, then P
    counts = starts[1:] - starts[:-1]  # [E]
    if align == 1:
        group_start, ends, R = starts[:-1], starts[1:], P
        row_sorted = torch.arange(P, device=ids.device)
    else:
        padded = (counts + align - 1) // align * align  # [E]
        ends = torch.cumsum(padded, 0)  # [E]
        group_start = ends - padded
        # the buffer's rows: room for every group's padding, itself a multiple of align (FP8's grouped GEMM reads
        # the permuted rows transposed, [*, R], whose row stride in bytes must be a multiple of 16)
        R = (P + num_experts * (align - 1) + align - 1) // align * align
        row_sorted = group_start[sorted_ids] + torch.arange(P, device=ids.device) - starts[:-1][sorted_ids]  # [P]
    row_of_pair = torch.empty_like(row_sorted).scatter_(0, order, row_sorted)  # [P]: inverse of the sort
    return ExpertLayout(row_of_pair, order, ends.to(torch.int32), R, k, align)


# ---------------------------------------------------------------------------------------------- grouped GEMM


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> str | None:
    """Why ``torch._grouped_mm`` cannot take ``x [R, in]`` and ``w [E, out, in]`` (None when it can): a dtype it has
    no kernel for on this device, or rows whose stride is not a multiple of 16 bytes."""
    if not hasattr(torch, "_grouped_mm"):
        return "this torch has no torch._grouped_mm"
    ok = (torch.bfloat16, torch.float16, torch.float32) if x.is_cuda else (torch.bfloat16, torch.float32)
    if x.dtype not in ok or w.dtype != x.dtype:
        return f"x is {x.dtype} and w {w.dtype} on {x.device.type}, expected one dtype of {[str(d) for d in ok]}"
    if torch.compiler.is_compiling() and x.dtype != torch.bfloat16:  # its meta function (torch 2.13) takes bf16 only
        return f"x is {x.dtype}: torch._grouped_mm under torch.compile takes bfloat16 only"
    size = x.element_size()
    if (x.shape[-1] * size) % 16 or (w.shape[-2] * size) % 16:
        return f"in={x.shape[-1]}, out={w.shape[-2]}: rows must be multiples of 16 bytes for torch._grouped_mm"
    return None


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, kernel: str = "auto") -> torch.Tensor:
    """``y[rows of group e] = x[rows of group e] · w[e]ᵀ``: one GEMM per expert group, ``w`` in ``nn.Linear``
    orientation.

    Args:
        x: ``[R, in]`` rows grouped by expert (:func:`expert_layout`); w: ``[E, out, in]``; offsets: ``[E]`` int32
            cumulative row ends. Rows past ``offsets[-1]`` are not computed (their output is unspecified).
        kernel: ``"grouped_mm"`` (``torch._grouped_mm``, differentiable), ``"loop"`` (one ``F.linear`` per group;
            reads the offsets on the host) or ``"auto"`` (grouped where :func:`grouped_mm_supported`, else loop).

    Returns:
        ``[R, out]`` in ``x.dtype``.

    Raises:
        ValueError: shapes that disagree, or ``kernel="grouped_mm"`` on inputs it cannot take.
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[-1] != w.shape[-1] or offsets.shape != (w.shape[0],):
        raise ValueError(
            f"grouped_mm: x {tuple(x.shape)}, w {tuple(w.shape)}, offsets {tuple(offsets.shape)}; expected "
            "x [R, in], w [E, out, in], offsets [E]"
        )
    why = grouped_mm_supported(x, w)
    if kernel == "grouped_mm" and why is not None:
        raise ValueError(f"grouped_mm: kernel='grouped_mm' cannot run: {why}")
    if kernel not in ("auto", "grouped_mm", "loop"):
        raise ValueError(f"grouped_mm: kernel got {kernel!r}, expected 'auto', 'grouped_mm' or 'loop'")
    if kernel == "grouped_mm" or (kernel == "auto" and why is None):
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    ends = offsets.tolist()  # host read: the readable fallback only (fp64, unaligned rows)
    out = [F.linear(x[s:e], w[g]) for g, (s, e) in enumerate(zip([0, *ends[:-1]], ends))]
    tail = x.new_zeros(x.shape[0] - (ends[-1] if ends else 0), w.shape[1])
    return torch.cat([*out, tail])


# ---------------------------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _gather_sum_kernel(
        src_ptr, idx_ptr, w_ptr, out_ptr, D, K: tl.constexpr, HAS_W: tl.constexpr, BLOCK: tl.constexpr
    ):
        """out[n, d] = sum_slot (w[n k + slot] *) src[idx[n k + slot], d], accumulated in fp32."""
        n = tl.program_id(0)
        d = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = d < D
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for slot in range(K):  # slot order: the sum's order is fixed, so the result is bitwise reproducible
            row = tl.load(idx_ptr + n * K + slot).to(tl.int64)
            v = tl.load(src_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
            if HAS_W:
                v = v * tl.load(w_ptr + n * K + slot).to(tl.float32)
            acc += v
        tl.store(out_ptr + n.to(tl.int64) * D + d, acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _combine_bwd_kernel(
        y_ptr, dr_ptr, idx_ptr, w_ptr, dy_ptr, dw_ptr, D: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr
    ):
        """Per pair p = n k + slot: dy[idx[p]] = w[p] dr[n] (in dy's dtype), dw[p] = <y[idx[p]], dr[n]> (fp32)."""
        p = tl.program_id(0)
        n = p // K
        row = tl.load(idx_ptr + p).to(tl.int64)
        wp = tl.load(w_ptr + p).to(tl.float32)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, D, BLOCK):
            d = start + tl.arange(0, BLOCK)
            mask = d < D
            g = tl.load(dr_ptr + n.to(tl.int64) * D + d, mask=mask, other=0.0).to(tl.float32)
            yv = tl.load(y_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
            tl.store(dy_ptr + row * D + d, (wp * g).to(dy_ptr.dtype.element_ty), mask=mask)
            acc += yv * g
        tl.store(dw_ptr + p, tl.sum(acc, axis=0))


def _triton_ok(*ts: torch.Tensor) -> bool:
    """Triton kernels take these tensors: Triton importable, CUDA (or the interpreter), dtypes it handles."""
    if triton is None:
        return False
    if not (all(t.is_cuda for t in ts) or os.environ.get("TRITON_INTERPRET", "0") == "1"):
        return False
    return all(t.dtype in _TRITON_DTYPES for t in ts)


def _pick(kernel: str, *ts: torch.Tensor) -> str:
    if kernel not in ("auto", "triton", "torch"):
        raise ValueError(f"kernel: got {kernel!r}, expected 'auto', 'triton' or 'torch'")
    ok = _triton_ok(*ts)
    if kernel == "triton" and not ok:
        raise ValueError("kernel='triton' cannot run here (no Triton, not CUDA, or an fp64 tensor)")
    return "triton" if kernel == "triton" or (kernel == "auto" and ok) else "torch"


_BLOCK = 1024  # columns per program of the gather-sums (D = 3584 -> 4 programs per token)


def _gather_sum(src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor | None, k: int, out_dtype, kernel: str):
    """``out[n] = sum_slot (w[n, slot] *) src[idx[n k + slot]]`` in fp32 (fp64 for fp64 ``src``), ``[N, D]`` in
    ``out_dtype``."""
    N, D = idx.numel() // k, src.shape[-1]
    if kernel == "triton":
        src = src.contiguous()
        out = torch.empty(N, D, dtype=out_dtype, device=src.device)
        if N and D:
            grid = (N, triton.cdiv(D, _BLOCK))
            wt = w.reshape(-1).contiguous() if w is not None else idx
            _gather_sum_kernel[grid](src, idx, wt, out, D, K=k, HAS_W=w is not None, BLOCK=_BLOCK, num_warps=4)
        return out
    cd = torch.float64 if src.dtype == torch.float64 else torch.float32
    rows = src.index_select(0, idx).view(N, k, D)  # [N, k, D]
    out = torch.zeros(N, D, dtype=cd, device=src.device)
    for slot in range(k):  # the Triton kernel's order
        v = rows[:, slot].to(cd)
        out += v if w is None else v * w[:, slot, None].to(cd)
    return out.to(out_dtype)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, row_of_pair, order, R, k, kernel):
        ctx.save_for_backward(row_of_pair)
        ctx.args = (k, kernel, z.dtype)
        if R == row_of_pair.numel():  # no padding rows: row j holds the pair order[j], of token order[j] // k
            return z.index_select(0, torch.div(order, k, rounding_mode="floor"))
        src = torch.div(torch.arange(row_of_pair.numel(), device=z.device), k, rounding_mode="floor")
        x = z.new_zeros(R, z.shape[-1])
        return x.index_copy_(0, row_of_pair, z.index_select(0, src))

    @staticmethod
    def backward(ctx, dx):
        (row_of_pair,) = ctx.saved_tensors
        k, kernel, dtype = ctx.args
        return _gather_sum(dx, row_of_pair, None, k, dtype, _pick(kernel, dx)), None, None, None, None, None


def permute_rows(z: torch.Tensor, layout: ExpertLayout, *, kernel: str = "auto") -> torch.Tensor:
    """The expert-grouped input rows ``x [R, D]``: ``x[row(p)] = z[p // k]`` (zeros in padding rows).

    Args:
        z: ``[N, D]`` the latent rows of the ``N`` tokens; layout: from :func:`expert_layout` for their ids.
        kernel: the backward's gather-sum: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton where it runs).

    Returns:
        ``[R, D]`` in ``z.dtype``; its gradient reaches ``z`` summed over each token's ``k`` rows in fp32.
    """
    if torch.compiler.is_compiling():  # Triton launches and a custom backward: one op for the compiler
        return _permute_rows_op(z, layout.row_of_pair, layout.order, layout.rows, layout.k, kernel)
    return _PermuteRows.apply(z, layout.row_of_pair, layout.order, layout.rows, layout.k, kernel)


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, weights, row_of_pair, k, kernel):
        run = _pick(kernel, y, weights)
        ctx.save_for_backward(y, weights, row_of_pair)
        ctx.args = (k, run)
        out_dtype = torch.float64 if compute_dtype(y) == torch.float64 else torch.float32
        return _gather_sum(y, row_of_pair, weights, k, out_dtype, run)

    @staticmethod
    def backward(ctx, dr):
        y, weights, row_of_pair = ctx.saved_tensors
        k, run = ctx.args
        N, D = dr.shape
        dy = torch.zeros_like(y) if y.shape[0] != row_of_pair.numel() else torch.empty_like(y)
        if run == "triton" and _triton_ok(dr, y):
            dw = torch.empty(N * k, dtype=torch.float32, device=dr.device)
            if N and D:
                _combine_bwd_kernel[(N * k,)](
                    y, dr.contiguous(), row_of_pair, weights.reshape(-1).contiguous(), dy, dw, D,
                    K=k, BLOCK=_BLOCK, num_warps=4,
                )  # fmt: skip
            return dy, dw.view(N, k).to(weights.dtype), None, None, None
        cd = dr.dtype
        rows = y.index_select(0, row_of_pair).view(N, k, D).to(cd)  # [N, k, D]
        dy.index_copy_(0, row_of_pair, (weights[..., None].to(cd) * dr[:, None, :]).reshape(N * k, D).to(y.dtype))
        dw = (rows * dr[:, None, :]).sum(-1)  # [N, k]
        return dy, dw.to(weights.dtype), None, None, None


def combine_rows(y: torch.Tensor, weights: torch.Tensor, layout: ExpertLayout, *, kernel: str = "auto") -> torch.Tensor:
    """The weighted sum of each token's expert outputs: ``r[n] = sum_slot w[n, slot] · y[row(n k + slot)]``.

    Args:
        y: ``[R, D]`` expert outputs in the activation dtype, grouped as ``layout``; weights: ``[N, k]`` the router
            weights (fp32). kernel: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton where it runs).

    Returns:
        ``[N, D]`` fp32 (fp64 for fp64 ``y``), summed in slot order. Gradients: ``dy`` in ``y.dtype`` (zeros in
        padding rows), ``dw`` in ``weights.dtype``.

    Raises:
        ValueError: ``weights`` not ``[N, k]`` for the layout's ``P = N k`` pairs.
    """
    if weights.ndim != 2 or weights.shape[1] != layout.k or weights.numel() != layout.row_of_pair.numel():
        raise ValueError(
            f"combine_rows: weights {tuple(weights.shape)}, expected [N, {layout.k}] for "
            f"{layout.row_of_pair.numel()} pairs"
        )
    if torch.compiler.is_compiling():  # Triton launches and a custom backward: one op for the compiler
        return _combine_rows_op(y, weights, layout.row_of_pair, layout.k, kernel)
    return _CombineRows.apply(y, weights, layout.row_of_pair, layout.k, kernel)


def unpermute_rows(y: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """Each pair's own output row, in pair order: ``out[p] = y[row(p)]`` (``[P, D]``, ``y.dtype``); for ``k = 1``
    (expert parallelism's received rows) this is the inverse of :func:`permute_rows`. Backward: a scatter with no
    repeated index (deterministic)."""
    return y.index_select(0, layout.row_of_pair)


# ---------------------------------------------------------------------------------------------- custom ops
# permute_rows and combine_rows as kimi:: ops for torch.compile (kernels_torch.ops.custom): the same functions, one
# node each for the compiler (their Triton launches and custom backwards stay out of the traced graph); their
# closed-form backwards are ops too (kimi::gather_sum, kimi::combine_rows_backward).


@torch.library.custom_op("kimi::permute_rows", mutates_args=())
def _permute_rows_op(
    z: torch.Tensor, row_of_pair: torch.Tensor, order: torch.Tensor, rows: int, k: int, kernel: str
) -> torch.Tensor:
    with torch.no_grad():
        return own(_PermuteRows.apply(z, row_of_pair, order, rows, k, kernel), (z,))


@_permute_rows_op.register_fake
def _(z, row_of_pair, order, rows, k, kernel):
    return z.new_empty(rows, z.shape[-1])


@torch.library.custom_op("kimi::gather_sum", mutates_args=())
def _gather_sum_op(src: torch.Tensor, idx: torch.Tensor, k: int, out_dtype: torch.dtype, kernel: str) -> torch.Tensor:
    return own(_gather_sum(src, idx, None, k, out_dtype, _pick(kernel, src)), (src,))


@_gather_sum_op.register_fake
def _(src, idx, k, out_dtype, kernel):
    return src.new_empty(idx.shape[0] // k, src.shape[-1], dtype=out_dtype)


def _permute_setup(ctx, inputs, output):
    z, row_of_pair, order, rows, k, kernel = inputs
    ctx.save_for_backward(row_of_pair)
    ctx.args = (k, z.dtype, kernel)


def _permute_backward(ctx, dx):
    (row_of_pair,) = ctx.saved_tensors
    k, dtype, kernel = ctx.args
    return _gather_sum_op(dx, row_of_pair, k, dtype, kernel), None, None, None, None, None


_permute_rows_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op("kimi::combine_rows", mutates_args=())
def _combine_rows_op(
    y: torch.Tensor, weights: torch.Tensor, row_of_pair: torch.Tensor, k: int, kernel: str
) -> torch.Tensor:
    with torch.no_grad():
        return own(_CombineRows.apply(y, weights, row_of_pair, k, kernel), (y, weights))


@_combine_rows_op.register_fake
def _(y, weights, row_of_pair, k, kernel):
    return y.new_empty(weights.shape[0], y.shape[-1], dtype=compute_dtype(y))


@torch.library.custom_op("kimi::combine_rows_backward", mutates_args=())
def _combine_rows_backward_op(
    dr: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, row_of_pair: torch.Tensor, k: int, kernel: str
) -> tuple[torch.Tensor, torch.Tensor]:
    ctx = SimpleNamespace(saved_tensors=(y, weights, row_of_pair), args=(k, _pick(kernel, y, weights)))
    dy, dw, *_ = _CombineRows.backward(ctx, dr)  # the eager backward, called on the saved tensors
    return own(dy, (dr, y, weights)), own(dw, (dr, y, weights))


@_combine_rows_backward_op.register_fake
def _(dr, y, weights, row_of_pair, k, kernel):
    return torch.empty_like(y), torch.empty_like(weights)


def _combine_setup(ctx, inputs, output):
    y, weights, row_of_pair, k, kernel = inputs
    ctx.save_for_backward(y, weights, row_of_pair)
    ctx.args = (k, kernel)


def _combine_backward(ctx, dr):
    y, weights, row_of_pair = ctx.saved_tensors
    dy, dw = _combine_rows_backward_op(dr, y, weights, row_of_pair, *ctx.args)
    return dy, dw, None, None, None


_combine_rows_op.register_autograd(_combine_backward, setup_context=_combine_setup)

CUSTOM_OPS = (_permute_rows_op, _gather_sum_op, _combine_rows_op, _combine_rows_backward_op)  # opcheck'd in tests
