"""KDA's short convolution in Triton: depthwise causal conv1d + SiLU over packed documents, one launch forward and
one backward (the ``cudnn`` backend's q/k/v convolutions, ``kernels_torch.kda._kda_layer_fast``).

Why: the H200 profile of one KDA layer fwd+bwd at 8K tokens (pass 9a, ``benchmarks/results/kda_layer_pass9a.json``)
gave fla's ``causal_conv1d`` 3.3 ms of 37.6 (2.4 ms of it its backward) for three ``[8192, 12288]`` bf16 tensors,
about five times what their bytes need at the memory bandwidth; at 32K, 13.5 of 156 ms.

Math (spec 2.2 step 2; the readable twin is ``kernels_torch.kda.short_conv``, which the tests compare against):
``pre[t, c] = sum_i w[c, i] * x[t - (W-1) + i, c]`` (tap ``W-1`` is the current token), ``y = silu(pre)``, in fp32,
y stored in x's dtype. A tap before its document's start reads the conv state ``[N, C, W-1]`` (the last ``W-1``
pre-conv inputs before the document, oldest first) or zero without one. Backward: ``dpre = dy * silu'(pre)`` with pre
recomputed from x, ``dx[u] = sum_i w[i] * dpre[u + (W-1) - i]`` over the outputs of u's own document, ``dw[c, i] =
sum_t dpre[t, c] * x[t - (W-1) + i, c]`` (state taps included), reduced over row blocks in torch (no atomics:
bitwise reproducible). The state gets no gradient (a state that requires one is refused: use the eager layer).

Layout: x ``[B, T, C]`` (contiguous; B sequences, or B == 1 with ``cu_seqlens``), weight ``[C, W]`` or ``[C, 1, W]``
(fp32 in the checkpoint). CUDA tensors, or any tensor under Triton's interpreter (``TRITON_INTERPRET=1`` before triton
is imported), which is how the CPU tests run these kernels.
"""

from __future__ import annotations

import torch

from kernels_torch.common import check_cu_seqlens
from kernels_torch.ops.kda_prep import triton_prep_unavailable

try:  # Triton is optional: the CPU CI machine has none.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None
    tl = None

__all__ = ["short_conv_silu", "TRITON_CONFIG"]

# block_t rows x block_c channels per program; the backward walks bwd_tiles row blocks per program, so its partial dw
# sums are [cdiv(rows, block_t * bwd_tiles), C, W] fp32.
TRITON_CONFIG = dict(block_t=32, block_c=64, warps=4, bwd_tiles=4)

if triton is not None:

    @triton.jit
    def _tap(x_ptr, s_ptr, src, rows, start, doc, cols, mask, C, HAS_STATE: tl.constexpr, W: tl.constexpr):
        """x at rows ``src`` [BT] (fp32 [BT, BC]); a row before its document's ``start`` reads the state or 0."""
        inside = src >= start
        v = tl.load(x_ptr + src.to(tl.int64)[:, None] * C + cols[None, :], mask=mask & inside[:, None], other=0.0)
        v = v.to(tl.float32)
        if HAS_STATE:
            j = src - start + (W - 1)  # the state window's column for a tap before the start: 0 .. W-2
            so = (doc.to(tl.int64) * C)[:, None] * (W - 1) + cols[None, :] * (W - 1) + j[:, None]
            sv = tl.load(s_ptr + so, mask=mask & (~inside)[:, None], other=0.0).to(tl.float32)
            v = tl.where(inside[:, None], v, sv)
        return v

    @triton.jit
    def _conv_fwd_kernel(
        x_ptr, w_ptr, s_ptr, start_ptr, doc_ptr, y_ptr, M, C,
        HAS_STATE: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BT + tl.arange(0, BT)
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        rmask, cmask = rows < M, cols < C
        mask = rmask[:, None] & cmask[None, :]
        start = tl.load(start_ptr + rows, mask=rmask, other=0)
        doc = start  # unused without a state
        if HAS_STATE:
            doc = tl.load(doc_ptr + rows, mask=rmask, other=0)
        acc = tl.zeros((BT, BC), dtype=tl.float32)
        for i in tl.static_range(W):
            w_i = tl.load(w_ptr + cols * W + i, mask=cmask, other=0.0).to(tl.float32)
            acc += _tap(x_ptr, s_ptr, rows - (W - 1) + i, rows, start, doc, cols, mask, C, HAS_STATE, W) * w_i[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _conv_bwd_kernel(
        x_ptr, w_ptr, s_ptr, start_ptr, end_ptr, doc_ptr, dy_ptr, dx_ptr, dw_ptr, M, C,
        HAS_STATE: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, TILES: tl.constexpr,
    ):  # fmt: skip
        cols = tl.program_id(1) * BC + tl.arange(0, BC)
        cmask = cols < C
        dw = tl.zeros((BC, W), dtype=tl.float32)  # this program's partial sums of dw[c, i]
        taps = tl.arange(0, W)
        for tile in tl.static_range(TILES):
            rows = (tl.program_id(0) * TILES + tile) * BT + tl.arange(0, BT)
            rmask = rows < M
            mask = rmask[:, None] & cmask[None, :]
            start = tl.load(start_ptr + rows, mask=rmask, other=0)
            end = tl.load(end_ptr + rows, mask=rmask, other=0)
            doc = start  # unused without a state
            if HAS_STATE:
                doc = tl.load(doc_ptr + rows, mask=rmask, other=0)
            dx = tl.zeros((BT, BC), dtype=tl.float32)
            for s in tl.static_range(W):  # the output at row u + s, if it is in u's document, reads x[u] at tap W-1-s
                r = rows + s
                live = mask & (r < end)[:, None]
                pre = tl.zeros((BT, BC), dtype=tl.float32)
                for i in tl.static_range(W):
                    w_i = tl.load(w_ptr + cols * W + i, mask=cmask, other=0.0).to(tl.float32)
                    pre += (
                        _tap(x_ptr, s_ptr, r - (W - 1) + i, rows, start, doc, cols, live, C, HAS_STATE, W)
                        * w_i[None, :]
                    )
                dy = tl.load(dy_ptr + r.to(tl.int64)[:, None] * C + cols[None, :], mask=live, other=0.0).to(tl.float32)
                sig = tl.sigmoid(pre)
                dpre = dy * sig * (1.0 + pre * (1.0 - sig))
                w_s = tl.load(w_ptr + cols * W + (W - 1 - s), mask=cmask, other=0.0).to(tl.float32)
                dx += dpre * w_s[None, :]
                if s == 0:  # dw[c, i] += sum_u dpre[u, c] * x[u - (W-1) + i, c]
                    for i in tl.static_range(W):
                        xv = _tap(x_ptr, s_ptr, rows - (W - 1) + i, rows, start, doc, cols, mask, C, HAS_STATE, W)
                        part = tl.sum(dpre * xv, axis=0)  # [BC]
                        dw += tl.where(taps[None, :] == i, part[:, None], 0.0)
            tl.store(dx_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        offs = tl.program_id(0).to(tl.int64) * C * W + cols[:, None] * W + taps[None, :]
        tl.store(dw_ptr + offs, dw, mask=cmask[:, None])


def _row_bounds(M: int, T: int, cu: torch.Tensor | None, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per flattened row: its document's start, end and index (int32 ``[M]`` each, on ``device``)."""
    if cu is None:
        cu = torch.arange(0, M + 1, T, device=device)
    cu = cu.to(device=device, dtype=torch.int64)
    rows = torch.arange(M, device=device)
    doc = torch.searchsorted(cu[1:], rows, right=True)
    return cu[doc].to(torch.int32), cu[doc + 1].to(torch.int32), doc.to(torch.int32)


def _final_state(x2: torch.Tensor, state: torch.Tensor | None, cu: torch.Tensor, W: int) -> torch.Tensor:
    """The last ``W-1`` pre-conv inputs of each document ``[N, C, W-1]`` (state columns where a document is short)."""
    N, C = cu.numel() - 1, x2.shape[1]
    start, end = cu[:-1, None], cu[1:, None]
    pos = end - (W - 1) + torch.arange(W - 1, device=x2.device)[None, :]  # [N, W-1]
    inside = pos >= start
    vals = x2[pos.clamp(min=0)]  # [N, W-1, C]
    if state is not None:
        j = (pos - start + (W - 1)).clamp(0, W - 2)
        from_state = state.gather(2, j[:, None, :].expand(N, C, W - 1)).transpose(1, 2)  # [N, W-1, C]
        vals = torch.where(inside[..., None], vals, from_state)
    else:
        vals = vals.masked_fill(~inside[..., None], 0)
    return vals.transpose(1, 2).contiguous()


class _ShortConvSiLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, w, state, start, end, doc):
        M, C = x2.shape
        W = w.shape[1]
        cfg = dict(TRITON_CONFIG)
        y = torch.empty_like(x2)
        grid = (triton.cdiv(M, cfg["block_t"]), triton.cdiv(C, cfg["block_c"]))
        s_arg = state if state is not None else x2
        _conv_fwd_kernel[grid](
            x2, w, s_arg, start, doc, y, M, C,
            HAS_STATE=state is not None, W=W, BT=cfg["block_t"], BC=cfg["block_c"], num_warps=cfg["warps"],
        )  # fmt: skip
        ctx.save_for_backward(x2, w, state, start, end, doc)
        ctx.cfg = cfg
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, state, start, end, doc = ctx.saved_tensors
        cfg = ctx.cfg
        M, C = x2.shape
        W = w.shape[1]
        dy = dy.contiguous()
        dx = torch.empty_like(x2)
        rows_per_program = cfg["block_t"] * cfg["bwd_tiles"]
        grid = (triton.cdiv(M, rows_per_program), triton.cdiv(C, cfg["block_c"]))
        dw_part = torch.empty(grid[0], C, W, dtype=torch.float32, device=x2.device)
        s_arg = state if state is not None else x2
        _conv_bwd_kernel[grid](
            x2, w, s_arg, start, end, doc, dy, dx, dw_part, M, C,
            HAS_STATE=state is not None, W=W, BT=cfg["block_t"], BC=cfg["block_c"], TILES=cfg["bwd_tiles"],
            num_warps=cfg["warps"],
        )  # fmt: skip
        return dx, dw_part.sum(0).to(w.dtype), None, None, None, None


def short_conv_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv1d + SiLU in Triton, with autograd for x and the weight (module docstring; same function
    and arguments as ``kernels_torch.kda.short_conv``).

    Args:
        x: ``[B, T, C]`` CUDA (bf16 in the layer). weight: ``[C, W]`` or ``[C, 1, W]`` (fp32).
        cu_seqlens: ``[N+1]`` (B == 1; int32 or int64, any device) or None (B sequences).
        conv_state: ``[N, C, W-1]`` the last ``W-1`` inputs before each document, or None (zeros); taken in x's dtype,
            as the eager function does; it must not require a gradient.

    Returns:
        ``(y [B, T, C] in x.dtype, new_conv_state [N, C, W-1] in x.dtype)``.

    Raises:
        ValueError: shapes or ``cu_seqlens``; RuntimeError: no Triton / not a CUDA tensor, or a ``conv_state`` that
            requires a gradient.
    """
    why = triton_prep_unavailable(x)
    if why is not None:
        raise RuntimeError(f"short_conv_silu: the Triton short convolution cannot run: {why}")
    if x.ndim != 3:
        raise ValueError(f"x: got shape {tuple(x.shape)}, expected [B, T, C]")
    B, T, C = x.shape
    w = weight[:, 0, :] if weight.ndim == 3 and weight.shape[1] == 1 else weight
    if w.ndim != 2 or w.shape[0] != C:
        raise ValueError(f"weight: got shape {tuple(weight.shape)}, expected [C, W] or [C, 1, W] with C={C}")
    W = w.shape[1]
    if W < 2 or W & (W - 1):
        raise ValueError(f"weight: got kernel width W={W}, expected a power of two >= 2 (Triton's tap axis)")
    cu = None
    if cu_seqlens is not None:
        check_cu_seqlens(torch.as_tensor(cu_seqlens).cpu(), T, B)
        cu = torch.as_tensor(cu_seqlens).to(device=x.device, dtype=torch.int64)
    N = B if cu is None else cu.numel() - 1
    if conv_state is not None:
        if tuple(conv_state.shape) != (N, C, W - 1):
            raise ValueError(
                f"conv_state: got shape {tuple(conv_state.shape)}, expected [N, C, W-1]=[{N}, {C}, {W - 1}]"
            )
        if conv_state.requires_grad and torch.is_grad_enabled():
            raise RuntimeError(
                "conv_state: requires a gradient, which the Triton short convolution does not compute; "
                "use kernels_torch.kda.short_conv"
            )
        conv_state = conv_state.detach().to(x.dtype).contiguous()
    x2 = x.contiguous().view(B * T, C)
    start, end, doc = _row_bounds(B * T, T, cu, x.device)
    y = _ShortConvSiLU.apply(x2, w.contiguous(), conv_state, start, end, doc)
    cu_full = cu if cu is not None else torch.arange(0, B * T + 1, T, device=x.device)
    return y.view(B, T, C), _final_state(x2.detach(), conv_state, cu_full, W)
