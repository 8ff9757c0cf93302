"""The torch path's parameters <-> the canonical (checkpoint) names: the routed experts' stacks split into per-expert
tensors and back. Twin of ``reference_jax.params`` for the torch side.

The torch modules hold each MoE layer's routed experts stacked (``...experts.w1`` ``[E, I, Dl]``, ``w3``, ``w2``:
``kimi.layout.stacked_layout``); checkpoints, the JAX reference and every cross-check name them one expert at a time
(``...experts.{e}.w1.weight``: ``kimi.layout.param_layout``). Everything else has the same name on both sides.

* :func:`canonical_state_dict` gives a module's tensors under the canonical names: expert slices are **views** of the
  stacks (no copy), with global expert ids under expert parallelism (``GroupedExperts.expert_ids``).
* :func:`load_canonical` copies ``(name, tensor)`` pairs into a module, one at a time: an expert's tensor goes into its
  slice of the stack, so a streamed checkpoint (``kimi.checkpoint.iter_arrays``) never exists a second time in memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from kernels_torch.moe import GroupedExperts
from kimi.arrays import to_torch
from kimi.layout import EXPERT_PROJECTIONS, expert_param_name, stacked_expert_name

__all__ = ["grouped_experts", "canonical_state_dict", "load_canonical", "local_stack", "is_dtensor"]


def local_stack(stack: torch.Tensor, bank: GroupedExperts, name: str = "experts") -> torch.Tensor:
    """The rows of an expert stack ``[E_local, ...]`` that this process holds, as a plain tensor (a view): ``stack``
    itself, or the local tensor of an expert-parallel DTensor (``Shard(0)`` over a 1-D ``ep`` mesh:
    ``kernels_torch.parallel.expert``, ``bank.ep_mesh``), whose rows are ``bank.expert_ids``.

    Raises:
        ValueError: a DTensor sharded otherwise (e.g. by FSDP2 too: its local part is no longer whole experts; read
            such a model with ``torch.distributed.checkpoint`` or its full state dict).
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(stack, DTensor):
        return stack
    if tuple(stack.placements) != (Shard(0),) or stack.device_mesh != getattr(bank, "ep_mesh", None):
        raise ValueError(
            f"{name}: a DTensor placed as {tuple(stack.placements)}, expected a plain tensor or the expert-parallel "
            "(Shard(0),) of whole local experts (load and read per expert before FSDP2 shards them)"
        )
    return stack.to_local()


def grouped_experts(module: nn.Module) -> dict[str, GroupedExperts]:
    """``{name prefix: GroupedExperts}`` of every routed-expert bank inside ``module`` (``"experts"`` for a bare
    ``KimiMoE``, ``"model.layers.1.block_sparse_moe.experts"`` in a model)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, GroupedExperts)}


def canonical_state_dict(module: nn.Module, tensors: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``module``'s tensors under the canonical names.

    Args:
        module: any module (a model, a ``KimiMoE``, ...). tensors: tensors keyed by ``module``'s own names (its
            ``state_dict()`` when None; e.g. ``{n: p.grad for n, p in module.named_parameters()}`` for gradients).

    Returns:
        A dict in which each stacked ``...experts.w*`` entry is replaced by its ``E`` per-expert slices (views;
        ``...experts.{e}.w*.weight``, expert-major then ``w1``, ``w3``, ``w2``, as ``kimi.layout.param_layout``
        orders them); other entries unchanged, in their order. A ``None`` stack (no gradient) gives ``None`` slices.
        Under expert parallelism the ids are the bank's own experts (``expert_ids``; an expert-parallel DTensor
        stack gives its local rows), or every expert when ``tensors`` holds the gathered full stack
        (``[num_experts, ...]``: ``torch.distributed.checkpoint.state_dict``'s ``full_state_dict``).
    """
    sd = module.state_dict() if tensors is None else tensors
    banks = grouped_experts(module)
    out: dict[str, Any] = {}
    for name, t in sd.items():
        prefix, _, last = name.rpartition(".")
        bank = banks.get(prefix)
        if bank is None or last not in EXPERT_PROJECTIONS:
            out[name] = t
            continue
        if last != EXPERT_PROJECTIONS[0]:
            continue  # emitted with w1, expert by expert
        stacks = {w: sd.get(f"{prefix}.{w}") for w in EXPERT_PROJECTIONS}
        ids = bank.expert_ids
        if t is not None and not is_dtensor(t) and t.shape[0] == bank.config.num_experts != len(ids):
            ids = range(bank.config.num_experts)  # a gathered (full) stack of an expert-parallel bank: every expert
        elif getattr(bank, "ep_mesh", None) is not None:  # expert-parallel: this rank's rows
            stacks = {w: None if v is None else local_stack(v, bank, f"{prefix}.{w}") for w, v in stacks.items()}
        for i, e in enumerate(ids):
            for w in EXPERT_PROJECTIONS:
                stack = stacks[w]
                out[expert_param_name(f"{prefix}.{w}", e)] = None if stack is None else stack[i]
    return out


def is_dtensor(t) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (a sharded parameter or gradient)."""
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def load_canonical(
    module: nn.Module, items: Mapping[str, Any] | Iterable[tuple[str, Any]], *, strict: bool = True
) -> nn.Module:
    """Copy canonical ``(name, tensor)`` pairs (torch tensors or numpy arrays, any dtype: cast on copy, as
    ``load_state_dict`` does) into ``module``'s parameters and buffers, one pair at a time; returns ``module``.

    An expert's tensor goes into its slice of the stack (local slice ``e - expert_ids.start`` under expert
    parallelism; experts of other ranks are skipped). ``items`` may be a generator (``kimi.checkpoint.iter_arrays``):
    nothing is kept but the pair being copied. A module on the ``meta`` device must be materialised first
    (``module.to_empty(device=...)``).

    Raises:
        ValueError: a tensor whose shape differs from its target, a target still on ``meta``; with ``strict``, names
            the module does not have and tensors (or expert slices) of the module that no pair filled, all listed.
    """
    targets = module.state_dict(keep_vars=True)
    banks = grouped_experts(module)
    missing = {n: set(banks[n.rpartition(".")[0]].expert_ids) if _is_stack(n, banks) else None for n in targets}
    unexpected: list[str] = []
    pairs = items.items() if isinstance(items, Mapping) else items
    for name, value in pairs:
        t = value if isinstance(value, torch.Tensor) else to_torch(value)
        hit = stacked_expert_name(name)
        if hit is not None and hit[0] in targets and _is_stack(hit[0], banks):
            stacked, e = hit
            bank = banks[stacked.rpartition(".")[0]]
            ids = bank.expert_ids
            if e not in ids:  # another rank's expert (expert parallelism), or an id past the layer's experts
                if not 0 <= e < bank.config.num_experts:
                    unexpected.append(name)
                continue
            _copy(local_stack(targets[stacked].data, bank, stacked)[e - ids.start], t, name)
            missing[stacked].discard(e)
        elif name in targets:
            dst = targets[name].data
            if _is_stack(name, banks):  # a whole stack: this rank's rows of it under expert parallelism
                dst = local_stack(dst, banks[name.rpartition(".")[0]], name)
            _copy(dst, t, name)
            missing[name] = set()
        else:
            unexpected.append(name)
    if strict:
        problems = [f"unexpected: {n}" for n in unexpected]
        for n, left in missing.items():
            if left is None:
                problems.append(f"missing: {n}")
            elif left:
                shown = sorted(left)
                problems.append(
                    f"missing: {len(left)} expert slice(s) of {n} (experts {shown[:8]}{'...' * (len(shown) > 8)})"
                )
        if problems:
            raise ValueError(f"load_canonical: {len(problems)} problem(s): " + "; ".join(problems[:20]))
    return module


def _is_stack(name: str, banks: Mapping[str, GroupedExperts]) -> bool:
    prefix, _, last = name.rpartition(".")
    return prefix in banks and last in EXPERT_PROJECTIONS


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.device.type == "meta":
        raise ValueError(
            f"load_canonical: {name}: the module is on the meta device, expected to_empty(device=...) first"
        )
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"load_canonical: {name}: got shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)
