"""The cache primitives of the MLA layers on the torch path: twin of ``reference_jax.kv_cache``.

A leaf module (it imports only torch), so that the layers (``kernels_torch.mla``, ``kernels_torch.indexer``) and the
GPU decode path (``kernels_torch.decode_cudnn``) share these pieces without importing the model-level cache
(``kernels_torch.cache``), which imports the layers. Spec 3.2 and 4.2; shapes in ``kimi.cache_layout``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MLACache", "write_rows", "write_token", "key_count", "cached_causal_mask"]


class MLACache(NamedTuple):
    """Cache of one MLA layer: ``c_kv`` ``[N, S_max, L]`` (``kv_a_layernorm`` output), ``k_pe`` ``[N, S_max, R]``
    (raw, never rotated: NoPE), ``index_k`` ``[N, S_max, KI]`` (DSA layers; None otherwise), in the activation dtype.
    Rows at or past a row's position are not read. ``c_kv`` and ``k_pe`` may be views of one ``[N, S_max, L + R]``
    buffer (``kernels_torch.decode.DecodeCache``: the sparse kernel then reads the rows in place)."""

    c_kv: torch.Tensor
    k_pe: torch.Tensor
    index_k: torch.Tensor | None = None


def write_rows(buf: torch.Tensor, new: torch.Tensor, pos: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """In place: ``buf[n, pos[n] + t] = new[n, t]`` for ``t < lengths[n]`` (padding columns are not written).

    buf ``[N, S_max, F]``, new ``[N, T, F]``, pos and lengths ``[N]`` int64 on the CPU (capacity checked by the
    caller). Returns ``buf``."""
    N, T = new.shape[:2]
    t = torch.arange(T)[None, :]
    valid = t < lengths[:, None]  # [N, T]
    rows = torch.arange(N)[:, None].expand(N, T)[valid].to(buf.device)
    cols = (pos[:, None] + t)[valid].to(buf.device)
    buf[rows, cols] = new[valid.to(new.device)].to(buf.dtype)
    return buf


def key_count(pos: torch.Tensor, lengths: torch.Tensor) -> int:
    """Keys a cached attention call spans: ``max(pos + lengths)`` (the longest row after the write)."""
    return int((pos + lengths).max())


def cached_causal_mask(pos: torch.Tensor, T: int, S: int, device=None) -> torch.Tensor:
    """``[N, T, S]`` bool: query ``t`` of row ``n`` (position ``pos[n] + t``) sees key ``s`` iff ``s <= pos[n] + t``.
    ``pos`` ``[N]`` int64 on any device (no host read)."""
    q_pos = pos.to(device)[:, None, None] + torch.arange(T, device=device)[None, :, None]  # [N, T, 1]
    return torch.arange(S, device=device)[None, None, :] <= q_pos


def write_token(buf: torch.Tensor, new: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """In place: ``buf[n, pos[n]] = new[n, 0]``, one new row per sequence at a position held on the device.

    buf ``[N, S_max, F]``, new ``[N, 1, F]``, pos ``[N]`` int64 on ``buf``'s device, each in ``[0, S_max)`` (the
    caller guards the capacity: an index past it is a device-side error, not a host check). No host read, so a
    decode step that calls it can be captured in a CUDA graph. Returns ``buf``."""
    buf[torch.arange(buf.shape[0], device=buf.device), pos] = new[:, 0].to(buf.dtype)
    return buf
