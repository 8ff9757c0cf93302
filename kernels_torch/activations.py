"""The GLU activations in plain torch ops (spec 5.1): SiTU-GLU and SiLU-GLU, the readable twins of
``reference_jax.moe.situ`` / ``glu_act``. A leaf module: the layers (``kernels_torch.moe``) and the fused op's torch
kernel (``kernels_torch.ops.situ``) both import it, so neither imports the other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels_torch.common import compute_dtype
from kimi.config import KimiConfig

__all__ = ["situ", "glu_act"]


def situ(a: torch.Tensor, b: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """SiTU-GLU (spec 5.1): ``[beta·tanh(a/beta)·sigmoid(a)] · [linear_beta·tanh(b/linear_beta)]``.

    ``a``, ``b``: ``[..., I]`` gate / up pre-activations. ``linear_beta=None`` uses plain ``b``. Returns ``[..., I]``
    in ``a.dtype`` (fp32 math, fp64 for fp64 input, one rounding at the end).

    Raises:
        ValueError: shapes differ, ``beta <= 0`` or ``linear_beta <= 0``.
    """
    if a.shape != b.shape:
        raise ValueError(f"situ: a has shape {tuple(a.shape)} and b {tuple(b.shape)}, expected equal shapes")
    if not beta > 0:
        raise ValueError(f"situ: beta got {beta!r}, expected a positive number (activation_situ_beta)")
    if linear_beta is not None and not linear_beta > 0:
        raise ValueError(f"situ: linear_beta got {linear_beta!r}, expected a positive number or None")
    cd = compute_dtype(a, b)
    af, bf = a.to(cd), b.to(cd)
    gate = beta * torch.tanh(af / beta) * torch.sigmoid(af)  # SiLU with x soft-capped to (-beta, beta)
    up = bf if linear_beta is None else linear_beta * torch.tanh(bf / linear_beta)
    return (gate * up).to(a.dtype)


def glu_act(a: torch.Tensor, b: torch.Tensor, config: KimiConfig) -> torch.Tensor:
    """SiTU (``hidden_act='situ'``) or SiLU-GLU ``silu(a) * b`` (``'silu'``, Kimi-Linear); fp32 math, ``a.dtype`` out.

    Raises:
        ValueError: an unknown ``hidden_act`` (or the errors of :func:`situ`).
    """
    if config.hidden_act == "situ":
        return situ(a, b, config.activation_situ_beta, config.activation_situ_linear_beta)
    if config.hidden_act == "silu":
        cd = compute_dtype(a, b)
        return (F.silu(a.to(cd)) * b.to(cd)).to(a.dtype)
    raise ValueError(f"hidden_act: got {config.hidden_act!r}, expected 'situ' or 'silu'")
