"""The arguments of a training run: one dataclass, from which the ``kimi train`` parser is derived.

Each :class:`TrainArgs` field carries its command-line help in ``field(metadata=arg(...))``; :func:`add_arguments`
turns the fields into flags (``seq_len`` -> ``--seq-len``; a ``bool`` defaulting to True -> ``--no-X``; a list ->
``nargs="+"``; ``X | None`` -> an optional ``X``), so a new field is a new flag with no second list to keep in step.
A field marked ``numbers=False`` (run control: where the run writes, how often it saves, what it prints, and how it
computes the same numbers: the parallel layout, the micro-batch, compilation, recomputation) may differ between a run
and its resumption; every other field (the model, the data, the tokens per step, the schedule, ...) is part of the
run's fingerprint (:func:`fingerprint`), which ``--resume`` checks against ``run.json``.

:func:`resolve` fills the ``None`` defaults and checks every plain argument before anything is read or written;
:func:`resume_defaults` gives an unset ``--micro-batch-tokens`` / ``--batch-tokens`` the resumed run's values and
:func:`default_batch_tokens` the tokens per step of a new run under its layout.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from kimi.config import PRESETS, KimiConfig
from kimi_tools.common import positive_int

__all__ = [
    "TrainArgs",
    "arg",
    "add_arguments",
    "args_from_namespace",
    "run_control_fields",
    "parse_save_every",
    "resolve",
    "resume_defaults",
    "default_batch_tokens",
    "fingerprint",
    "numbers_args",
    "diff_json",
    "as_flags",
    "RECOMPUTE_MODES",
    "OFFLOAD_MODES",
    "LAYER_KINDS",
    "parse_layer_kinds",
    "OPTIMIZERS",
    "OFFLOADS",
    "DEFAULT_SAVE_EVERY",
]

RECOMPUTE_MODES = ("layer", "mlp", "attn")  # the whole decoder layer, its MLP / MoE block, its attention block
OFFLOAD_MODES = ("none", "all", "attn", "mlp")  # kernels_torch.activation_memory.offload_activations
LAYER_KINDS = ("dense", "kda", "dsa", "mla")  # kernels_torch.activation_memory.layer_kind
# Fields added after runs were written, whose default (None or False) is the behaviour from before them: left out of
# the fingerprint at that default, so a run written before they existed still resumes.
ADDED_OFF_BY_DEFAULT = ("fp8", "fp8_compile", "fp8_min_dim")
# The same for fields whose earlier behaviour is a named default: left out of the fingerprint at that value.
ADDED_AT_DEFAULT = {"optimizer": "adamw-fp32"}
# --optimizer: fp32 AdamW over fp32 masters (torch.optim.AdamW), or bf16 weights, gradients and moments with
# stochastic rounding (torchao's AdamW); kimi_tools.plan.OPTIMIZERS counts their bytes
OPTIMIZERS = ("adamw-fp32", "adamw-bf16")
OFFLOADS = ("none", "cpu")  # --offload: FSDP2's sharded parameters, gradients and optimizer state on the host
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")  # kernels_torch.compile.COMPILE_BACKENDS (no torch to parse)
FP8_RECIPES = ("tensorwise", "rowwise")  # kernels_torch.fp8.FP8_RECIPES, spelled here so parsing needs no torch
DEFAULT_SAVE_EVERY = "10min"  # resume state every 10 minutes of training unless --save-every says otherwise


def arg(
    help: str,
    *,
    numbers: bool = True,
    type: Callable[[str], Any] | None = None,
    choices: Any = None,
    metavar: str | None = None,
    group: str | None = None,
    required: bool = False,
) -> dict[str, Any]:
    """The metadata of a :class:`TrainArgs` field: its ``--help`` text (``%(default)s`` allowed), whether it changes
    the numbers of a run (``numbers=False``: run control, outside the fingerprint), and argparse details the type
    hint does not give (``type``, ``choices`` (a sequence, or a function returning one when the parser is built),
    ``metavar``, a mutually exclusive ``group`` name, ``required``)."""
    return {
        "help": help,
        "numbers": numbers,
        "type": type,
        "choices": choices,
        "metavar": metavar,
        "group": group,
        "required": required,
    }


def parse_save_every(value: int | str | None) -> tuple[int, float]:
    """``--save-every`` as ``(steps, minutes)``: ``N`` (int or digits) saves every N steps, ``"Nmin"`` every N
    minutes of training (wall clock since the last save), 0 never (only at the end and when interrupted); None is
    :data:`DEFAULT_SAVE_EVERY`.

    Raises:
        ValueError: anything else (a negative number, another unit).
    """
    v = DEFAULT_SAVE_EVERY if value is None else value
    if isinstance(v, bool):
        raise ValueError(f"--save-every: got {v!r}, expected N (steps) or Nmin (minutes), e.g. 100 or 10min; 0: off")
    if isinstance(v, int):
        if v < 0:
            raise ValueError(f"--save-every: got {v}, expected N >= 0 steps or Nmin minutes (0: off)")
        return v, 0.0
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(min)?\s*", str(v))
    if m is None or (m.group(2) is None and "." in m.group(1)):
        raise ValueError(f"--save-every: got {v!r}, expected N (steps) or Nmin (minutes), e.g. 100 or 10min; 0: off")
    return (0, float(m.group(1))) if m.group(2) else (int(m.group(1)), 0.0)


def _save_every_type(s: str) -> int | str:
    """argparse type of ``--save-every``: digits become an int (steps), ``Nmin`` stays a string (minutes)."""
    try:
        parse_save_every(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--save-every: ")) from None
    return int(s) if s.strip().isdigit() else s.strip()


def _sources() -> list[str]:
    return sorted(PRESETS)


@dataclass
class TrainArgs:
    """Everything a training run depends on; each field is the ``kimi train`` flag of the same name
    (``seq_len`` -> ``--seq-len``, ``shuffle=False`` -> ``--no-shuffle``).

    Sizes are in tokens, ``lr`` is the peak learning rate, ``steps`` the schedule's length in optimizer steps.
    ``None`` defaults are resolved by :func:`resolve` (and written to ``run.json``): ``preset`` "tiny" when no
    ``checkpoint``; ``micro_batch_tokens`` = ``seq_len`` (on ``--resume``: the run's, :func:`resume_defaults`);
    ``batch_tokens`` by :func:`default_batch_tokens` once the layout is known (``micro_batch_tokens`` x ``dp`` x the
    micro-batches the pipeline schedule needs per rank; ``micro_batch_tokens`` in one process; on ``--resume`` the
    run's); ``pp_schedule`` "1F1B" with ``pp`` > 1; ``dp`` the world size / (``pp`` x ``cp``); ``dtype``
    "bfloat16" on the cudnn backend else "float32"; ``device`` "cuda" for cudnn, else "cpu"; ``warmup_steps``
    ``min(10, steps // 10)``; ``lora_alpha`` = 2 * ``lora_rank``; ``save_every`` :data:`DEFAULT_SAVE_EVERY`.
    """

    out: str = field(
        metadata=arg(
            "the run folder (new, an earlier run with --resume, or one to start again with --restart)",
            numbers=False,
            metavar="DIR",
            required=True,
        )
    )
    data: list[str] = field(
        metadata=arg(
            "text files, JSONL files (a 'text' field per line), folders of them", metavar="PATH", required=True
        )
    )
    checkpoint: str | None = field(
        default=None, metadata=arg("the model to train (config.json + safetensors)", metavar="DIR", group="source")
    )
    preset: str | None = field(
        default=None, metadata=arg("random init of a built-in config (default: tiny)", choices=_sources, group="source")
    )
    layers: int | None = field(default=None, metadata=arg("keep the first N layers", type=positive_int))
    steps: int = field(
        default=100, metadata=arg("optimizer steps (the schedule's length; default %(default)s)", type=positive_int)
    )
    stop_after: int | None = field(
        default=None,
        metadata=arg(
            "end this process after step N (its resume state saved; the model is written at --steps)",
            numbers=False,
            type=positive_int,
        ),
    )
    eval_data: list[str] | None = field(
        default=None, metadata=arg("held-out text (default: the tail of --data)", metavar="PATH")
    )
    eval_fraction: float = field(default=0.05, metadata=arg("tail of --data held out (default %(default)s)"))
    eval_tokens: int = field(
        default=8192, metadata=arg("evaluate on up to N tokens (default %(default)s)", type=positive_int)
    )
    eval_every: int = field(
        default=25, metadata=arg("steps between evals (0: start and end; default %(default)s)", numbers=False)
    )
    seq_len: int = field(default=256, metadata=arg("tokens per packed row (default %(default)s)"))
    # the micro-batch changes only the rounding of the sums (micro-batches are weighted by their target count, so
    # accumulation equals one big batch: tests/test_train.py) and, with --lora-dropout, the dropout draws: run
    # control, so a resume on another layout deals the run's tokens per step out in other micro-batches
    micro_batch_tokens: int | None = field(
        default=None,
        metadata=arg(
            "tokens per forward on each data-parallel rank (whole rows; default --seq-len, on --resume the run's; "
            "may change on --resume)",
            numbers=False,
            type=positive_int,
        ),
    )
    batch_tokens: int | None = field(
        default=None,
        metadata=arg(
            "tokens per optimizer step over all ranks (gradient accumulation; default --micro-batch-tokens x --dp x "
            "the micro-batches the --pp schedule needs per rank, i.e. --micro-batch-tokens in one process; on "
            "--resume the run's, which stays)",
            type=positive_int,
        ),
    )
    lr: float = field(default=3e-4, metadata=arg("peak learning rate (default %(default)s)"))
    min_lr_ratio: float = field(default=0.1, metadata=arg("final lr / peak lr (default %(default)s)"))
    warmup_steps: int | None = field(default=None, metadata=arg("linear warm-up steps (default: min(10, steps // 10))"))
    weight_decay: float = field(
        default=0.0, metadata=arg("AdamW decay of the matrices (never of norms, biases, A_log, dt_bias)")
    )
    beta1: float = field(default=0.9, metadata=arg("AdamW beta1 (default %(default)s)"))
    beta2: float = field(default=0.95, metadata=arg("AdamW beta2 (default %(default)s)"))
    grad_clip: float = field(default=1.0, metadata=arg("max gradient norm (0: none; default %(default)s)"))
    optimizer: str = field(
        default="adamw-fp32",
        metadata=arg(
            "adamw-fp32: torch's AdamW over fp32 weights (fp32 masters of bf16 parameters) and fp32 moments; "
            "adamw-bf16 (needs --dtype bfloat16): bf16 weights, gradients and moments, each update rounded "
            "stochastically to bf16 (torchao's AdamW), no fp32 masters; the tensors the checkpoint keeps in fp32 "
            "step in fp32 either way (default %(default)s)",
            choices=OPTIMIZERS,
        ),
    )
    backend: str = field(
        default="sdpa", metadata=arg("torch backend (default %(default)s)", choices=("eager", "sdpa", "cudnn"))
    )
    dtype: str | None = field(
        default=None,
        metadata=arg("parameter dtype (default bfloat16 on cudnn, else float32)", choices=("float32", "bfloat16")),
    )
    device: str | None = field(
        default=None, metadata=arg("device (default cuda on cudnn, else cpu)", choices=("cpu", "cuda"))
    )
    recompute: bool = field(
        default=False,
        metadata=arg(
            "recompute activations in the backward (see --recompute-mode; the same numbers, may change on --resume)",
            numbers=False,
        ),
    )
    recompute_mode: str = field(
        default="layer",
        metadata=arg(
            "with --recompute: each whole decoder layer (layer), only its MLP / MoE block (mlp) or only its "
            "attention block with its norm (attn): less recompute, more memory; the same numbers either way",
            numbers=False,
            choices=RECOMPUTE_MODES,
        ),
    )
    recompute_full_layers: int = field(
        default=0,
        metadata=arg(
            "with --recompute-mode mlp or attn: recompute the first N decoder layers whole, the others' block "
            "(Megatron's block recomputation: a memory knob between the modes)",
            numbers=False,
        ),
    )
    recompute_layers: str | None = field(
        default=None,
        metadata=arg(
            "with --recompute: the layer kinds it applies to, comma-separated from dense (the dense-MLP layers), "
            "kda, dsa, mla (the other layers by their attention); default every layer",
            numbers=False,
            metavar="KIND,...",
        ),
    )
    offload_activations: str = field(
        default="none",
        metadata=arg(
            "keep the activations of each decoder layer (all), of its attention block (attn) or of its MLP / MoE "
            "block (mlp) in pinned host memory between the forward and the backward (copied on a side CUDA stream; "
            "kernels_torch/activation_memory.py); around a recomputed block it holds the block's inputs; the same "
            "numbers (default %(default)s)",
            numbers=False,
            choices=OFFLOAD_MODES,
        ),
    )
    offload_layers: str | None = field(
        default=None,
        metadata=arg(
            "with --offload-activations: the layer kinds it applies to (as --recompute-layers); default every layer",
            numbers=False,
            metavar="KIND,...",
        ),
    )
    fp8: str | None = field(
        default=None,
        metadata=arg(
            "FP8 matmuls (torchao, kernels_torch/fp8.py) for the attention and KDA projections, the shared and the "
            "grouped routed experts, by recipe; bf16 activations, fp32 masters; a CUDA GPU of compute capability 8.9+ "
            "(the routed experts with --backend cudnn only: on eager / sdpa they stay bf16, as the run's header and "
            "run.json say)",
            choices=FP8_RECIPES,
            metavar="RECIPE",
        ),
    )
    fp8_compile: bool = field(
        default=False,
        metadata=arg(
            "with --fp8: compile each FP8 projection on its own (torch.compile, inductor), so that torchao's casts "
            "fuse around the FP8 GEMM; the rest of the model stays eager"
        ),
    )
    fp8_min_dim: int | None = field(
        default=None,
        metadata=arg(
            "with --fp8: keep in bf16 the projections whose smaller side min(in, out) is below N (a rule by measured "
            "shape, recorded in run.json); default: the width where the compiled recipe was measured faster than "
            "bf16 (kernels_torch.fp8.MEASURED_MIN_DIM: tensorwise 4096, rowwise 7168) with --fp8-compile or "
            "--compile, else 0",
            type=int,
            metavar="N",
        ),
    )
    compile: bool = field(
        default=False,
        metadata=arg(
            "compile each decoder layer (torch.compile, per block, no graph break: kernels_torch/compile.py); the "
            "embedding, output mix and loss stay eager; eager or sdpa backend, one process; the same numbers up to "
            "rounding, so it may change on --resume",
            numbers=False,
        ),
    )
    compile_backend: str | None = field(
        default=None,
        metadata=arg(
            "with --compile: the torch.compile backend (default inductor; aot_eager generates no code)",
            numbers=False,
            choices=COMPILE_BACKENDS,
        ),
    )
    freeze: list[str] = field(
        default_factory=list, metadata=arg("freeze parameters by name (fnmatch globs)", metavar="GLOB")
    )
    stage: str = field(default="lm", metadata=arg("training objective (see kimi_tools.train.stages.STAGES)"))
    seed: int = field(default=0, metadata=arg("init (presets), data order, dropout (default %(default)s)"))
    shuffle: bool = field(default=True, metadata=arg("documents in file order"))
    lora_rank: int | None = field(
        default=None, metadata=arg("train LoRA adapters of rank R instead of the weights", type=positive_int)
    )
    lora_alpha: float | None = field(default=None, metadata=arg("LoRA alpha (default 2 x rank)"))
    lora_dropout: float = field(default=0.0, metadata=arg("dropout on the adapters' input (default %(default)s)"))
    lora_targets: list[str] | None = field(
        default=None,
        metadata=arg("module-name patterns to adapt (default: the attention projections)", metavar="PATTERN"),
    )
    resume: bool = field(
        default=False, metadata=arg("continue the run in --out from its latest complete step-N", numbers=False)
    )
    restart: bool = field(
        default=False,
        metadata=arg(
            "start the run in --out again from scratch, deleting what an earlier run wrote there", numbers=False
        ),
    )
    save: bool = field(
        default=True,
        metadata=arg("write no weights and no step-N/ (a measurement run: metrics and plot only)", numbers=False),
    )
    save_every: int | str | None = field(
        default=None,
        metadata=arg(
            f"save the resume state every N steps or every Nmin minutes (default {DEFAULT_SAVE_EVERY}; 0: only at "
            "the end and when interrupted)",
            numbers=False,
            type=_save_every_type,
            metavar="N|Nmin",
        ),
    )
    keep: int = field(
        default=2, metadata=arg("step-N resume states kept (default %(default)s)", numbers=False, type=positive_int)
    )
    peak_tflops: float | None = field(default=None, metadata=arg("the device's peak TFLOP/s, for MFU", numbers=False))
    quiet: bool = field(default=False, metadata=arg("no progress bar or messages", numbers=False))
    plot: bool = field(default=True, metadata=arg("no loss.png", numbers=False))
    # context parallelism changes only the fp32 rounding of the LM stage (tests/test_train_parallel.py); the
    # stages whose numbers it would change (the distillation stages) refuse --cp > 1
    cp: int = field(
        default=1,
        metadata=arg(
            "context-parallel ranks under torchrun (kimi_tools/train/parallel.py)", numbers=False, type=positive_int
        ),
    )
    # the layout sizes change only the rounding of the sums (tests/test_train_parallel.py, tests/test_mesh.py): run
    # control, so a run resumes on another layout (DCP reshards)
    dp: int | None = field(
        default=None,
        metadata=arg(
            "data-parallel ranks under torchrun (default: the world size / (--pp x --cp)); --pp x --dp x --cp = the world size",
            numbers=False,
            type=positive_int,
        ),
    )
    pp: int = field(
        default=1,
        metadata=arg(
            "pipeline-parallel ranks under torchrun: the layers cut into stages at AttnRes block boundaries; "
            "--pp x --dp x --cp = the world size; composes with --cp, --ep and --dtype bfloat16, not with LoRA, "
            "--fp8 or the distillation stages (kernels_torch/parallel/pipeline.py)",
            numbers=False,
            type=positive_int,
        ),
    )
    pp_schedule: str | None = field(
        default=None,
        metadata=arg(
            "pipeline schedule with --pp > 1 (default 1F1B; Interleaved1F1B: 2 stages per rank unless --pp-layout "
            "gives more; DualPipeV, ZBVZeroBubble: 2 stages per rank in a V, the backward split into input and "
            "weight parts; kernels_torch/parallel/pipeline.py)",
            numbers=False,
            choices=("1F1B", "GPipe", "Interleaved1F1B", "DualPipeV", "ZBVZeroBubble"),
        ),
    )
    pp_layout: str | None = field(
        default=None,
        metadata=arg(
            "layers per pipeline stage, comma-separated (e.g. 12,24,24,33; 0 on the first stage: the embedding "
            "alone, on the last: the output norm and lm_head alone; with --pp > 1); default: the AttnRes blocks "
            "dealt evenly",
            numbers=False,
            metavar="N,N,...",
        ),
    )
    ep: int = field(
        default=1,
        metadata=arg(
            "expert-parallel ranks under torchrun: the routed experts are split over groups of EP ranks, a divisor "
            "of --dp x --cp (it adds no GPU) and of the model's experts (kimi_tools/train/parallel.py)",
            numbers=False,
            type=positive_int,
        ),
    )
    # the overlap changes the rounding of the sums only (tests/test_ep_overlap.py): run control, as the layout
    ep_overlap: str = field(
        default="none",
        metadata=arg(
            "with --ep > 1: chunks cuts each MoE layer's tokens in two, one chunk's all-to-all travelling while the "
            "other's experts run, forward and backward; fb (--pp > 1 --pp-schedule DualPipeV, --cp 1) runs each "
            "overlapped forward + backward action of the schedule as two threads taking turns at the all-to-alls, one "
            "micro-batch's transfers travelling while the other micro-batch computes; fb+chunks both (default "
            "%(default)s; kernels_torch/parallel/expert.py, fb_overlap.py)",
            numbers=False,
            choices=("none", "chunks", "fb", "fb+chunks"),
        ),
    )
    # FSDP2 policies: they change the speed and memory of a step, and (--reduce-dtype bf16) the rounding of the
    # gradient sums, as the layout does: run control, so a run resumes under another policy
    reduce_dtype: str = field(
        default="fp32",
        metadata=arg(
            "under torchrun: the dtype FSDP2 reduce-scatters gradients in (default %(default)s; bf16 halves the "
            "reduction's bytes and buffers; the sharded gradients and masters stay fp32)",
            numbers=False,
            choices=("fp32", "bf16"),
        ),
    )
    reshard_after_forward: str = field(
        default="auto",
        metadata=arg(
            "under torchrun: which FSDP2 units free their gathered parameters after the forward (default "
            "%(default)s: every unit except the last decoder layer and the root (torchtitan's); "
            "always: every unit, ZeRO-3; never: none, ZeRO-2)",
            numbers=False,
            choices=("auto", "always", "never"),
        ),
    )
    pp_fsdp: str | None = field(
        default=None,
        metadata=arg(
            "with --pp > 1: what a micro-batch's backward does with the stage's FSDP2 units (default layer: each "
            "unit resharded after its forward and its backward and its gradient reduce-scattered every "
            "micro-batch, as without --pp; a V schedule's split backward runs whole; stage: torch's PipelineStage "
            "keeps the whole stage gathered and its gradients unsharded until the step's end, reduced once: more "
            "memory, fewer collectives; kernels_torch/parallel/pipeline.py shard_stages)",
            numbers=False,
            choices=("layer", "stage"),
        ),
    )
    # where the shards live changes no number (tests/test_optim_policy.py): run control, so a run resumes either way
    offload: str = field(
        default="none",
        metadata=arg(
            "cpu: FSDP2 keeps the sharded parameters, their gradients and the optimizer state in host memory "
            "(CPUOffloadPolicy) and the optimizer steps on the CPU; under torchrun only (default %(default)s)",
            numbers=False,
            choices=OFFLOADS,
        ),
    )


def _hint(tp) -> tuple[type, bool, bool]:
    """``(base type, optional, is_list)`` of a field's type hint (``int | None``, ``list[str]``, ...)."""
    optional, is_list = False, False
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        optional = type(None) in args
        rest = [a for a in args if a is not type(None)]
        tp = rest[0] if len(rest) == 1 else str
    if typing.get_origin(tp) is list:
        is_list, tp = True, typing.get_args(tp)[0]
    return tp, optional, is_list


def add_arguments(p: argparse.ArgumentParser, cls: type = TrainArgs) -> None:
    """Add one flag per field of the dataclass ``cls`` (default :class:`TrainArgs`) to ``p``, as the module docstring
    says; the namespace's attribute names are the field names."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        tp, _, is_list = _hint(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if default is dataclasses.MISSING:
            default = None
        target = p
        if meta.get("group"):
            target = groups.get(meta["group"]) or groups.setdefault(meta["group"], p.add_mutually_exclusive_group())
        kw: dict[str, Any] = {"dest": f.name, "help": meta.get("help")}
        if tp is bool:
            if default:
                target.add_argument("--no-" + f.name.replace("_", "-"), action="store_false", **kw)
            else:
                target.add_argument(flag, action="store_true", **kw)
            continue
        choices = meta.get("choices")
        if callable(choices):
            choices = choices()
        kw.update(default=default, type=meta.get("type") or tp)
        if choices is not None:
            kw["choices"] = list(choices)
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        elif choices is None:
            kw["metavar"] = {int: "N", float: "X"}.get(tp, "NAME")
        if is_list:
            kw["nargs"] = "+"
        if meta.get("required"):
            kw["required"] = True
        target.add_argument(flag, **kw)


def args_from_namespace(ns: argparse.Namespace, cls: type = TrainArgs):
    """The ``cls`` (default :class:`TrainArgs`) of a namespace parsed by a parser built with :func:`add_arguments`."""
    return cls(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)})


def run_control_fields(cls: type = TrainArgs) -> tuple[str, ...]:
    """The fields marked ``numbers=False``: they do not change the numbers of a run, so a resumption may change
    them (where the run writes, how often it saves and evaluates, what it prints)."""
    return tuple(f.name for f in dataclasses.fields(cls) if not f.metadata.get("numbers", True))


def flag_of(name: str) -> str:
    """The flag of field ``name`` as typed (``shuffle`` -> ``--no-shuffle``)."""
    f = {f.name: f for f in dataclasses.fields(TrainArgs)}.get(name)
    if f is not None and f.default is True:
        return "--no-" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


# ---------------------------------------------------------------------------------------------- resolve


def resolve(args: TrainArgs) -> TrainArgs:
    """A copy of ``args`` with the ``None`` defaults filled and every plain argument checked (no file is read).
    ``batch_tokens`` stays None unless given: its default depends on the layout (:func:`default_batch_tokens`).

    Raises:
        ValueError: one line naming the flag, the value and what was expected.
    """
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
    if a.optimizer not in OPTIMIZERS:
        raise ValueError(f"--optimizer: got {a.optimizer!r}, expected one of {list(OPTIMIZERS)}")
    if a.optimizer == "adamw-bf16" and a.dtype != "bfloat16":
        raise ValueError(
            f"--optimizer adamw-bf16: got --dtype {a.dtype}, expected --dtype bfloat16 (it steps bf16 weights with "
            "bf16 moments; fp32 weights train with --optimizer adamw-fp32)"
        )
    if a.optimizer == "adamw-bf16" and importlib.util.find_spec("torchao") is None:
        # checked here, before a model is built: a full-size rank takes minutes to materialise
        raise ValueError("--optimizer adamw-bf16: needs torchao (pip install 'torchao>=0.17,<0.19'), not installed")
    if a.offload not in OFFLOADS:
        raise ValueError(f"--offload: got {a.offload!r}, expected one of {list(OFFLOADS)}")
    if a.fp8_min_dim is not None and a.fp8_min_dim < 0:
        raise ValueError(f"--fp8-min-dim: got {a.fp8_min_dim}, expected a width >= 0 (0: every projection)")
    if a.fp8 is not None:
        from kernels_torch.fp8 import FP8_RECIPES as recipes  # the library's list (the field's choices spell it)

        if a.fp8 not in recipes:
            raise ValueError(f"--fp8: got {a.fp8!r}, expected one of {list(recipes)}")
        from kernels_torch.fp8 import FP8UnsupportedError, check_fp8_supported

        problems = []  # every one at once: a CPU user is not sent round twice
        if a.dtype != "bfloat16":
            problems.append(
                f"got --dtype {a.dtype}, expected bfloat16 (FP8 GEMMs take and give bf16 activations; the master "
                "weights and AdamW state stay fp32)"
            )
        try:
            check_fp8_supported(a.device)  # naming the device and its capability
        except FP8UnsupportedError as e:
            problems.append(str(e).removeprefix("--fp8: "))
        if problems:
            raise FP8UnsupportedError("--fp8: " + "; and ".join(problems))
    elif a.fp8_compile:
        raise ValueError("--fp8-compile: compiles the FP8 projections; it needs --fp8 RECIPE")
    elif a.fp8_min_dim is not None:
        raise ValueError(f"--fp8-min-dim: got {a.fp8_min_dim} without --fp8; it chooses which projections run in FP8")
    if a.compile:
        from kernels_torch.compile import check_compile_supported

        if a.fp8_compile:
            raise ValueError("--compile/--fp8-compile: got both, expected one (--compile compiles whole blocks)")
        a.compile_backend = a.compile_backend or "inductor"
        try:
            check_compile_supported(a.backend, a.compile_backend)
        except ValueError as e:
            raise ValueError("--" + str(e)) from None
    elif a.compile_backend is not None:
        raise ValueError(f"--compile-backend: got {a.compile_backend!r} without --compile, expected --compile too")
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
    if a.batch_tokens is not None and (a.batch_tokens < a.micro_batch_tokens or a.batch_tokens % a.micro_batch_tokens):
        raise ValueError(
            f"--batch-tokens: got {a.batch_tokens}, expected a positive multiple of --micro-batch-tokens "
            f"{a.micro_batch_tokens}"
        )
    for flag, v in (("--pp-schedule", a.pp_schedule), ("--pp-layout", a.pp_layout), ("--pp-fsdp", a.pp_fsdp)):
        if v is not None and a.pp == 1:  # it would be ignored: no pipeline
            raise ValueError(
                f"{flag}: got {v!r} without --pp, expected --pp N > 1 too (pipeline stages under torchrun)"
            )
    if a.pp > 1:
        a.pp_schedule = a.pp_schedule or "1F1B"
        a.pp_fsdp = a.pp_fsdp or "layer"
    if a.stop_after is not None and not 1 <= a.stop_after <= a.steps:
        raise ValueError(f"--stop-after: got {a.stop_after}, expected a step in [1, {a.steps}] (--steps)")
    for name in ("eval_every", "warmup_steps"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}: got {getattr(a, name)}, expected an integer >= 0")
    saving = parse_save_every(a.save_every)  # checks it
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
        [f"--save-every {a.save_every}"] * (a.save_every is not None and saving != (0, 0.0))
        + [f"--stop-after {a.stop_after}"] * (a.stop_after is not None)
        + ["--resume"] * bool(a.resume)
    )
    if not a.save and given:
        raise ValueError(
            f"--no-save: a run that saves nothing cannot be stopped and resumed; got it with {', '.join(given)}, "
            "expected none of --save-every, --stop-after, --resume"
        )
    if a.resume and a.restart:
        raise ValueError(
            "--resume/--restart: got both, expected one (--resume continues the run in --out, --restart deletes it "
            "and starts again)"
        )
    if a.save_every is None:
        a.save_every = DEFAULT_SAVE_EVERY
    if a.peak_tflops is not None and not a.peak_tflops > 0:
        raise ValueError(f"--peak-tflops: got {a.peak_tflops}, expected a positive peak (TFLOP/s)")
    from kimi_tools.train.schedule import lr_multiplier

    lr_multiplier(0, warmup_steps=a.warmup_steps, total_steps=a.steps, min_lr_ratio=a.min_lr_ratio)  # checks
    from kimi_tools.train.stages import STAGES

    if a.stage not in STAGES:
        raise ValueError(f"--stage: got {a.stage!r}, expected one of {sorted(STAGES)}")
    if a.recompute_mode not in RECOMPUTE_MODES:
        raise ValueError(f"--recompute-mode: got {a.recompute_mode!r}, expected one of {list(RECOMPUTE_MODES)}")
    if a.recompute_mode != "layer" and not a.recompute:  # it would be ignored: nothing recomputed
        raise ValueError(f"--recompute-mode: got {a.recompute_mode!r} without --recompute, expected --recompute too")
    if a.recompute_full_layers < 0:
        raise ValueError(f"--recompute-full-layers: got {a.recompute_full_layers}, expected >= 0")
    if a.recompute_full_layers and (not a.recompute or a.recompute_mode == "layer"):
        raise ValueError(
            f"--recompute-full-layers: got {a.recompute_full_layers}, expected it only with --recompute "
            "--recompute-mode mlp or attn"
        )
    _check_activation_policy(a)
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


def resume_defaults(args: TrainArgs, saved: dict | None) -> TrainArgs:
    """``args`` with an unset ``micro_batch_tokens`` / ``batch_tokens`` taken from ``saved`` (the ``args`` of the
    resumed run's ``run.json``): a resumed run keeps its tokens per step (part of the fingerprint) and, unless told
    otherwise, its micro-batch. ``args`` unchanged without ``--resume`` or without a record."""
    if not args.resume or not isinstance(saved, dict) or saved.get("seq_len") != args.seq_len:
        return args  # (another --seq-len: the fingerprint check names it)
    kept = {
        k: saved[k]
        for k in ("micro_batch_tokens", "batch_tokens")
        if getattr(args, k) is None and isinstance(saved.get(k), int) and not isinstance(saved.get(k), bool)
    }
    return dataclasses.replace(args, **kept)


def default_batch_tokens(micro_batch_tokens: int, microbatches: int) -> int:
    """The tokens per step of a run without ``--batch-tokens``: ``micro_batch_tokens x microbatches``, where
    ``microbatches`` is the fewest micro-batches a step needs under the layout, ``dp x`` (with ``--pp`` and a
    1F1B-type schedule) the pipeline's stages (``kimi_tools.train.parallel.TrainParallel.min_microbatches``): one
    micro-batch per data-parallel rank and pipeline stage, as torchtitan's and Megatron's global batch defaults
    to the local batch times ``dp``, so that the command of one process runs unchanged under any layout."""
    return micro_batch_tokens * microbatches


def parse_layer_kinds(value: str | None, flag: str) -> tuple[str, ...] | None:
    """``"kda,dsa"`` -> ``("kda", "dsa")`` in :data:`LAYER_KINDS` order; None (every kind) stays None.

    Raises:
        ValueError: an empty list or a name outside :data:`LAYER_KINDS`, naming ``flag``.
    """
    if value is None:
        return None
    names = [s.strip() for s in str(value).split(",") if s.strip()]
    bad = [n for n in names if n not in LAYER_KINDS]
    if bad or not names:
        raise ValueError(f"{flag}: got {value!r}, expected kinds from {list(LAYER_KINDS)}, comma-separated")
    return tuple(k for k in LAYER_KINDS if k in names)


def _check_activation_policy(a: TrainArgs) -> None:
    """The layer kinds of ``--recompute-layers`` / ``--offload-layers`` (normalised to :data:`LAYER_KINDS` order)
    and what does not compose: offload under ``--compile``, a kinds flag without its policy, and an attention or MLP
    offload on layers that ``--recompute-mode layer`` recomputes whole (the per-layer check, with
    ``--recompute-full-layers``, is ``kernels_torch.activation_memory.offload_activations``'s)."""
    if a.offload_activations not in OFFLOAD_MODES:
        raise ValueError(f"--offload-activations: got {a.offload_activations!r}, expected one of {list(OFFLOAD_MODES)}")
    rk = parse_layer_kinds(a.recompute_layers, "--recompute-layers")
    ok = parse_layer_kinds(a.offload_layers, "--offload-layers")
    if rk is not None and not a.recompute:
        raise ValueError(
            f"--recompute-layers: got {a.recompute_layers!r} without --recompute, expected --recompute too"
        )
    if ok is not None and a.offload_activations == "none":
        raise ValueError(
            f"--offload-layers: got {a.offload_layers!r} with --offload-activations none, expected a mode "
            "(all, attn or mlp)"
        )
    a.recompute_layers = None if rk is None else ",".join(rk)
    a.offload_layers = None if ok is None else ",".join(ok)
    if a.offload_activations == "none":
        return
    if a.compile:
        raise ValueError(
            f"--offload-activations: got {a.offload_activations} with --compile, expected one of them (the "
            "offload's saved-tensor hooks were not tried inside compiled blocks)"
        )
    both = set(rk or LAYER_KINDS) & set(ok or LAYER_KINDS)
    if a.recompute and a.recompute_mode == "layer" and a.offload_activations != "all" and both:
        raise ValueError(
            f"--offload-activations: got {a.offload_activations} with --recompute-mode layer on the same layers "
            f"({','.join(k for k in LAYER_KINDS if k in both)}): a layer recomputed whole keeps no block activation "
            "to offload; expected all (the layer inputs on the host), another --recompute-mode, or disjoint "
            "--recompute-layers / --offload-layers"
        )


# ---------------------------------------------------------------------------------------------- fingerprint


def fingerprint(args: TrainArgs, config: KimiConfig) -> tuple[str, dict]:
    """``(sha256 hex, body)``: the hash of the model config and of the arguments that change the numbers (every
    field but :func:`run_control_fields`); ``body`` is what was hashed (``run.json``'s ``fingerprint_of``)."""
    body = {"args": numbers_args(dataclasses.asdict(args)), "config": config.to_dict()}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest(), body


def numbers_args(recorded: dict) -> dict:
    """A ``fingerprint_of["args"]`` recorded by an earlier version, less the fields that are run control now (e.g.
    ``micro_batch_tokens``, ``compile``) and the fields added off by default at their default: what
    :func:`fingerprint` hashes today, so that a run written before a field became run control still resumes."""
    control = set(run_control_fields())
    return {
        k: v
        for k, v in recorded.items()
        if k not in control
        and not (k in ADDED_OFF_BY_DEFAULT and v in (None, False))
        and not (k in ADDED_AT_DEFAULT and v == ADDED_AT_DEFAULT[k])
    }


_ABSENT = object()  # a key one side of a diff_json lacks


def as_flags(args: dict) -> dict:
    """run.json's ``args`` keyed as the command line spells them: ``shuffle: False`` is ``no_shuffle: True``."""
    negated = {f.name for f in dataclasses.fields(TrainArgs) if f.default is True}
    return {
        (f"no_{k}" if k in negated else k): (not v if k in negated and isinstance(v, bool) else v)
        for k, v in args.items()
    }


def _show(v: Any, limit: int = 60) -> str:
    """A value of a diff, short: ``absent``, or its repr cut to ``limit`` characters (with the item count)."""
    if v is _ABSENT:
        return "absent"
    r = repr(v)
    if len(r) <= limit:
        return r
    return r[: limit - 5] + " ...]" * isinstance(v, list) + " ...}" * isinstance(v, dict) + f" ({len(v)} items)"


def diff_json(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The differences between two JSON values (run.json's and now), one ``"path (run: X, now: Y)"`` per leaf.

    Nested dicts (a checkpoint's ``text_config.linear_attn_config``) are walked, so the path names the key as it
    stands in ``config.json`` (``text_config.num_hidden_layers``); lists of equal length are compared item by item
    (``...kda_layers[5]``), so the differing item shows even in a long list; a key on one side only is ``absent``;
    anything else (a dict against None, lists of other lengths) is shown whole, cut short.
    """
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += diff_json(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{prefix}.{k}" if prefix else str(k))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff_json(x, y, f"{prefix}[{i}]")]
    return [] if a == b else [f"{prefix} (run: {_show(a)}, now: {_show(b)})"]
