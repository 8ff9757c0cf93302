"""Sharded training of the torch model: FSDP2 (``torch.distributed.fsdp.fully_shard``) over one
:class:`~kernels_torch.parallel.mesh.ParallelMesh` (data, context and expert parallelism), combined with context
parallelism (:mod:`kernels_torch.parallel.context`) and expert parallelism (:mod:`kernels_torch.parallel.expert`),
DCP checkpoints (``torch.distributed.checkpoint``) and the full-weight export for the HF safetensors writer.

Layout (torchtitan's ``dp_shard_cp`` and ``efsdp``): parameters are sharded over all ``dp x cp`` ranks (the mesh's
flattened ``dp_cp``), one FSDP unit per decoder layer, one for the input embedding (untied) and the root (final norm,
lm_head, AttnRes output mix); under expert parallelism each MoE layer's routed experts are a unit of their own, ``Shard(0)`` over ``ep`` and
FSDP2 over ``efsdp``. The ``cp`` dimension's ranks hold the same sequences cut into shards; their parameter
gradients are parts of one gradient and must be **summed**, while ``dp`` replicas average: the reduce-scatter
therefore divides by ``dp``, not by the world size (:func:`apply_fsdp`), and each rank's loss is its tokens' sum
divided by the token count of its whole (all-``cp``) sequence batch (:func:`global_token_count`).

Under ``torchrun``::

    mesh = init_mesh(dp=2, cp=2, device_type="cuda", ep=2)  # reads RANK / WORLD_SIZE / MASTER_ADDR from torchrun
    cp = parallelize(model, mesh).ctx                     # kernels_torch.parallel.parallelize: CP + EP + FSDP2
    ids, cu = cp.shard(input_ids, cu_seqlens)             # the same global row on every cp rank
    loss = model.loss(ids, cp.shard_like(labels), cu) / n_tokens  # summed NLL, lm_head gathered, no logits
    save_checkpoint(path, model, optimizer)               # DCP: loads on any other layout or world size
    sd = full_state_dict(model)                           # rank 0: full tensors for kernels_torch.model.save_model
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from kernels_torch.parallel.mesh import ParallelDims, ParallelMesh, init_distributed

__all__ = [
    "init_mesh",
    "fp32_compute_params",
    "apply_fsdp",
    "RESHARD_POLICIES",
    "reshard",
    "offloaded_params",
    "HostGradSums",
    "check_ignored",
    "check_expert_layout",
    "own_cp_group",
    "global_token_count",
    "save_checkpoint",
    "load_checkpoint",
    "full_state_dict",
    "export_safetensors",
]


def init_mesh(
    dp: int | None = None,
    cp: int = 1,
    device_type: str = "cpu",
    *,
    ep: int = 1,
    pp: int = 1,
    host_collectives: bool = False,
) -> ParallelMesh:
    """The meshes of a ``dp x cp`` layout with expert parallelism over ``ep`` of its ranks
    (:class:`kernels_torch.parallel.mesh.ParallelMesh`), initialising the default process group from the
    ``torchrun`` environment if needed (NCCL on CUDA, gloo on CPU; ``host_collectives``: gloo beside NCCL for host
    tensors, ``kernels_torch.parallel.mesh.init_distributed``); ``dp`` fills the world when None.

    Raises:
        ValueError: a non-positive size, ``dp x cp`` not the world size, ``ep`` not dividing ``dp x cp``.
    """
    for name, v in (("dp", dp), ("cp", cp), ("ep", ep), ("pp", pp)):
        if v is not None and v < 1:
            raise ValueError(f"mesh: got {name}={v}, expected a positive size")
    world = init_distributed(device_type, host_collectives)
    return ParallelDims.fill(world, dp=dp, cp=cp, ep=ep, pp=pp).build_mesh(device_type)


def fp32_compute_params(model: nn.Module, param_dtype: torch.dtype | None) -> list[nn.Parameter]:
    """The parameters that must stay out of a ``param_dtype`` mixed-precision FSDP2 unit: those held in another
    floating dtype than ``param_dtype`` (the checkpoint's fp32 tensors of a bf16 model: ``A_log``, ``dt_bias``, the
    short-conv weights, ``o_norm``, the router's ``e_score_correction_bias``; ``kimi.layout`` dtypes), which FSDP2
    would otherwise cast to ``param_dtype`` in every forward. Empty when ``param_dtype`` is None."""
    if param_dtype is None:
        return []
    return [p for p in model.parameters() if p.is_floating_point() and p.dtype != param_dtype]


def check_ignored(module: nn.Module, param_dtype: torch.dtype | None, ignored_params) -> None:
    """Refuse parameters of ``module`` outside ``param_dtype`` (:func:`fp32_compute_params`) that are not in
    ``ignored_params``: FSDP2 would cast them to ``param_dtype`` in every forward.

    Raises:
        ValueError: naming how many and the first one."""
    ignored = set(ignored_params or ())
    odd = set(fp32_compute_params(module, param_dtype)) - ignored
    stray = [n for n, p in module.named_parameters() if p in odd]
    if stray:
        raise ValueError(
            f"param_dtype: {len(stray)} parameter(s) not in {param_dtype} (e.g. {stray[0]}) would be cast to it by "
            "FSDP2; expected them in ignored_params (fp32_compute_params)"
        )


def apply_fsdp(
    layers: list[nn.Module],
    roots: list[nn.Module],
    mesh: ParallelMesh | DeviceMesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool | str = "auto",
    gradient_divide_factor: float | None = None,
    ignored_params: set[nn.Parameter] | None = None,
    master_dtype: torch.dtype | None = torch.float32,
    offload_policy=None,
) -> None:
    """FSDP2, step 6 of ``kernels_torch.parallel.parallelize.parallelize``, for a whole model or a pipeline rank's stages
    (``kernels_torch.parallel.pipeline.shard_stages``): one ``fully_shard`` per decoder layer of ``layers`` and
    one per root module of ``roots`` (each holding some of ``layers`` and the parameters outside them: the model,
    or a pipeline stage module) over the flattened ``dp x cp`` ranks (``mesh["dp_cp"]``); under expert parallelism
    (``mesh.dims.ep`` > 1: the experts already ``Shard(0)`` over ``mesh["ep"]``) one more per MoE layer's routed
    experts over ``mesh["efsdp"]``, applied first so that the layer's unit leaves them out.

    Args:
        layers: the decoder layers to wrap. roots: the modules to wrap last (their parameters not in a layer).
        mesh: a :class:`~kernels_torch.parallel.mesh.ParallelMesh`, or a 1-D ``DeviceMesh`` of data-parallel ranks
            (no expert parallelism: ``dp_cp`` is that mesh).
        param_dtype: FSDP2 ``MixedPrecisionPolicy`` compute dtype (None keeps the parameters' dtype). With
            ``bfloat16``: pass modules whose parameters are in their compute dtypes (bf16, and fp32 where the
            checkpoint keeps fp32); the trainable bf16 parameters become ``master_dtype`` sharded masters (FSDP2
            all-gathers bf16 copies), frozen ones stay bf16; parameters in another dtype
            (:func:`fp32_compute_params`) must be in ``ignored_params`` (else ValueError).
        reduce_dtype: of the gradient reduce-scatter (fp32 by default; fp64 for fp64 models, forced).
        reshard_after_forward: the reshard policy (:data:`RESHARD_POLICIES`): ``"auto"`` (default, torchtitan's)
            frees the gathered parameters after each unit's forward (ZeRO-3) except where the backward comes right
            after: the last decoder layer and the root; ``True`` / ``"always"`` every unit, ``False`` / ``"never"``
            none (ZeRO-2: one all-gather per unit and step, every gathered copy held from the forward to the
            backward). Also on one rank: there the gathered bf16 copies are copies of the fp32 masters, and holding
            them all (``"never"``) ran the 4-layer step out of allocator headroom on an 80 GB card
            (``benchmarks/README.md``, benchmark 5 under torchrun).
        gradient_divide_factor: what the reduce-scatter divides the summed gradients by; default ``dp`` (each dp
            rank's loss the mean over its own batch; a 1-D mesh's size); 1.0 when every rank's loss is already
            weighted by the global batch (``kimi_tools.train.parallel``). The expert units use the same factor: their
            gradients are the sums over every token routed to them, from any rank.
        ignored_params: parameters FSDP2 leaves whole on every rank (``fully_shard(ignored_params=)``): not sharded,
            their gradients not reduced (the caller all-reduces them); for parameters used outside their module's
            forward (the indexer re-run of ``kimi_tools.distill``) and the fp32 parameters of a bf16 model.
        offload_policy: FSDP2's ``CPUOffloadPolicy`` (the sharded parameters, their gradients and so the optimizer
            state on the host, copied to the device for each all-gather), or None.
        master_dtype: the dtype of the sharded masters of the trainable ``param_dtype`` parameters (fp32); None
            keeps them in ``param_dtype`` (an optimizer that steps bf16 weights itself, e.g. with stochastic
            rounding: no fp32 copy, the gradients reduced into bf16 shards).

    Raises:
        ValueError: a ``DeviceMesh`` that is not 1-D; parameters outside ``param_dtype`` not ignored
            (:func:`check_ignored`).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            raise ValueError(
                f"mesh: got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}, expected a ParallelMesh or the 1-D "
                "data-parallel mesh"
            )
        dense, experts, dp = mesh, None, mesh.size()
    else:
        dense, dp = mesh["dp_cp"], mesh.dims.dp
        experts = mesh["efsdp"] if mesh.dims.ep > 1 else None
    ignored = set(ignored_params or ())
    for root in roots:
        check_ignored(root, param_dtype, ignored)
    if param_dtype is not None and master_dtype is not None:  # sharded masters of the trainable bf16 parameters
        for root in roots:
            _upcast_trainable(root, param_dtype, ignored, master_dtype)
    if any(p.dtype == torch.float64 for root in roots for p in root.parameters()):
        reduce_dtype = torch.float64
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = _reshard_policy(reshard_after_forward)
    kw = dict(mp_policy=policy)
    if offload_policy is not None:
        kw["offload_policy"] = offload_policy
    if ignored:
        kw["ignored_params"] = ignored
    units = []  # (module, its mesh)
    for i, layer in enumerate(layers):
        moe = getattr(layer, "block_sparse_moe", None)
        last = i == len(layers) - 1
        if experts is not None and moe is not None:
            fully_shard(
                moe.experts, mesh=experts, shard_placement_fn=_expert_placement(experts.size()),
                reshard_after_forward=reshard(experts, last), **kw,
            )  # fmt: skip
            register_fsdp_forward_method(moe.experts, "rows_forward")  # expert parallelism's call of the experts
            units.append((moe.experts, experts))
        fully_shard(layer, mesh=dense, reshard_after_forward=reshard(dense, last), **kw)
        units.append((layer, dense))
    for root in roots:
        # the input embedding is a unit of its own (torchtitan's): its gathered copy ([vocab, D], as large as a
        # few layers) is freed after its forward instead of being held by the root through the whole step
        embed = _own_embedding(root)
        if embed is not None:
            fully_shard(embed, mesh=dense, reshard_after_forward=reshard(dense, False), **kw)
            units.append((embed, dense))
        fully_shard(root, mesh=dense, reshard_after_forward=reshard(dense, True), **kw)
        units.append((root, dense))
        if hasattr(root, "loss"):  # KimiK3Model.loss is a forward of its own: gather the root's parameters for it too
            register_fsdp_forward_method(root, "loss")
    # cp ranks hold parts of one gradient (sum), dp ranks replicas (mean): divide by dp, not by dp x cp
    factor = float(dp) if gradient_divide_factor is None else float(gradient_divide_factor)
    for m, m_mesh in units:
        _set_divide_factor(m, factor, m_mesh)


def _expert_placement(efsdp: int):
    """FSDP2's placement of an expert stack ``[E, out, in]`` (already ``Shard(0)`` over ``ep``) over ``efsdp``: its
    dim 1 when ``efsdp`` divides it (even shards: at ep 64 each rank's 14 experts over efsdp 4 would split 4, 4, 4, 2
    along dim 0, a rank holding 14 % more than its share), else dim 0 (FSDP2 pads uneven dim-0 shards)."""
    from torch.distributed.tensor import Shard

    return lambda p: Shard(1) if p.ndim > 1 and p.shape[1] % efsdp == 0 else Shard(0)


RESHARD_POLICIES = ("auto", "always", "never")


def reshard(module: nn.Module) -> None:
    """Free every gathered FSDP2 unit under ``module`` (``FSDPModule.reshard``). A forward without a backward (an
    evaluation) leaves the units that do not reshard after their forward (``reshard_after_forward`` ``"auto"``: the
    last decoder layer and the root) holding their gathered parameters, and ``module.parameters()`` then yields those
    instead of the sharded DTensors the optimizer steps; call this after such a forward, before a state dict."""
    from torch.distributed.fsdp import FSDPModule

    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def offloaded_params(module: nn.Module) -> list[nn.Parameter]:
    """The sharded parameters under ``module`` that FSDP2 keeps on the host (units with a ``CPUOffloadPolicy``:
    their gradients land in host memory), each once, in module order; ``[]`` without such a unit."""
    from torch.distributed.fsdp import FSDPModule

    out, seen = [], set()
    for m in module.modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        for fp in group.fsdp_params if group is not None else ():
            p = fp.sharded_param
            if fp.offload_to_cpu and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard (FSDP2 adds into it too)


class HostGradSums:
    """The gradients of FSDP2's host-offloaded parameters summed outside ``.grad`` between the micro-batches of a
    step, so that every reduce-scattered gradient takes FSDP2's fast copy to the host.

    Why: under ``CPUOffloadPolicy`` torch's ``foreach_reduce``
    (``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``) copies a parameter's reduce-scattered gradient
    to the host non-blocking, into pinned memory, only when the parameter has no gradient yet; when ``.grad``
    already holds one (every micro-batch of a step after the first) it copies blocking, into new pageable memory,
    and adds on the host: 0.655 s per GB against 0.018 s on an H100 (``benchmarks/host_optimizer.py``,
    ``grad_accumulate``). FSDP2 waits for its non-blocking copies at the end of each backward
    (``FSDPParamGroup.finalize_backward``), so the host gradients are complete when ``backward()`` returns.

    Use, with ``n`` > 1 micro-batches::

        sums = HostGradSums(offloaded_params(model))
        for i, batch in enumerate(batches):
            loss(batch).backward()
            if i < n - 1:
                sums.take()  # .grad -> the held sum; .grad = None
        sums.give_back()     # the held sum + the last micro-batch's gradient -> .grad

    :meth:`take` holds a parameter's first gradient tensor (fp32 or the masters' dtype, on the host, as FSDP2 made
    it) as its accumulator and adds each later one into it in place, in micro-batch order; :meth:`give_back` adds
    the last one into it and makes it ``.grad`` (or leaves ``.grad`` as it is when nothing is held). The sum is
    ``((g0 + g1) + g2) + ...``, the same additions in the same order as FSDP2's own accumulation
    (``grad._local_tensor += new``), so the result is bit identical to it. Nothing may read ``.grad`` of these
    parameters between :meth:`take` and :meth:`give_back`. Host memory: one more set of gradients (the held sums
    beside the next micro-batch's) while a step runs.
    """

    def __init__(self, params: list[nn.Parameter]):
        self.params = list(params)
        self.held: dict[int, torch.Tensor] = {}  # index in params -> the accumulator (the first gradient tensor)

    def take(self) -> None:
        """Move each parameter's ``.grad`` into its held sum (the first one held as it is, later ones added in
        place) and set ``.grad`` to None."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if p.grad is None:
                    continue
                acc = self.held.get(i)
                if acc is None:
                    self.held[i] = p.grad
                else:
                    _local(acc).add_(_local(p.grad))
                p.grad = None

    def give_back(self) -> None:
        """Add each held sum and the parameter's ``.grad`` (the held sum left, as FSDP2 adds) and make the sum
        ``.grad`` (the held sum alone where ``.grad`` is None); nothing is held afterwards."""
        with torch.no_grad():
            for i, acc in self.held.items():
                p = self.params[i]
                if p.grad is not None:
                    _local(acc).add_(_local(p.grad))
                p.grad = acc
        self.held = {}


def _reshard_policy(policy: bool | str):
    """``reshard(mesh, last) -> bool``: whether a unit on ``mesh`` reshards after its forward under ``policy``
    (:func:`apply_fsdp`'s ``reshard_after_forward``); ``last``: the unit's backward comes right after its forward
    (the last decoder layer, the root).

    Raises:
        ValueError: a policy outside :data:`RESHARD_POLICIES` and the booleans."""
    if policy in (True, "always"):
        return lambda mesh, last: True
    if policy in (False, "never"):
        return lambda mesh, last: False
    if policy != "auto":
        raise ValueError(f"reshard_after_forward: got {policy!r}, expected a bool or one of {list(RESHARD_POLICIES)}")
    return lambda mesh, last: not last


def _own_embedding(root: nn.Module) -> nn.Module | None:
    """The input embedding (``embed_tokens``) under ``root`` that can be an FSDP2 unit of its own: an
    ``nn.Embedding`` whose weight nothing else in ``root`` shares (tied embeddings stay in the root, as the LM head
    reads the same tensor), not a unit already; None otherwise."""
    from torch.distributed.fsdp import FSDPModule

    config = getattr(root, "config", None) or getattr(getattr(root, "model", None), "config", None)
    if getattr(config, "tie_word_embeddings", False):  # the LM head reads the embedding's weight in the root's loss
        return None
    for name, mod in root.named_modules():
        if name.split(".")[-1] != "embed_tokens" or not isinstance(mod, nn.Embedding) or isinstance(mod, FSDPModule):
            continue
        shared = sum(p is mod.weight for _, p in root.named_parameters(remove_duplicate=False))
        return mod if shared == 1 else None
    return None


def _upcast_trainable(model: nn.Module, dtype: torch.dtype, ignored: set, master_dtype=torch.float32) -> None:
    """Replace each trainable ``dtype`` parameter (not ignored) by an fp32 one (a new ``nn.Parameter``: assigning
    ``.data`` does not change a DTensor's dtype); a parameter shared by two modules (tied embeddings) stays shared."""
    memo: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.requires_grad and p.dtype == dtype and p not in ignored:
                if id(p) not in memo:
                    memo[id(p)] = nn.Parameter(p.detach().to(master_dtype), requires_grad=True)
                setattr(mod, name, memo[id(p)])


def check_expert_layout(moes: list, mesh: ParallelMesh) -> None:
    """Refuse experts that are expert-parallel already over anything but ``mesh["ep"]``.

    Args:
        moes: the model's ``kernels_torch.moe.KimiMoE`` modules. mesh: the layout they are about to be sharded on.

    Raises:
        ValueError: a MoE whose experts are a slice (``expert_ids`` not all of them) sharded over another group than
            ``mesh["ep"]``, or over any group when ``mesh`` has no expert parallelism.
    """
    for moe in moes:
        bank = moe.experts
        if bank.expert_ids == range(moe.config.num_experts):
            continue
        on = getattr(bank, "ep_mesh", None)
        if mesh.dims.ep == 1 or on is None or on != mesh["ep"]:
            raise ValueError(
                f"ep: the model's experts are expert-parallel already (this rank holds experts "
                f"{bank.expert_ids.start}-{bank.expert_ids.stop - 1} of {moe.config.num_experts}) over another "
                f"group than this mesh's ep {mesh.dims.ep}; expected an unsharded model (parallelize applies the "
                "mesh's expert parallelism) or shard_experts(model, mesh=mesh['ep'])"
            )


def _set_divide_factor(module, factor: float, mesh: DeviceMesh) -> None:
    """FSDP2's gradient divide factor of one unit; gloo (CPU) has no AVG / PREMUL_SUM: sum, then divide.

    On a 1-rank mesh (one rank, or the experts' ``efsdp`` at ``ep = dp x cp``) FSDP2 with a factor copies the
    gradient through ``input / factor`` (a temporary the size of the unit's gradients) and, with a forced sum (and
    fp64 reductions), divides it twice (torch 2.13 ``foreach_reduce``: the one-rank copy, then the post-divide);
    there the unit's factor stays unset (a plain copy) and a hook on the reduced gradient divides once, in place."""
    if mesh.size() == 1:
        # nothing to reduce: FSDP2 copies the gradient (with a factor set, through a temporary as large as the
        # unit's gradients: ``input / factor``); leave the factor unset and divide in place when it is not 1
        if factor != 1.0:
            module.set_all_reduce_hook(lambda g: g.div_(factor))
    else:
        module.set_gradient_divide_factor(factor)
    if mesh.device_type == "cpu":
        module.set_force_sum_reduction_for_comms(True)


def own_cp_group(mesh: ParallelMesh):
    """A process group (``torch.distributed.ProcessGroup``) of this rank's ``cp`` row, for its ``ContextParallel``; a
    collective: every rank creates every row's group, in order. Distinct from the mesh's (FSDP's flattened group is the same
    ranks when ``dp == 1``): CP's collectives are issued by autograd nodes, FSDP's by module hooks, and the two
    orders need not interleave the same way on ranks whose shard graphs differ; separate communicators keep each
    sequence consistent on its own."""
    mine = None
    for row in mesh.dense.mesh.reshape(-1, mesh["cp"].size()).tolist():  # every rank creates every group, in order
        group = dist.new_group(ranks=row)
        if dist.get_rank() in row:
            mine = group
    return mine


def global_token_count(n_local: int | torch.Tensor, mesh: ParallelMesh) -> torch.Tensor:
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
