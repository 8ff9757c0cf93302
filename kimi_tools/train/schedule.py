"""The learning-rate schedule: a pure function of the optimizer step (nanochat's ``get_lr_multiplier``), wired into
``torch.optim.lr_scheduler.LambdaLR`` so that its state is the step count DCP saves with the run."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = ["lr_multiplier", "build_scheduler", "ScheduleState"]


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning-rate multiplier of optimizer step ``step`` (0-based): linear warm-up, then cosine decay.

    ``(step + 1) / warmup_steps`` while ``step < warmup_steps``; then
    ``min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * p)) / 2`` with ``p = (step - warmup_steps) /
    (total_steps - warmup_steps)`` in [0, 1) (SGDR, Loshchilov & Hutter 2017, without restarts). Pure.

    Raises:
        ValueError: ``step`` outside [0, total_steps), ``warmup_steps`` outside [0, total_steps), or
            ``min_lr_ratio`` outside [0, 1].
    """
    if not 0 <= warmup_steps < max(total_steps, 1):
        raise ValueError(f"--warmup-steps: got {warmup_steps}, expected an integer in [0, {total_steps}) (--steps)")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"--min-lr-ratio: got {min_lr_ratio}, expected a fraction in [0, 1]")
    if not 0 <= step < total_steps:
        raise ValueError(f"step: got {step}, expected an integer in [0, {total_steps})")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def build_scheduler(optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_lr_ratio: float):
    """``LambdaLR`` over :func:`lr_multiplier`: before the optimizer's k-th step (k = 0, 1, ...) every group's lr is
    its base lr times ``lr_multiplier(k)``; call ``scheduler.step()`` after each ``optimizer.step()``."""
    import torch

    def multiplier(k: int) -> float:
        # LambdaLR evaluates k = total_steps once, after the last step (nothing steps with it)
        return lr_multiplier(
            min(k, total_steps - 1), warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, multiplier)


class ScheduleState:
    """The ``lr_scheduler`` entry of a resume state: the step count of a ``LambdaLR`` (``last_epoch``,
    ``_step_count``), the whole of what the schedule depends on. Its per-group lists (``base_lrs``, ``_last_lr``)
    are left out: they follow from ``--lr`` and the optimizer's groups, which differ between ranks that hold
    different parameters (pipeline stages: a stage without vectors has one group), and a resume state written with
    them still loads (only these keys are read)."""

    KEYS = ("last_epoch", "_step_count")

    def __init__(self, scheduler):
        self.scheduler = scheduler

    def state_dict(self) -> dict:
        d = self.scheduler.state_dict()
        return {k: d[k] for k in self.KEYS}

    def load_state_dict(self, state: dict) -> None:
        d = self.scheduler.state_dict()
        d.update({k: state[k] for k in self.KEYS})
        self.scheduler.load_state_dict(d)
