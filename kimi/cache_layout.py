"""What the two paths' generation caches share: the per-layer tensor shapes and the config fingerprint.

The model-level cache (``reference_jax.cache.ModelCache``, ``kernels_torch.cache.ModelCache``) is a plain container
of per-layer caches plus a position per row. This module says, once for both twins, which tensors each layer keeps
(names as in the layers: ``conv_q``/``conv_k``/``conv_v``/``S`` for KDA, spec 2.4; ``c_kv``/``k_pe`` for MLA and
``index_k`` for the DSA indexer, spec 3.2 and 4.2) and with which shapes, so that a cache built for another config
is refused with a message naming the layer and the tensor.

Shapes (axis letters of ``docs/design.md``): ``N`` rows (sequences), ``S_max`` the cache capacity in tokens.

* KDA: ``conv_q``, ``conv_k``, ``conv_v`` ``[N, P, W-1]`` (``P = kda_num_heads * kda_head_dim``, ``W`` the short-conv
  width): the last ``W-1`` pre-conv projections; ``S`` ``[N, H, K, V]`` the recurrent state, K-first (fla layout).
* MLA: ``c_kv`` ``[N, S_max, kv_lora_rank]`` the normalised latent and ``k_pe`` ``[N, S_max, qk_rope_head_dim]`` the
  shared (never rotated) rope key: ``kv_lora_rank + qk_rope_head_dim`` numbers per token, FlashMLA's 576 for K3.1.
* DSA (MLA plus): ``index_k`` ``[N, S_max, index_head_dim]`` the indexer keys after ``k_norm``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Sequence

from kimi.config import KimiConfig

__all__ = ["config_id", "layer_cache_shapes", "check_capacity", "chunk_bounds"]


def config_id(config: KimiConfig) -> str:
    """A short fingerprint (12 hex digits) of every config field except ``raw``: two configs with the same id build
    the same model. A cache remembers the id of the config it was built for."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "raw"}
    return hashlib.sha1(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:12]


def layer_cache_shapes(config: KimiConfig, layer_idx: int, batch: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """The cache tensors of layer ``layer_idx`` and their shapes, in order (see the module docstring).

    Raises:
        ValueError: ``batch`` or ``max_len`` < 1.
    """
    if batch < 1:
        raise ValueError(f"batch: got {batch}, expected >= 1 sequences")
    if max_len < 1:
        raise ValueError(f"max_len: got {max_len}, expected a capacity >= 1 token")
    c, N = config, batch
    if c.layer_type(layer_idx) == "kda":
        P, W = c.kda_num_heads * c.kda_head_dim, c.short_conv_kernel_size
        window = (N, P, W - 1)
        return {
            "conv_q": window,
            "conv_k": window,
            "conv_v": window,
            "S": (N, c.kda_num_heads, c.kda_head_dim, c.kda_head_dim),
        }
    shapes = {"c_kv": (N, max_len, c.kv_lora_rank), "k_pe": (N, max_len, c.qk_rope_head_dim)}
    if c.layer_type(layer_idx) == "dsa":
        shapes["index_k"] = (N, max_len, c.index_head_dim)
    return shapes


def check_capacity(pos: list[int], lengths: list[int], max_len: int) -> None:
    """Refuse a write past the cache's end: row ``b`` holds ``pos[b]`` tokens and gets ``lengths[b]`` more.

    Raises:
        ValueError: naming the first row that would overflow, its position, the new tokens and the capacity.
    """
    for b, (p, n) in enumerate(zip(pos, lengths)):
        if p + n > max_len:
            raise ValueError(
                f"cache: row {b} holds {p} tokens and would get {n} more, past its end (capacity max_len={max_len}); "
                "build the cache with a larger max_len"
            )


def chunk_bounds(T: int, chunk_size: int | None, snapshot_at: Sequence[int] = ()) -> list[tuple[int, int]]:
    """Column ranges ``[(a, b), ...]`` covering ``[0, T)``: chunks of ``chunk_size`` (one chunk when None), also cut
    at every ``snapshot_at`` offset so that the cache can be copied there (a mid-chunk position splits its chunk).

    Raises:
        ValueError: ``chunk_size`` < 1, or a snapshot offset outside ``[1, T]`` (past the prompt's end).
    """
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"chunk_size: got {chunk_size}, expected a positive integer or None (one chunk)")
    cuts = set(range(0, T, int(chunk_size))) if chunk_size else {0}
    for t in snapshot_at:
        if not 1 <= int(t) <= T:
            raise ValueError(f"snapshot_at: got {t}, expected an offset in [1, {T}] (past the prompt's end otherwise)")
        cuts.add(int(t))
    cuts = sorted(cuts - {T}) + [T]
    return list(zip(cuts[:-1], cuts[1:]))
