"""Helpers shared by the GPU tests (``from _helpers import rel, init_layer``: pytest puts ``tests/gpu`` on the path,
as for ``test_gpu_hardening``'s imports). No test lives here; importing it needs no GPU."""

from __future__ import annotations

import torch
from torch import nn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (Frobenius, in fp64; ``||b||`` floored at 1e-30 so an all-zero ``b`` gives a huge
    error, never a division by zero). Detaches both."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def init_layer(module: nn.Module, seed: int) -> None:
    """Fresh random weights (CPU generator ``seed``), in place: norm weights ``1 + 0.1 N(0, 1)``, norm biases
    ``0.1 N(0, 1)``, matrices ``N(0, 1) / sqrt(in_features)``; anything else (KDA's ``A_log``, ``dt_bias``, conv
    weights) keeps its init. The draws follow ``named_parameters`` order, so a seed gives the same weights as the
    per-file copies this replaces (an MLA layer has only norms and matrices)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
