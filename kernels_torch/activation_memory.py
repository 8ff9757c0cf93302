"""Where a decoder layer's saved activations live between its forward and its backward: recomputed, kept on the
GPU, or offloaded to host memory; and how many bytes each block saves.

Three regions of a :class:`kernels_torch.model.DecoderLayer` can be wrapped (:data:`BLOCKS`): the whole layer
(``forward``), its attention block (``attention``: ``input_layernorm`` and the KDA or MLA/DSA attention) and its MLP
/ MoE block (``feed_forward``: ``post_attention_layernorm`` and the dense MLP or the MoE). The AttnRes depth mixes and
the residual adds sit between the blocks, in the layer's forward only.

* Recomputation (:func:`recompute_layers`) wraps a region in non-reentrant ``torch.utils.checkpoint``.
* Offload (:func:`offload_activations`) runs a region under :class:`save_on_host`, torch's
  ``saved_tensors_hooks``: every tensor the region's autograd graph saves (its activations; never a parameter or a
  view of one) is copied to pinned host memory in the forward, on a side CUDA stream, and copied back when the
  backward reads it. On a CPU the copy is a plain host copy (the same code path, for the tests).
* :func:`saved_bytes_by_block` counts the bytes each region saves, per layer (``benchmarks/activation_bytes.py``).

Layer kinds (:data:`LAYER_KINDS`, :func:`layer_kind`): ``dense`` is a layer whose feed-forward
is the dense MLP (the first ``first_k_dense_replace`` layers, whatever their attention), the others are named by
their attention: ``kda``, ``dsa`` (MLA with the indexer) or ``mla``. Each layer has exactly one kind.

How the two compose, per layer (nested ``saved_tensors_hooks``: the innermost context packs a saved tensor):

* offload around a recomputed region (``all`` with mode ``layer``, ``attn`` with ``attn``, ``mlp`` with ``mlp``,
  ``all`` with ``attn`` or ``mlp``): the recomputed region saves only its inputs (non-reentrant checkpoint saves them
  outside its own hooks), which go to the host; inside it the checkpoint's hooks win;
* offload and recomputation of disjoint blocks (``attn`` with ``mlp`` and the reverse): each as alone;
* offload inside a recomputed region (``attn`` or ``mlp`` in a layer recomputed whole) is refused: the offload
  hooks would take the saved tensors from the checkpoint's, which then recomputes for nothing.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from kimi.config import KimiConfig

__all__ = [
    "RECOMPUTE_MODES",
    "OFFLOAD_MODES",
    "LAYER_KINDS",
    "BLOCKS",
    "MIN_OFFLOAD_BYTES",
    "layer_kind",
    "recompute_layers",
    "decoder_layers",
    "save_on_host",
    "offload_activations",
    "saved_bytes_by_block",
]

# kimi train's --recompute-mode, --offload-activations and layer kinds (kimi_tools.train.args spells the same tuples
# without importing torch; tests/test_recompute.py checks they agree)
RECOMPUTE_MODES = ("layer", "mlp", "attn")  # the whole decoder layer, its MLP / MoE block, its attention block
OFFLOAD_MODES = ("none", "all", "attn", "mlp")
LAYER_KINDS = ("dense", "kda", "dsa", "mla")
# the method of a DecoderLayer each recompute / offload region wraps
BLOCKS = {"layer": "forward", "all": "forward", "attn": "attention", "mlp": "feed_forward"}
# tensors below this stay on the device: a copy's fixed cost (a few microseconds) outweighs the bytes (torchtune's
# activation offloading uses the same floor)
MIN_OFFLOAD_BYTES = 1024


def layer_kind(config: KimiConfig, idx: int) -> str:
    """The kind of decoder layer ``idx``: ``"dense"`` (a dense-MLP layer), else its attention type ``"kda"``,
    ``"dsa"`` or ``"mla"`` (``KimiConfig.layer_type``)."""
    return config.layer_type(idx) if config.is_moe_layer(idx) else "dense"


def decoder_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(index in the whole model, layer)`` of every decoder layer ``model`` holds: a ``KimiK3Model``'s
    ``model.layers`` list, or a pipeline rank's module, which keys them by their index in a ``ModuleDict``."""
    layers = model.model.layers
    return [(int(k), m) for k, m in layers.items()] if hasattr(layers, "items") else list(enumerate(layers))


def recompute_layers(model: nn.Module, mode: str = "layer", full_layers: int = 0, kinds=None) -> None:
    """Activation recomputation (``torch.utils.checkpoint``, non-reentrant) on every decoder layer of ``model``:
    ``layer`` wraps the whole layer (it keeps only its inputs for the backward; its forward runs twice); ``mlp`` only
    its MLP / MoE block (``DecoderLayer.feed_forward``: the attention keeps its activations; the block's forward runs
    twice); ``attn`` only its attention block (``DecoderLayer.attention``: ``input_layernorm`` and the KDA or MLA
    attention; the MLP / MoE keeps its activations). On the H200, 4 real-dimension layers at 32K tokens (benchmark
    5): ``layer`` 63 GiB and 44.6% MFU, ``mlp`` 120 GiB and 52.0%, none out of memory. Gradients are the same in
    every mode (the same ops, recomputed in order). A block that reads context parallelism's current shard (a whole
    layer, an attention block) is recomputed with the shard of its forward
    (``kernels_torch.parallel.context.recompute_context``), also under a pipeline schedule.

    ``full_layers`` (``mlp`` or ``attn``) recomputes the first ``full_layers`` decoder layers whole and the others'
    block: Megatron-LM's "block" recomputation, a memory knob between the modes (each whole layer frees its
    attention activations, about 14 GiB per real-dimension layer at 32K tokens, for one more attention forward).

    ``kinds`` (``--recompute-layers``): the layer kinds (:func:`layer_kind`: ``dense``,
    ``kda``, ``dsa``, ``mla``) the mode applies to; None: every layer. The first ``full_layers`` layers are recomputed
    whole whatever their kind.

    Raises:
        ValueError: ``mode`` not in :data:`RECOMPUTE_MODES`; ``full_layers`` negative, beyond
            the model's layer count, or non-zero with ``mode="layer"``; a kind outside ``LAYER_KINDS``.
    """
    import torch.utils.checkpoint

    from kernels_torch.parallel.context import cp_attached, recompute_context

    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute-mode: got {mode!r}, expected one of {list(RECOMPUTE_MODES)}")
    layers = model.model.layers
    if not isinstance(full_layers, int) or not 0 <= full_layers <= len(layers):
        raise ValueError(f"--recompute-full-layers: got {full_layers!r}, expected an int in [0, {len(layers)}]")
    if full_layers and mode == "layer":
        raise ValueError(
            f"--recompute-full-layers: got {full_layers} with --recompute-mode {mode}, expected mode mlp or attn "
            "(mode layer recomputes every layer whole already)"
        )
    if any(k not in LAYER_KINDS for k in kinds or ()):
        raise ValueError(f"--recompute-layers: got {','.join(kinds)!r}, expected kinds from {list(LAYER_KINDS)}")
    # a pipeline rank's module (kernels_torch.parallel.pipeline.Pipeline.rank_module) holds its layers in a
    # ModuleDict keyed by their index in the whole model
    items = [(int(k), m) for k, m in layers.items()] if hasattr(layers, "items") else list(enumerate(layers))
    for i, layer in items:
        if i >= full_layers and kinds is not None and layer_kind(layer.config, i) not in kinds:
            continue
        name = "forward" if mode == "layer" or i < full_layers else BLOCKS[mode]
        kw = {"use_reentrant": False}
        if name != "feed_forward" and cp_attached():
            # the token mixers read context parallelism's current shard: the recomputation gets its forward's (a
            # pipeline stage runs later micro-batches' forwards before this one's backward); without context
            # parallelism no context_fn, so that torch.compile (which takes none) traces the attention block
            kw["context_fn"] = recompute_context
        setattr(layer, name, functools.partial(torch.utils.checkpoint.checkpoint, getattr(layer, name), **kw))


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter, or a view of one (``F.linear`` saves ``weight.t()``): FSDP2's gathered weights included."""
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class save_on_host(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: the tensors autograd saves inside it are kept in host memory until the backward reads them.

    Pack (forward): a plain tensor of at least ``min_bytes`` bytes that is no parameter (nor a view of one) is
    copied into a fresh host tensor of the same shape, dtype and strides (``torch.empty_like``; contiguous where the
    tensor is not dense): on CUDA into pinned memory (torch's caching host allocator) by a ``non_blocking`` copy
    on ``stream``, which first waits for the compute stream; ``record_stream`` keeps the device tensor's memory
    from reuse until the copy has run, and the copy's event is kept with the host tensor. Everything else (a
    parameter, a small tensor, a tensor subclass such as an FP8 or DTensor one) is kept as autograd keeps it.
    Unpack (backward): the compute stream waits for the copy's event, then a ``non_blocking`` copy back to the
    original device on the compute stream (read when the backward needs it; not prefetched).

    Built on ``torch.autograd.graph.saved_tensors_hooks`` as ``torch.autograd.graph.save_on_cpu(pin_memory=True)``
    is; it differs in the side stream of the forward copy, the strides kept and the parameters left in place.

    Args:
        stats: a dict whose ``"tensors"`` and ``"bytes"`` counts grow with each offloaded tensor (tests, reports).
        min_bytes: the smallest tensor offloaded (:data:`MIN_OFFLOAD_BYTES`).
        stream: the CUDA stream of the forward copies (default: one side stream per device, made on first use).
    """

    _streams: dict[int, torch.cuda.Stream] = {}

    def __init__(self, stats: dict | None = None, min_bytes: int = MIN_OFFLOAD_BYTES, stream=None):
        def pack(t: torch.Tensor):
            if type(t) is not torch.Tensor or _is_parameter(t) or t.numel() * t.element_size() < min_bytes:
                return t
            if stats is not None:
                stats["tensors"] = stats.get("tensors", 0) + 1
                stats["bytes"] = stats.get("bytes", 0) + t.numel() * t.element_size()
            if t.device.type != "cuda":
                return (t.device, torch.empty_like(t, device="cpu").copy_(t), None)
            side = stream or self._side_stream(t.device)
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            side.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(side):
                host.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(side)
            t.record_stream(side)
            return (t.device, host, done)

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            device, host, done = packed
            if done is None:
                return host.to(device)
            torch.cuda.current_stream(device).wait_event(done)
            return host.to(device, non_blocking=True)

        super().__init__(pack, unpack)

    @classmethod
    def _side_stream(cls, device: torch.device) -> torch.cuda.Stream:
        i = device.index if device.index is not None else torch.cuda.current_device()
        if i not in cls._streams:
            cls._streams[i] = torch.cuda.Stream(device=i)
        return cls._streams[i]


def _wrap(layer: nn.Module, method: str, context) -> None:
    """``layer.<method>`` (its current value: a recomputation wrapper stays inside) run under ``context()``."""
    fn = getattr(layer, method)

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with context():
            return fn(*args, **kwargs)

    setattr(layer, method, wrapped)


def _recomputed_block(layer: nn.Module) -> str | None:
    """The method of ``layer`` that ``recompute_layers`` wrapped in a checkpoint (``forward``, ``attention`` or
    ``feed_forward``), or None."""
    import torch.utils.checkpoint

    for name in ("forward", "attention", "feed_forward"):
        f = layer.__dict__.get(name)
        if isinstance(f, functools.partial) and f.func is torch.utils.checkpoint.checkpoint:
            return name
    return None


def offload_activations(model: nn.Module, mode: str, kinds: tuple[str, ...] | None = None) -> dict[int, dict]:
    """Activation offload to host memory (:class:`save_on_host`) on the decoder layers of ``model`` whose
    :func:`layer_kind` is in ``kinds`` (None: every layer): ``all`` the whole layer, ``attn`` its attention block,
    ``mlp`` its MLP / MoE block, ``none`` nothing. Call it after ``recompute_layers`` (the trainer's order): a
    recomputed region inside the offloaded one saves only its inputs, and those go to the host.

    The gradients are those of no offload, bit for bit (the same tensors come back; ``tests/test_recompute.py``).
    Returns ``{layer index: stats}``, each stats dict counting the tensors and bytes that layer offloaded (it grows
    with every forward).

    Raises:
        ValueError: ``mode`` outside :data:`OFFLOAD_MODES`, a kind outside
            :data:`LAYER_KINDS`, or ``attn`` / ``mlp`` on a layer recomputed whole (the offload would sit inside the
            checkpoint and take its saved tensors).
    """
    if mode not in OFFLOAD_MODES:
        raise ValueError(f"--offload-activations: got {mode!r}, expected one of {list(OFFLOAD_MODES)}")
    bad = [k for k in kinds or () if k not in LAYER_KINDS]
    if bad:
        raise ValueError(f"--offload-layers: got {','.join(bad)!r}, expected kinds from {list(LAYER_KINDS)}")
    if mode == "none":
        return {}
    chosen = [(i, layer) for i, layer in decoder_layers(model) if kinds is None or layer_kind(layer.config, i) in kinds]
    for i, layer in chosen:  # check every layer before wrapping any
        if mode != "all" and _recomputed_block(layer) == "forward":
            raise ValueError(
                f"--offload-activations: got {mode} on layer {i}, which is recomputed whole (--recompute-mode "
                "layer or --recompute-full-layers): its blocks keep no activation to offload; expected all (the "
                "layer's inputs on the host) or layers not recomputed whole (--offload-layers / --recompute-layers)"
            )
    out = {}
    for i, layer in chosen:
        stats = out[i] = {"tensors": 0, "bytes": 0}
        _wrap(layer, BLOCKS[mode], functools.partial(save_on_host, stats))
    return out


def saved_bytes_by_block(model: nn.Module, step) -> dict[int, dict[str, int]]:
    """Bytes of activations the autograd graph keeps on the device between the forward and the backward, by decoder
    layer and block, for one call of ``step()`` (a forward, e.g. ``lambda: model.loss(ids, labels)``), without
    running the backward: ``{layer index: {"attn": B, "mlp": B, "layer": B}}``, ``layer`` the whole layer (its
    blocks, the AttnRes mixes and the residual adds).

    One ``saved_tensors_hooks`` around ``step()`` sees every tensor that no inner hook took: with recomputation or
    offload wrappers in place it counts what they leave on the device (a recomputed region's inputs; an offloaded
    region's tensors under ``MIN_OFFLOAD_BYTES``, which stay, are not counted). Each tensor is attributed to the
    innermost block running when it is saved (the blocks' methods are wrapped for the call, with no hook of their
    own, and restored after); each storage is counted once, where it is first saved (a view and its base, a tensor
    saved by two ops: one allocation); a tensor that a graph the forward dropped saved (no output of ``step()``
    reaches it) is not counted, nor are parameters and their views. Works on any device, ``meta``
    included. The model must not be compiled (the hooks would run at trace time)."""
    per: dict[int, dict[str, int]] = {}
    saved: list[tuple[weakref.ref, tuple]] = []  # every tensor saved in a block, in order, and where
    where: list[tuple[int, str]] = []  # the blocks running now, innermost last

    def pack(t: torch.Tensor):
        if type(t) is torch.Tensor and not _is_parameter(t) and where:
            saved.append((weakref.ref(t), tuple(where)))
        return t

    @contextlib.contextmanager
    def running(i: int, block: str):
        where.append((i, block))
        try:
            yield
        finally:
            where.pop()

    originals = []
    for i, layer in decoder_layers(model):
        per[i] = {"layer": 0, "attn": 0, "mlp": 0}
        for block, name in (("layer", "forward"), ("attn", "attention"), ("mlp", "feed_forward")):
            originals.append((layer, name, layer.__dict__.get(name), name in layer.__dict__))
            _wrap(layer, name, functools.partial(running, i, block))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            result = step()  # held: its graph holds what the backward will read
    finally:
        for layer, name, fn, had in reversed(originals):
            if had:
                setattr(layer, name, fn)
            else:
                delattr(layer, name)
    seen = set()
    for ref, stack in saved:
        t = ref()
        if t is None:  # saved by a graph the forward dropped (e.g. the indexer's, whose top-k carries no gradient)
            continue
        st = t.untyped_storage()
        if st._cdata in seen:  # the storage's identity (data_ptr is 0 for every meta tensor); alive, so unique
            continue
        seen.add(st._cdata)
        i, block = stack[-1]
        per[i][block] += st.nbytes()
        if block != "layer" and (i, "layer") in stack:
            per[i]["layer"] += st.nbytes()
    del result
    return per
