"""Several projections of one input, with the input gradient summed inside the GEMMs (issue 15).

A layer that feeds one activation ``x`` to n projections (KDA: q, k, v, the gate's ``f_a``, beta's ``b``, the output
gate's ``g_a``) gets n gradients for ``x`` in the backward, and autograd adds them with n - 1 elementwise kernels,
each reading two ``[T, D]`` tensors and writing one (pass 10 profile of the KDA layer: 0.40 ms at 8K tokens, 1.61 ms
at 32K). :func:`shared_input_linears` computes the same outputs and gradients, but accumulates ``dx`` in the GEMMs'
epilogue (``dx.addmm_(dy_i, W_i)``, beta = 1), which costs one extra read of ``dx`` inside each GEMM and no separate
kernel. Rounding: ``dx`` is rounded to x's dtype after each GEMM, as autograd's running sum of bf16 gradients is.
"""

from __future__ import annotations

import torch

__all__ = ["shared_input_linears"]


class _SharedInputLinears(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, *weights: torch.Tensor):
        ws = [w.to(x.dtype) for w in weights]  # the activation dtype, as ``F.linear(x, w.to(x.dtype))``
        ctx.save_for_backward(x, *ws)
        ctx.weight_dtypes = [w.dtype for w in weights]
        return tuple(torch.nn.functional.linear(x, w) for w in ws)

    @staticmethod
    def backward(ctx, *dys):
        x, *ws = ctx.saved_tensors
        x2 = x.reshape(-1, x.shape[-1])  # [M, D]
        dx = None
        dws = []
        for i, (dy, w) in enumerate(zip(dys, ws)):
            if dy is None:
                dws.append(None)
                continue
            dy2 = dy.reshape(-1, dy.shape[-1])  # [M, N_i]
            if ctx.needs_input_grad[0]:
                if dx is None:
                    dx = dy2 @ w  # [M, D]
                else:
                    dx.addmm_(dy2, w)  # dx += dy_i W_i, summed in the GEMM's epilogue
            dws.append(dy2.t() @ x2 if ctx.needs_input_grad[1 + i] else None)  # [N_i, D]
        dws = [None if g is None else g.to(dt) for g, dt in zip(dws, ctx.weight_dtypes)]
        if dx is not None:
            dx = dx.reshape(x.shape)
        elif ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x)
        return (dx, *dws)


def shared_input_linears(x: torch.Tensor, weights: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w.to(x.dtype)) for w in weights)``, with one input-gradient buffer that every projection's
    backward GEMM adds into (no elementwise sums of the ``x`` gradients).

    Args:
        x: ``[..., D]`` activations (bf16 in the layers; any float dtype).
        weights: ``[N_i, D]`` each, any float dtype (cast to ``x.dtype`` for the product, as ``_linear``; the weight
            gradients come back in each weight's own dtype).

    Returns:
        ``[..., N_i]`` per weight, in ``x.dtype``.

    Raises:
        ValueError: an empty ``weights``, or a weight that is not 2-D with ``D`` columns (named by its position).
    """
    if not weights:
        raise ValueError("weights: got an empty list, expected at least one [N, D] weight")
    D = x.shape[-1]
    for i, w in enumerate(weights):
        if w.dim() != 2 or w.shape[1] != D:
            raise ValueError(f"weights[{i}]: got shape {tuple(w.shape)}, expected [N, {D}] (x's last axis)")
    return _SharedInputLinears.apply(x, *weights)
