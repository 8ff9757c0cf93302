"""The one place that parallelizes the torch model: :func:`parallelize` applies a layout (a
:class:`~kernels_torch.parallel.mesh.ParallelMesh`, or none in one process) and a :class:`ParallelPolicy` to a
:class:`kernels_torch.model.KimiK3Model`, in one fixed order (torchtitan's ``parallelize``, one function per model):

1. **context parallelism** over the ``cp`` ranks (``ContextParallel`` on a ``cp`` group of its own,
   :func:`kernels_torch.parallel.fsdp.own_cp_group`): the token mixers read each micro-batch's sequence shard;
2. **expert parallelism** over ``ep`` (:func:`kernels_torch.parallel.expert.shard_experts`): each rank keeps its
   ``E / ep`` routed experts and dispatches rows to their owners;
3. **the pipeline stage split** over ``pp`` (:class:`kernels_torch.parallel.pipeline.Pipeline`, this rank's stages
   at AttnRes block boundaries). Context and expert parallelism come first because they attach to the layer instances,
   which the stages share;
4. **activation memory**: recomputation (:func:`kernels_torch.activation_memory.recompute_layers`) and the
   offload of saved activations to host memory (``offload_activations``) on the decoder layers;
5. **compile** (:func:`kernels_torch.compile.compile_blocks`, one process only for now), after every wrapper the
   blocks run under;
6. **FSDP2** (:func:`kernels_torch.parallel.fsdp.apply_fsdp`, or ``shard_stages`` for a rank's stages) over the
   ``dp x cp`` ranks, the experts over ``efsdp``, with the policy's mixed precision (``param_dtype``, masters in
   ``master_dtype``, reduce in ``reduce_dtype``), reshard and parameter-offload choices. Not on a one-rank layout
   where FSDP2 would only copy (:func:`fsdp_only_copies`: nothing to shard, cast, offload or divide), as torchtitan
   applies ``fully_shard`` only when ``dp_shard > 1 or cp > 1``.

The model may be on ``meta`` (each rank materialises its shards afterwards: ``kernels_torch.parallel.load``). The
trainer (``kimi_tools.train.parallel.TrainParallel``), the planner's meta check (``tests/test_plan.py``) and the
rank rehearsal (``benchmarks/rank_rehearsal.py``) all come through here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels_torch.parallel.context import ContextParallel
from kernels_torch.parallel.mesh import ParallelMesh

__all__ = ["PipelineSpec", "ParallelPolicy", "Parallelized", "parallelize", "fsdp_only_copies", "OFFLOAD_POLICIES"]

OFFLOAD_POLICIES = ("none", "cpu")  # FSDP2's parameter offload: none, or CPUOffloadPolicy


@dataclass(frozen=True)
class PipelineSpec:
    """How the ``pp`` ranks cut and run the model (:class:`kernels_torch.parallel.pipeline.Pipeline`):
    ``schedule`` (``SCHEDULES``), ``layer_counts`` (layers per stage, None: the AttnRes blocks dealt evenly),
    ``stages_per_rank`` (2 or more under Interleaved1F1B, 2 under DualPipeV and ZBVZeroBubble), ``n_microbatches`` (per step and data-parallel group),
    ``fsdp`` (the stages' FSDP2 policy, ``"layer"`` or ``"stage"``: ``pipeline.shard_stages``)."""

    schedule: str = "1F1B"
    layer_counts: tuple[int, ...] | None = None
    stages_per_rank: int = 1
    n_microbatches: int = 1
    fsdp: str = "layer"


@dataclass(frozen=True)
class ParallelPolicy:
    """What :func:`parallelize` does besides the mesh sizes.

    Args:
        param_dtype: FSDP2's compute dtype (``MixedPrecisionPolicy.param_dtype``; None: the parameters' own).
        master_dtype: the dtype of the sharded trainable ``param_dtype`` parameters (fp32: AdamW's masters; None:
            kept in ``param_dtype``, for an optimizer that steps bf16 weights with stochastic rounding).
        reduce_dtype: the gradient reduce-scatter's dtype (fp64 is forced for an fp64 model).
        reshard_after_forward: ``"auto"``, ``"always"``, ``"never"`` or a bool (``fsdp.RESHARD_POLICIES``).
        offload: FSDP2's parameter offload, :data:`OFFLOAD_POLICIES` (``"cpu"``: ``CPUOffloadPolicy``: sharded
            parameters, gradients and optimizer states in host memory, the optimizer stepping there).
        gradient_divide_factor: what the reduce-scatter divides the summed gradients by (None: ``dp``; 1.0 when each
            rank's loss is already weighted by the global batch).
        recompute, recompute_full_layers, recompute_kinds: ``recompute_layers``'s mode (None: no recomputation),
            ``full_layers`` and ``kinds``.
        offload_activations, offload_kinds: ``offload_activations``'s mode (``"none"``) and kinds.
        compile_backend: ``compile_blocks``'s backend (None: not compiled).
        ep_overlap: expert parallelism's all-to-alls, ``"none"``, ``"chunks"``, ``"fb"`` or ``"fb+chunks"``
            (``shard_experts(overlap=)``; the ``fb`` modes also ``Pipeline(overlap_f_b=True)``, under DualPipeV).
        pipeline: the pipeline's schedule and cut (with ``mesh.dims.pp`` > 1).
        shard_one_rank: apply FSDP2 on a one-rank layout even where it would only copy (:func:`fsdp_only_copies`;
            to measure its cost there, ``benchmarks/train_step_4layers.py --shard-one-rank``).
    """

    param_dtype: torch.dtype | None = None
    master_dtype: torch.dtype | None = torch.float32
    reduce_dtype: torch.dtype | None = torch.float32
    reshard_after_forward: bool | str = "auto"
    offload: str = "none"
    gradient_divide_factor: float | None = None
    recompute: str | None = None
    recompute_full_layers: int = 0
    recompute_kinds: tuple[str, ...] | None = None
    offload_activations: str = "none"
    offload_kinds: tuple[str, ...] | None = None
    compile_backend: str | None = None
    ep_overlap: str = "none"
    pipeline: PipelineSpec = field(default_factory=PipelineSpec)
    shard_one_rank: bool = False


@dataclass
class Parallelized:
    """What :func:`parallelize` made: ``module`` (what trains: the model, or this rank's stages under the model's
    names, ``Pipeline.rank_module()``), ``ctx`` (the ``ContextParallel`` to shard each batch with, or None),
    ``pipe`` (the ``Pipeline``, or None), ``sharded`` (whether FSDP2 was applied: False in one process and on a
    one-rank layout where it would only copy, :func:`fsdp_only_copies`)."""

    module: nn.Module
    ctx: ContextParallel | None = None
    pipe: object | None = None
    sharded: bool = False


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh | None = None,
    policy: ParallelPolicy | None = None,
    *,
    ignored_params: set[nn.Parameter] | None = None,
) -> Parallelized:
    """Apply ``mesh`` and ``policy`` to ``model`` in the order of the module docstring.

    Args:
        model: a :class:`kernels_torch.model.KimiK3Model` (real or on ``meta``), not parallelized yet.
        mesh: the layout (``init_mesh`` / ``ParallelDims.build_mesh``); None in one process: only the activation
            memory policy and compile apply.
        policy: :class:`ParallelPolicy` (default: fp32 reduction, torchtitan's reshard policy, nothing else).
        ignored_params: parameters FSDP2 leaves whole on every rank (their gradients are the caller's to sum): the
            fp32 tensors of a bf16 model (``fsdp.fp32_compute_params``), a stage's replicated indexers.

    Returns:
        :class:`Parallelized`.

    Raises:
        ValueError: the model's experts already expert-parallel over another mesh (``fsdp.check_expert_layout``);
            parameters outside ``param_dtype`` not ignored (``fsdp.check_ignored``); ``compile_backend`` with a mesh
            (compiled blocks were not tried under FSDP2); ``shard_one_rank`` without a mesh; ``offload`` outside :data:`OFFLOAD_POLICIES`; and those of
            ``recompute_layers`` and ``offload_activations`` (bad modes, kinds); the pipeline's (bad sizes or stage
            layouts), prefixed ``pipeline: ``.
    """
    from kernels_torch.activation_memory import offload_activations, recompute_layers
    from kernels_torch.moe import KimiMoE
    from kernels_torch.parallel.fsdp import check_expert_layout, check_ignored

    policy = ParallelPolicy() if policy is None else policy
    if policy.offload not in OFFLOAD_POLICIES:
        raise ValueError(f"offload: got {policy.offload!r}, expected one of {list(OFFLOAD_POLICIES)}")
    if mesh is None and policy.shard_one_rank:
        raise ValueError("shard_one_rank: got True without a mesh, expected a mesh (one process runs no FSDP2)")
    if mesh is not None and policy.compile_backend is not None:
        raise ValueError(
            f"compile_backend: got {policy.compile_backend!r} with a mesh, expected None (compiled blocks were not "
            "tried under FSDP2, context, expert or pipeline parallelism)"
        )
    ctx = pipe = None
    if mesh is not None:
        check_ignored(model, policy.param_dtype, ignored_params)
        moes = [m for m in model.modules() if isinstance(m, KimiMoE)]
        check_expert_layout(moes, mesh)
        # 1. context parallelism on the layers (the stages share them)
        if mesh.dims.cp > 1:
            from kernels_torch.parallel.fsdp import own_cp_group

            ctx = ContextParallel(model, own_cp_group(mesh))
        # 2. expert parallelism (unless the model's experts are expert-parallel over this mesh already)
        if mesh.dims.ep > 1 and moes and moes[0].experts.expert_ids == range(moes[0].config.num_experts):
            from kernels_torch.parallel.expert import shard_experts

            shard_experts(model, mesh=mesh["ep"], overlap=policy.ep_overlap)
        # 3. this rank's pipeline stages
        if mesh.dims.pp > 1:
            from kernels_torch.parallel.pipeline import Pipeline

            spec = policy.pipeline
            try:
                pipe = Pipeline(
                    model,
                    pp_size=mesh.dims.pp,
                    pp_rank=mesh["pp"].get_local_rank(),
                    n_microbatches=spec.n_microbatches,
                    schedule=spec.schedule,
                    stages_per_rank=spec.stages_per_rank,
                    layer_counts=None if spec.layer_counts is None else list(spec.layer_counts),
                    group=mesh["pp"].get_group(),
                    device=mesh.device_type,
                    context=ctx,
                    overlap_f_b=policy.ep_overlap in ("fb", "fb+chunks"),
                )
            except ValueError as e:  # the stage cut (sizes, layer counts): named as the pipeline's
                raise ValueError(f"pipeline: {e}") from None
    module = model if pipe is None else pipe.rank_module()
    # 4. activation memory: recomputation, then the offload around it (a recomputed block keeps only its inputs)
    if policy.recompute is not None:
        recompute_layers(module, policy.recompute, policy.recompute_full_layers, policy.recompute_kinds)
    if policy.offload_activations != "none":
        offload_activations(module, policy.offload_activations, policy.offload_kinds)
    # 5. compile, after every wrapper the blocks run under
    if policy.compile_backend is not None:
        from kernels_torch.compile import compile_blocks

        compile_blocks(module, backend=policy.compile_backend)
    # 6. FSDP2
    sharded = mesh is not None and not fsdp_only_copies(model, mesh, policy, ignored_params)
    if sharded:
        _apply_fsdp(model, pipe, mesh, policy, ignored_params)
    return Parallelized(module=module, ctx=ctx, pipe=pipe, sharded=sharded)


def fsdp_only_copies(
    model: nn.Module, mesh: ParallelMesh, policy: ParallelPolicy, ignored_params: set[nn.Parameter] | None = None
) -> bool:
    """Whether FSDP2 on ``mesh`` under ``policy`` would only copy: one rank (``pp x dp x cp`` = 1), no sharded
    masters in another dtype than the compute dtype (``param_dtype`` None, or ``master_dtype`` None: the
    optimizer steps the parameters themselves), no parameter offload, no gradient divide factor (None or 1.0), and
    a reduce dtype (``reduce_dtype``; fp64 for an fp64 model, as ``apply_fsdp`` forces) that holds every value of
    each parameter dtype FSDP2 would manage (the same dtype or a wider float: else its reduce would round).
    Then every ``fully_shard`` unit's all-gather copies its shard into a buffer and out, and its reduce copies the
    gradient in and out (6 % of the 4-layer step on an H100: ``benchmarks/README.md``, benchmark 5 under torchrun),
    for no sharding; :func:`parallelize` leaves the model as it is, which computes what FSDP2 would: the same
    parameters in the same dtype, the same loss, gradients equal up to the order in which a parameter used more than
    once sums its bf16 parts (``tests/test_fsdp_policy.py``). torchtitan's rule is the same
    (``ParallelDims.fsdp_enabled``: ``dp_shard > 1 or cp > 1``). ``policy.shard_one_rank`` forces FSDP2."""
    if policy.shard_one_rank or mesh.dims.world_size != 1 or policy.offload != "none":
        return False
    if policy.gradient_divide_factor not in (None, 1.0):
        return False
    if policy.param_dtype is not None and policy.master_dtype is not None:
        return False  # FSDP2 holds the masters (fp32) and gathers the compute dtype's copies
    ignored = set(ignored_params or ())
    dtypes = {p.dtype for p in model.parameters() if p not in ignored}
    reduce = torch.float64 if torch.float64 in dtypes else policy.reduce_dtype  # apply_fsdp forces fp64 there
    return all(reduce is None or reduce == d or reduce in _EXACT_REDUCE.get(d, ()) for d in dtypes)


# the reduce dtypes a gradient of each dtype goes through and back unchanged (a wider format holding every value)
_EXACT_REDUCE = {
    torch.bfloat16: (torch.float32, torch.float64),
    torch.float16: (torch.float32, torch.float64),
    torch.float32: (torch.float64,),
}


def _apply_fsdp(model: nn.Module, pipe, mesh: ParallelMesh, policy: ParallelPolicy, ignored_params) -> None:
    """Step 6 of :func:`parallelize`: FSDP2 on the whole model, or on this rank's pipeline stages."""
    from kernels_torch.parallel.fsdp import apply_fsdp

    kw = dict(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        reshard_after_forward=policy.reshard_after_forward,
        gradient_divide_factor=policy.gradient_divide_factor,
        ignored_params=ignored_params,
        master_dtype=policy.master_dtype,
        offload_policy=None,
    )
    if policy.offload == "cpu":
        from torch.distributed.fsdp import CPUOffloadPolicy

        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda")
    if pipe is None:
        apply_fsdp(list(model.model.layers), [model], mesh, **kw)
    else:
        from kernels_torch.parallel.pipeline import shard_stages

        shard_stages(pipe, mesh, fsdp=policy.pipeline.fsdp, **kw)
