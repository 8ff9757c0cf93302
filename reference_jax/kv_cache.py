"""The cache primitives of the MLA layers in the reference: twin of ``kernels_torch.kv_cache``.

A leaf module (it imports only JAX), shared by the layers (``reference_jax.mla``, ``reference_jax.indexer``) and the
model-level cache (``reference_jax.cache``), which imports the layers. Spec 3.2 and 4.2; shapes in
``kimi.cache_layout``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["MLACache", "write_rows", "cached_causal_mask"]


class MLACache(NamedTuple):
    """Cache of one MLA layer: ``c_kv`` ``[N, S_max, L]`` (``kv_a_layernorm`` output), ``k_pe`` ``[N, S_max, R]``
    (raw, never rotated: NoPE), ``index_k`` ``[N, S_max, KI]`` (DSA layers; None otherwise). All in the activation
    dtype; rows at or past a row's position are not read."""

    c_kv: jax.Array
    k_pe: jax.Array
    index_k: jax.Array | None = None


def write_rows(buf: jax.Array, new: jax.Array, pos, lengths) -> jax.Array:
    """``buf[n, pos[n] + t] = new[n, t]`` for ``t < lengths[n]``; the padding columns are dropped.

    buf ``[N, S_max, F]``, new ``[N, T, F]``, pos and lengths ``[N]`` ints (capacity checked by the caller).
    Returns the updated buffer (same shape and dtype)."""
    N, T = new.shape[:2]
    t = jnp.arange(T)[None, :]
    idx = jnp.where(t < jnp.asarray(lengths)[:, None], jnp.asarray(pos)[:, None] + t, buf.shape[1])  # pad -> dropped
    return buf.at[jnp.arange(N)[:, None], idx].set(new.astype(buf.dtype), mode="drop")


def cached_causal_mask(pos, T: int, S: int) -> jax.Array:
    """``[N, T, S]`` bool: query ``t`` of row ``n`` (position ``pos[n] + t``) sees key ``s`` iff ``s <= pos[n] + t``."""
    q_pos = jnp.asarray(pos)[:, None, None] + jnp.arange(T)[None, :, None]  # [N, T, 1]
    return jnp.arange(S)[None, None, :] <= q_pos
