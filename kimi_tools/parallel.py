"""``kimi train`` under ``torchrun``: the parallel wiring, kept out of the training loop.

``torchrun --nproc-per-node N -m kimi_tools.cli train ... --cp C`` runs the same loop on N processes: FSDP2 of the
decoder layers over all ranks and context parallelism over groups of ``C`` ranks (``kernels_torch.parallel``: a
``(dp = N / C, cp = C)`` mesh). Every rank reads the same data in the same order (the loader state stays one state);
the ``accum`` micro-batches of a step are dealt round-robin to the ``dp`` groups (so ``accum`` must be a multiple of
``dp``: every rank runs the same number of forwards, which FSDP2's collectives need), and inside a group each rank
takes its contiguous shard of the row. Losses are weighted by the step's global target count, so the gradient is the
sum of every rank's part (FSDP reduce-scatter with divide factor 1). Rank 0 alone writes ``run.json``, metrics and
the plot; all ranks write their shards of the DCP ``step-N/`` folder and their files of the safetensors export.

A stage may keep some parameters whole on every rank (``stage.replicated(name)``: the distillation stages' DSA
indexers, which they re-run outside the layer's forward, where FSDP2 has not gathered them): FSDP2 ignores them
and :meth:`TrainParallel.reduce_replicated` sums their gradients over all ranks after the backward.

Without ``torchrun`` (no ``WORLD_SIZE`` > 1) :class:`TrainParallel` is a no-op and ``--cp`` must be 1.

Limits: parameters in fp32 (FSDP2 mixed precision would also cast the checkpoint's fp32 tensors -- ``A_log``,
``dt_bias``, conv weights -- to bf16, so bf16 / ``cudnn`` runs are refused here); no LoRA.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TrainParallel"]


class TrainParallel:
    """What the loop asks of the parallel layout (identity in one process).

    Raises:
        ValueError: ``--cp`` that does not divide the world size, ``--cp`` > 1 without torchrun, bf16 parameters or
            LoRA under torchrun, a step's micro-batch count that is not a multiple of the ``dp`` size.
    """

    def __init__(self, cp: int, device: str):
        world = int(os.environ.get("WORLD_SIZE", "1"))
        self.enabled = world > 1
        if cp < 1 or world % cp:
            raise ValueError(f"--cp: got {cp}, expected a positive divisor of the world size {world}")
        if cp > 1 and not self.enabled:
            raise ValueError(f"--cp: got {cp} in one process, expected a launch under torchrun with a multiple of {cp}")
        self.cp_size, self.dp_size, self.device = cp, world // cp, device
        self.rank, self.mesh, self.ctx = 0, None, None
        self.replicated: list[nn.Parameter] = []
        if self.enabled:
            from kernels_torch.parallel.fsdp import init_mesh

            self.mesh = init_mesh(dp=self.dp_size, cp=cp, device_type=device)
            self.rank = dist.get_rank()

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def check_accum(self, accum: int, micro_batch_tokens: int) -> None:
        """Refuse a step whose ``accum`` micro-batches cannot be dealt evenly to the ``dp`` groups."""
        if accum % self.dp_size:
            raise ValueError(
                f"--batch-tokens: {accum} micro-batch(es) of {micro_batch_tokens} tokens per step cannot be dealt "
                f"evenly to the {self.dp_size} data-parallel groups (world {self.dp_size * self.cp_size} / --cp "
                f"{self.cp_size}); expected --batch-tokens a multiple of {self.dp_size * micro_batch_tokens}"
            )

    def setup(self, model: nn.Module, lora: bool, replicated: Callable[[str], bool] | None = None) -> None:
        """FSDP2 + CP on the model (before the optimizer is built: ``fully_shard`` replaces the parameters);
        ``replicated(name)``: trainable parameters FSDP2 leaves whole (module docstring)."""
        if not self.enabled:
            return
        if lora:
            raise ValueError(
                "--lora-rank: LoRA under torchrun is not wired (kimi_tools/parallel.py); run it in one process"
            )
        bad = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
        if bad:
            raise ValueError(
                f"--dtype: got parameters in {bad} under torchrun, expected float32 (see kimi_tools/parallel.py)"
            )
        from kernels_torch.parallel.fsdp import parallelize

        if replicated is not None:
            self.replicated = [p for n, p in model.named_parameters() if replicated(n)]
        self.ctx = parallelize(model, self.mesh, gradient_divide_factor=1.0, ignored_params=set(self.replicated))

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
                dist.all_reduce(p.grad)

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
