"""Helpers shared by the GPU tests (``from _helpers import rel, init_layer``: pytest puts ``tests/gpu`` on the path,
as for ``test_gpu_hardening``'s imports). No test lives here; importing it needs no GPU."""

from __future__ import annotations

import math

import torch
from torch import nn


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``||a - b|| / ||b||`` (Frobenius, in fp64), detached. ``inf`` where ``a`` holds a NaN or an infinity, so a
    check written ``not rel(a, b) <= tol`` (or ``rel(a, b) <= tol``) fails on it; ``0.0`` where ``a`` and ``b`` are
    both exactly zero; ``inf`` where only ``b`` is (see :func:`rel_or_scaled` for references the math makes zero)."""
    a, b = a.detach().double(), b.detach().double()
    if not bool(torch.isfinite(a).all()):
        return math.inf
    num, den = float((a - b).norm()), float(b.norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


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
