"""Sharded loading: fill a parallelised model's local shards from a checkpoint, reading only what each rank owns.

The model is built on ``meta``, parallelised (FSDP2, expert or context parallelism: any layout whose parameters are
plain tensors or ``DTensor``\\ s), then materialised with ``model.to_empty(device=...)``; :func:`load_sharded` then
copies into every parameter and buffer exactly its local block:

* a ``DTensor``'s block is ``[offset, offset + local shape)`` per dimension from
  ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset`` (the chunk DCP saves it under), for any
  mesh and any ``Shard`` / ``Replicate`` placements (``Partial`` is refused: a sum has no block in a checkpoint);
* a plain tensor is whole, except a routed-expert stack of a bank holding a range of the experts
  (``kernels_torch.parallel.expert``: ``GroupedExperts.expert_ids``), whose block is those rows.

Each block is read with ``kimi.checkpoint.read_canonical_block``: safetensors' lazy ``get_slice`` reads the block's
bytes only, the routed experts (stored one expert at a time, maybe MXFP4: spec 6) are read and decoded only for the
stack rows the rank holds, and within an expert only the rows / columns of its block. Blocks are read in pieces
along dimension 0 of at most ``chunk_bytes`` (4 MiB by default; an MXFP4 row counted at 12 bytes an element, what
decoding it takes), so the memory a load adds to the rank's own shards is a few pieces (the piece's file pages, its
copy, what the allocator keeps of earlier pieces), whatever the tensor's size; each piece reopens its file, a header
parse of about a millisecond for a 5 GB shard. Values
are cast on copy (``Tensor.copy_``) to the parameter's dtype, as ``kernels_torch.model.load_model`` does.

:func:`fill_sharded` does the same from canonical arrays held in memory (``kimi.init.init_params``: a ``--preset``
run's random init, the same weights as one process).

A layer wrapped by an adapter (peft's ``LoraLayer`` keeps the original layer as its ``base_layer``:
``q_proj.base_layer.weight``) is filled under the original name (``q_proj.weight``). Tensors the checkpoint does not
hold (the LoRA adapters' initial values, ``kimi_tools.lora.initial_adapters``) come whole in ``extra`` and each
rank copies its block of them, as it does of the others.

The model has no non-persistent buffers (NoPE: nothing cached at init). Should a module gain one, ``to_empty``
leaves it uninitialised: :func:`load_sharded` calls that module's ``reset_buffers()`` to recompute it, and refuses a
module that has none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np
import torch
from torch import nn

from kernels_torch.params import grouped_experts
from kimi.arrays import numpy_dtype, to_torch
from kimi.layout import EXPERT_PROJECTIONS, TensorSpec, expert_param_name, param_layout, stacked_layout

__all__ = ["LoadStats", "local_block", "load_sharded", "fill_sharded", "to_empty"]

DEFAULT_CHUNK_BYTES = 4 * 2**20


@dataclass
class LoadStats:
    """What one rank's load did: ``bytes_read`` (tensor bytes read from the files,
    ``kimi.checkpoint.CheckpointReader.bytes_read``), ``owned_elements`` (elements of the local blocks filled),
    ``owned_bytes`` (their bytes in the model's dtypes) and ``blocks`` (pieces read)."""

    bytes_read: int = 0
    owned_elements: int = 0
    owned_bytes: int = 0
    blocks: int = 0
    nonfinite: list[str] = field(default_factory=list)


def local_block(module: nn.Module, name: str, t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """``(local tensor, global shape, global offset)`` of one parameter or buffer ``name`` of ``module``: the tensor
    this rank holds (a view to copy into) and where it lies in the global one.

    A ``DTensor`` gives its ``to_local()`` and ``compute_local_shape_and_global_offset``; a rank outside its mesh
    gets an empty block. A plain tensor is the whole tensor, except a routed-expert stack (``...experts.w1`` ...) of a
    :class:`kernels_torch.moe.GroupedExperts` bank whose ``expert_ids`` are a range of the layer's experts.

    Raises:
        ValueError: a ``Partial`` placement, or a local tensor whose shape differs from its placements' block.
    """
    try:
        from torch.distributed.tensor import DTensor, Partial
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    if isinstance(t, DTensor):
        if any(isinstance(p, Partial) for p in t.placements):
            raise ValueError(f"load: {name}: placements {t.placements} hold partial sums, expected Shard / Replicate")
        with torch.no_grad():  # a plain view of the local storage (no autograd view to write through)
            local = t.to_local()
        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        if not offset:  # this rank is not in the tensor's mesh
            return local.reshape(-1)[:0].reshape((0,) * t.ndim), tuple(t.shape), (0,) * t.ndim
        if tuple(local.shape) != tuple(shape):
            raise ValueError(
                f"load: {name}: local tensor {tuple(local.shape)} differs from its block {tuple(shape)} "
                f"(global {tuple(t.shape)}, placements {t.placements})"
            )
        return local, tuple(t.shape), tuple(offset)
    prefix, _, last = name.rpartition(".")
    bank = grouped_experts(module).get(prefix) if last in EXPERT_PROJECTIONS else None
    if bank is not None:
        ids = bank.expert_ids
        E = bank.config.num_experts
        if len(ids) != E:
            return t.data, (E, *t.shape[1:]), (ids.start, *([0] * (t.ndim - 1)))
    return t.data, tuple(t.shape), (0,) * t.ndim


def to_empty(module: nn.Module, device: str | torch.device) -> nn.Module:
    """``module.to_empty(device=device)`` keeping every plain parameter's Python object: ``Module.to_empty`` gives a
    parameter on ``meta`` a new ``nn.Parameter`` (the two tensor types cannot share ``.data``), so references taken
    before (the parameters a parallel layout keeps whole and reduces itself, a frozen set) would point at the
    discarded meta tensors; here each new tensor is swapped back into the old object (``torch.utils.swap_tensors``).
    FSDP2's ``DTensor`` parameters are left to FSDP2 (its ``_apply`` re-points them). Returns ``module``."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover
        DTensor = ()
    before = {
        (id(m), n): p
        for m in module.modules()
        for n, p in m._parameters.items()
        if p is not None and not isinstance(p, DTensor)
    }
    module.to_empty(device=device)
    for m in module.modules():
        for n, p in list(m._parameters.items()):
            old = before.get((id(m), n))
            if old is not None and p is not old and not isinstance(p, DTensor):
                torch.utils.swap_tensors(old, p)  # old now holds the materialised tensor
                m._parameters[n] = old
    return module


def _targets(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers by state_dict name (FSDP2 keeps the original names)."""
    return dict(module.state_dict(keep_vars=True))


def _layout_name(name: str) -> str:
    """The checkpoint layout's name of a model tensor: an adapter-wrapped layer's ``base_layer`` level dropped."""
    return name.replace(".base_layer.", ".")


def _all_finite(t: torch.Tensor, piece: int = 2**20) -> bool:
    """Whether every value of a floating ``t`` is finite, checked ``piece`` elements at a time."""
    if not t.is_floating_point():
        return True
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[i : i + piece]).all()) for i in range(0, flat.numel(), piece))


def _reset_nonpersistent_buffers(module: nn.Module) -> None:
    for mname, m in module.named_modules():
        names = getattr(m, "_non_persistent_buffers_set", set())
        if not names:
            continue
        reset = getattr(m, "reset_buffers", None)
        if reset is None:
            raise ValueError(
                f"load: module {mname or '<root>'} has non-persistent buffers {sorted(names)} that to_empty left "
                "uninitialised and no reset_buffers() to recompute them"
            )
        reset()


def _fill(
    module: nn.Module,
    config,
    read: Callable[[TensorSpec, tuple[tuple[int, int], ...]], np.ndarray],
    chunk_bytes: int,
    stats: LoadStats,
    check_finite: bool,
    partial: bool = False,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> None:
    from kimi.checkpoint import nonfinite_tensors

    if not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes: got {chunk_bytes!r}, expected a positive integer")
    want = {s.name: s for s in stacked_layout(config)}
    canon = {s.name: s for s in param_layout(config)}
    targets = _targets(module)
    extra = dict(extra or {})
    layout = {n: _layout_name(n) for n in targets}  # model name -> checkpoint layout name
    held = set(layout.values())
    problems = [
        f"missing from the model: {n} (expected {list(s.shape)})"
        for n, s in want.items()
        if n not in held and not partial
    ]
    problems += [f"not in the checkpoint's layout: {n}" for n in targets if layout[n] not in want and n not in extra]
    problems += [f"extra: {n} is not a tensor of the model" for n in extra if n not in targets and not partial]
    problems += [f"extra: {n} is in the checkpoint's layout too" for n in extra if layout.get(n) in want]
    blocks = {}
    for n, t in targets.items():
        expected = want[layout[n]].shape if layout[n] in want else tuple(extra[n].shape) if n in extra else None
        if expected is None:
            continue
        local, gshape, offset = local_block(module, n, t)
        if gshape != expected:
            source = "checkpoint layout" if layout[n] in want else "extra"
            problems.append(f"wrong shape: {n} ({source} {list(expected)}, model {list(gshape)})")
            continue
        if local.device.type == "meta":
            problems.append(f"on the meta device: {n} (expected model.to_empty(device=...) before loading)")
            continue
        blocks[n] = (local, offset)
    if problems:
        raise ValueError(f"load_sharded: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:50]))

    def put(dst: torch.Tensor, spec: TensorSpec, block: tuple[tuple[int, int], ...]) -> None:
        a = read(spec, block)
        if tuple(a.shape) != tuple(dst.shape):
            raise ValueError(
                f"load_sharded: {spec.name}: read block {list(block)} as {list(a.shape)}, expected {list(dst.shape)}"
            )
        with torch.no_grad():
            dst.copy_(to_torch(np.ascontiguousarray(a)))
        if check_finite and not _all_finite(dst):  # checked on the copy, in pieces: no block-sized temporary
            stats.nonfinite += nonfinite_tensors({f"{spec.name} block {list(block)}": dst})
        stats.blocks += 1

    def put_rows(dst: torch.Tensor, spec: TensorSpec, block: tuple[tuple[int, int], ...]) -> None:
        """``put`` in pieces along dimension 0 of at most ``chunk_bytes`` each (of the work a row costs: its decoded
        values, about 12 bytes an element while an MXFP4 row is decoded)."""
        if dst.ndim == 0:
            return put(dst, spec, block)
        per = 12 if ".experts." in spec.name and config.quant_method == "mxfp4" else numpy_dtype(spec.dtype).itemsize
        step = max(1, chunk_bytes // max(1, dst[0].numel() * per))
        for r in range(0, dst.shape[0], step):
            k = min(step, dst.shape[0] - r)
            put(dst[r : r + k], spec, ((block[0][0] + r, block[0][0] + r + k), *block[1:]))

    for n, (local, offset) in blocks.items():
        if local.numel() == 0:
            continue
        stats.owned_elements += local.numel()
        stats.owned_bytes += local.numel() * local.element_size()
        block = tuple((o, o + s) for o, s in zip(offset, local.shape))
        if n in extra:  # held whole in memory: a view of the block, copied (and cast) in one go
            with torch.no_grad():
                local.copy_(extra[n][tuple(slice(*b) for b in block)])
            stats.blocks += 1
            continue
        name = layout[n]
        if name in canon:
            put_rows(local, canon[name], block)
            continue
        # a routed-expert stack [E, out, in]: its rows are experts, each stored (and read) on its own
        for i, e in enumerate(range(*block[0])):
            put_rows(local[i], canon[expert_param_name(name, e)], block[1:])
    _reset_nonpersistent_buffers(module)


def load_sharded(
    model: nn.Module,
    checkpoint: str | Path | Any,
    *,
    check_finite: bool = True,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    partial: bool = False,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> LoadStats:
    """Fill every parameter and persistent buffer of ``model`` (a :class:`kernels_torch.model.KimiK3Model`, built on
    ``meta``, parallelised, then ``to_empty``-materialised; or any model with its ``config`` and the checkpoint's
    names) with exactly its local block (module docstring) from the checkpoint directory ``checkpoint`` (or an open
    ``kimi.checkpoint.CheckpointReader``). ``model.config`` may be a truncated config (``config.truncated(N)``: the
    first N layers of a bigger checkpoint). Local to the rank: no collective.

    Args:
        check_finite: refuse NaN / inf weights (each block checked after it is read; all listed at the end).
        chunk_bytes: the most bytes of one read (dimension 0 is cut into pieces beyond it).
        partial: the model holds some of the layout's tensors only (a pipeline rank's stages,
            ``kernels_torch.parallel.pipeline.Pipeline.rank_module``): those it lacks are not a problem.
        extra: ``{model state_dict name: whole tensor}`` for tensors outside the checkpoint's layout (the LoRA
            adapters' initial values, ``kimi_tools.lora.initial_adapters``): each rank copies its block, cast to the
            model tensor's dtype; not checked for finiteness, not counted in ``bytes_read``.

    Returns:
        :class:`LoadStats` of this rank (bytes read, owned elements and bytes).

    Raises:
        kimi.checkpoint.CheckpointError: the checkpoint's tensors do not match the layout of ``model.config`` (all
            problems, by key with expected and found shape and dtype, before anything is read), an unreadable
            shard, non-finite weights.
        ValueError: model tensors missing from or foreign to the layout (and not in ``extra``), an ``extra`` name
            the model lacks or the layout holds, a global shape that differs from the layout's or ``extra``'s (key
            and both shapes named), a tensor still on ``meta``, a ``Partial`` placement.
    """
    from kimi.checkpoint import CheckpointReader, check_checkpoint, read_canonical_block

    reader = checkpoint if isinstance(checkpoint, CheckpointReader) else CheckpointReader(checkpoint)
    cfg = model.config
    check_checkpoint(reader, cfg, range(cfg.num_hidden_layers))
    start = reader.bytes_read
    stats = LoadStats()

    def read(spec: TensorSpec, block: tuple[tuple[int, int], ...]) -> np.ndarray:
        return read_canonical_block(reader, cfg, spec, block)

    _fill(model, cfg, read, chunk_bytes, stats, check_finite, partial, extra)
    stats.bytes_read = reader.bytes_read - start
    if stats.nonfinite:
        from kimi.checkpoint import CheckpointError

        raise CheckpointError(
            f"{reader.path}: non-finite weights: " + "; ".join(stats.nonfinite[:20]), list(stats.nonfinite)
        )
    return stats


def fill_sharded(
    model: nn.Module,
    params: Mapping[str, Any],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    partial: bool = False,
    extra: Mapping[str, torch.Tensor] | None = None,
) -> LoadStats:
    """:func:`load_sharded` from canonical parameters in memory (``{name: numpy array or torch tensor}`` as
    ``kimi.init.init_params`` gives them, every rank holding the whole set): each rank copies its blocks
    (``partial``, ``extra``: as :func:`load_sharded`'s).

    Raises:
        ValueError: as :func:`load_sharded`; a canonical parameter missing from ``params`` or of another shape.
    """
    from kimi.arrays import to_numpy

    def read(spec: TensorSpec, block: tuple[tuple[int, int], ...]) -> np.ndarray:
        if spec.name not in params:
            raise ValueError(f"fill_sharded: params: missing {spec.name} (expected {list(spec.shape)})")
        a = params[spec.name]
        if tuple(a.shape) != spec.shape:
            raise ValueError(
                f"fill_sharded: params: {spec.name} has shape {list(a.shape)}, expected {list(spec.shape)}"
            )
        return to_numpy(a)[tuple(slice(*b) for b in block)]

    stats = LoadStats()
    _fill(model, model.config, read, chunk_bytes, stats, check_finite=False, partial=partial, extra=extra)
    return stats
