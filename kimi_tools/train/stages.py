"""Training objectives (``--stage NAME``): which parameters train and what loss they minimise.

A stage is any object with

* ``trainable(name) -> bool``: whether the parameter of that canonical name may train (it can only narrow the set:
  parameters the backend or LoRA froze stay frozen, unless ``prepare`` unfreezes them);
* ``loss(model, batch) -> (loss, metrics)``: ``loss`` a scalar tensor, the mean over the micro-batch's targets;
  ``metrics`` a dict of floats, averaged over the step like the loss and appended to the step's record (and shown as
  ``eval_<key>`` for evaluations);

and optionally

* ``prepare(model)``: called right after the model is built, before LoRA and the trainable set (the distillation
  stages unfreeze the ``cudnn`` backend's indexers here);
* ``check_parallel(dp, cp)``: raise ValueError for a layout the stage cannot run in (before anything is written);
* ``replicated(name) -> bool``: parameters the stage uses outside the model's forward (the distillation's indexer
  re-run), which FSDP2 must then leave whole on every rank; the loop all-reduces their gradients.

Register a factory ``(config, args) -> stage`` in :data:`STAGES` (or a ``"module:attr"`` string, imported on use).
The eval loss is the stage's loss too, so a stage's runs are resumable and plotted like the LM stage's.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kimi.config import KimiConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

    from kimi_tools.data import Batch

__all__ = ["Stage", "LMStage", "STAGES", "make_stage"]


class Stage(Protocol):
    """A training objective (module docstring)."""

    def trainable(self, name: str) -> bool: ...

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]: ...


class LMStage:
    """Next-token cross-entropy over the batch's targets (``labels != IGNORE_INDEX``), in fp32, computed by the
    model's ``forward(..., labels=)`` without materialising the logits (``kernels_torch.loss.linear_cross_entropy``).

    Trains everything except the DSA indexer (``*.indexer.*``: hard top-k, no LM-loss gradient) and the router's
    ``e_score_correction_bias``, which aux-loss-free balancing updates by a rule, not by gradient (DeepSeek-V3
    section 2.1.2).
    """

    def __init__(self, config: KimiConfig, args: Any = None):
        self.config = config

    def trainable(self, name: str) -> bool:
        return ".indexer." not in name and not name.endswith("e_score_correction_bias")

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        # the summed NLL inside the model's forward, in row chunks: the [T, vocab] logits never exist at once
        # (kernels_torch.loss.linear_cross_entropy; = F.cross_entropy of the logits: tests/test_linear_cross_entropy.py)
        total = model.loss(batch.input_ids, batch.labels, batch.cu_seqlens)
        return total / max(batch.num_targets, 1), {}


STAGES: dict[str, Callable[[KimiConfig, Any], Stage] | str] = {
    "lm": LMStage,
    "indexer-warmup": "kimi_tools.distill:WarmupStage",  # DeepSeek-V3.2 dense warm-up of the DSA indexers
    "sparse": "kimi_tools.distill:SparseStage",  # DeepSeek-V3.2 sparse stage: LM loss + indexer KL over S_t
}


def make_stage(name: str, config: KimiConfig, args: Any) -> Stage:
    """The stage registered as ``name`` in :data:`STAGES`, built for ``config`` and the run's arguments.

    Raises:
        ValueError: an unknown name (listing the registered ones), or what the stage's factory raises.
    """
    if name not in STAGES:
        raise ValueError(f"--stage: got {name!r}, expected one of {sorted(STAGES)}")
    factory = STAGES[name]
    if isinstance(factory, str):
        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(config, args)
