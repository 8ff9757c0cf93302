"""``kimi train`` under ``torchrun``: the parallel wiring, kept out of the training loop.

``torchrun --nproc-per-node N -m kimi_tools.cli train ... [--dp D] [--cp C] [--ep X]`` runs the same loop on N
processes over one mesh (:mod:`kernels_torch.parallel.mesh`): ``D x C = N`` (``--dp`` fills the rest of the world
unless given), context parallelism over groups of ``C`` ranks, expert parallelism over groups of ``X`` ranks (``X``
divides ``D x C`` and adds no rank: the routed experts take a second view of the same ranks, ``Shard(0)`` over ``ep``
and FSDP2 over the ``efsdp = D x C / X`` ranks that hold the same experts), FSDP2 of everything else over all
``D x C`` ranks (``kernels_torch.parallel.fsdp.parallelize``). Every rank reads the same data in the same order (the
loader state stays one state); the ``accum`` micro-batches of a step are dealt round-robin to the ``dp`` groups (so
``accum`` must be a multiple of ``dp``: every rank runs the same number of forwards, which FSDP2's collectives need),
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

Without ``torchrun`` :class:`TrainParallel` is a no-op and ``--cp``, ``--ep``, ``--dp`` must be 1 (or absent);
``torchrun --nproc-per-node 1`` runs the parallel path on one rank (FSDP2 over one rank, bf16 mixed precision).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TrainParallel", "under_torchrun"]


def under_torchrun() -> bool:
    """Whether this process was started by ``torchrun`` (its ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` set)."""
    return all(k in os.environ for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


class TrainParallel:
    """What the loop asks of the parallel layout (identity in one process).

    Args:
        cp, dp, ep: ``--cp``, ``--dp`` (None: the rest of the world), ``--ep``. device: ``cpu`` (gloo) or ``cuda``
            (NCCL). world: the world size (default ``$WORLD_SIZE`` under torchrun, else 1).

    Raises:
        ValueError (one line naming the flags and values; before any process group is made): a size < 1;
            ``--cp``/``--ep``/``--dp`` > 1 without torchrun; ``--dp x --cp`` not the world size; ``--ep`` not
            dividing ``--dp x --cp``; at :meth:`setup`, ``--ep`` not dividing the model's routed experts, or a model
            without MoE layer; at :meth:`check_accum`, a step's micro-batch count that is not a multiple of ``--dp``.
    """

    def __init__(self, cp: int, device: str, *, dp: int | None = None, ep: int = 1, world: int | None = None):
        from kernels_torch.parallel.mesh import ParallelDims

        self.enabled = under_torchrun() or int(os.environ.get("WORLD_SIZE", "1")) > 1 if world is None else True
        world = (int(os.environ.get("WORLD_SIZE", "1")) if self.enabled else 1) if world is None else world
        for flag, v in (("--cp", cp), ("--dp", dp), ("--ep", ep)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag}: got {v!r}, expected a positive integer")
        if not self.enabled:
            given = [f"{f} {v}" for f, v in (("--cp", cp), ("--dp", dp), ("--ep", ep)) if v is not None and v > 1]
            if given:
                raise ValueError(
                    f"{' '.join(given)}: given in one process, expected a launch under torchrun (torchrun "
                    "--nproc-per-node N -m kimi_tools.cli train ...)"
                )
        if dp is None and world % cp:
            raise ValueError(f"--cp: got {cp}, expected a positive divisor of the world size {world}")
        dp = world // cp if dp is None else dp
        if dp * cp != world:
            raise ValueError(f"--dp/--cp: got --dp {dp} x --cp {cp} = {dp * cp} ranks, expected the world size {world}")
        if (dp * cp) % ep:
            raise ValueError(
                f"--ep: got {ep}, expected a divisor of --dp x --cp = {dp} x {cp} = {dp * cp} (expert parallelism "
                "regroups those ranks; it adds none)"
            )
        self.dims = ParallelDims(world, dp=dp, cp=cp, ep=ep)
        self.cp_size, self.dp_size, self.ep_size, self.device = cp, dp, ep, device
        self.rank, self.mesh, self.ctx = 0, None, None
        self.replicated: list[nn.Parameter] = []
        if self.enabled:
            from kernels_torch.parallel.fsdp import init_mesh

            self.mesh = init_mesh(dp=dp, cp=cp, device_type=device, ep=ep)
            self.rank = dist.get_rank()

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def check_accum(self, accum: int, micro_batch_tokens: int) -> None:
        """Refuse a step whose ``accum`` micro-batches cannot be dealt evenly to the ``dp`` groups."""
        if accum % self.dp_size:
            raise ValueError(
                f"--batch-tokens: {accum} micro-batch(es) of {micro_batch_tokens} tokens per step cannot be dealt "
                f"evenly to the {self.dp_size} data-parallel groups (--dp {self.dp_size} = world "
                f"{self.dp_size * self.cp_size} / --cp {self.cp_size}); expected --batch-tokens a multiple of "
                f"{self.dp_size * micro_batch_tokens}"
            )

    def setup(self, model: nn.Module, lora: bool, replicated: Callable[[str], bool] | None = None) -> None:
        """Context, expert and FSDP2 parallelism on the model (module docstring), before the optimizer is built
        (``fully_shard`` replaces the parameters); ``replicated(name)``: trainable parameters FSDP2 leaves whole.
        The model may be on ``meta`` (materialised after this by the caller). ``lora`` is accepted for the record
        (its frozen base stays in its dtype, the adapters train as fp32 masters)."""
        if not self.enabled:
            return
        from kernels_torch.moe import KimiMoE
        from kernels_torch.parallel.fsdp import fp32_compute_params, parallelize

        moes = [m for m in model.modules() if isinstance(m, KimiMoE)]
        if self.ep_size > 1 and not moes:
            raise ValueError(f"--ep: got {self.ep_size}, but the model has no MoE layer (nothing to shard); drop --ep")
        if moes and moes[0].config.num_experts % self.ep_size:
            raise ValueError(
                f"--ep: got {self.ep_size}, expected a divisor of the model's {moes[0].config.num_experts} routed "
                "experts (each rank owns num_experts / ep of them)"
            )
        param_dtype = torch.bfloat16 if any(p.dtype == torch.bfloat16 for p in model.parameters()) else None
        ignored = {p for n, p in model.named_parameters() if replicated is not None and replicated(n)}
        ignored |= set(fp32_compute_params(model, param_dtype))
        self.replicated = [p for p in model.parameters() if p in ignored and p.requires_grad]
        self.ctx = parallelize(
            model, self.mesh, param_dtype=param_dtype, gradient_divide_factor=1.0, ignored_params=ignored
        )

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
        """Sum the gradients of the replicated parameters over all ranks (each rank's loss is weighted by the global
        target count, as FSDP's reduce-scatter with divide factor 1 sums the sharded ones)."""
        for p in self.replicated:
            if p.grad is not None:
                g = p.grad.float()  # summed in fp32 (a bf16 gradient rounds once, after the sum)
                dist.all_reduce(g)
                p.grad.copy_(g)

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
        own files, ``kernels_torch.parallel.export.export_sharded``, never gathering the model on one rank)."""
        if self.enabled:
            from kernels_torch.parallel.export import export_sharded

            export_sharded(model, out)
        else:
            from kernels_torch.model import save_model

            save_model(model, out)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
