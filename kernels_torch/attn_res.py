"""Block Attention Residuals (AttnRes): the depth-mixing operator, PyTorch twin of ``reference_jax.attn_res``.

Only the operator; the block recurrence and the ``*_res_norm`` / ``*_res_proj`` parameters belong to the model
assembler. See ``reference_jax.attn_res`` for the recurrence of spec 5.4 and a worked example of which layers write
blocks (``tiny``: 0, 4, 8 -> 4 sources in the output mix; K3: 0, 12, ..., 84 -> 9 sources).
"""

from __future__ import annotations

from typing import Sequence

import torch

from kernels_torch.common import compute_dtype

__all__ = ["attn_res_weights", "attn_res_mix"]


def _stack(sources: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    if isinstance(sources, (list, tuple)):
        if not sources:
            raise ValueError("attn_res_mix: got no sources, expected at least one [B, T, D] tensor")
        first = sources[0]
        # compared pairwise, not as a set of shape tuples: hashing a symbolic size (torch.compile) would specialise it
        if any(s.shape != first.shape or s.dtype != first.dtype for s in sources[1:]):
            shapes = {tuple(s.shape) for s in sources}
            dtypes = {s.dtype for s in sources}
            raise ValueError(
                f"attn_res_mix: sources have shapes {sorted(shapes)} and dtypes {sorted(map(str, dtypes))}, "
                "expected one shape and one dtype"
            )
        return torch.stack(list(sources))  # [M, B, T, D]
    if sources.ndim < 2 or sources.shape[0] < 1:
        raise ValueError(f"attn_res_mix: stacked sources have shape {tuple(sources.shape)}, expected [M >= 1, ..., D]")
    return sources


def attn_res_weights(
    sources: Sequence[torch.Tensor] | torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """The depth-softmax ``π`` of :func:`attn_res_mix`: ``[M, B, T]`` fp32 (fp64 for fp64 sources), sums to 1 over M."""
    V = _stack(sources)  # [M, B, T, D]
    D = V.shape[-1]
    if tuple(norm_weight.shape) != (D,) or tuple(proj_weight.shape) not in ((1, D), (D,)):
        raise ValueError(
            f"attn_res_mix: norm_weight {tuple(norm_weight.shape)} and proj_weight "
            f"{tuple(proj_weight.shape)}, expected ({D},) and (1, {D})"
        )
    cd = compute_dtype(V)
    Vf = V.to(cd)
    key = Vf * torch.rsqrt(Vf.pow(2).mean(-1, keepdim=True) + eps)  # [M, B, T, D], no weight
    query = norm_weight.to(cd) * proj_weight.reshape(D).to(cd)  # [D]
    score = torch.einsum("m...d,d->m...", key, query)  # [M, B, T]; no temperature, no 1/sqrt(D)
    return torch.softmax(score, dim=0)  # over depth


def attn_res_mix(
    sources: Sequence[torch.Tensor] | torch.Tensor,
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """AttnRes ``Mix(V; n, p)`` (spec 5.4): ``out = Σ_i softmax_i(⟨rmsnorm(v_i), n ⊙ p⟩) · v_i``, fp32 math.

    Args:
        sources: M tensors ``[B, T, D]`` (stored blocks, then the current partial sum last) or ``[M, B, T, D]``.
        norm_weight: ``[D]`` (``*_res_norm.weight``); proj_weight: ``[1, D]`` (``*_res_proj.weight``; ``[D]`` ok).
        eps: key RMS-norm eps (``rms_norm_eps``).

    Returns:
        ``[B, T, D]`` in the sources' dtype; one source comes back unchanged.

    Raises:
        ValueError: no sources, mismatched shapes/dtypes, or weights not ``[D]`` / ``[1, D]``.
    """
    V = _stack(sources)  # [M, B, T, D]
    pi = attn_res_weights(V, norm_weight, proj_weight, eps)  # [M, B, T]
    if V.shape[0] == 1:
        return V[0]
    out = torch.einsum("m...,m...d->...d", pi, V.to(pi.dtype))  # [B, T, D]
    return out.to(V.dtype)
