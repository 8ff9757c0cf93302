"""The indexer's RoPE tables and argument checks, shared by both paths (numpy: no framework).

DeepSeek-V3.2's lightning indexer rotates the leading ``rope_dim`` of its 128 channels (spec 9 ``indexer_rope``).
The angles are computed once here in float64, so the JAX reference and the torch twin rotate by the same rounded
angles; each path applies them in its own framework (``reference_jax.indexer.apply_rope``,
``kernels_torch.indexer.apply_rope``).
"""

from __future__ import annotations

import numpy as np

__all__ = ["INDEXER_ROPE_THETA", "ROPE_STYLES", "document_positions", "rope_tables", "check_rope_args"]

INDEXER_ROPE_THETA = 10000.0  # DeepSeek-V3.2's rope_theta (no YaRN scaling here)
ROPE_STYLES = ("none", "half", "interleaved")


def document_positions(T: int, cu: np.ndarray | None) -> np.ndarray:
    """Position of every token inside its document, ``[T]`` int64: ``t`` without ``cu``, ``t - cu[n]`` in document
    n (RoPE restarts at every packed document, as a separate run would). ``cu``: validated ``cu_seqlens``, numpy."""
    if cu is None:
        return np.arange(T, dtype=np.int64)
    doc = np.searchsorted(cu[1:], np.arange(T), side="right")
    return np.arange(T, dtype=np.int64) - cu[doc]


def rope_tables(positions, rope_dim: int, theta: float = INDEXER_ROPE_THETA) -> tuple[np.ndarray, np.ndarray]:
    """``cos, sin`` ``[T, rope_dim/2]`` float64 of the angles ``positions[t] * theta^(-2i/rope_dim)`` (RoFormer eq. 15)."""
    inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)  # [R/2]
    ang = np.asarray(positions, np.float64)[:, None] * inv_freq[None, :]  # [T, R/2]
    return np.cos(ang), np.sin(ang)


def check_rope_args(style: str, rope_dim: int, T: int, KI: int, positions) -> None:
    """The checks of ``apply_rope`` in both paths, for ``x`` of ``T`` tokens and head dim ``KI``.

    Raises:
        ValueError: an unknown ``style``, an odd ``rope_dim`` or one larger than ``KI``, ``positions`` not ``[T]``.
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"indexer_rope: got {style!r}, expected one of {list(ROPE_STYLES)}")
    if style == "none":
        return
    if rope_dim % 2 or not 0 < rope_dim <= KI:
        raise ValueError(f"rope_dim: got {rope_dim}, expected an even number in [2, {KI}] (the indexer head dim)")
    if np.shape(positions) != (T,):
        raise ValueError(f"positions: got shape {np.shape(positions)}, expected [T]=[{T}]")
