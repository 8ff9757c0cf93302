"""The generation cache of the whole model, reference side: a plain pytree of per-layer caches and a position per row.

Notable (spec 2.4 for KDA, 3.2 and 4.2 for MLA/DSA; shapes in ``kimi.cache_layout``):

* :class:`ModelCache` holds one entry per layer, in layer order: a ``kda.KDACache`` (conv windows ``conv_q``,
  ``conv_k``, ``conv_v`` and the state ``S``) for KDA layers, an :class:`MLACache` (latent ``c_kv``, rope key ``k_pe``
  and, on DSA layers, the indexer keys ``index_k``, all preallocated to ``max_len`` rows) for MLA layers, and
  ``pos`` ``[N]`` int32: how many tokens row ``n`` holds. AttnRes, the MLPs and MoE are per token: nothing to cache.
* A call with a cache reads the model with ``T`` new tokens per row: row ``n`` gets ``lengths[n]`` of them (the rest
  of its ``T`` columns are right padding, their logits are garbage and not written anywhere), so sequences of
  different lengths share one call, each with its own position. Query ``t`` of row ``n`` sits at position
  ``pos[n] + t`` and sees the cached keys ``s <= pos[n] + t`` (:func:`cached_causal_mask`).
* KDA layers run the chunk form for ``T > 1`` and the recurrent form for ``T == 1`` (decode), as fla does; rows of
  different lengths run as packed documents (``cu_seqlens``), each from its own state row.
* JAX arrays are immutable, so a cache is a value: keep one to resume from it later (prefix caching). The KDA state
  cannot be rolled back, so a prefix cache at position p is a copy taken when the cache held exactly p tokens
  (``generate.prefill(..., snapshot_at=p)`` splits a chunk there).
* Attention and the indexer span the whole capacity ``max_len`` under the causal mask, so every decode step has the
  same shapes and a step can be wrapped in ``jax.jit`` (``lengths`` stays concrete; the capacity check is skipped
  under tracing). The torch twin spans only ``max(pos + lengths)`` keys.

Errors name the field: a cache built for another config (``config_id`` differs), of another batch size, with a
layer of the wrong kind or shape, or a write past ``max_len``.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from kimi.cache_layout import check_capacity, chunk_bounds, config_id, layer_cache_shapes
from kimi.config import KimiConfig
from reference_jax.kda import KDACache
from reference_jax.kv_cache import MLACache, cached_causal_mask, write_rows

__all__ = [
    "MLACache",
    "ModelCache",
    "CacheStep",
    "init_cache",
    "check_cache",
    "write_rows",
    "cached_causal_mask",
    "kda_step",
    "prefill",
]


@struct.dataclass
class ModelCache:
    """The model-level cache: ``layers`` (one ``KDACache`` or :class:`MLACache` per layer), ``pos`` ``[N]`` int32
    (tokens held per row), and, static, ``max_len`` (capacity in tokens) and ``config_id``
    (``kimi.cache_layout.config_id`` of the config it was built for). A pytree: ``jax.tree.map`` works on it."""

    layers: tuple
    pos: jax.Array
    max_len: int = struct.field(pytree_node=False)
    config_id: str = struct.field(pytree_node=False)

    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])

    def copy(self) -> ModelCache:
        """A copy (JAX arrays are immutable, so this is the cache itself: the twin of the torch ``copy``)."""
        return self

    def rows(self, idx: Sequence[int]) -> ModelCache:
        """A cache of the rows ``idx`` (repeats allowed: a batch-1 prefill copied into N decode rows, as nanochat).

        Raises:
            ValueError: an index outside ``[0, N)``.
        """
        idx = [int(i) for i in idx]
        bad = [i for i in idx if not 0 <= i < self.batch]
        if not idx or bad:
            raise ValueError(f"idx: got {idx}, expected a non-empty list of rows in [0, {self.batch})")
        take = np.asarray(idx)
        return jax.tree.map(lambda a: a[take], self)


def init_cache(config: KimiConfig, batch: int, max_len: int, dtype=jnp.float32) -> ModelCache:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens: zeros, ``pos = 0``.

    ``dtype`` is the activation dtype of the model it feeds (conv windows, latent rows, indexer keys); the KDA state
    ``S`` is fp32 (fp64 when ``dtype`` is fp64), as the layer computes it. An empty cache gives exactly the cache-free
    forward (zero conv windows and state are the layer's defaults).

    Raises:
        ValueError: ``batch`` or ``max_len`` < 1.
    """
    state_dt = jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32
    layers = []
    for i in range(config.num_hidden_layers):
        shapes = layer_cache_shapes(config, i, batch, max_len)
        if config.layer_type(i) == "kda":
            layers.append(KDACache(*(jnp.zeros(s, state_dt if n == "S" else dtype) for n, s in shapes.items())))
        else:
            layers.append(MLACache(*(jnp.zeros(s, dtype) for s in shapes.values())))
    return ModelCache(tuple(layers), jnp.zeros(batch, jnp.int32), int(max_len), config_id(config))


class CacheStep(NamedTuple):
    """What one cached call hands each layer: the layer caches, ``pos`` ``[N]`` int32 (may be traced under
    ``jax.jit``) and ``lengths`` (numpy ``[N]`` ints, concrete)."""

    layers: tuple
    pos: jax.Array
    lengths: np.ndarray


def check_cache(cache: ModelCache, config: KimiConfig, B: int, T: int, lengths=None, cu_seqlens=None) -> CacheStep:
    """Validate a cached call of ``B`` rows with ``T`` columns and return its :class:`CacheStep`.

    Raises:
        ValueError: a cache from another config, another batch size, a layer of the wrong kind or shape, ``lengths``
            outside ``[1, T]``, ``cu_seqlens`` given (rows replace packed documents here), a write past ``max_len``.
    """
    if not isinstance(cache, ModelCache):
        raise ValueError(f"cache: got {type(cache).__name__}, expected a reference_jax.cache.ModelCache (init_cache)")
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: not with a cache; give one row per sequence and their lengths instead")
    if cache.config_id != config_id(config):
        raise ValueError(
            f"cache: built for another config (config_id {cache.config_id}), this model's is {config_id(config)} "
            f"({config.num_hidden_layers} layers); build it with init_cache(model.config, ...)"
        )
    if cache.batch != B:
        raise ValueError(f"cache: holds {cache.batch} rows, input_ids has batch {B}; expected the same")
    for i, layer in enumerate(cache.layers):
        want = layer_cache_shapes(config, i, B, cache.max_len)
        kind = KDACache if config.layer_type(i) == "kda" else MLACache
        got = {n: tuple(getattr(layer, n).shape) for n in want} if isinstance(layer, kind) else None
        if got != want:
            raise ValueError(f"cache: layer {i} holds {layer!r:.80}, expected a {kind.__name__} with shapes {want}")
    lengths = np.full(B, T) if lengths is None else np.asarray(lengths)
    if (
        lengths.shape != (B,)
        or not np.issubdtype(lengths.dtype, np.integer)
        or (lengths < 1).any()
        or (lengths > T).any()
    ):
        raise ValueError(f"lengths: got {lengths.tolist()}, expected [B]={B} integers in [1, T={T}]")
    if not isinstance(cache.pos, jax.core.Tracer):  # under jax.jit positions are unknown: writes past the end drop
        check_capacity(np.asarray(cache.pos).tolist(), lengths.tolist(), cache.max_len)
    return CacheStep(cache.layers, cache.pos, lengths)


def kda_step(layer, x: jax.Array, cache: KDACache, step: CacheStep) -> tuple[jax.Array, KDACache]:
    """One cached call of a KDA layer (a bound ``KimiDeltaAttention``): x ``[N, T, D]`` -> (out ``[N, T, D]``, cache).

    ``T == 1`` runs the recurrent form (decode), longer calls the chunk form. Rows of different lengths run as
    packed documents (``cu_seqlens``), each from its own conv window and state row; padding columns give 0."""
    N, T, _ = x.shape
    mode = "recurrent" if T == 1 else "chunk"
    n = step.lengths
    if (n == T).all():
        return layer(x, cache=cache, mode=mode)
    cu = np.concatenate([[0], np.cumsum(n)])
    packed = jnp.concatenate([x[b, : n[b]] for b in range(N)], axis=0)[None]  # [1, sum(n), D]
    out, new = layer(packed, cu_seqlens=cu, cache=cache, mode=mode)
    rows = [jnp.pad(out[0, cu[b] : cu[b + 1]], ((0, T - n[b]), (0, 0))) for b in range(N)]
    return jnp.stack(rows), new


def prefill(model, params, input_ids, cache: ModelCache, chunk_size: int | None = None, snapshot_at=(), apply=None):
    """Feed a prompt ``input_ids`` ``[N, T]`` into ``cache`` in chunks of ``chunk_size`` tokens (one call when None);
    twin of ``kernels_torch.cache.prefill`` (plus ``params``; ``apply(params, ids, cache) -> (logits, cache)``
    replaces ``model.apply``, e.g. a ``jax.jit`` of it).

    Returns:
        ``(logits [N, T, vocab], cache, snapshots)``; ``snapshots`` ``{t: ModelCache}`` holds the cache after ``t``
        prompt tokens for every ``t`` in ``snapshot_at`` (prefix caching).

    Raises:
        ValueError: see ``kimi.cache_layout.chunk_bounds`` and :func:`check_cache`.
    """
    if apply is None:

        def apply(p, ids, c):
            return model.apply({"params": p}, ids, c, method="step")

    ids = np.asarray(input_ids)
    logits, snapshots = [], {}
    wanted = {int(t) for t in snapshot_at}
    for a, b in chunk_bounds(ids.shape[1], chunk_size, snapshot_at):
        out, cache = apply(params, ids[:, a:b], cache)
        logits.append(out)
        if b in wanted:
            snapshots[b] = cache.copy()
    return jnp.concatenate(logits, axis=1), cache, snapshots
