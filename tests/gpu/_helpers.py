"""Helpers shared by the GPU tests (``from _helpers import init_layer, rel_or_scaled``: pytest puts ``tests/gpu`` on
the path; ``rel`` itself is ``tests/helpers.py``'s). No test lives here; importing it needs no GPU."""

from __future__ import annotations

import math

import torch
from helpers import rel
from torch import nn


def rel_or_scaled(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    """:func:`rel` where the reference ``b`` is not all zero; where it is (a gradient the math makes exactly zero,
    e.g. a KDA gate's at T = 1 from a zero state, which only multiplies that state), ``||a|| / ||scale||``: the
    kernel's rounding in units of the same tensor's size in a case where it is not zero (``scale``, a reference of
    ``a``'s shape). ``inf`` for a non-finite ``a``, as :func:`rel`.

    Raises:
        ValueError: ``b`` is zero and ``scale`` is zero or not finite (no unit to measure in)."""
    if bool(b.detach().ne(0).any()) or not bool(torch.isfinite(a.detach()).all()):
        return rel(a, b)
    s = float(scale.detach().double().norm())
    if not 0.0 < s < math.inf:
        raise ValueError(f"scale: got a tensor of norm {s}, expected a finite, non-zero reference of the same quantity")
    return float(a.detach().double().norm()) / s


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
