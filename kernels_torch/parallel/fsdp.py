"""Sharded training of the torch model: FSDP2 (``torch.distributed.fsdp.fully_shard``) over a 2-D device mesh
``(dp, cp)``, combined with context parallelism (:mod:`kernels_torch.parallel.context`), DCP checkpoints
(``torch.distributed.checkpoint``) and the full-weight export for the HF safetensors writer.

Layout (torchtitan's ``dp_shard_cp``): parameters are sharded over all ``dp x cp`` ranks (the two mesh dimensions
flattened), one FSDP unit per decoder layer plus the root (embedding, final norm, lm_head, AttnRes output mix). The
``cp`` dimension's ranks hold the same sequences cut into shards; their parameter gradients are parts of one
gradient and must be **summed**, while ``dp`` replicas average: the reduce-scatter therefore divides by ``dp``, not
by the world size (:func:`parallelize`), and each rank's loss is its tokens' sum divided by the token count of its
whole (all-``cp``) sequence batch (:func:`global_token_count`).

Under ``torchrun``::

    mesh = init_mesh(dp=1, cp=2, device_type="cuda")     # reads RANK / WORLD_SIZE / MASTER_ADDR from torchrun
    cp = parallelize(model, mesh)                         # FSDP2 + CP; returns the ContextParallel (None if cp=1)
    ids, cu = cp.shard(input_ids, cu_seqlens)             # the same global row on every cp rank
    loss = model.loss(ids, cp.shard_like(labels), cu) / n_tokens  # summed NLL, lm_head gathered, no logits
    save_checkpoint(path, model, optimizer)               # DCP: loads on any other world size
    sd = full_state_dict(model)                           # rank 0: full tensors for kernels_torch.model.save_model
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kernels_torch.parallel.context import ContextParallel

__all__ = [
    "init_mesh",
    "parallelize",
    "global_token_count",
    "save_checkpoint",
    "load_checkpoint",
    "full_state_dict",
    "export_safetensors",
]


def init_mesh(dp: int, cp: int, device_type: str = "cpu") -> DeviceMesh:
    """The 2-D mesh ``(dp, cp)`` over all ranks, initialising the default process group from the ``torchrun``
    environment if needed (NCCL on CUDA, gloo on CPU).

    Raises:
        ValueError: ``dp * cp`` is not the world size, or a non-positive dimension.
    """
    if dp < 1 or cp < 1:
        raise ValueError(f"mesh: got dp={dp}, cp={cp}, expected positive sizes")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    world = dist.get_world_size()
    if dp * cp != world:
        raise ValueError(f"mesh: got dp={dp} x cp={cp} = {dp * cp}, expected the world size {world}")
    return init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool = True,
    gradient_divide_factor: float | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> ContextParallel | None:
    """Apply context parallelism over ``mesh["cp"]`` (when its size is > 1), then FSDP2 over the flattened
    ``(dp, cp)`` ranks: one ``fully_shard`` per ``model.model.layers[i]`` and one for the root.

    Args:
        model: a :class:`kernels_torch.model.KimiK3Model` (its parameters on the mesh's device type).
        mesh: from :func:`init_mesh`. param_dtype / reduce_dtype: FSDP2 ``MixedPrecisionPolicy`` (None keeps the
            parameters' dtype; fp32 gradient reduction by default, fp64 parameters reduce in fp64).
        reshard_after_forward: free the gathered parameters after each layer's forward (ZeRO-3).
        gradient_divide_factor: what the reduce-scatter divides the summed gradients by; default ``dp`` (each dp
            rank's loss is the mean over its own batch); 1.0 when every rank's loss is already weighted by the
            global batch (``kimi_tools.parallel``).
        ignored_params: parameters FSDP2 leaves whole on every rank (``fully_shard(ignored_params=)``): not sharded,
            their gradients not reduced (the caller all-reduces them); for parameters used outside their module's
            forward, where FSDP2 has not gathered them (the indexer re-run of ``kimi_tools.distill``).

    Returns:
        The :class:`ContextParallel` to call ``shard`` on before each forward, or None when ``cp == 1``.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    # The routed experts are stacked (one [E, out, in] tensor per projection), so every rank's backward gives each
    # stack a gradient (zeros for experts it routed nothing to) and the reduce-scatters agree in size on every rank.
    dp, cp = mesh["dp"].size(), mesh["cp"].size()
    ctx = ContextParallel(model, _own_cp_group(mesh)) if cp > 1 else None
    shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if dp * cp > 1 else mesh
    if any(p.dtype == torch.float64 for p in model.parameters()):
        reduce_dtype = torch.float64
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = dict(mesh=shard_mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if ignored_params:
        kw["ignored_params"] = set(ignored_params)
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if hasattr(model, "loss"):  # KimiK3Model.loss is a forward of its own: gather the root's parameters for it too
        register_fsdp_forward_method(model, "loss")
    # cp ranks hold parts of one gradient (sum), dp ranks replicas (mean): divide by dp, not by dp x cp
    factor = float(dp) if gradient_divide_factor is None else float(gradient_divide_factor)
    for m in [*model.model.layers, model]:
        m.set_gradient_divide_factor(factor)
        if mesh.device_type == "cpu":  # gloo has no AVG / PREMUL_SUM reductions: sum, then divide
            m.set_force_sum_reduction_for_comms(True)
    return ctx


def _own_cp_group(mesh: DeviceMesh):
    """A process group of this rank's ``cp`` row, distinct from the mesh's (FSDP's flattened group is the same
    ranks when ``dp == 1``): CP's collectives are issued by autograd nodes, FSDP's by module hooks, and the two
    orders need not interleave the same way on ranks whose shard graphs differ; separate communicators keep each
    sequence consistent on its own."""
    mine = None
    for row in mesh.mesh.reshape(-1, mesh["cp"].size()).tolist():  # every rank creates every group, in order
        group = dist.new_group(ranks=row)
        if dist.get_rank() in row:
            mine = group
    return mine


def global_token_count(n_local: int | torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Sum of ``n_local`` (e.g. this rank's loss tokens) over the ``cp`` ranks: the divisor of each rank's summed
    loss, so that the cp-summed gradient is the gradient of the mean over the whole sequence batch."""
    n = torch.as_tensor(n_local, dtype=torch.float64).reshape(1)
    dist.all_reduce(n, group=mesh["cp"].get_group())
    return n[0]


def save_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Write a DCP checkpoint of the (sharded) model and optimizer: every rank writes its shards; the folder loads on
    any world size with :func:`load_checkpoint` (or ``dcp.load`` in one process, no process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=str(path))


def load_checkpoint(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    """Load a DCP checkpoint written by :func:`save_checkpoint` on any world size into ``model`` (sharded or not) and,
    given, ``optimizer``. A parameter that had no optimizer state when it was saved (it never got a gradient, e.g.
    layer 0's unused AttnRes mix) has none after the load either; every other key must be in the checkpoint.

    Raises:
        RuntimeError: (DCP) a model or optimizer key the checkpoint lacks.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        held = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        osd = get_optimizer_state_dict(model, optimizer)  # (it makes a state for every parameter)
        osd["state"] = {n: s for n, s in osd["state"].items() if any(f"optimizer.state.{n}.{k}" in held for k in s)}
        state["optimizer"] = osd
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        # strict=False: the parameters left out above (no state saved) may stay without state
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(strict=False))


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors of every parameter on rank 0 (an empty dict elsewhere); a collective: call it
    on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def export_safetensors(model: nn.Module, path: str | Path) -> None:
    """The HF safetensors checkpoint of a sharded model (``kernels_torch.model.save_model``'s layout and dtypes: the
    stacked routed experts split into the checkpoint's per-expert tensors), written by rank 0; a collective."""
    from kernels_torch.params import canonical_state_dict
    from kimi.checkpoint import save_params
    from kimi.layout import param_layout

    sd = full_state_dict(model)
    if dist.get_rank() == 0:
        dtypes = {s.name: getattr(torch, s.dtype) for s in param_layout(model.config)}
        canonical = canonical_state_dict(model, sd)
        save_params(path, {k: v.detach().to("cpu", dtypes[k]) for k, v in canonical.items()}, model.config)
    dist.barrier()
