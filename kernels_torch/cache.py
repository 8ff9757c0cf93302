"""The generation cache of the whole model on the torch path: twin of ``reference_jax.cache`` (same names and shapes).

Notable (spec 2.4 for KDA, 3.2 and 4.2 for MLA/DSA; shapes in ``kimi.cache_layout``):

* :class:`ModelCache` holds one entry per layer, in layer order: a ``kda.KDACache`` (``conv_q``, ``conv_k``,
  ``conv_v``, ``S``) for KDA layers, an :class:`MLACache` (``c_kv``, ``k_pe`` and, on DSA layers, ``index_k``,
  preallocated to ``max_len`` rows, as nanochat's ``KVCache``) for MLA layers, and ``pos`` ``[N]`` int64 (CPU): how
  many tokens row ``n`` holds.
* A call ``model.step(input_ids [N, T], cache, lengths=None)`` gives row ``n`` ``lengths[n]`` new tokens (default
  T; the rest is right padding whose logits are garbage and which is written nowhere) and returns
  ``(logits, cache)``. Query ``t`` of row ``n`` sits at position ``pos[n] + t`` and sees keys ``s <= pos[n] + t``.
  Attention and the indexer span ``max(pos + lengths)`` keys (the reference spans the whole capacity, masked).
* **The cache is updated in place** (latent rows are written into the preallocated buffers, the KDA entries and
  ``pos`` replaced) and the same object is returned; unlike the JAX twin, whose caches are values. Keep a prefix with
  :meth:`ModelCache.copy` before extending it. The KDA state cannot be rolled back: a prefix cache at position p is a
  copy taken when the cache held exactly p tokens.
* KDA layers run the chunk form for ``T > 1`` and the recurrent form for ``T == 1`` (decode; on ``cudnn`` fla's
  ``fused_recurrent_kda``, see ``kernels_torch.decode_cudnn``); rows of different lengths run as packed documents.

The static-shape decode step (positions on the device, one CUDA graph per batch size) builds on this cache:
``kernels_torch.decode``.

Errors name the field: a cache built for another config (``config_id`` differs), of another batch size, with a
layer of the wrong kind or shape, or a write past ``max_len``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from kernels_torch.kda import KDACache
from kernels_torch.kv_cache import MLACache, cached_causal_mask, key_count, write_rows
from kimi.cache_layout import check_capacity, chunk_bounds, config_id, layer_cache_shapes
from kimi.config import KimiConfig

__all__ = [
    "MLACache",
    "ModelCache",
    "CacheStep",
    "init_cache",
    "check_cache",
    "write_rows",
    "key_count",
    "cached_causal_mask",
    "kda_step",
    "prefill",
]


@dataclass
class ModelCache:
    """The model-level cache: ``layers`` (one ``KDACache`` or :class:`MLACache` per layer), ``pos`` ``[N]`` int64 on
    the CPU (tokens held per row), ``max_len`` (capacity in tokens) and ``config_id`` (``kimi.cache_layout.config_id``
    of the config it was built for). Mutable: a cached forward updates it in place."""

    layers: list
    pos: torch.Tensor
    max_len: int
    config_id: str

    @property
    def batch(self) -> int:
        return int(self.pos.shape[0])

    def copy(self) -> ModelCache:
        """A copy with new buffers (detached from any autograd graph): a prefix cache that later calls on ``self``
        leave untouched."""
        layers = [type(c)(*(None if t is None else t.detach().clone() for t in c)) for c in self.layers]
        return ModelCache(layers, self.pos.clone(), self.max_len, self.config_id)

    def rows(self, idx: Sequence[int]) -> ModelCache:
        """A new cache of the rows ``idx`` (repeats allowed: a batch-1 prefill copied into N decode rows).

        Raises:
            ValueError: an index outside ``[0, N)``.
        """
        idx = [int(i) for i in idx]
        bad = [i for i in idx if not 0 <= i < self.batch]
        if not idx or bad:
            raise ValueError(f"idx: got {idx}, expected a non-empty list of rows in [0, {self.batch})")
        take = torch.tensor(idx)

        def pick(t):
            return None if t is None else t[take.to(t.device)].clone()

        layers = [type(entry)(*(pick(t) for t in entry)) for entry in self.layers]
        return ModelCache(layers, self.pos[take].clone(), self.max_len, self.config_id)


def init_cache(
    config: KimiConfig, batch: int, max_len: int, dtype: torch.dtype = torch.float32, device="cpu"
) -> ModelCache:
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens: zeros, ``pos = 0``.

    ``dtype`` is the model's activation dtype (conv windows, latent rows, indexer keys); ``S`` is fp32 (fp64 when
    ``dtype`` is fp64). An empty cache gives exactly the cache-free forward.

    Raises:
        ValueError: ``batch`` or ``max_len`` < 1.
    """
    state_dt = torch.float64 if dtype == torch.float64 else torch.float32
    layers: list = []
    for i in range(config.num_hidden_layers):
        shapes = layer_cache_shapes(config, i, batch, max_len)
        if config.layer_type(i) == "kda":
            zeros = (torch.zeros(s, dtype=state_dt if n == "S" else dtype, device=device) for n, s in shapes.items())
            layers.append(KDACache(*zeros))
        else:
            layers.append(MLACache(*(torch.zeros(s, dtype=dtype, device=device) for s in shapes.values())))
    return ModelCache(layers, torch.zeros(batch, dtype=torch.int64), int(max_len), config_id(config))


class CacheStep(NamedTuple):
    """What one cached call hands each layer: the layer caches, ``pos`` and ``lengths`` (``[N]`` int64, CPU)."""

    layers: list
    pos: torch.Tensor
    lengths: torch.Tensor


def check_cache(
    cache: ModelCache, config: KimiConfig, B: int, T: int, lengths=None, cu_seqlens=None, *, dtype=None, device=None
) -> CacheStep:
    """Validate a cached call of ``B`` rows with ``T`` columns and return its :class:`CacheStep`. ``dtype`` /
    ``device``: the model's activation dtype and device, when given: every cache tensor must be on ``device`` and
    the MLA layers' rows in ``dtype``.

    Raises:
        ValueError: a cache from another config, another batch size, a layer of the wrong kind or shape, dtype or
            device, ``lengths`` outside ``[1, T]``, ``cu_seqlens`` given (rows replace packed documents here), a write
            past ``max_len``.
    """
    if not isinstance(cache, ModelCache):
        raise ValueError(f"cache: got {type(cache).__name__}, expected a kernels_torch.cache.ModelCache (init_cache)")
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens: not with a cache; give one row per sequence and their lengths instead")
    if cache.config_id != config_id(config):
        raise ValueError(
            f"cache: built for another config (config_id {cache.config_id}), this model's is {config_id(config)} "
            f"({config.num_hidden_layers} layers); build it with init_cache(model.config, ...)"
        )
    if cache.batch != B:
        raise ValueError(f"cache: holds {cache.batch} rows, input_ids has batch {B}; expected the same")
    if len(cache.layers) != config.num_hidden_layers:
        raise ValueError(f"cache: holds {len(cache.layers)} layers, expected {config.num_hidden_layers}")
    for i, layer in enumerate(cache.layers):
        want = layer_cache_shapes(config, i, B, cache.max_len)
        kind = KDACache if config.layer_type(i) == "kda" else MLACache
        got = {n: tuple(getattr(layer, n).shape) for n in want} if isinstance(layer, kind) else None
        if got != want:
            raise ValueError(f"cache: layer {i} holds {type(layer).__name__} {got}, expected a {kind.__name__} {want}")
        for name, t in layer._asdict().items():
            if t is None:
                continue
            # the latent rows are written in place into init_cache's buffers, so their dtype is the one asked for
            # there; the KDA layers hand back new conv windows and states in the dtypes their kernels produce
            want_dtype = dtype if isinstance(layer, MLACache) else None
            if (want_dtype is not None and t.dtype != want_dtype) or (device is not None and t.device != device):
                raise ValueError(
                    f"cache: layer {i} {name} is {t.dtype} on {t.device}, expected {want_dtype or t.dtype} on "
                    f"{device or t.device} like the model; build it with init_cache(model.config, B, max_len, "
                    f"dtype={dtype}, device=...)"
                )
    lengths = torch.full((B,), T, dtype=torch.int64) if lengths is None else torch.as_tensor(lengths).cpu()
    if (
        tuple(lengths.shape) != (B,)
        or lengths.is_floating_point()
        or lengths.dtype == torch.bool
        or bool((lengths < 1).any())
        or bool((lengths > T).any())
    ):
        raise ValueError(f"lengths: got {lengths.tolist()}, expected [B]={B} integers in [1, T={T}]")
    check_capacity(cache.pos.tolist(), lengths.tolist(), cache.max_len)
    return CacheStep(cache.layers, cache.pos, lengths.to(torch.int64))


def kda_step(layer, x: torch.Tensor, cache: KDACache, step: CacheStep) -> tuple[torch.Tensor, KDACache]:
    """One cached call of a ``KimiDeltaAttention``: x ``[N, T, D]`` -> (out ``[N, T, D]``, new KDACache).

    ``T == 1`` runs the recurrent form (decode; fla's ``fused_recurrent_kda`` on ``cudnn``), longer calls the chunk
    form. Rows of different lengths run as packed documents (``cu_seqlens``), each from its own state row; padding
    columns give 0."""
    N, T, _ = x.shape
    n = step.lengths
    if T == 1 and layer.backend == "cudnn":
        from kernels_torch.decode_cudnn import kda_decode_fla  # lazy: CPU machines never import the GPU path

        return kda_decode_fla(layer, x, cache)
    mode = "recurrent" if T == 1 else "chunk"
    if bool((n == T).all()):
        return layer(x, cache=cache, mode=mode)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    valid = (torch.arange(T)[None, :] < n[:, None]).to(x.device)  # [N, T]
    out, new = layer(x[valid][None], cu_seqlens=cu, cache=cache, mode=mode)  # packed [1, sum(n), D]
    full = x.new_zeros(x.shape)
    full[valid] = out[0]
    return full, new


def prefill(model, input_ids: torch.Tensor, cache: ModelCache, chunk_size: int | None = None, snapshot_at=()):
    """Feed a prompt ``input_ids`` ``[N, T]`` into ``cache`` in chunks of ``chunk_size`` tokens (one call when None).

    Any chunking gives the one-call result (the test of ``tests/test_cache.py``). ``snapshot_at``: offsets ``t`` in
    ``[1, T]`` at which a copy of the cache is kept (prefix caching: the copy holds ``pos + t`` tokens per row and
    resumes exactly like a cold prefill of those tokens).

    Returns:
        ``(logits [N, T, vocab], cache, snapshots)``: ``cache`` updated in place, ``snapshots`` ``{t: ModelCache}``.

    Raises:
        ValueError: see ``kimi.cache_layout.chunk_bounds`` and :func:`check_cache`.
    """
    logits, snapshots = [], {}
    wanted = {int(t) for t in snapshot_at}
    for a, b in chunk_bounds(input_ids.shape[1], chunk_size, snapshot_at):
        out, cache = model.step(input_ids[:, a:b], cache)
        logits.append(out)
        if b in wanted:
            snapshots[b] = cache.copy()
    return torch.cat(logits, dim=1), cache, snapshots
