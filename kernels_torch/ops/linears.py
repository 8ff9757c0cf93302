"""Projections without the elementwise traffic around them (plain torch).

* :func:`shared_input_linears`: several projections of one input, with the input gradient summed inside the GEMMs.
* :func:`headwise_matmul`: one matrix per head (MLA's absorbed ``W_UK`` / ``W_UV``) on strided views, no copies.

Why the first: a layer that feeds one activation ``x`` to n projections (KDA: q, k, v, the gate's ``f_a``, beta's ``b``,
the output gate's ``g_a``) gets n gradients for ``x`` in the backward, and autograd adds them with n - 1 elementwise
kernels, each reading two ``[T, D]`` tensors and writing one (the KDA layer's profile on the H200, 2026-12-01: 0.40 ms
at 8K tokens, 1.61 ms at 32K; benchmarks/README.md). :func:`shared_input_linears` computes the same outputs and
gradients, but accumulates ``dx`` in the GEMMs' epilogue (``dx.addmm_(dy_i, W_i)``, beta = 1), which costs one extra
read of ``dx`` inside each GEMM and no separate kernel. Rounding: ``dx`` is rounded to x's dtype after each GEMM, as
autograd's running sum of bf16 gradients is.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

__all__ = ["shared_input_linears", "headwise_matmul"]


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor):
        ws = [w.to(x.dtype) for w in weights]  # the activation dtype, as ``F.linear(x, w.to(x.dtype))``
        ctx.save_for_backward(x, *ws)
        ctx.weight_dtypes = [w.dtype for w in weights]
        ctx.set_materialize_grads(False)  # an unused output's weight gets no gradient (None), as with F.linear
        return tuple(torch.nn.functional.linear(x, w) for w in ws)

    @staticmethod
    @once_differentiable  # a second derivative raises: the saved weights are casts made without autograd
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        M = math.prod(x.shape[:-1])
        x2 = x.reshape(M, x.shape[-1])  # [M, D]
        dx = None
        dws = []
        for i, (dy, w) in enumerate(zip(dys, ws)):
            if dy is None:
                dws.append(None)
                continue
            dy2 = dy.reshape(M, w.shape[0])  # [M, N_i]
            if ctx.needs_input_grad[0]:
                if dx is None:
                    dx = dy2 @ w  # [M, D]
                else:
                    dx.addmm_(dy2, w)  # dx += dy_i W_i, summed in the GEMM's epilogue
            dws.append(dy2.t() @ x2 if ctx.needs_input_grad[1 + i] else None)  # [N_i, D]
        dws = [None if g is None else g.to(dt) for g, dt in zip(dws, ctx.weight_dtypes)]
        # dx is None only when x needs no gradient: autograd calls backward with at least one dy defined
        return (None if dx is None else dx.reshape(x.shape), *dws)


def shared_input_linears(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w.to(x.dtype)) for w in weights)``, with one input-gradient buffer that every projection's
    backward GEMM adds into (no elementwise sums of the ``x`` gradients).

    Args:
        x: ``[..., D]`` activations (bf16 in the layers; any float dtype).
        weights: ``[N_i, D]`` each, any float dtype (cast to ``x.dtype`` for the product, as ``_linear``; the weight
            gradients come back in each weight's own dtype).

    Returns:
        ``[..., N_i]`` per weight, in ``x.dtype``. First derivatives only (a double backward raises); a weight whose
        output takes no part in the loss gets no gradient (None).

    Raises:
        ValueError: an empty ``weights``, or a weight that is not 2-D with ``D`` columns (named by its position).
    """
    weights = list(weights)
    if not weights:
        raise ValueError("weights: got an empty list, expected at least one [N, D] weight")
    D = x.shape[-1]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != D:
            raise ValueError(f"weights[{i}]: got shape {tuple(w.shape)}, expected [N, {D}] (x's last axis)")
    return _SharedInputLinears.apply(x, *weights)


class _HeadwiseMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor):
        ctx.w_dtype = w.dtype
        w = w.to(x.dtype)
        ctx.save_for_backward(x, w)
        out = x.new_empty(*x.shape[:2], w.shape[2])
        # batch over heads on [H, N, *] views: cuBLAS reads and writes the [N, H, *] memory with its own strides
        torch.bmm(x.transpose(0, 1), w, out=out.transpose(0, 1))
        return out

    @staticmethod
    @once_differentiable  # bmm with out= has no autograd: a second derivative raises
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx = dw = None
        dy_h = dy.transpose(0, 1)  # [H, N, O]
        if ctx.needs_input_grad[0]:
            dx = x.new_empty(x.shape)
            torch.bmm(dy_h, w.transpose(1, 2), out=dx.transpose(0, 1))  # dx[n, h] = dy[n, h] W[h]^T
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(x.transpose(0, 1).transpose(1, 2), dy_h).to(ctx.w_dtype)  # dW[h] = x[:, h]^T dy[:, h]
        return dx, dw


def headwise_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``einsum("nhi,hio->nho", x, w)`` (one matrix per head: MLA's absorbed ``W_UK`` / ``W_UV``, spec 3.3) without
    moving a byte: forward and backward are head-batched ``torch.bmm`` calls on ``[H, N, *]`` transposed views, which
    cuBLAS reads and writes with their strides. ``torch.einsum`` permutes x (and its gradient) to ``[H, N, *]`` with
    strided copies instead: 39 ms of copy kernels in one DSA layer's fwd+bwd at 64K tokens on the H200 (profiled
    2026-12-01, ``benchmarks/results/dsa_vs_dense_layer_pass11.log``).

    Args:
        x: ``[N, H, I]``; its last axis contiguous (any row and head strides, e.g. a slice of a wider tensor).
        w: ``[H, I, O]``, any float dtype (cast to ``x.dtype``; its gradient comes back in its own dtype).

    Returns:
        ``[N, H, O]`` contiguous, ``x.dtype``. First derivatives only (a double backward raises).

    Raises:
        ValueError: shapes that do not chain (naming both), or an x whose last axis is not contiguous.
    """
    if x.dim() != 3 or w.dim() != 3 or w.shape[0] != x.shape[1] or w.shape[1] != x.shape[2]:
        raise ValueError(
            f"headwise_matmul: got x {tuple(x.shape)} and w {tuple(w.shape)}, expected [N, H, I], [H, I, O]"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"headwise_matmul: x's last axis has stride {x.stride(-1)}, expected 1")
    return _HeadwiseMatmul.apply(x, w)
