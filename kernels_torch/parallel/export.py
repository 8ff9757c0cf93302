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


def gather_block(
    module: nn.Module, name: str, t: torch.Tensor, block: tuple[tuple[int, int], ...], dst: int
) -> torch.Tensor | None:
    """The block ``[start, stop)`` per dimension of the global tensor ``t`` (parameter ``name`` of ``module``,
    sharded in any layout :func:`kernels_torch.parallel.load.local_block` reads) as a CPU tensor of ``t``'s dtype on
    global rank ``dst``; None on the other ranks. A collective over the default group (every rank calls it with the
    same arguments), except for a plain tensor that every rank holds whole (no communication).

    Raises:
        ValueError: a block outside the tensor, or local blocks that do not cover it (a layout this function does not
            understand).
    """
    local, gshape, offset = local_block(module, name, t)
    nd = len(gshape)
    if len(block) != nd or any(not 0 <= a <= b <= n for (a, b), n in zip(block, gshape)):
        raise ValueError(f"gather_block: {name}: block {list(block)} is not inside its shape {list(gshape)}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    whole = not is_dtensor(t) and tuple(local.shape) == gshape
    if whole or not dist.is_initialized() or dist.get_world_size() == 1:
        if rank != dst:
            return None
        return local[tuple(slice(a, b) for a, b in block)].detach().to("cpu", copy=True)
    lo = [max(a, o) for (a, _), o in zip(block, offset)]
    hi = [min(b, o + s) for (_, b), o, s in zip(block, offset, local.shape)]
    mine = all(h > lo_ for lo_, h in zip(lo, hi)) and local.numel() > 0
    meta = torch.tensor([int(mine), *lo, *hi], dtype=torch.int64, device=local.device)
    metas = [torch.empty_like(meta) for _ in range(dist.get_world_size())]
    dist.all_gather(metas, meta)
    boxes: dict[tuple[int, ...], list[int]] = {}
    for r, m in enumerate(metas):
        m = m.tolist()
        if m[0]:
            boxes.setdefault(tuple(m[1:]), []).append(r)
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
    out = torch.empty([b - a for a, b in block], dtype=local.dtype)
    for box, src in sorted(senders.items(), key=lambda kv: kv[1]):
        where = tuple(slice(box[d] - block[d][0], box[nd + d] - block[d][0]) for d in range(nd))
        if src == rank:
            out[where] = piece.detach().to("cpu")
        else:
            buf = torch.empty([box[nd + d] - box[d] for d in range(nd)], dtype=local.dtype, device=local.device)
            dist.recv(buf, src)
            out[where] = buf.to("cpu")
    return out


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
    """Write ``model`` (a sharded :class:`kernels_torch.model.KimiK3Model`) as a checkpoint in the real layout into
    the folder ``path``, every rank writing its own files (module docstring); a collective. The result equals
    ``kernels_torch.model.save_model`` of the same weights byte for byte (same files, headers and tensors: bf16,
    fp32, MXFP4 experts) and loads in one process.

    Args:
        max_shard_bytes: file size limit (``kimi.checkpoint.DEFAULT_MAX_SHARD_BYTES``, 5 GB, by default); smaller
            files spread the writing over more ranks.

    Returns:
        The file names this rank wrote.

    Raises:
        ValueError: a model whose tensors do not match ``kimi.layout.stacked_layout(model.config)`` (key and shapes
            named), a layout :func:`gather_block` cannot read.
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
    problems = []
    for s in stacked_layout(cfg):
        if s.name not in targets:
            problems.append(f"missing from the model: {s.name} (expected {list(s.shape)})")
        elif tuple(targets[s.name].shape) != s.shape:
            problems.append(f"wrong shape: {s.name} (layout {list(s.shape)}, model {list(targets[s.name].shape)})")
    if problems:
        raise ValueError(f"export_sharded: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:50]))
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
                    t = gather_block(model, u.model_name, targets[u.model_name], u.block, dst=i % world)
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
