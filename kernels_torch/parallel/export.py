"""Parallel export of a sharded model in the real checkpoint layout: every rank writes its own safetensors files,
none gathers the model.

The files are those :func:`kernels_torch.model.save_model` writes for the same weights (``kimi.checkpoint``'s
``plan_files`` over ``kimi.layout.stored_layout``: the same file names, the same tensors in each, the same headers),
so the export is byte for byte the single-process one. File ``i`` of the plan is written by rank ``i mod world``.
The files are written in rounds of ``world`` files, one per rank; within a round the ranks gather, tensor by tensor,
each file's next canonical tensor to its writer (a routed expert's ``[I, Dl]`` slice of its stack, never the stack),
so a rank holds at most one canonical tensor beside what it owns. The writer casts it to the checkpoint dtype (as
``save_model`` does: ``Tensor.to``), quantises a routed expert to MXFP4 when the config says so and pads ``A_log``
(``kimi.checkpoint.stored_items``), and appends its bytes to the file.

Gathering one block of one tensor (:func:`gather_block`) works for any layout :func:`kernels_torch.parallel.load.
local_block` understands (``DTensor``\\ s on any mesh with ``Shard`` / ``Replicate`` placements, plain tensors, the
expert ranges of ``kernels_torch.parallel.expert``): the ranks all-gather where their local blocks meet the wanted
block (2 x ndim integers each), then each distinct piece is sent once (``torch.distributed.send`` / ``recv``; a
piece the writer holds itself is not sent; replicas send nothing more). Plain tensors whole on every rank need no
communication.

A rank may hold some tensors not at all: a pipeline rank's stages (``kernels_torch.parallel.pipeline.Pipeline.
rank_module``, under the one-process names, maybe FSDP2-sharded over its data-parallel ranks). It still takes part in
every gather (an empty local block: it sends nothing, and as a writer receives every piece), so the file plan, the
writers and the bytes are those of the whole model, and no rank holds more than its own stages plus one canonical
tensor. Which ranks hold what is counted once up front (one all-reduce of a flag per tensor): a tensor no rank holds
is an error naming it, on every rank.

Atomicity (as ``kimi.checkpoint.write_stream``): rank 0 first removes an existing index (a stale index never names
a mix of old and new files); every file goes to a temporary name, is fsynced and renamed into place by its writer
once all of that rank's files are complete; after a barrier rank 0 writes ``config.json`` and, last,
``model.safetensors.index.json`` (the commit point), then drops files of an overwritten checkpoint that the new index
does not name; a final barrier returns on every rank with the export complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from kernels_torch.parallel.load import local_block
from kernels_torch.params import is_dtensor
from kimi.arrays import dtype_name, to_numpy
from kimi.layout import TensorSpec, param_layout, stacked_expert_name, stacked_layout, stored_layout

__all__ = ["gather_block", "export_sharded"]


# the dtypes a gathered piece may have, by code (the all-gathered metadata carries the code: a writer that holds none
# of the tensor allocates the pieces it receives from it)
_DTYPES = (
    torch.float64,
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)


def gather_block(
    module: nn.Module,
    name: str,
    t: torch.Tensor | None,
    block: tuple[tuple[int, int], ...],
    dst: int,
    *,
    shape: tuple[int, ...] | None = None,
    everywhere: bool = True,
) -> torch.Tensor | None:
    """The block ``[start, stop)`` per dimension of the global tensor ``t`` (parameter ``name`` of ``module``,
    sharded in any layout :func:`kernels_torch.parallel.load.local_block` reads) as a CPU tensor of ``t``'s dtype on
    global rank ``dst``; None on the other ranks. A collective over the default group (every rank calls it with the
    same arguments), except for a plain tensor that every rank holds whole (no communication).

    Args:
        t: None on a rank that holds none of the tensor (a pipeline rank without its stage,
            ``kernels_torch.parallel.pipeline.Pipeline.rank_module``): the rank takes part with an empty local block,
            and the pieces come from the ranks that hold it (on ``dst`` too: the result has the holders' dtype).
        shape: the global shape, required where ``t`` is None (elsewhere ``t``'s).
        everywhere: every rank passes ``t`` (False where some pass None: the path without communication, for a
            plain tensor held whole, is then not taken, so that all ranks run the collective).

    Raises:
        ValueError: a block outside the tensor, local blocks that do not cover it (a layout this function does not
            understand; also a tensor no rank holds), ``t`` None without ``shape`` or with ``everywhere``, pieces of
            different dtypes or of a dtype outside :data:`_DTYPES`.
    """
    if t is None:
        if shape is None or everywhere:
            raise ValueError(
                f"gather_block: {name}: a rank without the tensor (t None) needs its global shape and "
                f"everywhere=False, got shape={shape!r}, everywhere={everywhere!r}"
            )
        gshape = tuple(shape)
        local, offset = torch.empty((0,) * len(gshape), device=_device(module)), (0,) * len(gshape)
    else:
        local, gshape, offset = local_block(module, name, t)
    nd = len(gshape)
    if len(block) != nd or any(not 0 <= a <= b <= n for (a, b), n in zip(block, gshape)):
        raise ValueError(f"gather_block: {name}: block {list(block)} is not inside its shape {list(gshape)}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    single = not dist.is_initialized() or dist.get_world_size() == 1
    if t is None and single:
        raise ValueError(f"gather_block: {name}: no rank holds the tensor (one process, t None)")
    whole = everywhere and not is_dtensor(t) and tuple(local.shape) == gshape
    if whole or single:
        if rank != dst:
            return None
        return local[tuple(slice(a, b) for a, b in block)].detach().to("cpu", copy=True)
    lo = [max(a, o) for (a, _), o in zip(block, offset)]
    hi = [min(b, o + s) for (_, b), o, s in zip(block, offset, local.shape)]
    mine = t is not None and all(h > lo_ for lo_, h in zip(lo, hi)) and local.numel() > 0
    code = _DTYPES.index(local.dtype) if local.dtype in _DTYPES else -1
    meta = torch.tensor([int(mine), code, *lo, *hi], dtype=torch.int64, device=local.device)
    metas = [torch.empty_like(meta) for _ in range(dist.get_world_size())]
    dist.all_gather(metas, meta)
    boxes: dict[tuple[int, ...], list[int]] = {}
    codes = set()
    for r, m in enumerate(metas):
        m = m.tolist()
        if m[0]:
            boxes.setdefault(tuple(m[2:]), []).append(r)
            codes.add(m[1])
    if len(codes) > 1 or -1 in codes:  # every rank sees the same metadata, so every rank raises
        raise ValueError(
            f"gather_block: {name}: the holders' dtypes are {sorted(str(_DTYPES[c]) if c >= 0 else '?' for c in codes)}"
            f", expected one of {[str(d) for d in _DTYPES]}"
        )
    dtype = _DTYPES[codes.pop()] if codes else local.dtype
    # one sender per distinct piece: the writer itself when it holds the piece, else the lowest rank holding it
    senders = {box: (dst if dst in rs else min(rs)) for box, rs in boxes.items()}
    want = 1
    for a, b in block:
        want *= b - a
    got = sum(_volume(box, nd) for box in senders)
    if got != want:
        raise ValueError(
            f"gather_block: {name}: the ranks' local blocks cover {got} of the {want} elements of {list(block)} "
            f"(global {list(gshape)}); expected a partition (Shard / Replicate placements)"
        )
    piece = None
    if mine:
        piece = local[tuple(slice(lo_ - o, h - o) for lo_, h, o in zip(lo, hi, offset))]
    if rank != dst:
        if mine and senders[(*lo, *hi)] == rank:
            dist.send(piece.contiguous(), dst)
        return None
    out = torch.empty([b - a for a, b in block], dtype=dtype)
    for box, src in sorted(senders.items(), key=lambda kv: kv[1]):
        where = tuple(slice(box[d] - block[d][0], box[nd + d] - block[d][0]) for d in range(nd))
        if src == rank:
            out[where] = piece.detach().to("cpu")
        else:
            buf = torch.empty([box[nd + d] - box[d] for d in range(nd)], dtype=dtype, device=local.device)
            dist.recv(buf, src)
            out[where] = buf.to("cpu")
    return out


def _device(module: nn.Module) -> torch.device:
    """Where ``module``'s tensors live (the first parameter's or buffer's device; CPU for none): the device of the
    collectives of a rank that holds none of a tensor."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


def _volume(box: tuple[int, ...], nd: int) -> int:
    v = 1
    for d in range(nd):
        v *= box[nd + d] - box[d]
    return v


class _Unit:
    """One canonical tensor to gather for one file: its model tensor, block and the stored names it yields there."""

    def __init__(self, canonical: TensorSpec, model_name: str, block, expert: bool, stored: list[str]):
        self.canonical, self.model_name, self.block, self.expert, self.stored = (
            canonical,
            model_name,
            block,
            expert,
            stored,
        )


def _units(config, files: list[tuple[str, list[TensorSpec]]]) -> list[list[_Unit]]:
    """Each file's canonical tensors in write order (an MXFP4 expert's packed and scale tensors one unit when they
    share a file; each gathered for its own file when the plan splits them)."""
    canon = {s.name: s for s in param_layout(config)}
    stacks = {s.name: s for s in stacked_layout(config)}
    out = []
    for _, specs in files:
        units: list[_Unit] = []
        for s in specs:
            cname = s.name
            if s.name.endswith((".weight_packed", ".weight_scale")) and ".experts." in s.name:
                cname = s.name.rsplit(".", 1)[0] + ".weight"
            if units and units[-1].canonical.name == cname:
                units[-1].stored.append(s.name)
                continue
            c = canon[cname]
            hit = stacked_expert_name(cname)
            if hit is not None:
                stacked, e = hit
                shape = stacks[stacked].shape
                block = ((e, e + 1), *((0, n) for n in shape[1:]))
                units.append(_Unit(c, stacked, block, True, [s.name]))
            else:
                units.append(_Unit(c, cname, tuple((0, n) for n in c.shape), False, [s.name]))
        out.append(units)
    return out


class _FileWriter:
    """One safetensors file written in order to a temporary name (header first), checked tensor by tensor."""

    def __init__(self, path: Path, fname: str, specs: list[TensorSpec], prefix: str):
        from kimi.checkpoint import shard_header, tmp_name

        self.final = path / fname
        self.tmp = tmp_name(path, fname)
        self.specs = {s.name: s for s in specs}
        self.f = open(self.tmp, "wb")  # noqa: SIM115 - closed in finish / abort
        self.f.write(shard_header(specs, prefix))

    def append(self, name: str, a) -> None:
        from kimi.checkpoint import CheckpointError, write_tensor_data

        s = self.specs[name]
        got = (tuple(a.shape), dtype_name(a))
        if got != (s.shape, s.dtype):
            raise CheckpointError(f"export: {name} expected {list(s.shape)} {s.dtype}, found {list(got[0])} {got[1]}")
        write_tensor_data(self.f, a)

    def finish(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def export_sharded(model: nn.Module, path: str | Path, *, max_shard_bytes: int | None = None) -> list[str]:
    """Write ``model`` (a sharded :class:`kernels_torch.model.KimiK3Model`, or a pipeline rank's stages
    ``Pipeline.rank_module()``: any module with the model's ``config`` and names) as a checkpoint in the real layout
    into the folder ``path``, every rank writing its own files (module docstring); a collective. Together the ranks
    must hold every tensor of ``kimi.layout.stacked_layout(model.config)``; one rank may hold some only. The result
    equals ``kernels_torch.model.save_model`` of the same weights byte for byte (same files, headers and tensors:
    bf16, fp32, MXFP4 experts) and loads in one process.

    Args:
        max_shard_bytes: file size limit (``kimi.checkpoint.DEFAULT_MAX_SHARD_BYTES``, 5 GB, by default); smaller
            files spread the writing over more ranks.

    Returns:
        The file names this rank wrote.

    Raises:
        ValueError: a tensor of ``kimi.layout.stacked_layout(model.config)`` that no rank holds, or a global shape
            that differs from the layout's (key and shapes named; raised on every rank, the rank that found a shape
            problem naming it), a layout :func:`gather_block` cannot read.
    """
    from kimi.checkpoint import (
        DEFAULT_MAX_SHARD_BYTES,
        INDEX_NAME,
        config_bytes,
        fsync_dir,
        index_bytes,
        plan_files,
        stored_items,
        write_atomic,
    )

    cfg = model.config
    path = Path(path)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    max_shard_bytes = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes: got {max_shard_bytes!r}, expected a positive integer")
    targets = dict(model.state_dict(keep_vars=True))
    layout = stacked_layout(cfg)
    problems = []
    for s in layout:
        if s.name in targets:
            gshape = local_block(model, s.name, targets[s.name])[1]
            if gshape != s.shape:
                problems.append(f"wrong shape: {s.name} (layout {list(s.shape)}, model {list(gshape)})")
    # how many ranks hold each tensor (a pipeline rank holds its stages' only), and whether any rank found a problem:
    # one all-reduce, so that every rank takes the same branch
    held = torch.tensor([int(s.name in targets) for s in layout] + [int(bool(problems))], dtype=torch.int64)
    if world > 1:
        held = held.to(_device(model))
        dist.all_reduce(held)
    held = held.tolist()
    problems += [
        f"missing from the model: {s.name} (expected {list(s.shape)}; held by no rank)"
        for s, n in zip(layout, held)
        if n == 0
    ]
    if held[-1] and not problems:
        problems.append("another rank found problems (its error names them)")
    if problems:
        raise ValueError(f"export_sharded: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:50]))
    everywhere = {s.name: n == world for s, n in zip(layout, held)}
    shapes = {s.name: s.shape for s in layout}
    plan = plan_files(stored_layout(cfg), max_shard_bytes)
    units = _units(cfg, plan)

    old_files: set[str] = set()
    index = path / INDEX_NAME
    if rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        if index.exists():  # de-commit first: a stale index must never name a mix of old and new files
            try:
                old_files = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
            except (ValueError, AttributeError):
                pass
            index.unlink()
            fsync_dir(path)
    _barrier()

    mine: list[_FileWriter] = []
    try:
        for start in range(0, len(plan), world):
            round_files = list(range(start, min(start + world, len(plan))))
            writers = {}
            for i in round_files:
                if i % world == rank:
                    writers[i] = _FileWriter(path, plan[i][0], plan[i][1], cfg.key_prefix)
                    mine.append(writers[i])
            for j in range(max(len(units[i]) for i in round_files)):
                for i in round_files:
                    if j >= len(units[i]):
                        continue
                    u = units[i][j]
                    n = u.model_name
                    t = gather_block(
                        model, n, targets.get(n), u.block, i % world, shape=shapes[n], everywhere=everywhere[n]
                    )
                    if t is None:
                        continue
                    if u.expert:
                        t = t[0]
                    t = t.detach().to("cpu", getattr(torch, u.canonical.dtype))  # save_model's cast
                    items = dict(stored_items(u.canonical.name, to_numpy(t), cfg))
                    for name in u.stored:
                        writers[i].append(name, items[name])
            for w in writers.values():
                w.finish()
    except BaseException:
        for w in mine:
            w.abort()
        raise
    for w in mine:
        os.replace(w.tmp, w.final)
    _barrier()
    if rank == 0:
        fsync_dir(path)
        write_atomic(path / "config.json", config_bytes(cfg))
        write_atomic(index, index_bytes(plan, cfg.key_prefix))  # the commit point
        names = {f for f, _ in plan}
        for stale in old_files - names:
            if "/" not in stale and stale.endswith(".safetensors"):
                (path / stale).unlink(missing_ok=True)
    _barrier()
    return [w.final.name for w in mine]


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
