"""``kimi train`` under ``torchrun``: the parallel wiring, kept out of the training loop.

``torchrun --nproc-per-node N -m kimi_tools.cli train ... --cp C`` runs the same loop on N processes: FSDP2 of the
decoder layers over all ranks and context parallelism over groups of ``C`` ranks (``kernels_torch.parallel``: a
``(dp = N / C, cp = C)`` mesh). Every rank reads the same data in the same order (the loader state stays one state);
the ``accum`` micro-batches of a step are dealt round-robin to the ``dp`` groups, and inside a group each rank takes
its contiguous shard of the row. Losses are weighted by the step's global target count, so the gradient is the sum
of every rank's part (FSDP reduce-scatter with divide factor 1). Rank 0 alone writes ``run.json``, metrics, the
safetensors export and the plot; all ranks write their shards of the DCP ``step-N/`` folder.

Without ``torchrun`` (no ``WORLD_SIZE`` > 1) :class:`TrainParallel` is a no-op and ``--cp`` must be 1.

Limits: parameters in fp32 (FSDP2 mixed precision would also cast the checkpoint's fp32 tensors -- ``A_log``,
``dt_bias``, conv weights -- to bf16, so bf16 / ``cudnn`` runs are refused here); no LoRA.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["TrainParallel"]


class TrainParallel:
    """What the loop asks of the parallel layout (identity in one process).

    Raises:
        ValueError: ``--cp`` that does not divide the world size, ``--cp`` > 1 without torchrun, bf16 parameters or
            LoRA under torchrun.
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
        if self.enabled:
            from kernels_torch.parallel.fsdp import init_mesh

            self.mesh = init_mesh(dp=self.dp_size, cp=cp, device_type=device)
            self.rank = dist.get_rank()

    @property
    def is_writer(self) -> bool:
        return self.rank == 0

    def setup(self, model: nn.Module, lora: bool) -> None:
        """FSDP2 + CP on the model (before the optimizer is built: ``fully_shard`` replaces the parameters)."""
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

        self.ctx = parallelize(model, self.mesh, gradient_divide_factor=1.0)

    def local(self, batches: list) -> list:
        """This ``dp`` group's micro-batches of a step."""
        if not self.enabled:
            return batches
        return batches[self.mesh["dp"].get_local_rank() :: self.dp_size]

    def loss(self, stage, model: nn.Module, batch):
        """``stage.loss`` on this rank's shard of ``batch``, rescaled so the ``cp`` ranks' losses sum to the
        batch's mean loss (``stage.loss`` divides by the targets it sees)."""
        if self.ctx is None:
            return stage.loss(model, batch)
        from kimi_tools.data import Batch

        ids, cu = self.ctx.shard(batch.input_ids, batch.cu_seqlens)
        part = Batch(ids, self.ctx.shard_like(batch.labels), cu)
        loss, metrics = stage.loss(model, part)
        return loss * (part.num_targets / max(batch.num_targets, 1)), metrics

    def _sum(self, x: float, group) -> float:
        if not self.enabled:
            return x
        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=group)
        return float(t[0])

    def sum_all(self, x: float) -> float:
        """Sum over every rank (a step's loss: disjoint micro-batches and shards)."""
        return self._sum(x, None)

    def sum_cp(self, x: float) -> float:
        """Sum over this rank's ``cp`` group (the eval loss: every dp group evaluates every batch)."""
        return x if self.mesh is None else self._sum(x, self.mesh["cp"].get_group())

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def save_model(self, model: nn.Module, out: Path) -> None:
        """The HF safetensors export (``kernels_torch.model.save_model``; gathered from the shards under FSDP)."""
        if self.enabled:
            from kernels_torch.parallel.fsdp import export_safetensors

            export_safetensors(model, out)
        else:
            from kernels_torch.model import save_model

            save_model(model, out)

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
