"""``kimi train``: full fine-tuning (or LoRA) of the torch twin on packed real text, resumable exactly.

Modelled on nanochat's ``scripts/base_train.py`` (one loop read top to bottom; the schedule a pure function of the
step; one record per step) and torchtitan's checkpointer (named ``Stateful``s saved by
``torch.distributed.checkpoint`` into ``step-N/`` folders, valid only with their ``.metadata``).

Python API: ``train(TrainArgs(...)) -> TrainResult`` (the CLI is a thin wrapper). What it does, in order:

1. **Check everything first** (arguments, data, model source, LoRA options, the output folder): a bad input raises
   ``ValueError`` with one line naming the field, before anything is written.
2. **Model**: ``--checkpoint DIR`` (read lazily, ``--layers N`` keeps the first N layers) or ``--preset NAME``
   (random init, :func:`kimi.init.init_params`, ``--seed``), on ``--backend`` in ``--dtype``. Parameters stay in
   the checkpoint's dtypes (``A_log``, ``dt_bias``, conv weights, ``o_norm`` in fp32). In bf16 the optimizer
   works on **fp32 master copies** of the trainable parameters (gradients are copied up, the update is copied
   down), so AdamW state and updates are fp32.
3. **Trainable parameters** = those the stage allows (``lm``: everything except the DSA indexer, which the hard
   top-k gives no LM-loss gradient, and the router's ``e_score_correction_bias``, which aux-loss-free balancing
   updates by a rule, not by gradient: DeepSeek-V3 section 2.1.2), minus ``--freeze`` glob patterns
   (``fnmatch`` on the canonical parameter name), and with LoRA only the adapters. Frozen parameters have
   ``requires_grad=False`` and are not in the optimizer.
4. **Data** (:mod:`kimi_tools.data`): documents packed into rows of ``--seq-len`` tokens with ``cu_seqlens``;
   ``--micro-batch-tokens`` per forward (whole rows), ``--batch-tokens`` per optimizer step (gradient
   accumulation). The loss is the mean cross-entropy over the step's target tokens (micro-batches weighted by their
   target count, so accumulation equals one big batch). Eval: ``--eval-data`` or the last ``--eval-fraction`` of
   the tokens held out; up to ``--eval-tokens`` tokens, at step 0, every ``--eval-every`` steps and at the end.
5. **Step**: AdamW (``torch.optim``, decay on matrices only), warm-up + cosine (:func:`lr_multiplier` through
   ``LambdaLR``), gradient clipping at ``--grad-clip`` (the record holds the norm before clipping), per-layer
   activation recomputation with ``--recompute`` (``torch.utils.checkpoint``, non-reentrant; ``--recompute-mode
   layer | mlp``: each whole layer or only its MLP / MoE block).
6. **Output folder** ``--out``: ``run.json`` (resolved arguments, model config, fingerprint); ``metrics.jsonl``
   (one record per step, keys :data:`RECORD_KEYS` plus the stage's metrics; a ``step`` 0 record holds the first
   eval loss); ``step-N/`` DCP folders (trainable weights, fp32 masters, AdamW, schedule, data position, RNG,
   step and tokens seen; the latest ``--keep``); the model in the HF safetensors layout
   (:func:`kimi.checkpoint.save_params` through :func:`kernels_torch.model.save_model`: ``config.json``, shards,
   index; loadable by ``kimi compare --checkpoint``, ``kimi logits`` and ``reference_jax.model.load_model``) or,
   with LoRA, the adapter in peft's two files; ``loss.png`` at the end. Routed experts of an MXFP4 checkpoint are
   re-quantised on export (the checkpoint format); the DCP state keeps the exact weights.
7. **Resume** (``--resume``, same arguments): the fingerprint of the model config and of every argument that
   changes the numbers must match ``run.json``; the latest ``step-N`` is loaded and the run continues exactly
   (bitwise on CPU in fp32). ``--stop-after N`` ends a run early at step N (the schedule still spans ``--steps``).
8. **Divergence**: a step whose loss or gradient norm is not finite updates nothing; the run saves the state before
   it as ``step-(N-1)/`` (unless there already, or under ``--no-save``) with its model, writes :data:`DIVERGED`
   (step, loss, gradient norm, last good step) and ``loss.png``, and raises one line naming the step and the loss.
   The folder is then what ``--stop-after N-1`` would have left plus ``diverged.json``: ``--resume`` continues from
   step N-1 (and removes the marker); the metrics hold steps 0 to N-1.

MFU: ``kimi.flops.estimate_flops(cfg, seq_len, backward=True)["flops_per_token"] * tokens/s`` over
``--peak-tflops`` (no default: ``mfu`` is null without it).

**Extension points.**

* *Stages* (indexer distillation and other objectives): a stage is any object with ``trainable(name) -> bool`` and
  ``loss(model, batch) -> (loss, metrics)``: ``loss`` a scalar tensor, the mean over the micro-batch's targets;
  ``metrics`` a dict of floats, averaged over the step like the loss and appended to the step's record (and
  shown as ``eval_<key>`` for evaluations). Register a factory ``(config, args) -> stage`` in :data:`STAGES`
  (or a ``"module:attr"`` string, imported on use), then ``--stage NAME`` selects it. ``trainable`` can only narrow
  the set: parameters the backend (the ``cudnn`` indexer) or LoRA froze stay frozen, unless the stage's optional
  ``prepare(model)`` (called right after the model is built, before LoRA) unfreezes them, as the distillation
  stages do for the ``cudnn`` indexers. The eval loss is the stage's
  loss too, so a stage's runs are resumable and plotted like the LM stage's.
* *LoRA* (``kimi_tools.lora``): ``--lora-rank R`` switches it on; ``check_lora_supported`` vets the options against
  the backend, ``apply_lora`` wraps the target modules and freezes the base, ``save_adapter`` writes the output.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import hashlib
import io
import json
import math
import os
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from kimi.config import PRESETS, KimiConfig
from kimi_tools.common import CliError, positive_int, write_atomic

if TYPE_CHECKING:  # torch is imported where it is used, so that ``kimi info`` and ``--help`` start fast
    import torch
    from torch import nn

    from kimi_tools.data import Batch

__all__ = [
    "TrainArgs",
    "TrainResult",
    "train",
    "lr_multiplier",
    "Stage",
    "LMStage",
    "STAGES",
    "RECORD_KEYS",
    "add_parser",
    "cmd_train",
]

DIVERGED = "diverged.json"  # written beside step-N when a step's loss or gradient norm is not finite

RECORD_KEYS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes")

# Arguments that do not change the numbers of a run: they may differ between a run and its resumption.
_RUN_CONTROL = (
    "out",
    "resume",
    "stop_after",
    "quiet",
    "save",
    "save_every",
    "keep",
    "eval_every",
    "peak_tflops",
    "plot",
    "cp",
    "recompute_mode",  # what --recompute recomputes: the same numbers either way (tests/test_train.py)
)


# ---------------------------------------------------------------------------------------------- arguments


@dataclass
class TrainArgs:
    """Everything a training run depends on; the CLI flags map one to one (``--seq-len`` -> ``seq_len``).

    Sizes are in tokens, ``lr`` is the peak learning rate, ``steps`` the schedule's length in optimizer steps.
    ``None`` defaults are resolved by :func:`train` (and written to ``run.json``): ``preset`` "tiny" when no
    ``checkpoint``; ``micro_batch_tokens`` = ``seq_len``; ``batch_tokens`` = ``micro_batch_tokens``; ``dtype``
    "bfloat16" on the cudnn backend else "float32"; ``device`` "cuda" for cudnn, else "cpu";
    ``lora_alpha`` = 2 * ``lora_rank``.
    """

    out: str
    data: list[str]
    checkpoint: str | None = None
    preset: str | None = None
    layers: int | None = None
    steps: int = 100
    stop_after: int | None = None
    eval_data: list[str] | None = None
    eval_fraction: float = 0.05
    eval_tokens: int = 8192
    eval_every: int = 25
    seq_len: int = 256
    micro_batch_tokens: int | None = None
    batch_tokens: int | None = None
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup_steps: int | None = None  # None: min(10, steps // 10)
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    backend: str = "sdpa"
    dtype: str | None = None
    device: str | None = None
    recompute: bool = False
    recompute_mode: str = "layer"  # "layer" | "mlp" (see recompute_layers)
    freeze: list[str] = field(default_factory=list)
    stage: str = "lm"
    seed: int = 0
    shuffle: bool = True
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_dropout: float = 0.0
    lora_targets: list[str] | None = None
    resume: bool = False
    save: bool = True  # False: no weights and no step-N/ (a measurement run: metrics.jsonl and loss.png only)
    save_every: int = 0
    keep: int = 2
    peak_tflops: float | None = None
    quiet: bool = False
    plot: bool = True
    cp: int = 1


@dataclass
class TrainResult:
    """What a run did: ``records`` are the metrics.jsonl records of this process (``step`` 0 first on a fresh run);
    ``eval_losses`` maps step -> eval loss over the whole run (earlier records read back on resume)."""

    out: Path
    start_step: int
    step: int
    tokens_seen: int
    records: list[dict[str, Any]]
    eval_losses: dict[int, float]
    trainable_params: int
    total_params: int
    wall_s: float

    @property
    def final_loss(self) -> float | None:
        losses = [r["loss"] for r in self.records if r.get("loss") is not None]
        return losses[-1] if losses else None


# ---------------------------------------------------------------------------------------------- schedule


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


# ---------------------------------------------------------------------------------------------- stages


class Stage(Protocol):
    """A training objective: which parameters train and what loss they minimise (module docstring)."""

    def trainable(self, name: str) -> bool: ...

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]: ...


class LMStage:
    """Next-token cross-entropy over the batch's targets (``labels != -100``), in fp32, computed by the model's
    ``forward(..., labels=)`` without materialising the logits (``kernels_torch.loss.linear_cross_entropy``).

    Trains everything except the DSA indexer (``*.indexer.*``: hard top-k, no LM-loss gradient) and the router's
    ``e_score_correction_bias`` (not a gradient-trained parameter).
    """

    def __init__(self, config: KimiConfig, args: TrainArgs):
        self.config = config

    def trainable(self, name: str) -> bool:
        return ".indexer." not in name and not name.endswith("e_score_correction_bias")

    def loss(self, model: nn.Module, batch: Batch) -> tuple[torch.Tensor, dict[str, float]]:
        # the summed NLL inside the model's forward, in row chunks: the [T, vocab] logits never exist at once
        # (kernels_torch.loss.linear_cross_entropy; = F.cross_entropy of the logits: tests/test_linear_cross_entropy.py)
        total = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, labels=batch.labels)
        return total / max(batch.num_targets, 1), {}


STAGES: dict[str, Callable[[KimiConfig, TrainArgs], Stage] | str] = {
    "lm": LMStage,
    "indexer-warmup": "kimi_tools.distill:WarmupStage",  # DeepSeek-V3.2 dense warm-up of the DSA indexers
    "sparse": "kimi_tools.distill:SparseStage",  # DeepSeek-V3.2 sparse stage: LM loss + indexer KL over S_t
}


def _stage(name: str, config: KimiConfig, args: TrainArgs) -> Stage:
    if name not in STAGES:
        raise ValueError(f"--stage: got {name!r}, expected one of {sorted(STAGES)}")
    factory = STAGES[name]
    if isinstance(factory, str):
        import importlib

        module, _, attr = factory.partition(":")
        factory = getattr(importlib.import_module(module), attr)
    return factory(config, args)


# ---------------------------------------------------------------------------------------------- state


class _FnState:
    """A ``Stateful`` from two functions (DCP calls ``state_dict`` before save/load and ``load_state_dict`` after)."""

    def __init__(self, get: Callable[[], dict], put: Callable[[dict], None]):
        self.get, self.put = get, put

    def state_dict(self) -> dict:
        return self.get()

    def load_state_dict(self, state: dict) -> None:
        self.put(state)


class Checkpointer:
    """``step-N/`` DCP folders in ``out``: written to a temporary folder, then renamed (valid only with
    ``.metadata``); the latest ``keep`` are kept."""

    def __init__(self, out: Path, keep: int, par=None):
        self.out, self.keep, self.par = out, keep, par  # par: kimi_tools.parallel.TrainParallel (torchrun)

    def steps(self) -> list[int]:
        found = []
        for p in self.out.glob("step-*"):
            tail = p.name.removeprefix("step-")
            if tail.isdigit() and (p / ".metadata").is_file():
                found.append(int(tail))
        return sorted(found)

    def save(self, step: int, states: dict[str, Any]) -> Path:
        import torch.distributed.checkpoint as dcp

        final = self.out / f"step-{step}"
        par = self.par if self.par is not None and self.par.enabled else None
        tmp = self.out / (f".step-{step}.tmp" if par else f".step-{step}.tmp-{os.getpid()}")  # one folder, all ranks
        if par is None or par.is_writer:
            shutil.rmtree(tmp, ignore_errors=True)
        if par is not None:
            par.barrier()
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.save(states, checkpoint_id=str(tmp))
        if par is not None:
            par.barrier()
            if not par.is_writer:
                par.barrier()
                return final
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.out / f"step-{old}", ignore_errors=True)
        if par is not None:
            par.barrier()
        return final

    def load(self, step: int, states: dict[str, Any]) -> set[str]:
        """Load ``step-N`` into ``states`` in place; returns the flat keys the checkpoint holds.

        Partial loads are allowed because a parameter that never received a gradient (e.g. layer 0's unused
        AttnRes mix) has no AdamW state in the checkpoint; the caller checks the rest.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

        path = str(self.out / f"step-{step}")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process.*")
            dcp.load(states, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
        return set(FileSystemReader(path).read_metadata().state_dict_metadata)


def _fingerprint(args: TrainArgs, config: KimiConfig) -> tuple[str, dict]:
    """sha256 of the model config and of the arguments that change the numbers (not :data:`_RUN_CONTROL`)."""
    relevant = {k: v for k, v in dataclasses.asdict(args).items() if k not in _RUN_CONTROL}
    body = {"args": relevant, "config": config.to_dict()}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest(), body


_ABSENT = object()  # a key one side of a _diff lacks
_NEGATED = {"shuffle": "no_shuffle"}  # TrainArgs fields set by a --no-X flag (run control ones never differ)


def _as_flags(args: dict) -> dict:
    """run.json's ``args`` keyed as the command line spells them: ``shuffle: False`` is ``no_shuffle: True``."""
    return {_NEGATED.get(k, k): (not v if k in _NEGATED and isinstance(v, bool) else v) for k, v in args.items()}


def _show(v: Any, limit: int = 60) -> str:
    """A value of a _diff, short: ``absent``, or its repr cut to ``limit`` characters (with the item count)."""
    if v is _ABSENT:
        return "absent"
    r = repr(v)
    if len(r) <= limit:
        return r
    return r[: limit - 5] + " ...]" * isinstance(v, list) + " ...}" * isinstance(v, dict) + f" ({len(v)} items)"


def _diff(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The differences between two JSON values (run.json's and now), one ``"path (run: X, now: Y)"`` per leaf.

    Nested dicts (a checkpoint's ``text_config.linear_attn_config``) are walked, so the path names the key as it
    stands in ``config.json`` (``text_config.num_hidden_layers``); lists of equal length are compared item by item
    (``...kda_layers[5]``), so the differing item shows even in a long list; a key on one side only is ``absent``;
    anything else (a dict against None, lists of other lengths) is shown whole, cut by :func:`_show`.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{prefix}[{i}]")]
    return [] if a == b else [f"{prefix} (run: {_show(a)}, now: {_show(b)})"]


# ---------------------------------------------------------------------------------------------- set-up helpers


def _resolve(args: TrainArgs) -> TrainArgs:
    """Fill the ``None`` defaults and check every plain argument (no file is read)."""

    from kernels_torch.model import BACKENDS

    a = dataclasses.replace(args, data=list(args.data or []), freeze=list(args.freeze or []))
    if a.checkpoint is None and a.preset is None:
        a.preset = "tiny"
    if a.warmup_steps is None:
        a.warmup_steps = min(10, a.steps // 10) if isinstance(a.steps, int) else 10
    if a.checkpoint is not None and a.preset is not None:
        raise ValueError("--checkpoint/--preset: got both, expected one model source")
    if a.preset is not None and a.preset not in PRESETS:
        raise ValueError(f"--preset: got {a.preset!r}, expected one of {sorted(PRESETS)}")
    if a.backend not in BACKENDS:
        raise ValueError(f"--backend: got {a.backend!r}, expected one of {list(BACKENDS)}")
    a.dtype = a.dtype or ("bfloat16" if a.backend == "cudnn" else "float32")
    if a.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype: got {a.dtype!r}, expected float32 or bfloat16")
    a.device = a.device or ("cuda" if a.backend == "cudnn" else "cpu")
    if a.device not in ("cpu", "cuda"):
        raise ValueError(f"--device: got {a.device!r}, expected cpu or cuda")
    if a.backend == "cudnn" and (a.device != "cuda" or a.dtype != "bfloat16"):
        raise ValueError(f"--backend cudnn: runs on cuda in bfloat16, got --device {a.device} --dtype {a.dtype}")
    for name in ("steps", "seq_len", "eval_tokens", "keep"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(a, name)}, expected a positive integer")
    if a.seq_len < 2:
        raise ValueError(f"--seq-len: got {a.seq_len}, expected at least 2 (a row needs a token and its target)")
    a.micro_batch_tokens = a.micro_batch_tokens or a.seq_len
    if a.micro_batch_tokens < a.seq_len or a.micro_batch_tokens % a.seq_len:
        raise ValueError(
            f"--micro-batch-tokens: got {a.micro_batch_tokens}, expected a positive multiple of --seq-len {a.seq_len}"
        )
    a.batch_tokens = a.batch_tokens or a.micro_batch_tokens
    if a.batch_tokens < a.micro_batch_tokens or a.batch_tokens % a.micro_batch_tokens:
        raise ValueError(
            f"--batch-tokens: got {a.batch_tokens}, expected a positive multiple of --micro-batch-tokens "
            f"{a.micro_batch_tokens}"
        )
    if a.stop_after is not None and not 1 <= a.stop_after <= a.steps:
        raise ValueError(f"--stop-after: got {a.stop_after}, expected a step in [1, {a.steps}] (--steps)")
    for name in ("eval_every", "save_every", "warmup_steps"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(a, name)}, expected an integer >= 0")
    if not (a.lr > 0 and math.isfinite(a.lr)):
        raise ValueError(f"--lr: got {a.lr}, expected a positive learning rate")
    if not (a.grad_clip >= 0 and math.isfinite(a.grad_clip)):
        raise ValueError(f"--grad-clip: got {a.grad_clip}, expected a norm >= 0 (0: no clipping)")
    if not (a.weight_decay >= 0 and 0 <= a.beta1 < 1 and 0 <= a.beta2 < 1):
        raise ValueError(
            f"--weight-decay/--beta1/--beta2: got {a.weight_decay}/{a.beta1}/{a.beta2}, expected wd >= 0 and "
            f"betas in [0, 1)"
        )
    given = (
        [f"--save-every {a.save_every}"] * bool(a.save_every)
        + [f"--stop-after {a.stop_after}"] * (a.stop_after is not None)
        + ["--resume"] * bool(a.resume)
    )
    if not a.save and given:
        raise ValueError(
            f"--no-save: a run that saves nothing cannot be stopped and resumed; got it with {', '.join(given)}, "
            "expected none of --save-every, --stop-after, --resume"
        )
    if a.peak_tflops is not None and not a.peak_tflops > 0:
        raise ValueError(f"--peak-tflops: got {a.peak_tflops}, expected a positive peak (TFLOP/s)")
    lr_multiplier(0, warmup_steps=a.warmup_steps, total_steps=a.steps, min_lr_ratio=a.min_lr_ratio)  # checks
    if a.stage not in STAGES:
        raise ValueError(f"--stage: got {a.stage!r}, expected one of {sorted(STAGES)}")
    if a.recompute_mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute-mode: got {a.recompute_mode!r}, expected one of {list(RECOMPUTE_MODES)}")
    if a.recompute_mode != "layer" and not a.recompute:  # it would be ignored: nothing recomputed
        raise ValueError(f"--recompute-mode: got {a.recompute_mode!r} without --recompute, expected --recompute too")
    lora_opts = (a.lora_alpha, a.lora_targets, a.lora_dropout or None)
    if a.lora_rank is None and any(o is not None for o in lora_opts):
        raise ValueError("--lora-alpha/--lora-dropout/--lora-targets: given without --lora-rank, expected it too")
    if a.lora_rank is not None and a.stage in ("indexer-warmup", "sparse"):
        raise ValueError(
            f"--stage {a.stage} with --lora-rank: LoRA freezes every base weight, the DSA indexer (which this stage "
            "distils, and which is no LoRA target) included, so its KL would train nothing; run the stage without LoRA"
        )
    if a.lora_rank is not None:
        if a.lora_rank < 1:
            raise ValueError(f"--lora-rank: got {a.lora_rank}, expected a positive integer")
        a.lora_alpha = float(a.lora_alpha if a.lora_alpha is not None else 2 * a.lora_rank)
    return a


def _lora_settings(a: TrainArgs):
    from kimi_tools import lora

    kw = {"dropout": a.lora_dropout}
    if a.lora_targets:
        kw["targets"] = tuple(a.lora_targets)
    settings = lora.LoraSettings(a.lora_rank, a.lora_alpha, **kw)
    lora.check_lora_supported(settings, a.backend)
    return settings


def _load_config(a: TrainArgs) -> KimiConfig:
    from kimi.config import load_config

    cfg = load_config(a.preset) if a.checkpoint is None else KimiConfig.from_json(Path(a.checkpoint))
    if a.layers is not None:
        cfg = cfg.truncated(a.layers)
    return cfg


def _build_model(a: TrainArgs, cfg: KimiConfig):
    import torch

    from kernels_torch.model import load_model, model_from_params

    dtype = getattr(torch, a.dtype)
    if a.checkpoint is not None:
        return load_model(a.checkpoint, layers=a.layers, backend=a.backend, dtype=dtype, device=a.device)
    from kimi.config import load_config
    from kimi.init import init_params

    # the full preset's config sets the residual-output scale, so --layers N gives the first N layers of the model
    params = init_params(load_config(a.preset), seed=a.seed, layers=cfg.num_hidden_layers)
    return model_from_params(cfg, params, a.backend, dtype, a.device)


def _read_data(a: TrainArgs, cfg: KimiConfig):
    from kimi.tokenizer import load_tokenizer
    from kimi_tools.data import num_targets, read_documents, split_tail, tokenize_documents

    tok = load_tokenizer(a.checkpoint, cfg.vocab_size)
    docs = tokenize_documents(read_documents(a.data, "--data"), tok.encode)
    if a.eval_data:
        eval_docs = tokenize_documents(read_documents(a.eval_data, "--eval-data"), tok.encode)
        where = "--eval-data"
    else:
        docs, eval_docs = split_tail(docs, a.eval_fraction)
        where = f"the held-out {a.eval_fraction:g} of --data"
    if num_targets(docs) == 0:
        raise ValueError("--data: no document has two tokens or more after the held-out split: nothing to predict")
    if num_targets(eval_docs) == 0:
        raise ValueError(
            f"--eval-data: {where} has no document of two tokens or more (pass --eval-data or a larger --eval-fraction)"
        )
    for d in (*docs, *eval_docs):
        if d.size and (d.min() < 0 or d.max() >= cfg.vocab_size):
            raise ValueError(f"data: token id {int(d.max())} outside [0, {cfg.vocab_size}) of the model's vocabulary")
    return tok, docs, eval_docs


def _check_out(a: TrainArgs, fingerprint: str, body: dict) -> None:
    out = Path(a.out)
    if a.resume:
        run_json = out / "run.json"
        if not run_json.is_file():
            raise ValueError(f"--resume: {out} holds no run (no run.json); start it without --resume")
        saved = json.loads(run_json.read_text(encoding="utf-8"))
        if saved.get("fingerprint") != fingerprint:
            was = saved.get("fingerprint_of", {})
            flags = [
                f"--{k.replace('_', '-')} ({v}"
                for k, _, v in (
                    d.partition(" (") for d in _diff(_as_flags(was.get("args", {})), _as_flags(body["args"]))
                )
            ]
            parts = []
            cfg_diffs = _diff(was.get("config", {}), body["config"])
            for what, diffs in (("another model config", cfg_diffs), ("other settings", flags)):
                if diffs:
                    more = f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""
                    parts.append(f"{what}: {'; '.join(diffs[:4])}{more}")
            raise ValueError(
                f"--resume: {out} holds a run with "
                + (" and ".join(parts) or "another fingerprint (run.json has no readable record of its settings)")
                + "; resume with the run's own settings, or choose another --out"
            )
        if not Checkpointer(out, a.keep).steps():
            raise ValueError(f"--resume: {out} has no complete step-N checkpoint to resume from")
    elif out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"--out: {out} exists and is not empty; pass --resume to continue the run there, or choose another --out"
        )


def _freeze(model: nn.Module, stage: Stage, patterns: list[str]) -> None:

    names = [n for n, _ in model.named_parameters()]
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(n, pat) for n in names):
            raise ValueError(f"--freeze: {pat!r} matches no parameter name (e.g. {names[0]!r}; globs: * ?)")
    for n, p in model.named_parameters():
        if p.requires_grad and (not stage.trainable(n) or any(fnmatch.fnmatchcase(n, pat) for pat in patterns)):
            p.requires_grad_(False)


def _master_copy(model: nn.Module) -> nn.Module:
    """The module the optimizer steps: ``model`` itself when every trainable parameter is fp32, else a copy of the
    module tree holding fp32 copies of the trainable parameters (frozen ones empty), same names."""
    import torch
    from torch import nn

    if all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad):
        return model
    memo: dict[int, Any] = {}
    for p in model.parameters():
        if p.requires_grad:
            memo[id(p)] = nn.Parameter(p.detach().float().clone())
        else:
            memo[id(p)] = nn.Parameter(torch.empty(0, device=p.device), requires_grad=False)
    import copy

    return copy.deepcopy(model, memo)


RECOMPUTE_MODES = ("layer", "mlp")


def recompute_layers(model: nn.Module, mode: str = "layer") -> None:
    """Activation recomputation (``torch.utils.checkpoint``, non-reentrant) on every decoder layer of ``model``:
    ``layer`` wraps the whole layer (it keeps only its inputs for the backward; its forward runs twice); ``mlp`` only
    its MLP / MoE block (``DecoderLayer.feed_forward``: the attention keeps its activations; the block's forward runs
    twice). On the H200, 4 real-dimension layers at 32K tokens (benchmark 5): ``layer`` 63 GiB and 44.6% MFU, ``mlp``
    120 GiB and 52.0%, none out of memory. Gradients are the same either way (the same ops, recomputed in order).

    Raises:
        ValueError: ``mode`` not in :data:`RECOMPUTE_MODES`.
    """
    import functools

    import torch.utils.checkpoint

    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute-mode: got {mode!r}, expected one of {list(RECOMPUTE_MODES)}")
    for layer in model.model.layers:
        name = "forward" if mode == "layer" else "feed_forward"
        fn = getattr(layer, name)
        setattr(layer, name, functools.partial(torch.utils.checkpoint.checkpoint, fn, use_reentrant=False))


def _peak_mem_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB; process-wide


def _plot(path: Path, records: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.add_subplot()
    tr = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    ev = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train loss", lw=1)
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(path, buf.getvalue())


def _copy_tokenizer(src: str | None, out: Path) -> None:
    if src is None:
        return
    for name in ("tiktoken.model", "tokenizer_config.json"):
        if (Path(src) / name).is_file():
            write_atomic(out / name, (Path(src) / name).read_bytes())


# ---------------------------------------------------------------------------------------------- the run


def train(args: TrainArgs) -> TrainResult:
    """Run (or resume) a training run; see the module docstring. Returns what it did.

    Raises:
        ValueError (also ConfigError, CheckpointError): a bad argument, data, model source, LoRA option or output
            folder, before anything is written; a non-finite loss or gradient norm during training (after the
            last good step is saved: module docstring, point 8).
    """
    import torch

    from kimi_tools.data import PackedLoader, eval_batches

    t_start = time.perf_counter()
    # ---- 1. check everything before writing anything
    a = _resolve(args)
    lora_settings = _lora_settings(a) if a.lora_rank is not None else None
    if a.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda asked for (the cudnn backend runs on CUDA), but CUDA is not available here")
    cfg = _load_config(a)
    fingerprint, body = _fingerprint(a, cfg)
    from kimi_tools.parallel import TrainParallel

    par = TrainParallel(a.cp, a.device)  # torchrun: FSDP2 + context parallelism; else a no-op
    _check_out(a, fingerprint, body)
    par.barrier()  # every rank has checked --out before rank 0 writes into it
    tok, docs, eval_docs = _read_data(a, cfg)
    rows = a.micro_batch_tokens // a.seq_len
    accum = a.batch_tokens // a.micro_batch_tokens
    loader = PackedLoader(docs, a.seq_len, rows=rows, seed=a.seed, shuffle=a.shuffle)
    evals = eval_batches(eval_docs, a.seq_len, rows, a.eval_tokens)
    stage = _stage(a.stage, cfg, a)

    # ---- 2. model, trainable set, optimizer
    torch.manual_seed(a.seed)
    model = _build_model(a, cfg)
    if hasattr(stage, "prepare"):  # e.g. the distillation stages unfreeze the cudnn backend's indexers
        stage.prepare(model)
    if lora_settings is not None:
        from kimi_tools import lora

        lora.apply_lora(model, lora_settings)
    _freeze(model, stage, a.freeze)
    par.setup(model, lora=lora_settings is not None)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("--freeze/--stage: no parameter is left to train")
    master = _master_copy(model)
    master_params = dict(master.named_parameters())
    pairs = [(p, master_params[n]) for n, p in trainable]  # (model parameter, its fp32 master; the same in fp32)
    decay = [m for _, m in pairs if m.ndim >= 2]  # matrices decay; norms, biases, A_log, dt_bias do not
    no_decay = [m for _, m in pairs if m.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(a.beta1, a.beta2),
        fused=a.device == "cuda" or None,  # one kernel, no foreach temporaries (an fp32 copy of every state list)
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: lr_multiplier(
            min(s, a.steps - 1), warmup_steps=a.warmup_steps, total_steps=a.steps, min_lr_ratio=a.min_lr_ratio
        ),
    )
    if a.recompute:
        recompute_layers(model, a.recompute_mode)
    flops_per_token = None
    if a.peak_tflops is not None:
        from kimi.flops import estimate_flops

        flops_per_token = estimate_flops(cfg, a.seq_len, backward=True)["flops_per_token"]

    # ---- 3. the state DCP saves and loads
    train_state = {"step": 0, "tokens_seen": 0}
    cuda = a.device == "cuda"

    def get_train_state() -> dict:
        d = {**train_state, "rng_cpu": torch.get_rng_state()}
        if cuda:
            d["rng_cuda"] = torch.cuda.get_rng_state()
        return d

    def put_train_state(d: dict) -> None:
        train_state.update(step=int(d["step"]), tokens_seen=int(d["tokens_seen"]))
        torch.set_rng_state(d["rng_cpu"])
        if cuda:
            torch.cuda.set_rng_state(d["rng_cuda"].cpu())

    def get_optim() -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(master, opt)

    def put_optim(d: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(master, opt, d)

    def put_weights(d: dict) -> None:
        with torch.no_grad():
            for p, m in pairs:
                if p is not m:
                    p.copy_(m)

    states = {
        "weights": _FnState(lambda: {n: m.detach() for n, m in master_params.items() if m.requires_grad}, put_weights),
        "optimizer": _FnState(get_optim, put_optim),
        "lr_scheduler": _FnState(sched.state_dict, sched.load_state_dict),
        "dataloader": loader,
        "train_state": _FnState(get_train_state, put_train_state),
    }
    out = Path(a.out)
    ckpt = Checkpointer(out, a.keep, par)
    metrics_path = out / "metrics.jsonl"
    history: list[dict] = []
    if a.resume:
        start = ckpt.steps()[-1]
        held = ckpt.load(start, states)
        missing = [f"weights.{n}" for n, m in master_params.items() if m.requires_grad and f"weights.{n}" not in held]
        missing += [f"train_state.{k}" for k in ("step", "tokens_seen", "rng_cpu") if f"train_state.{k}" not in held]
        if missing:
            raise ValueError(
                f"--resume: {out}/step-{start} lacks {', '.join(missing[:4])} (not a checkpoint of this run)"
            )
        for n, m in master_params.items():  # no AdamW state saved: the parameter never had a gradient; nor now
            if m in opt.state and f"optimizer.state.{n}.step" not in held:
                del opt.state[m]
        if start == 0:  # step-0 (a divergence at step 1) holds the placeholder state that DCP's
            opt.state.clear()  # get_optimizer_state_dict makes with a zero-lr step (AdamW step 1): a fresh run has none
        if train_state["step"] != start:
            raise ValueError(f"--resume: {out}/step-{start} holds step {train_state['step']}, expected {start}")
        if a.stop_after is not None and a.stop_after < start:
            raise ValueError(f"--stop-after: got {a.stop_after}, but the run in {out} is at step {start} already")
        if metrics_path.is_file():
            for line in metrics_path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:  # a line torn by a crash: the checkpoint says where to restart
                    continue
                if rec["step"] <= start:
                    history.append(rec)
        if par.is_writer:
            write_atomic(metrics_path, "".join(json.dumps(r) + "\n" for r in history).encode())
            (out / DIVERGED).unlink(missing_ok=True)  # continuing: a new divergence writes it again
    elif par.is_writer:
        out.mkdir(parents=True, exist_ok=True)
        run = {
            "fingerprint": fingerprint,
            "fingerprint_of": body,
            "args": dataclasses.asdict(a),
            "tokenizer": tok.name,
            "trainable_params": sum(p.numel() for _, p in trainable),
            "total_params": sum(p.numel() for p in model.parameters()),
        }
        write_atomic(out / "run.json", json.dumps(run, indent=1).encode())
        metrics_path.write_text("", encoding="utf-8")
    start = train_state["step"]
    if a.resume and start >= (a.stop_after or a.steps):
        if start < a.steps:  # stopped early by --stop-after, and asked to stop there again
            raise ValueError(
                f"--resume: the run in {out} stopped at step {start} of {a.steps}, and --stop-after {a.stop_after} "
                f"ends there too; drop --stop-after (or give a later step) to continue it"
            )
        raise ValueError(
            f"--resume: the run in {out} already finished step {start} of {a.steps}; nothing to train (its model "
            f"and metrics are there; choose another --out for a new run)"
        )

    # ---- 4. the loop
    def evaluate() -> tuple[float, dict[str, float]]:
        model.eval()
        total, n, extra = 0.0, 0, {}
        with torch.no_grad():
            for b in evals:
                loss, m = par.loss(stage, model, b.to(a.device))
                k = b.num_targets
                total, n = total + float(loss) * k, n + k
                for key, v in m.items():
                    extra[key] = extra.get(key, 0.0) + float(v) * k
        model.train()
        total = par.sum_cp(total)  # context parallel: each rank's loss is its shard's share
        return total / max(n, 1), {f"eval_{k}": v / max(n, 1) for k, v in extra.items()}

    records: list[dict] = []

    def log(rec: dict) -> None:
        records.append(rec)
        history.append(rec)
        if par.is_writer:
            with open(metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def save(step: int) -> None:
        ckpt.save(step, states)
        if lora_settings is not None:
            from kimi_tools import lora

            lora.save_adapter(model, lora_settings, out, base_checkpoint=a.checkpoint)
        else:
            par.save_model(model, out)  # kernels_torch.model.save_model; gathered from the shards under torchrun
            if par.is_writer:
                _copy_tokenizer(a.checkpoint, out)

    from tqdm.auto import tqdm

    stop = a.stop_after or a.steps
    n_train = sum(p.numel() for _, p in trainable)
    n_total = sum(p.numel() for p in model.parameters())
    if not a.quiet and par.is_writer:
        print(
            f"kimi train: {f'checkpoint {a.checkpoint}' if a.checkpoint else f'preset {a.preset} (random init, seed {a.seed})'}, "
            f"{cfg.num_hidden_layers} layers, {n_train:,} of {n_total:,} parameters trained"
            + (f" (LoRA rank {a.lora_rank})" if lora_settings is not None else "")
            + (f"; stage {a.stage}" if a.stage != "lm" else "")
            + f"; backend {a.backend}, {a.dtype}, {a.device}"
            + (f", recompute ({a.recompute_mode})" if a.recompute else "")
            + f"\n  data: {len(docs)} documents, {sum(map(len, docs)):,} tokens ({tok.name}); eval "
            f"{sum(b.num_tokens for b in evals):,} tokens; {a.batch_tokens:,} tokens per step "
            f"({accum} x {rows} rows of {a.seq_len})" + (f"\n  resumed from {out}/step-{start}" if a.resume else ""),
            flush=True,
        )
    model.train()
    if start == 0 and not history:  # (a resume from step-0, saved by a divergence at step 1, has its record)
        ev, ev_extra = evaluate()
        log({"step": 0, **dict.fromkeys(RECORD_KEYS[1:]), "eval_loss": ev, **ev_extra})
    bar = tqdm(
        total=stop, initial=start, desc="train", unit="step", disable=a.quiet or not par.is_writer, file=sys.stderr
    )
    peak = 0
    with contextlib.closing(bar):
        for step in range(start + 1, stop + 1):
            t0 = time.perf_counter()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            before = (loader.state_dict(), get_train_state())  # what step-(step-1) holds, if this step diverges
            batches = [loader.next_batch() for _ in range(accum)]
            n_tgt = sum(b.num_targets for b in batches)
            step_loss, step_extra = 0.0, {}
            for b in par.local(batches):  # torchrun: this dp group's micro-batches
                w = b.num_targets / n_tgt if n_tgt else 0.0
                loss, m = par.loss(stage, model, b.to(a.device))
                (loss * w).backward()
                step_loss += float(loss.detach()) * w
                for key, v in m.items():
                    step_extra[key] = step_extra.get(key, 0.0) + float(v) * w
            step_loss = par.sum_all(step_loss)
            if lora_settings is not None and step == start + 1:  # LoRA must never be silently skipped (vLLM's bug)
                from kimi_tools import lora

                skipped = lora.adapters_without_gradient(model)
                if skipped:
                    raise ValueError(
                        f"LoRA: the adapters of {', '.join(skipped[:4])} got no gradient on backend {a.backend} "
                        "(a code path reads the base weight around them); refusing to train"
                    )
            for p, mp in pairs:  # gradients up to the fp32 masters
                if p is not mp:
                    mp.grad = None if p.grad is None else p.grad.float()
                    p.grad = None
            grads = [mp for _, mp in pairs if mp.grad is not None]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, a.grad_clip if a.grad_clip > 0 else math.inf))
            if not (math.isfinite(step_loss) and math.isfinite(grad_norm)):
                # Diverged. Nothing has been updated yet (the optimizer steps below), so the model, AdamW and the
                # schedule are those of step - 1: put the data position and RNG back too and save them as
                # step-(step - 1), the folder then being what --stop-after step-1 leaves, plus diverged.json.
                opt.zero_grad(set_to_none=True)
                for p, _ in pairs:
                    p.grad = None
                loader.load_state_dict(before[0])
                put_train_state(before[1])
                good = step - 1
                if a.save and good not in ckpt.steps():
                    save(good)
                if par.is_writer:
                    note = {"step": step, "loss": step_loss, "grad_norm": grad_norm, "last_good_step": good}
                    write_atomic(out / DIVERGED, json.dumps(note).encode())
                    if a.plot:
                        _plot(out / "loss.png", history)
                par.close()
                kept = (
                    f"step-{good}/ (the run up to step {good}: --resume continues from it), its model, "
                    if a.save
                    else "no weights (--no-save) but "
                )
                raise ValueError(
                    f"step {step}: the loss is {step_loss} (gradient norm {grad_norm}), not finite: training stopped; "
                    f"{out} keeps {kept}metrics.jsonl and {DIVERGED}; for another try, a lower --lr in a new --out"
                )
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            put_weights({})  # masters down to the model (a no-op in fp32)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            n_tok = sum(b.num_tokens for b in batches)
            train_state["step"], train_state["tokens_seen"] = step, train_state["tokens_seen"] + n_tok
            tps = n_tok / dt
            peak = _peak_mem_bytes(a.device)
            rec = {
                "step": step,
                "loss": step_loss,
                "eval_loss": None,
                "lr": lr,
                "grad_norm": grad_norm,
                "tokens_per_s": tps,
                "mfu": None if flops_per_token is None else flops_per_token * tps / (a.peak_tflops * 1e12),
                "peak_mem_bytes": peak,
                **step_extra,
            }
            if step == a.steps or (a.eval_every and step % a.eval_every == 0):
                rec["eval_loss"], ev_extra = evaluate()
                rec.update(ev_extra)
                if not a.quiet and par.is_writer:
                    bar.write(f"step {step}: eval loss {rec['eval_loss']:.4f}")
            log(rec)
            bar.set_postfix(loss=f"{step_loss:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
            bar.update(1)
            if a.save and (step == stop or (a.save_every and step % a.save_every == 0)):
                save(step)
    if start == stop:  # resumed a finished run: nothing to do but make sure the outputs exist
        save(stop)
    if a.plot and par.is_writer:
        _plot(out / "loss.png", history)
    evals_seen = {r["step"]: r["eval_loss"] for r in history if r.get("eval_loss") is not None}
    result = TrainResult(
        out=out,
        start_step=start,
        step=train_state["step"],
        tokens_seen=train_state["tokens_seen"],
        records=records,
        eval_losses=evals_seen,
        trainable_params=n_train,
        total_params=n_total,
        wall_s=time.perf_counter() - t_start,
    )
    if not a.quiet and par.is_writer:
        first, last = min(evals_seen), max(evals_seen)
        what = "adapter (adapter_config.json, adapter_model.safetensors)" if lora_settings else "model (safetensors)"
        what = f"{what}, step-{result.step}/ (resume state)" if a.save else "no weights or resume state (--no-save)"
        print(
            f"step {result.step}/{a.steps}: loss {result.final_loss if result.final_loss is not None else float('nan'):.4f}"
            f"; eval loss {evals_seen[first]:.4f} (step {first}) -> {evals_seen[last]:.4f} (step {last}); "
            f"{result.tokens_seen:,} tokens in {result.wall_s:.0f} s"
            f"\nwrote {out}: {what}, metrics.jsonl" + (", loss.png" if a.plot else ""),
            flush=True,
        )
    par.close()
    return result


# ---------------------------------------------------------------------------------------------- command line


def add_parser(subparsers) -> argparse.ArgumentParser:
    """``kimi train``: every :class:`TrainArgs` field as a flag."""
    p = subparsers.add_parser("train", help="fine-tune (full or LoRA) on text; resumable; metrics and a loss curve")
    d = TrainArgs(out="", data=[])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--checkpoint", metavar="DIR", help="the model to train (config.json + safetensors)")
    g.add_argument("--preset", choices=sorted(PRESETS), help="random init of a built-in config (default: tiny)")
    p.add_argument("--layers", type=positive_int, help="keep the first N layers")
    p.add_argument("--out", required=True, metavar="DIR", help="the run folder (new, or an earlier run with --resume)")
    p.add_argument("--data", required=True, nargs="+", metavar="PATH", help="text files, JSONL (text field), folders")
    p.add_argument("--eval-data", nargs="+", metavar="PATH", help="held-out text (default: the tail of --data)")
    p.add_argument("--eval-fraction", type=float, default=d.eval_fraction, help="tail of --data held out")
    p.add_argument(
        "--eval-tokens",
        type=positive_int,
        default=d.eval_tokens,
        help="evaluate on up to N tokens (default %(default)s)",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        default=d.eval_every,
        help="steps between evals (0: start and end; default %(default)s)",
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        default=d.steps,
        help="optimizer steps (the schedule's length; default %(default)s)",
    )
    p.add_argument("--stop-after", type=positive_int, help="end this process after step N (resume later)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per packed row (default %(default)s)")
    p.add_argument("--micro-batch-tokens", type=positive_int, help="tokens per forward (rows; default --seq-len)")
    p.add_argument("--batch-tokens", type=positive_int, help="tokens per optimizer step (gradient accumulation)")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (default %(default)s)")
    p.add_argument("--min-lr-ratio", type=float, default=d.min_lr_ratio, help="final lr / peak lr")
    p.add_argument(
        "--warmup-steps", type=int, default=d.warmup_steps, help="linear warm-up steps (default: min(10, steps // 10))"
    )
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="AdamW decay (matrices only)")
    p.add_argument("--beta1", type=float, default=d.beta1)
    p.add_argument("--beta2", type=float, default=d.beta2)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip, help="max gradient norm (0: none)")
    p.add_argument("--backend", choices=["eager", "sdpa", "cudnn"], default=d.backend)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="default bfloat16 on cudnn, else float32")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default cuda on cudnn, else cpu")
    p.add_argument("--recompute", action="store_true", help="recompute activations in the backward (--recompute-mode)")
    p.add_argument(
        "--recompute-mode",
        choices=RECOMPUTE_MODES,
        default=d.recompute_mode,
        help="with --recompute: each whole decoder layer, or only its MLP / MoE block (less recompute, more memory)",
    )
    p.add_argument("--freeze", nargs="+", default=[], metavar="GLOB", help="freeze parameters by name (fnmatch)")
    p.add_argument("--stage", default=d.stage, help=f"training objective (one of {sorted(STAGES)})")
    p.add_argument("--seed", type=int, default=d.seed, help="init (presets), data order, dropout")
    p.add_argument("--no-shuffle", dest="shuffle", action="store_false", help="documents in file order")
    p.add_argument("--lora-rank", type=positive_int, help="train LoRA adapters of rank R instead of the weights")
    p.add_argument("--lora-alpha", type=float, help="LoRA alpha (default 2 x rank)")
    p.add_argument("--lora-dropout", type=float, default=0.0)
    p.add_argument("--lora-targets", nargs="+", metavar="PATTERN", help="module-name patterns to adapt")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its latest step-N")
    p.add_argument(
        "--save-every", type=int, default=d.save_every, help="checkpoint every N steps (0: at the end, the default)"
    )
    p.add_argument(
        "--no-save",
        dest="save",
        action="store_false",
        help="write no weights and no step-N/ (a measurement run: metrics and plot only)",
    )
    p.add_argument("--keep", type=positive_int, default=d.keep, help="step-N checkpoints kept (default %(default)s)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak TFLOP/s, for MFU")
    p.add_argument("--no-plot", dest="plot", action="store_false", help="no loss.png")
    p.add_argument("--quiet", action="store_true", help="no progress bar or messages")
    p.add_argument("--cp", type=positive_int, default=1, help="context-parallel ranks under torchrun (parallel.py)")
    p.set_defaults(func=cmd_train)
    return p


def cmd_train(args: argparse.Namespace) -> int:
    fields = {f.name for f in dataclasses.fields(TrainArgs)}
    try:
        train(TrainArgs(**{k: v for k, v in vars(args).items() if k in fields}))
    except ImportError as e:  # kimi_tools.lora missing, or the gpu extra
        raise CliError(f"kimi train: {e}") from None
    return 0
