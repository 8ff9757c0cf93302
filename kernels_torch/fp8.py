"""FP8 training matmuls (Hopper and later) through torchao: which projections run in FP8, and the conversion.

The library is torchao (``torchao.float8`` and the MoE training prototype ``torchao.prototype.moe_training``),
versions :data:`TORCHAO_REQUIREMENT` (built against torch 2.11, the H200's; its Python API also runs beside the CPU
torch 2.13). Dense projections become ``torchao.float8``'s ``Float8Linear`` (``convert_to_float8_training``): each
forward casts the input and the weight to e4m3 with dynamic scales and runs ``torch._scaled_mm``; the backward casts
the output gradient (e5m2 under ``tensorwise``, e4m3 under ``rowwise``) for the two gradient GEMMs. Master weights
and optimizer state are untouched: the casts are made from the module's own (bf16 or fp32) weight at every call.
The grouped routed experts' weights are wrapped by ``torchao.quantize_`` with ``Float8TrainingOpConfig`` (FP8
rowwise, the only FP8 grouped recipe torchao has), whose tensor subclass turns
``torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)`` into its differentiable ``torch._scaled_grouped_mm``
(rowwise e4m3 for the input, the weights and the output gradient).

Recipes (:data:`FP8_RECIPES`, torchao's ``Float8LinearConfig.from_recipe_name``):

* ``tensorwise``: one scale per tensor, cuBLAS's FP8 GEMM, e5m2 gradients; the one that supports FSDP2's FP8
  all-gather (``fsdp_float8_all_gather=True``: the sharded weights are cast to FP8 before the all-gather, halving
  its bytes; call ``torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model)`` after each optimizer step).
* ``rowwise``: one scale per row (a power of two), CUTLASS's rowwise FP8 GEMM, e4m3 everywhere: finer scales, a
  little slower.

What runs in FP8 (:data:`FP8_LINEARS`, by the module that owns the projection; names are the checkpoint's):

* MLA / DSA (``GatedMLA``): ``q_a_proj``, ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``g_proj`` (the
  output gate), ``o_proj``, and ``kv_b_proj`` in MLA layers. A DSA layer's ``kv_b_proj`` stays as it is: the
  ``cudnn`` backend applies it in absorbed form (``W_UK`` / ``W_UV`` read from its weight by
  ``kernels_torch.ops.linears.headwise_matmul``, spec 3.3), which no FP8 linear reaches.
* KDA (``KimiDeltaAttention``): ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (or ``g_a_proj`` / ``g_b_proj``),
  ``o_proj``. The gate's low-rank ``f_a_proj`` / ``f_b_proj`` and beta's ``b_proj`` are candidates but excluded by
  default (:data:`DEFAULT_EXCLUDE`): at K3.1's widths they are 0.7% of the layer's projection FLOPs (rank 128 and
  96 outputs against 12,288), below the size where the cast overhead pays, and they feed ``exp`` / ``sigmoid`` gates
  that compound through the recurrence. On the ``cudnn`` backend the six projections of x otherwise run as one
  ``kernels_torch.ops.linears.shared_input_linears`` node that reads their ``.weight`` directly (no module forward,
  so no FP8); a converted projection makes the layer run them one by one through their modules instead, as it does
  for LoRA (the six input gradients are then summed by autograd's elementwise adds: about 0.4 ms at 8K tokens on
  the H200).
* Dense MLP and shared experts (``DenseMLP``): ``gate_proj``, ``up_proj``, ``down_proj``.
* Latent MoE (``KimiMoE``): ``routed_expert_down_proj``, ``routed_expert_up_proj``.
* Routed experts (``kernels_torch.moe.GroupedExperts``: ``w1``, ``w3`` ``[E, I, Dl]``, ``w2`` ``[E, Dl, I]``) by
  ``quantize_``, where they run the ``grouped_mm`` kernel (the ``cudnn`` backend's default, or ``moe_kernel=
  "grouped_mm"``): the ``loop`` kernel indexes one expert's weight per ``F.linear``, which the wrapper hands back as a
  plain tensor, so experts on the loop are left as they are and listed in ``skipped``.

Everything else stays as it is: ``lm_head``, the router ``gate``, the norms, the AttnRes projections, the KDA short
convolutions and recurrence, the DSA indexer (its ``wq_b``, ``wk``, ``weights_proj``; it reads ``q_a_proj``'s FP8
output ``c_q``) and the sparse attention. A LoRA-wrapped projection (peft) converts its frozen ``base_layer``; the
adapters stay in the activation dtype. A converted projection pads its tokens with zero rows to a multiple of 16
when their count is not one (the weight gradient's FP8 GEMM reduces over them; exact: see :func:`_pad_rows`). A
projection whose width is not a multiple of 16 (``torch._scaled_mm``'s requirement) is left as it is and listed in
the record's ``skipped``.

The grouped experts' contract (what ``torchao``'s ``Float8TrainingWeightWrapperTensor`` intercepts and asserts):
the forward calls exactly ``torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)`` with ``w`` the parameter
itself (or a view, slice or ``.to()`` of it: those keep the wrapper; ``torch.cat`` or ``torch.stack`` of the
parameters, indexing one expert, or ``.contiguous()`` after the transpose lose it), ``x`` ``[rows, in]`` bf16 and
row-major, ``in`` and ``out`` multiples of 16, ``offsets`` int32 cumulative row ends, and every expert's row count a
multiple of 16 (torchao's padding option is refused by its FP8 forward): :func:`convert_model_to_fp8` raises the
module's ``align`` to a multiple of :data:`FP8_ALIGN`. Rows of a group that hold no token must be finite (zero):
the weight gradient's per-group column scales read them. The output is bf16.

The dense casts run as eager kernels unless ``compile_linears`` compiles each ``Float8Linear`` (torchao's casts are
several elementwise passes each; compiled they fuse around the GEMM): eager FP8 projections were measured slower than
bf16 at every K3.1 shape, compiled ones faster where they are wide (``docs/gpu.md`` "Where FP8 pays", whence
:data:`MEASURED_MIN_DIM` and the ``min_dim`` rule). The grouped casts are fused Triton kernels already.

Why torchao and not Transformer Engine (PyPI, December 2026): ``transformer-engine-torch`` 2.20.2 is published as a
source distribution only (498 kB), whose build downloads a wheel made for the exact torch version from GitHub or
else compiles its CUDA extension against the installed torch; its core wheel ``transformer-engine-cu13`` 2.20.2 is
276.5 MB. The H200 machine has no package index and takes 64 MiB per call, so neither installs there; and TE's FP8
runs through its own ``te.Linear`` / ``te.GroupedLinear`` modules, which would replace this model's modules. torchao
0.18.0 is one 3.4 MB ``abi3`` wheel with no declared dependencies, Python and Triton over torch's own
``torch._scaled_mm`` / ``torch._scaled_grouped_mm`` (``benchmarks/fp8_wheels.sh``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import logging
import math
from typing import Any, Sequence

import torch
from torch import nn

__all__ = [
    "FP8_RECIPES",
    "FP8_MIN_CAPABILITY",
    "FP8_GROUPED_CAPABILITIES",
    "FP8_ALIGN",
    "TORCHAO_REQUIREMENT",
    "COMPILE_CACHE_LIMIT",
    "MEASURED_MIN_DIM",
    "min_dim_for",
    "FP8_LINEARS",
    "DEFAULT_EXCLUDE",
    "FP8UnsupportedError",
    "FP8Conversion",
    "check_fp8_supported",
    "import_torchao",
    "quiet_torchao_import",
    "check_recipe",
    "convert_model_to_fp8",
    "fp8_record",
]

FP8_RECIPES = ("tensorwise", "rowwise")
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0, 12.0)
# torch._scaled_grouped_mm runs on exactly these (a set, not a floor: 12.0 is refused), per its own check
FP8_GROUPED_CAPABILITIES = ((9, 0), (10, 0))
FP8_ALIGN = 16  # rows per expert, and every GEMM width: torch._scaled_mm / _scaled_grouped_mm need multiples of 16
COMPILE_CACHE_LIMIT = 256  # dynamo graphs per code object under compile_linears: widths x token counts x layers
# The narrowest projection side, min(in, out), at which a compiled FP8 projection was measured faster than bf16 (forward
# and backward at 8,192 tokens, benchmarks/fp8_gemm.py --compile on the H200; table in docs/gpu.md "Where FP8 pays"):
# tensorwise 7168 x 6144 1.40x, 7168 x 1536 0.65x; rowwise 7168 x 12288 1.29x, 7168 x 6144 0.81x.
MEASURED_MIN_DIM = {"tensorwise": 4096, "rowwise": 7168}
TORCHAO_REQUIREMENT = ">=0.17,<0.19"  # 0.17/0.18: the Float8TrainingOpConfig API used here; tested with 0.18.0
_TORCHAO_MIN, _TORCHAO_BELOW = (0, 17), (0, 19)

# Owner module class name -> the projections (attribute names, checkpoint keys) that run in FP8.
FP8_LINEARS: dict[str, tuple[str, ...]] = {
    "GatedMLA": ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj"),
    "KimiDeltaAttention": (
        "q_proj",
        "k_proj",
        "v_proj",
        "f_a_proj",
        "f_b_proj",
        "b_proj",
        "g_proj",
        "g_a_proj",
        "g_b_proj",
        "o_proj",
    ),
    "DenseMLP": ("gate_proj", "up_proj", "down_proj"),
    "KimiMoE": ("routed_expert_down_proj", "routed_expert_up_proj"),
}
GROUPED_EXPERTS = "GroupedExperts"  # the stacked routed experts (kernels_torch.moe): w1, w3 [E, I, Dl], w2 [E, Dl, I]
# fnmatch globs on qualified module names: the KDA gate and beta projections stay bf16 unless exclude says otherwise
DEFAULT_EXCLUDE = ("*.f_a_proj", "*.f_b_proj", "*.b_proj")


class FP8UnsupportedError(ValueError):
    """FP8 asked for where it cannot run: no CUDA device, a GPU below compute capability 8.9 (9.0 / 10.0 for the
    grouped experts), or torchao missing or outside :data:`TORCHAO_REQUIREMENT`. A ``ValueError``, so that the
    ``kimi`` commands report it as one ``kimi: error:`` line: the ``--fp8`` argument is what is refused here."""


@dataclasses.dataclass(frozen=True)
class FP8Conversion:
    """What :func:`convert_model_to_fp8` did, kept on the model as ``model.fp8`` (for ``run.json``).

    ``linears``: qualified names of the projections that became ``Float8Linear``; ``grouped_experts``: the
    ``GroupedExperts`` modules whose weights torchao wraps (FP8 rowwise grouped GEMMs); ``skipped``: ``(name,
    reason)`` for candidates left as they are (excluded by a pattern, narrower than ``min_dim``, a width not a
    multiple of 16, a DSA layer's absorbed ``kv_b_proj``, grouped experts under ``emulate`` or on the ``loop``
    kernel)."""

    recipe: str
    grouped_recipe: str | None
    torchao_version: str
    emulate: bool
    fsdp_float8_all_gather: bool
    compiled: bool
    exclude: tuple[str, ...]
    linears: tuple[str, ...]
    grouped_experts: tuple[str, ...]
    skipped: tuple[tuple[str, str], ...]
    min_dim: int = 0

    def to_dict(self, names: bool = False) -> dict[str, Any]:
        """A JSON-ready summary: the settings, the counts, the skipped candidates by reason (with ``names``, the
        full lists of converted names too)."""
        by_reason: dict[str, list[str]] = {}
        for name, reason in self.skipped:
            by_reason.setdefault(reason, []).append(name)
        d: dict[str, Any] = {
            "recipe": self.recipe,
            "grouped_recipe": self.grouped_recipe,
            "torchao": self.torchao_version,
            "emulate": self.emulate,
            "fsdp_float8_all_gather": self.fsdp_float8_all_gather,
            "compiled": self.compiled,
            "min_dim": self.min_dim,
            "exclude": list(self.exclude),
            "linears": len(self.linears),
            "grouped_experts": len(self.grouped_experts),
            "skipped": {reason: len(v) for reason, v in by_reason.items()},
        }
        if names:
            d.update(
                linear_names=list(self.linears),
                grouped_expert_names=list(self.grouped_experts),
                skipped_names=by_reason,
            )
        return d


def check_recipe(recipe: str) -> str:
    """Return ``recipe`` if it is one of :data:`FP8_RECIPES`; raise ValueError naming it otherwise."""
    if recipe not in FP8_RECIPES:
        raise ValueError(f"fp8 recipe: got {recipe!r}, expected one of {list(FP8_RECIPES)}")
    return recipe


def check_fp8_supported(device: str | torch.device, grouped: bool = False) -> tuple[int, int]:
    """Refuse FP8 matmuls where they cannot run; return the device's compute capability ``(major, minor)``.

    FP8 GEMMs (``torch._scaled_mm``) need a CUDA GPU of compute capability >= :data:`FP8_MIN_CAPABILITY` (8.9: Ada,
    Hopper, Blackwell); with ``grouped`` (the routed experts' ``torch._scaled_grouped_mm``) one of
    :data:`FP8_GROUPED_CAPABILITIES` (9.0 or 10.0 exactly).

    Raises:
        FP8UnsupportedError: ``device`` is not CUDA, CUDA is not available, or the capability is too low (the message
            names the device, its name and its capability).
    """
    dev = torch.device(device)
    if dev.type != "cuda":
        raise FP8UnsupportedError(
            f"--fp8: FP8 matmuls need a CUDA GPU of compute capability >= {_cap(FP8_MIN_CAPABILITY)} (Ada, Hopper, "
            f"Blackwell), got device {str(dev)!r}; torchao has no FP8 kernels for the CPU"
        )
    if not torch.cuda.is_available():
        raise FP8UnsupportedError(f"--fp8: FP8 matmuls need a CUDA GPU, but CUDA is not available here (device {dev})")
    cap = tuple(torch.cuda.get_device_capability(dev))
    name = torch.cuda.get_device_name(dev)
    if cap < FP8_MIN_CAPABILITY:
        raise FP8UnsupportedError(
            f"--fp8: {dev} ({name}) has compute capability {_cap(cap)}, expected >= {_cap(FP8_MIN_CAPABILITY)} "
            "(FP8 tensor cores: Ada, Hopper, Blackwell)"
        )
    if grouped and cap not in FP8_GROUPED_CAPABILITIES:
        raise FP8UnsupportedError(
            f"--fp8: {dev} ({name}) has compute capability {_cap(cap)}; the grouped experts' FP8 GEMM "
            f"(torch._scaled_grouped_mm) runs on {' or '.join(_cap(c) for c in FP8_GROUPED_CAPABILITIES)} only"
        )
    return cap  # type: ignore[return-value]


def _cap(cap: Sequence[int]) -> str:
    return f"{cap[0]}.{cap[1]}"


# Loggers that speak while torchao is imported on a machine it was not built for: torchao's own ("Failed to load
# .../torchao/_C_mxfp8...so": C++ extensions for another torch, used by neither the FP8 training path nor LoRA)
# and torch's pytree (a deprecation line for each Enum that torchao registers as a constant).
TORCHAO_IMPORT_LOGGERS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_torchao_import():
    """Hold :data:`TORCHAO_IMPORT_LOGGERS` at ERROR for the block: wrap what imports torchao, directly or not (peft
    imports transformers, which imports torchao whenever it is installed, FP8 asked for or not)."""
    loggers = [logging.getLogger(n) for n in TORCHAO_IMPORT_LOGGERS]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def import_torchao():
    """Import torchao (quietly: on a torch other than its build's, it logs that its C++ extensions did not load; the
    FP8 training path uses none of them) and check its version. Returns the module.

    Raises:
        FP8UnsupportedError: torchao is not installed, or its version is outside :data:`TORCHAO_REQUIREMENT`.
    """
    try:
        with quiet_torchao_import():
            import torchao
            import torchao.float8  # noqa: F401
    except ImportError as e:
        raise FP8UnsupportedError(
            f"--fp8: needs torchao{TORCHAO_REQUIREMENT} (pip install 'torchao{TORCHAO_REQUIREMENT}', or the fp8 "
            f"extra), which is not importable here: {e}"
        ) from e
    version = getattr(torchao, "__version__", "unknown")
    try:
        major_minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor is not None and not _TORCHAO_MIN <= major_minor < _TORCHAO_BELOW:
        raise FP8UnsupportedError(f"--fp8: torchao {version} is installed, expected torchao{TORCHAO_REQUIREMENT}")
    return torchao


def _candidates(model: nn.Module) -> tuple[list[tuple[str, nn.Module, str | None]], list[tuple[str, nn.Module]]]:
    """The projections FP8 may reach, ``(qualified name, module, reason to skip or None)``, and the grouped experts
    ``(qualified name, module)``, in ``named_modules`` order. A LoRA-wrapped projection yields its ``base_layer``."""
    linears: list[tuple[str, nn.Module, str | None]] = []
    grouped: list[tuple[str, nn.Module]] = []
    for owner_name, owner in model.named_modules():
        kind = type(owner).__name__
        if kind == GROUPED_EXPERTS:
            grouped.append((owner_name, owner))
            continue
        for leaf in FP8_LINEARS.get(kind, ()):
            child = getattr(owner, leaf, None)
            if child is None:
                continue
            name = f"{owner_name}.{leaf}" if owner_name else leaf
            if hasattr(child, "base_layer"):  # peft LoraLayer: the frozen base runs in FP8, the adapters do not
                child, name = child.base_layer, f"{name}.base_layer"
            if type(child).__name__ == "Float8Linear":
                raise ValueError(f"model: {name} is already an FP8 linear (convert_model_to_fp8 was called before)")
            if type(child) is not nn.Linear:
                continue
            reason = None
            if kind == "GatedMLA" and leaf == "kv_b_proj" and getattr(owner, "kind", None) == "dsa":
                reason = "absorbed kv_b_proj (DSA)"
            elif child.in_features % FP8_ALIGN or child.out_features % FP8_ALIGN:
                reason = f"width not a multiple of {FP8_ALIGN}"
            linears.append((name, child, reason))
    return linears, grouped


def min_dim_for(recipe: str, compiled: bool) -> int:
    """The ``min_dim`` of :func:`convert_model_to_fp8` that keeps in bf16 the projections measured slower in FP8:
    :data:`MEASURED_MIN_DIM` of ``recipe`` for compiled projections; 0 (every candidate) for eager ones, which were
    measured slower than bf16 at every K3.1 shape (0.1x to 0.9x at 8K and 32K tokens: docs/gpu.md) and are kept
    for numerics studies.

    Raises:
        ValueError: an unknown recipe."""
    check_recipe(recipe)
    return MEASURED_MIN_DIM[recipe] if compiled else 0


def convert_model_to_fp8(
    model: nn.Module,
    recipe: str,
    *,
    exclude: Sequence[str] = DEFAULT_EXCLUDE,
    emulate: bool = False,
    fsdp_float8_all_gather: bool = False,
    compile_linears: bool = False,
    min_dim: int = 0,
    device: str | torch.device | None = None,
) -> FP8Conversion:
    """Run the model's projections and grouped experts in FP8 (torchao), in place; record it as ``model.fp8``.

    Call it on a :class:`kernels_torch.model.KimiK3Model` (or any module holding its layer modules) after the model
    is built and cast, after LoRA is applied (peft wraps plain ``nn.Linear`` only) and after expert parallelism has
    sliced the experts, and before ``torch.utils.checkpoint`` wrappers and FSDP2's ``fully_shard``. Parameter names, shapes and dtypes are unchanged (``state_dict`` keys stay the checkpoint's);
    the projections listed in the module docstring become torchao ``Float8Linear`` modules holding the same
    ``weight`` parameter; the ``GroupedExperts`` weights become torchao's ``Float8TrainingWeightWrapperTensor``
    (same values) and the module's ``align`` is raised to a multiple of :data:`FP8_ALIGN`.

    Args:
        model: the model (on its device, or on ``meta`` with ``device`` given).
        recipe: one of :data:`FP8_RECIPES` for the dense projections; the grouped experts run FP8 rowwise under
            either (torchao's only FP8 grouped recipe).
        exclude: ``fnmatch`` globs on qualified module names (``model.layers.3.self_attn.o_proj``) of projections
            to leave as they are; default :data:`DEFAULT_EXCLUDE` (the KDA gate / beta projections). A pattern that is
            not in the default must match some candidate. Each is also tried on the name with a leading ``.``, so
            that ``*.o_proj`` takes a top-level ``o_proj`` too (a layer converted on its own).
        emulate: torchao's emulation (FP8 rounding, high-precision GEMMs; slow): runs on the CPU and skips the device
            check; the grouped experts are then left as they are (torchao's FP8 grouped GEMM has no emulation).
        fsdp_float8_all_gather: FSDP2 all-gathers the projections' weights in FP8 (``tensorwise`` only).
        compile_linears: compile each converted projection on its own (``nn.Module.compile``, inductor; its row
            padding hooks included), so that torchao's amax, scale and cast fuse into a few kernels around
            ``torch._scaled_mm`` instead of running eagerly. The rest of the model stays eager. Every
            ``Float8Linear`` shares one code object, so dynamo's recompile limits are raised to at least
            :data:`COMPILE_CACHE_LIMIT` (a process-wide setting) to keep each shape compiled.
        min_dim: leave as they are (``skipped``, reason ``narrow``) the projections whose smaller side
            ``min(in_features, out_features)`` is below it: a rule by measured shape, as torchtitan's
            ``auto_filter_small_kn`` (:func:`min_dim_for` gives the measured one). 0: every candidate.
        device: where the GEMMs will run (default: the device of the model's first parameter).

    Returns:
        The :class:`FP8Conversion` record (also ``model.fp8``).

    Raises:
        ValueError: an unknown recipe, ``fsdp_float8_all_gather`` with ``rowwise``, a pattern matching no candidate,
            a model without any FP8 candidate, or one converted before; ``min_dim`` not an int >= 0.
        FP8UnsupportedError: (without ``emulate``) the device cannot run FP8 (:func:`check_fp8_supported`), or torchao
            is missing or of another version.
    """
    check_recipe(recipe)
    if fsdp_float8_all_gather and recipe != "tensorwise":
        raise ValueError(
            f"fsdp_float8_all_gather: torchao all-gathers FP8 weights under the tensorwise recipe only, got {recipe!r}"
        )
    if isinstance(min_dim, bool) or not isinstance(min_dim, int) or min_dim < 0:
        raise ValueError(f"min_dim: got {min_dim!r}, expected an int >= 0 (0: every candidate)")
    if getattr(model, "fp8", None) is not None:
        raise ValueError(f"model: already converted to FP8 (recipe {model.fp8.recipe!r})")
    linears, grouped = _candidates(model)
    if not linears and not grouped:
        raise ValueError(f"model: {type(model).__name__} holds no FP8 candidate (see kernels_torch.fp8.FP8_LINEARS)")
    names = [n for n, _, _ in linears] + [n for n, _ in grouped]
    exclude = tuple(exclude)
    for pat in exclude:
        if pat not in DEFAULT_EXCLUDE and not any(_matches(n, pat) for n in names):
            raise ValueError(f"exclude: {pat!r} matches no FP8 candidate (e.g. {names[0]!r}; globs: * ?)")
    if device is None:
        device = next(model.parameters()).device
    if torch.device(device).type == "meta":
        raise ValueError("device: the model is on 'meta'; pass device= (where the GEMMs will run)")
    if not emulate:
        check_fp8_supported(device, grouped=bool(grouped))
    torchao = import_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    skipped: list[tuple[str, str]] = []
    chosen: list[str] = []
    for name, module, reason in linears:
        if reason is None and any(_matches(name, pat) for pat in exclude):
            reason = "excluded"
        if reason is None and min(module.in_features, module.out_features) < min_dim:
            reason = f"narrow: min(in, out) < {min_dim}"
        if reason is None:
            chosen.append(name)
        else:
            skipped.append((name, reason))
    chosen_set = set(chosen)
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = dataclasses.replace(config, emulate=emulate, enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    if chosen:
        convert_to_float8_training(model, module_filter_fn=lambda m, fqn: fqn in chosen_set, config=config)
        converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
        missing = sorted(chosen_set - converted)
        if missing:  # torchao's traversal missed a module we selected: never run part of the model silently in bf16
            raise RuntimeError(f"torchao did not convert {len(missing)} selected projections, e.g. {missing[0]}")
        for name in chosen:
            module = model.get_submodule(name)
            module.register_forward_pre_hook(_pad_rows)
            module.register_forward_hook(_unpad_rows)
        if compile_linears:
            _raise_compile_limits()
            for name in chosen:
                model.get_submodule(name).compile()

    grouped_done: list[str] = []
    for name, module in grouped:
        if any(_matches(name, pat) for pat in exclude):
            skipped.append((name, "excluded"))
        elif emulate:
            skipped.append((name, "grouped experts under emulate"))
        elif _expert_kernel(module) != "grouped_mm":
            skipped.append((name, "grouped experts on the loop kernel"))
        else:
            _check_grouped(name, module)
            grouped_done.append(name)
    if grouped_done:
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        done = set(grouped_done)
        for name in grouped_done:
            module = model.get_submodule(name)
            module.align = math.lcm(int(module.align), FP8_ALIGN)  # every expert's rows: a multiple of 16
        quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda m, fqn: fqn in done)

    record = FP8Conversion(
        recipe=recipe,
        grouped_recipe="fp8_rowwise" if grouped_done else None,
        torchao_version=str(getattr(torchao, "__version__", "unknown")),
        emulate=emulate,
        fsdp_float8_all_gather=fsdp_float8_all_gather,
        compiled=bool(compile_linears and chosen),
        min_dim=min_dim,
        exclude=exclude,
        linears=tuple(chosen),
        grouped_experts=tuple(grouped_done),
        skipped=tuple(skipped),
    )
    model.fp8 = record
    return record


def _raise_compile_limits() -> None:
    """Raise dynamo's per-code-object recompile limits to :data:`COMPILE_CACHE_LIMIT`: one ``Float8Linear.forward``
    serves every projection width and token count of the model, each a separate graph."""
    import torch._dynamo

    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, COMPILE_CACHE_LIMIT)
    cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, 4 * COMPILE_CACHE_LIMIT)


def _matches(name: str, pattern: str) -> bool:
    """``pattern`` (an ``fnmatch`` glob) matches the qualified ``name``, or ``"." + name``: ``*.f_a_proj`` names
    ``f_a_proj`` in a whole model (``model.layers.0.self_attn.f_a_proj``) and in a layer converted on its own."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase("." + name, pattern)


def _pad_rows(module: nn.Module, args: tuple) -> tuple | None:
    """Forward pre-hook of each converted projection: its input ``[..., in]`` as ``[M, in]`` rows padded with zero
    rows to a multiple of :data:`FP8_ALIGN` when the token count ``M`` is not one. The weight gradient's FP8 GEMM
    (``grad_out^T @ x``) reduces over the tokens, and ``torch._scaled_mm`` needs that inner size a multiple of 16
    (T = 1, 63, 2049 otherwise fail). Zero rows are exact: their outputs are cut off by :func:`_unpad_rows`, their
    gradients are zero, no per-tensor or per-row amax changes. Aligned inputs pass untouched (no copy)."""
    (x,) = args
    rows = x.shape[:-1].numel()
    pad = -rows % FP8_ALIGN
    module._fp8_rows = None if pad == 0 else x.shape[:-1]
    if pad == 0:
        return None
    return (torch.nn.functional.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, pad)),)


def _unpad_rows(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
    """Forward hook paired with :func:`_pad_rows`: the output's first ``M`` rows in the input's leading shape."""
    shape, module._fp8_rows = getattr(module, "_fp8_rows", None), None
    if shape is None:
        return None
    return out[: shape.numel()].reshape(*shape, out.shape[-1])


def _expert_kernel(module: nn.Module) -> str:
    """The kernel a ``GroupedExperts`` module will run on a CUDA bf16 batch: its ``moe_kernel`` (or
    ``$KIMI_MOE_KERNEL``) when set to one, else the ``auto`` rule (``grouped_mm`` on the ``cudnn`` backend)."""
    from kernels_torch import kernel_choice

    chosen = kernel_choice.resolve("moe", getattr(module, "moe_kernel", None))
    if chosen != "auto":
        return chosen
    return "grouped_mm" if getattr(module, "backend", "cudnn") == "cudnn" else "loop"


def _check_grouped(name: str, module: nn.Module) -> None:
    """The ``GroupedExperts`` contract: ``w1``, ``w3`` ``[E, I, Dl]`` and ``w2`` ``[E, Dl, I]`` parameters with ``I``
    and ``Dl`` multiples of 16 (torchao's FP8 grouped GEMM asserts them), and an integer ``align`` attribute.

    Raises:
        ValueError: naming the module, the parameter and its shape.
    """
    params = dict(module.named_parameters(recurse=False))
    shapes = {k: tuple(params[k].shape) for k in ("w1", "w3", "w2") if k in params}
    if len(shapes) != 3 or any(len(s) != 3 for s in shapes.values()):
        raise ValueError(f"{name}: GroupedExperts expects 3-D parameters w1, w3, w2, got {shapes}")
    E, I, Dl = shapes["w1"]
    if shapes["w3"] != (E, I, Dl) or shapes["w2"] != (E, Dl, I):
        raise ValueError(
            f"{name}: got w1 {shapes['w1']}, w3 {shapes['w3']}, w2 {shapes['w2']}, expected w1, w3 [E, I, Dl] and "
            "w2 [E, Dl, I]"
        )
    if I % FP8_ALIGN or Dl % FP8_ALIGN:
        raise ValueError(f"{name}: expert widths I={I}, Dl={Dl}, expected multiples of {FP8_ALIGN} for FP8")
    if not isinstance(getattr(module, "align", None), int) or module.align < 1:
        raise ValueError(
            f"{name}: GroupedExperts.align got {getattr(module, 'align', None)!r}, expected a positive int"
        )


def fp8_record(model: nn.Module) -> dict[str, Any] | None:
    """``model.fp8.to_dict()`` (the summary for ``run.json`` / ``metrics.jsonl``), or None for a model not converted."""
    rec = getattr(model, "fp8", None)
    return None if rec is None else rec.to_dict()
