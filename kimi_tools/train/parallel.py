"""``kimi train`` under ``torchrun``: the parallel wiring, kept out of the training loop.

``torchrun --nproc-per-node N -m kimi_tools.cli train ... [--dp D] [--cp C] [--ep X]`` runs the same loop on N
processes over one mesh (:mod:`kernels_torch.parallel.mesh`): ``D x C = N`` (``--dp`` fills the rest of the world
unless given), context parallelism over groups of ``C`` ranks, expert parallelism over groups of ``X`` ranks (``X``
divides ``D x C`` and adds no rank: the routed experts take a second view of the same ranks, ``Shard(0)`` over ``ep``
and FSDP2 over the ``efsdp = D x C / X`` ranks that hold the same experts), FSDP2 of everything else over all
``D x C`` ranks (``kernels_torch.parallel.parallelize.parallelize``). Every rank reads the same data in the same order (the
loader state stays one state); the ``accum`` micro-batches of a step are dealt round-robin to the ``dp`` groups (so
``accum`` must be a multiple of ``dp``: every rank runs the same number of forwards, which FSDP2's collectives need;
without ``--batch-tokens`` a step is :attr:`TrainParallel.min_microbatches` micro-batches, one per ``dp`` group and
pipeline stage),
and inside a group each rank takes its contiguous shard of the row. Losses are weighted by the step's global target
count, so the gradient is the sum of every rank's part (FSDP reduce-scatter with divide factor 1). Rank 0 alone
writes ``run.json``, metrics and the plot; all ranks write their shards of the DCP ``step-N/`` folder (the expert
stacks are DTensors: every rank's experts are saved, and reshard on resume) and their files of the safetensors export
(:func:`kernels_torch.parallel.export.export_sharded`).

Precision: a ``--dtype bfloat16`` model (and so ``cudnn``, the grouped experts and ``--fp8``) runs through FSDP2's
``MixedPrecisionPolicy``: the trainable bf16 parameters become fp32 sharded masters (AdamW steps them and holds its
state in fp32; FSDP2 all-gathers bf16 copies for the forward and reduce-scatters the gradients in fp32), frozen bf16
parameters (a LoRA base) stay bf16 shards; the tensors the checkpoint keeps in fp32 (``A_log``, ``dt_bias``, the
short-conv weights, ``o_norm``, the router's correction bias: ``kimi.layout``) stay out of FSDP2, whole and fp32 on
every rank (they are small), so they are never rounded to bf16. ``kimi_tools.train.weights.MasterWeights`` then
finds every trainable parameter in fp32 and keeps no second copy.

A stage may keep some parameters whole on every rank (``stage.replicated(name)``: the distillation stages' DSA
indexers, which they re-run outside the layer's forward, where FSDP2 has not gathered them): FSDP2 ignores them
and :meth:`TrainParallel.reduce_replicated` sums their gradients (and the fp32 tensors' above) over all ranks after
the backward.

Pipeline parallelism (``--pp P [--pp-schedule S] [--pp-layout N,N,...]``, world = ``P x D x C``): the model (built
on ``meta``; the trainer then materialises only this rank's stages) gets context parallelism over its ``cp`` group
and expert parallelism over ``ep`` as above, then is cut into this rank's stages
(``kernels_torch.parallel.pipeline.Pipeline`` over the ``pp`` group, the ``ContextParallel`` as its ``context``),
which FSDP2 shards as ``parallelize`` shards a whole model (``shard_stages``, the same
``kernels_torch.parallel.fsdp.apply_fsdp``: over the ``dp x cp`` ranks of its pipeline coordinate, the experts over
``efsdp``, bf16 with fp32 masters and the fp32 tensors left out; ``--pp-fsdp layer``, the default, runs every unit
as without a pipeline, resharded after its forward and backward and reduce-scattered every micro-batch; ``stage``
keeps the stage gathered until the step's end as torch's ``PipelineStage`` does); the loop trains ``pipe.rank_module()`` (the stages
under the one-process names: DCP states resume under another ``--pp`` or in one process). A step runs the ``dp``
group's micro-batches through the schedule, each rank its ``cp`` shard of every row with the rows' global
``cu_seqlens`` (:meth:`TrainParallel.pipeline_step`; the replicated gradients summed over the ``dp x cp`` ranks of
the pipeline coordinate), the evaluation forward only (:meth:`TrainParallel.pipeline_eval`, summed over ``cp``),
the gradient norm sums over ``pp`` (:attr:`TrainParallel.norm_group`; each rank's sharded norms already span its
``dp x cp`` and ``efsdp x ep`` meshes, its replicated tensors count once), the export per rank from its stages
(``export_sharded``). Refused with ``--pp`` > 1: LoRA, the distillation stages and FP8 (:func:`refuse_pipeline`).

Optimizer and offload policies: under ``--optimizer adamw-bf16`` the trainable bf16 parameters stay bf16 shards
(``bf16_masters``: ``apply_fsdp(master_dtype=None)``, no fp32 masters; gradients reduce-scattered in ``--reduce-dtype``,
then held in bf16), stepped by torchao's AdamW with bf16 moments (``kimi_tools.train.weights.build_optimizer``).
``--offload cpu`` passes FSDP2's ``CPUOffloadPolicy`` (pinned host memory on CUDA) to every unit: the shards, their
gradients and the optimizer state live on the host, and the optimizer steps there; the tensors FSDP2 leaves whole
stay on the device. Between the micro-batches of a step (with ``--pp``, under ``--pp-fsdp layer``: after each
backward action of the schedule, ``Pipeline.host_sums``) the trainer holds the host gradients outside ``.grad`` (``kernels_torch.parallel.fsdp.HostGradSums``), so that FSDP2 copies each one to the host
non-blocking into pinned memory, not blocking with a host add; the sums are FSDP2's own bit for bit. On CUDA the process group then gets a gloo backend for host tensors beside NCCL
(``cpu:gloo,cuda:nccl``, as torchtitan does), for the gradient norm of host shards.

Without ``torchrun`` :class:`TrainParallel` is a no-op and ``--cp``, ``--ep``, ``--dp`` must be 1 (or absent);
``torchrun --nproc-per-node 1`` runs the parallel path on one rank: FSDP2 over that rank where it holds the fp32
masters or offloads, else (``--optimizer adamw-bf16`` or an fp32 model, no ``--offload``) the model as it is, as in
one process (``kernels_torch.parallel.parallelize.fsdp_only_copies``: FSDP2 would only copy there).
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TrainParallel", "under_torchrun", "refuse_pipeline", "REDUCE_DTYPES"]

# --reduce-dtype: the dtype FSDP2 reduce-scatters the gradients in (the sharded gradients are fp32 either way: the
# masters'); bf16 halves the reduce-scatter's bytes and its buffers and rounds each rank's part once before the sum
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def refuse_pipeline(pp: int, a, lora: bool) -> None:
    """With ``--pp`` > 1, refuse (one line naming the flags and values) what the pipeline path does not run yet:
    LoRA (the stages' export writes full weights, not adapters), the distillation stages (``--stage`` other than
    ``lm``: the pipeline's last stage computes the LM loss only) and ``--fp8`` (not run under ``--pp``).
    ``a``: the run's ``TrainArgs``."""
    if pp == 1:
        return
    bad = [
        f"--lora-rank {a.lora_rank}" * lora,
        f"--stage {a.stage}" * (a.stage != "lm"),
        f"--fp8 {a.fp8}" * (a.fp8 is not None),
    ]
    bad = [b for b in bad if b]
    if bad:
        raise ValueError(
            f"--pp {pp} with {' '.join(bad)}: not supported yet; expected --pp > 1 with full fine-tuning (no LoRA), "
            "--stage lm and no --fp8"
        )


class TrainParallel:
    """What the loop asks of the parallel layout (identity in one process).

    Args:
        cp, dp, ep, pp: ``--cp``, ``--dp`` (None: the rest of the world), ``--ep``, ``--pp``. pp_schedule,
            pp_layout: ``--pp-schedule``, ``--pp-layout`` (the text). device: ``cpu`` (gloo) or ``cuda`` (NCCL).
            world: the world size (default ``$WORLD_SIZE`` under torchrun, else 1). offload: ``--offload`` (``none``
            or ``cpu``).
            ep_overlap: ``--ep-overlap`` (``none``, ``chunks``, ``fb`` or ``fb+chunks``:
            ``ParallelPolicy.ep_overlap``). pp_fsdp: ``--pp-fsdp`` (``layer`` or ``stage``, None: ``layer``; what a
            micro-batch's backward does with the stages' FSDP2 units, ``kernels_torch.parallel.pipeline.shard_stages``).

    Raises:
        ValueError (one line naming the flags and values; before any process group is made): a size < 1;
            ``--offload cpu`` without torchrun;
            ``--pp``/``--cp``/``--ep``/``--dp`` > 1 without torchrun; ``--pp x --dp x --cp`` not the world size;
            a ``--pp-layout`` that is not counts, or of a stage count
            the schedule cannot take; at :meth:`setup`, a layout the model refuses or more stages than the default
            layout cuts; ``--ep`` not
            dividing ``--dp x --cp``; at :meth:`setup`, ``--ep`` not dividing the model's routed experts, or a model
            without MoE layer; at :meth:`check_accum`, a step's micro-batch count that is not a multiple of ``--dp``,
            or fewer per ``dp`` group than stages (1F1B, Interleaved1F1B, DualPipeV, ZBVZeroBubble); ``--ep-overlap`` other than ``none`` /
            ``chunks`` / ``fb`` / ``fb+chunks``, or not ``none`` with ``--ep 1``; ``fb`` / ``fb+chunks`` without ``--pp``
            > 1 ``--pp-schedule DualPipeV`` or with ``--cp`` > 1.
    """

    closed_group = False  # a process group of this process was closed by close()

    def __init__(
        self,
        cp: int,
        device: str,
        *,
        dp: int | None = None,
        ep: int = 1,
        pp: int = 1,
        pp_schedule: str = "1F1B",
        pp_layout: str | None = None,
        world: int | None = None,
        reduce_dtype: str = "fp32",
        reshard_after_forward: str = "auto",
        bf16_masters: bool = False,
        offload: str = "none",
        ep_overlap: str = "none",
        shard_one_rank: bool = False,
        pp_fsdp: str | None = None,
    ):
        from kernels_torch.parallel.mesh import ParallelDims
        from kernels_torch.parallel.pipeline import PP_FSDP, SCHEDULES, V_SCHEDULES, parse_stage_layout

        self.enabled = under_torchrun() or int(os.environ.get("WORLD_SIZE", "1")) > 1 if world is None else True
        world = (int(os.environ.get("WORLD_SIZE", "1")) if self.enabled else 1) if world is None else world
        for flag, v in (("--cp", cp), ("--dp", dp), ("--ep", ep), ("--pp", pp)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag}: got {v!r}, expected a positive integer")
        if not self.enabled:
            sizes = (("--pp", pp), ("--cp", cp), ("--dp", dp), ("--ep", ep))
            given = [f"{f} {v}" for f, v in sizes if v is not None and v > 1]
            given += [f"--reduce-dtype {reduce_dtype}"] * (reduce_dtype != "fp32")
            given += [f"--reshard-after-forward {reshard_after_forward}"] * (reshard_after_forward != "auto")
            given += [f"--offload {offload}"] * (offload != "none")  # FSDP2's CPUOffloadPolicy
            given += ["shard_one_rank"] * shard_one_rank  # FSDP2 forced on one rank (the benchmark's --shard-one-rank)
            if given:
                raise ValueError(
                    f"{' '.join(given)}: given in one process, expected a launch under torchrun (torchrun "
                    "--nproc-per-node N -m kimi_tools.cli train ...)"
                )
        pp_schedule = pp_schedule or "1F1B"  # (None: --pp-schedule not given)
        if ep_overlap not in ("none", "chunks", "fb", "fb+chunks") or (ep_overlap != "none" and ep == 1):
            raise ValueError(
                f"--ep-overlap: got {ep_overlap!r} with --ep {ep}, expected none, or chunks, fb or fb+chunks with "
                "--ep > 1 (they overlap the expert all-to-all with compute)"
            )
        if ep_overlap in ("fb", "fb+chunks") and (pp == 1 or pp_schedule != "DualPipeV"):
            raise ValueError(
                f"--ep-overlap: got {ep_overlap!r} with --pp {pp} --pp-schedule {pp_schedule}, expected --pp > 1 "
                "--pp-schedule DualPipeV (fb overlaps one micro-batch's all-to-all with another's compute inside its "
                "overlapped forward + backward actions)"
            )
        if ep_overlap in ("fb", "fb+chunks") and cp > 1:
            raise ValueError(
                f"--ep-overlap: got {ep_overlap!r} with --cp {cp}, expected --cp 1 (context parallelism keeps one "
                "current shard, which two micro-batches taking turns inside a layer would overwrite)"
            )
        self.ep_overlap = ep_overlap
        if pp_fsdp is not None and (pp_fsdp not in PP_FSDP or pp == 1):
            raise ValueError(
                f"--pp-fsdp: got {pp_fsdp!r} with --pp {pp}, expected one of {list(PP_FSDP)} with --pp > 1 (the FSDP2 "
                "policy of pipeline stages)"
            )
        self.pp_fsdp = pp_fsdp or "layer"
        if pp_schedule not in SCHEDULES:
            raise ValueError(f"--pp-schedule: got {pp_schedule!r}, expected one of {list(SCHEDULES)}")
        self.pp_counts = None
        self.stages_per_rank = 2 if pp_schedule in ("Interleaved1F1B", *V_SCHEDULES) else 1
        if pp_layout is not None:
            try:
                self.pp_counts = parse_stage_layout(pp_layout)
            except ValueError:
                raise ValueError(
                    f"--pp-layout: got {pp_layout!r}, expected layer counts per stage like '12,24,24,33'"
                ) from None
            n = len(self.pp_counts)
            if pp_schedule == "Interleaved1F1B" and (n % pp or n // pp < 2):
                raise ValueError(
                    f"--pp-layout: got {n} stages with --pp {pp} --pp-schedule {pp_schedule}, expected a multiple "
                    f"of --pp of at least {2 * pp} (stages_per_rank >= 2)"
                )
            if pp_schedule in V_SCHEDULES and n != 2 * pp:
                raise ValueError(
                    f"--pp-layout: got {n} stages with --pp {pp} --pp-schedule {pp_schedule}, expected {2 * pp} "
                    "(two stages per rank, in a V)"
                )
            if pp_schedule not in ("Interleaved1F1B", *V_SCHEDULES) and n != pp:
                raise ValueError(
                    f"--pp-layout: got {n} stages with --pp {pp} --pp-schedule {pp_schedule}, expected {pp} "
                    "(one stage per rank)"
                )
            self.stages_per_rank = n // pp
        if dp is None and world % (cp * pp):
            if pp == 1:
                raise ValueError(f"--cp: got {cp}, expected a positive divisor of the world size {world}")
            raise ValueError(f"--pp/--cp: got --pp {pp} x --cp {cp}, expected a divisor of the world size {world}")
        dp = world // (cp * pp) if dp is None else dp
        if pp * dp * cp != world:
            if pp == 1:
                raise ValueError(
                    f"--dp/--cp: got --dp {dp} x --cp {cp} = {dp * cp} ranks, expected the world size {world}"
                )
            raise ValueError(
                f"--pp/--dp/--cp: got --pp {pp} x --dp {dp} x --cp {cp} = {pp * dp * cp} ranks, expected the world "
                f"size {world}"
            )
        if (dp * cp) % ep:
            raise ValueError(
                f"--ep: got {ep}, expected a divisor of --dp x --cp = {dp} x {cp} = {dp * cp} (expert parallelism "
                "regroups those ranks; it adds none)"
            )
        self.dims = ParallelDims(world, dp=dp, cp=cp, ep=ep, pp=pp)
        self.cp_size, self.dp_size, self.ep_size, self.pp_size, self.device = cp, dp, ep, pp, device
        self.pp_schedule = pp_schedule
        from kernels_torch.parallel.fsdp import RESHARD_POLICIES

        if reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"--reduce-dtype: got {reduce_dtype!r}, expected one of {list(REDUCE_DTYPES)}")
        if reshard_after_forward not in RESHARD_POLICIES:
            raise ValueError(
                f"--reshard-after-forward: got {reshard_after_forward!r}, expected one of {list(RESHARD_POLICIES)}"
            )
        self.reduce_dtype, self.reshard_after_forward = reduce_dtype, reshard_after_forward
        self.bf16_masters = bf16_masters  # the trainable bf16 parameters stay bf16 shards (a bf16 optimizer)
        self.offload = offload
        # FSDP2 even on a one-rank layout where it would only copy (ParallelPolicy.shard_one_rank; benchmarks only)
        self.shard_one_rank = shard_one_rank
        self.sharded = False  # whether setup applied FSDP2 (parallelize's Parallelized.sharded)
        self.rank, self.mesh, self.ctx, self.pipe, self.n_microbatches = 0, None, None, None, 1
        self.module: nn.Module | None = None  # what trains, after setup: the model or this rank's stages
        self.replicated: list[nn.Parameter] = []
        if self.enabled:
            from kernels_torch.parallel.fsdp import init_mesh

            self.mesh = init_mesh(dp=dp, cp=cp, device_type=device, ep=ep, pp=pp, host_collectives=offload != "none")
            self.rank = dist.get_rank()

    @classmethod
    def from_args(cls, a, world: int | None = None) -> TrainParallel:
        """The layout of the resolved ``TrainArgs`` ``a`` (``--cp``, ``--dp``, ``--ep``, ``--pp``, their schedule and
        policies; ``--optimizer adamw-bf16`` keeps no fp32 masters); ``world`` as the constructor's."""
        return cls(
            a.cp, a.device, dp=a.dp, ep=a.ep, pp=a.pp, pp_schedule=a.pp_schedule, pp_layout=a.pp_layout,
            reduce_dtype=a.reduce_dtype, reshard_after_forward=a.reshard_after_forward,
            bf16_masters=a.optimizer == "adamw-bf16", offload=a.offload, ep_overlap=a.ep_overlap, world=world,
            pp_fsdp=a.pp_fsdp,
        )  # fmt: skip

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def check_pipeline(self, a, lora: bool) -> None:
        """:func:`refuse_pipeline` for this layout's ``--pp``."""
        refuse_pipeline(self.pp_size, a, lora)

    @property
    def stages_needed(self) -> int:
        """The micro-batches each data-parallel group needs at least per step: the pipeline's stages under 1F1B,
        Interleaved1F1B and DualPipeV (torch's schedules refuse fewer) and ZBVZeroBubble (which would run fewer with
        the missing ones as bubbles); GPipe takes any count; else 1."""
        if self.pp_size == 1 or self.pp_schedule == "GPipe":
            return 1
        return self.pp_size * self.stages_per_rank

    @property
    def min_microbatches(self) -> int:
        """The fewest micro-batches a step needs under this layout: ``dp x`` :attr:`stages_needed` (what
        ``kimi_tools.train.args.default_batch_tokens`` gives a run without ``--batch-tokens``)."""
        return self.dp_size * self.stages_needed

    def _deals(self, accum: int) -> bool:
        """Whether ``accum`` micro-batches a step deal evenly to the ``dp`` groups, :attr:`stages_needed` or more
        each, in whole rounds of ``pp`` under Interleaved1F1B (torch's rule: a multiple of ``max(1, n // pp)``)."""
        n = accum // self.dp_size
        ok = accum % self.dp_size == 0 and n >= self.stages_needed
        return ok and (self.pp_schedule != "Interleaved1F1B" or n % max(1, n // self.pp_size) == 0)

    def check_accum(self, accum: int, micro_batch_tokens: int, seq_len: int | None = None, resumed: bool = False):
        """Refuse a step whose ``accum`` micro-batches of ``micro_batch_tokens`` cannot be dealt to the ``dp`` groups
        (evenly: FSDP2's collectives need every rank to run the same forwards; with ``--pp`` at least
        :attr:`stages_needed` each, which become the pipeline's micro-batches, :attr:`n_microbatches`). The one
        line names the sizes and what works: a ``--micro-batch-tokens`` (whole rows of ``seq_len``) that deals the
        same tokens per step, a ``--batch-tokens`` (not when ``resumed``: a run keeps its tokens per step), or
        another layout."""
        self.n_microbatches = max(accum // self.dp_size, 1)
        if self._deals(accum):
            return
        dp, need, batch = self.dp_size, self.stages_needed, accum * micro_batch_tokens
        world = self.pp_size * dp * self.cp_size
        sizes = f"--dp {dp} of world {world} = " + f"--pp {self.pp_size} x " * (self.pp_size > 1)
        sizes += f"--dp {dp} x --cp {self.cp_size}"
        pipe = f"; --pp {self.pp_size} --pp-schedule {self.pp_schedule} runs {need} stages" if need > 1 else ""
        row_tokens = seq_len or micro_batch_tokens
        rows = batch // row_tokens
        fits = [m for m in range(1, rows + 1) if rows % m == 0 and self._deals(rows // m)]
        ways = []
        if fits:
            smaller = [m for m in fits if m * row_tokens <= micro_batch_tokens]
            m = max(smaller) if smaller else min(fits)
            ways.append(f"--micro-batch-tokens {m * row_tokens:,} (the same tokens per step)")
        if not resumed:  # dp x need x j micro-batches always deal, so the search ends
            k = next(k for k in itertools.count(accum + 1) if self._deals(k))
            default = self.min_microbatches * micro_batch_tokens
            if k * micro_batch_tokens != default:
                ways.append(f"--batch-tokens {k * micro_batch_tokens:,}")
            ways.append(f"no --batch-tokens (the default: {default:,})")
        elif not fits:
            ways.append(
                f"a layout that deals the step's {rows} row(s) of {row_tokens:,} tokens (e.g. --cp in place of --dp, "
                "or --pp with --pp-schedule GPipe)"
            )
        n = f"{accum} micro-batch" + "es" * (accum > 1)
        raise ValueError(
            f"--batch-tokens: {batch:,} tokens per step"
            + (" (the run's, kept on --resume)" if resumed else "")
            + f" = {n} of --micro-batch-tokens {micro_batch_tokens:,}, which cannot be dealt to the {dp} "
            f"data-parallel group{'s' * (dp > 1)} ({sizes}{pipe})"
            + (f" at {need} or more each" if need > 1 else " evenly")
            + (
                f" (under {self.pp_schedule}: a multiple of n // {self.pp_size} each)"
                if self.pp_schedule == "Interleaved1F1B"
                else ""
            )
            + f"; expected {' or '.join(ways)}"
        )

    def setup(self, model: nn.Module, lora: bool, replicated: Callable[[str], bool] | None = None, args=None) -> None:
        """Parallelize ``model`` for this run through the one ``kernels_torch.parallel.parallelize.parallelize``
        (context, experts, pipeline stages, recomputation and activation offload, compile, FSDP2, in that order),
        before the optimizer is built (``fully_shard`` replaces the parameters): :attr:`ctx`, :attr:`pipe` and
        :attr:`module` (what trains) are set. In one process only ``args``' recomputation, offload and compile apply.

        Args:
            model: the model (on ``meta`` under torchrun, materialised afterwards by the caller).
            lora: accepted for the record (the frozen base stays in its dtype, the adapters train as masters).
            replicated: ``replicated(name)``: trainable parameters FSDP2 leaves whole on every rank.
            args: the run's ``TrainArgs`` for the activation memory and compile policy (None: none of them).
        """
        from kernels_torch.parallel.parallelize import parallelize

        self.module = model
        policy = self._policy(model, args)
        if not self.enabled:
            self.module = parallelize(model, None, policy).module
            return
        from kernels_torch.moe import KimiMoE
        from kernels_torch.parallel.fsdp import fp32_compute_params

        moes = [m for m in model.modules() if isinstance(m, KimiMoE)]
        if self.ep_size > 1 and not moes:
            raise ValueError(f"--ep: got {self.ep_size}, but the model has no MoE layer (nothing to shard); drop --ep")
        if moes and moes[0].config.num_experts % self.ep_size:
            raise ValueError(
                f"--ep: got {self.ep_size}, expected a divisor of the model's {moes[0].config.num_experts} routed "
                "experts (each rank owns num_experts / ep of them)"
            )
        ignored = {p for n, p in model.named_parameters() if replicated is not None and replicated(n)}
        ignored |= set(fp32_compute_params(model, policy.param_dtype))
        if self.pp_size > 1:
            self._check_stage_count(model.config)
        try:
            done = parallelize(model, self.mesh, policy, ignored_params=ignored)
        except ValueError as e:  # the pipeline's cut: name the flag that asked for it
            if self.pp_size == 1 or not str(e).startswith("pipeline: "):
                raise
            flag = "--pp-layout" if self.pp_counts is not None else "--pp"
            raise ValueError(f"{flag}: {str(e).removeprefix('pipeline: ')}") from None
        self.ctx, self.pipe, self.module, self.sharded = done.ctx, done.pipe, done.module, done.sharded
        self.replicated = [p for p in self.module.parameters() if p in ignored and p.requires_grad]

    def _policy(self, model: nn.Module, args):
        """This run's :class:`kernels_torch.parallel.parallelize.ParallelPolicy`: bf16 compute for a bf16 model,
        every rank's loss weighted by the step's global target count (divide factor 1), ``--reduce-dtype``,
        ``--reshard-after-forward``, the masters' dtype (none under ``--optimizer adamw-bf16``: ``bf16_masters``),
        ``--offload``, the pipeline's schedule and cut, and from ``args`` the recomputation, activation offload and
        compile flags."""
        from kernels_torch.parallel.parallelize import ParallelPolicy, PipelineSpec

        memory = {}
        if args is not None:
            from kimi_tools.train.args import parse_layer_kinds

            if args.recompute:
                memory.update(
                    recompute=args.recompute_mode,
                    recompute_full_layers=args.recompute_full_layers,
                    recompute_kinds=parse_layer_kinds(args.recompute_layers, "--recompute-layers"),
                )
            memory.update(
                offload_activations=args.offload_activations,
                offload_kinds=parse_layer_kinds(args.offload_layers, "--offload-layers"),
                compile_backend=args.compile_backend if args.compile else None,
            )
        return ParallelPolicy(
            param_dtype=torch.bfloat16 if any(p.dtype == torch.bfloat16 for p in model.parameters()) else None,
            master_dtype=None if self.bf16_masters else torch.float32,
            reduce_dtype=REDUCE_DTYPES[self.reduce_dtype],
            reshard_after_forward=self.reshard_after_forward,
            offload=self.offload,
            ep_overlap=self.ep_overlap,
            gradient_divide_factor=1.0,
            shard_one_rank=self.shard_one_rank,
            pipeline=PipelineSpec(
                schedule=self.pp_schedule,
                layer_counts=None if self.pp_counts is None else tuple(self.pp_counts),
                stages_per_rank=self.stages_per_rank,
                n_microbatches=self.n_microbatches,
                fsdp=self.pp_fsdp,
            ),
            **memory,
        )

    def _check_stage_count(self, config) -> None:
        """Refuse (one line naming ``--pp``, the schedule's stages and what fits) more stages than the default layout
        can cut: it gives each stage one AttnRes block (a layer without AttnRes) at least; a ``--pp-layout`` with
        0 layers on the first and / or last stage (the embedding, or the head, alone) fits up to two more."""
        from kernels_torch.parallel.pipeline import stage_layout

        stages, spr = self.pp_size * self.stages_per_rank, self.stages_per_rank
        L = config.num_hidden_layers
        bs = config.attn_res_block_size if config.has_attn_res else 1
        n_blocks = -(-L // bs)
        if self.pp_counts is not None or stages <= n_blocks:
            return
        per = f" ({spr} per rank under --pp-schedule {self.pp_schedule})" if spr > 1 else ""
        unit = f"AttnRes blocks of {bs} layers" if config.has_attn_res else "layers"
        fixes = [f"--pp at most {n_blocks // spr}"] if n_blocks // spr >= 2 else []
        if spr > 1 and self.pp_size <= n_blocks:
            fixes.append(f"--pp-schedule 1F1B ({self.pp_size} stages)")
        if stages <= n_blocks + 2:
            counts = [len(r) for r in stage_layout(config, n_blocks)]
            counts = [0, *counts] + [0] * (stages - n_blocks - 1)
            fixes.append(f"--pp-layout {','.join(map(str, counts))} (the embedding and / or the head alone on a stage)")
        raise ValueError(
            f"--pp {self.pp_size}: {stages} pipeline stages{per}, but the model's {L} layers are {n_blocks} {unit} and "
            f"the default layout gives each stage one at least; expected "
            + (" or ".join(fixes) or "more layers or no --pp")
        )

    def _cp_rows(self, batches: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The ids and labels ``[R, T_r]`` of ``batches`` (``[1, T]`` each): with ``--cp`` this rank's context shard
        of every row (``kernels_torch.parallel.context.shard_bounds``), else the whole rows."""
        ids = torch.cat([b.input_ids for b in batches])
        labels = torch.cat([b.labels for b in batches])
        if self.ctx is not None:
            from kernels_torch.parallel.context import shard_bounds

            start, stop = shard_bounds(ids.shape[1], self.cp_size)[self.ctx.rank]
            ids, labels = ids[:, start:stop], labels[:, start:stop]
        return ids.to(self.device), labels.to(self.device)

    def pipeline_step(self, batches: list, n_targets: int) -> float:
        """Forward and backward of this ``dp`` group's micro-batches (``[1, T]`` :class:`kimi_tools.data.Batch`
        each, their global ``cu_seqlens`` with them; with ``--cp`` this rank's context shard of each) through the
        pipeline, each micro-batch's summed NLL divided by the step's ``n_targets`` (all groups), then the
        replicated parameters' gradients summed (:meth:`reduce_replicated`); returns the step's loss summed over
        the ``dp x cp`` ranks of this pipeline coordinate."""
        ids, labels = self._cp_rows(batches)
        loss = self.pipe.step(ids, labels, [b.cu_seqlens for b in batches], n_tokens=max(n_targets, 1))
        self.reduce_replicated()
        return self._sum([float(loss)], self.mesh["dp_cp"].get_group())[0]

    def pipeline_eval(self, batches: list) -> float:
        """The mean NLL over ``batches`` (every ``dp`` group evaluates all of them; with ``--cp`` each rank its
        shard, the summed NLLs added over ``cp``), forward only through the pipeline, one batch at a time."""
        total, n = 0.0, 0
        for b in batches:
            ids, labels = self._cp_rows([b])
            nll = self.pipe.evaluate(ids, labels, [b.cu_seqlens], n_tokens=1)
            total, n = total + float(nll), n + b.num_targets
        return self.sum_cp([total])[0] / max(n, 1)

    def reshard(self, model: nn.Module) -> None:
        """Free the FSDP2 units a forward-only pass left gathered (``kernels_torch.parallel.fsdp.reshard``): call
        after an evaluation, so that the optimizer's sharded parameters are the model's again."""
        if self.enabled:
            from kernels_torch.parallel.fsdp import reshard

            reshard(model)

    def host_grad_sums(self, model: nn.Module, offload: str):
        """The held host gradient sums of ``model``'s FSDP2-offloaded parameters
        (``kernels_torch.parallel.fsdp.HostGradSums``) where FSDP2 reduces every micro-batch under ``--offload cpu``
        (no pipeline, or ``--pp-fsdp layer``); None elsewhere (``--pp-fsdp stage`` reduces once per step) or when
        FSDP2 offloads nothing."""
        if offload != "cpu" or (self.pipe is not None and self.pipe.fsdp != "layer"):
            return None
        from kernels_torch.parallel.fsdp import HostGradSums, offloaded_params

        held = offloaded_params(model)
        return HostGradSums(held) if held else None

    def sum_pp(self, x: float) -> float:
        """Sum over this rank's pipeline group (a count of parameters: each rank holds its stages')."""
        return x if self.pipe is None else self._sum([x], self.mesh["pp"].get_group())[0]

    @property
    def norm_group(self):
        """The group over which the squared gradient norms of the ranks' parameters add up (the pipeline's: each
        rank's stages hold other parameters), or None."""
        return None if self.pipe is None else self.mesh["pp"].get_group()

    def local(self, batches: list) -> list:
        """This ``dp`` group's micro-batches of a step."""
        if not self.enabled:
            return batches
        return batches[self.mesh["dp"].get_local_rank() :: self.dp_size]

    def loss(self, stage, model: nn.Module, batch):
        """``stage.loss`` on this rank's shard of ``batch``, rescaled (the loss and each metric) by the shard's share
        of the batch's targets, so that the ``cp`` ranks' values sum to the batch's mean (``stage.loss`` divides by
        the targets it sees)."""
        if self.ctx is None:
            return stage.loss(model, batch)
        from kimi_tools.data import Batch

        ids, cu = self.ctx.shard(batch.input_ids, batch.cu_seqlens)
        part = Batch(ids, self.ctx.shard_like(batch.labels), cu)
        loss, metrics = stage.loss(model, part)
        share = part.num_targets / max(batch.num_targets, 1)
        return loss * share, {k: v * share for k, v in metrics.items()}

    def reduce_replicated(self) -> None:
        """Sum the gradients of the replicated parameters over the ranks that hold them, the ``dp x cp`` ranks of
        this pipeline coordinate (all ranks without ``--pp``; each rank's loss is weighted by the global target
        count, as FSDP's reduce-scatter with divide factor 1 sums the sharded ones)."""
        if not self.replicated:
            return
        grads = [p.grad for p in self.replicated if p.grad is not None]
        if not grads or self.mesh["dp_cp"].size() == 1:
            return
        # one flat all-reduce per accumulation dtype (fp32, or fp64 for an fp64 model: a bf16 gradient rounds once,
        # after the sum), not one per tensor
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(torch.promote_types(g.dtype, torch.float32), []).append(g)
        for dtype, gs in by_dtype.items():
            flat = torch.cat([g.reshape(-1).to(dtype) for g in gs])
            dist.all_reduce(flat, group=self.mesh["dp_cp"].get_group())
            torch._foreach_copy_(gs, [v.view_as(g) for v, g in zip(flat.split([g.numel() for g in gs]), gs)])

    def _sum(self, xs: list[float], group) -> list[float]:
        if not self.enabled or not xs:
            return xs
        t = torch.tensor(xs, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        return t.tolist()

    def sum_all(self, x: float) -> float:
        """Sum over every rank (a step's loss: disjoint micro-batches and shards)."""
        return self._sum([x], None)[0]

    def sum_all_dict(self, d: dict[str, float]) -> dict[str, float]:
        """:meth:`sum_all` of every value (one collective; every rank must hold the same keys)."""
        keys = sorted(d)
        return dict(zip(keys, self._sum([d[k] for k in keys], None)))

    def sum_cp(self, xs: list[float]) -> list[float]:
        """Sum over this rank's ``cp`` group (the eval loss: every dp group evaluates every batch)."""
        return xs if self.mesh is None else self._sum(xs, self.mesh["cp"].get_group())

    def any_rank(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag OR-ed over all ranks (a stop signal or a save one rank's clock asks for), so that every rank
        takes the same branch."""
        if not self.enabled:
            return flags
        t = torch.tensor([float(f) for f in flags], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(bool(v) for v in t.tolist())

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def save_model(self, model: nn.Module, out: Path) -> None:
        """The HF safetensors export (``kernels_torch.model.save_model``'s files; under torchrun every rank writes its
        own files, ``kernels_torch.parallel.export.export_sharded``, never gathering the model on one rank). With
        ``--pp`` ``model`` is ``pipe.rank_module()``: each rank holds its stages only and sends their pieces to the
        files' writers."""
        if self.enabled:
            from kernels_torch.parallel.export import export_sharded

            export_sharded(model, out)
        else:
            from kernels_torch.model import save_model

            save_model(model, out)

    def close(self) -> None:
        """Every rank passes a barrier (all transfers done, every file written), then the group is destroyed;
        :data:`TrainParallel.closed_group` is then set, and ``kimi_tools.cli.main`` ends the process without the
        interpreter's teardown (see there)."""
        if self.enabled and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            TrainParallel.closed_group = True
