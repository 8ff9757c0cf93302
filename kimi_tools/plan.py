"""``kimi plan``: the parallel layouts of a training run that fit a cluster, with each rank's memory, the
communication per step and a predicted step time and MFU (``docs/scaling.md``, section "Planned layouts").

Layout (torchtitan's ``ParallelDims``; ``kernels_torch/parallel/``): ``world = pp x dp x cp``. The pipeline cuts the
layers into ``pp`` stages at AttnRes block boundaries (K3.1: 8 blocks of 12 layers, the last 9; ``pp`` divides the
number of blocks), the embedding on the first stage, the final norm, the AttnRes output mix and ``lm_head`` on the
last. Inside a stage, every parameter except the routed experts is FSDP2-sharded over the ``dp x cp`` ranks; the
routed experts take a second view of the same ranks: ``ep`` divides ``dp x cp``, each rank holds the ``E / ep``
experts of its ``ep`` coordinate (contiguous blocks, ``kernels_torch.parallel.expert``), FSDP2-sharded over
``efsdp = dp x cp / ep``. FSDP2 shards each parameter along dim 0 in ``torch.chunk`` pieces (``ceil(rows / n)``
rows per rank, the last ranks fewer or none): :func:`shard_rows`. Rank order: ``pp`` outermost, then ``dp``, ``cp``,
with the ``ep`` ranks contiguous, so an ``ep`` group of at most ``gpus_per_node`` ranks stays inside a node.

Per rank (the worst stage, FSDP coordinate 0, which holds the largest chunks), in bytes:

* **params / grads / optimizer**: the rank's local elements (:func:`rank_numel`, equal to the meta model sharded as
  the trainer shards it: ``tests/test_plan.py``) times the bytes per element of the optimizer policy
  (:data:`OPTIMIZERS`): ``adamw-fp32`` = fp32 masters (4) + fp32 gradients (4) + two fp32 moments (8), FSDP2's
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; ``adamw-bf16`` = bf16 parameters, gradients and
  moments (2 + 2 + 4; ``kimi train --optimizer adamw-bf16``: an AdamW with stochastic rounding);
  ``--offload cpu`` keeps all three on the host (``kimi train --offload cpu``: FSDP2 ``CPUOffloadPolicy``). The
  tensors the checkpoint keeps in fp32 (``A_log``, ``dt_bias``, convs, ...) stay fp32 under either policy; the
  router's ``e_score_correction_bias`` has no gradient and no state (:func:`state_bytes`). LoRA: the frozen base in bf16
  (2 B, no gradient, no state), the adapters (``kimi_tools.lora.DEFAULT_TARGETS``: attention projections) trained
  under the policy.
* **gathered**: FSDP2's unsharded working set, under the policy the trainer runs for the layout
  (:func:`trainer_fsdp`). ``fsdp="layer"`` (no pipeline: ZeRO-3, ``reshard_after_forward=True``, gradients
  reduce-scattered every micro-batch): two layers' bf16 parameters (the current and the prefetched) and one layer's
  fp32 unsharded gradients. ``fsdp="stage"`` (``pp`` > 1: torch's ``PipelineStage`` turns resharding after the
  backward and gradient sync off until the step's last backward): every unit of the stage gathered in bf16, with
  FSDP2's padding, and the gradients of its trained parameters unsharded in the reduce dtype
  (:func:`stage_fsdp_bytes`, measured on the pipeline trainer by ``tests/test_plan.py``).
* **activations**: per layer from the config's widths (:func:`layer_activation_bytes`: bytes per token each layer
  keeps for its backward), scaled by the measured 4-layer step (``plan_calibration.json``: peak allocated minus
  parameter bytes over ``T`` x the count of its 4 layers; the scale holds what the count leaves out: workspaces,
  the gradients in flight, the loss chunk, one recompute working set) for ``recompute="none"`` (8K, no
  recomputation) and ``"mlp"`` (32K, the MLP/MoE blocks recomputed, layer 0 whole: ``--recompute-full-layers 1``);
  ``"full"`` (every layer recomputed) keeps what :func:`held_per_microbatch` counts (each layer's input, ``D x 2`` B
  per token) plus the stage's largest layer's ``"none"`` working set. In every mode each in-flight micro-batch also
  keeps the stage's received and sent states and, on the last stage, the output mix, norm and loss tensors
  (:func:`held_per_microbatch`; not in the 4-layer calibration, which has no pipeline). A stage under 1F1B holds
  ``min(pp - s, micro-batches)`` micro-batches in flight (stage ``s``); ``T = seq_len / cp`` tokens per rank.

Communication per step per rank (bytes a rank sends/receives; rings move ``(n - 1) / n`` of the gathered size):
FSDP all-gathers (bf16) and reduce-scatters (fp32; bf16 under ``adamw-bf16``): ``"layer"`` two gathers and a
reduce per layer and micro-batch; ``"stage"`` ``m + 1`` gathers of each unit per step (a forward after a backward
finds the unit gathered and reshards it, the next backward gathers it again; a unit that does not reshard after its
forward gathers once, so this is the most) and one reduce; the MoE all-to-all in the latent width ``Dl`` (dispatch ``T k Dl`` x 2 B, combine the same; the backward
the same again, and once more when the MoE block is recomputed), ``(ep - 1) / ep`` of it leaving the rank; pipeline
sends between stages (the hidden state and the AttnRes blocks stored so far, ``(b + 1) x D x 2`` B per token,
forward and backward).

Time: a stage's compute per micro-batch is its model FLOPs (:func:`layer_flops`, the ``kimi.flops`` count; LoRA:
forward and input gradients only, 2/3 of the weight matmuls) at the calibrated rate (the model TFLOP/s of the
4-layer step per recompute mode; ``"full"`` = the no-recompute rate x 3/4, one more forward per three units of
work), the routed experts slowed down where a rank's experts get fewer rows than in the calibration step
(``T k ep / E`` rows per expert, against the measured grouped-GEMM rate: :meth:`Calibration.expert_slowdown`). The
all-to-all is added unhidden (``kimi train``'s default), or with ``--overlap-a2a`` as ``kimi train --ep-overlap
chunks`` runs it (each MoE layer's tokens in two chunks: the experts at half the rows per expert, the first dispatch
and the last combine of each layer exposed, the rest hidden behind the routed experts' compute); FSDP traffic
overlaps compute (FSDP2's prefetch) and only its excess counts; 1F1B's bubble multiplies the slowest stage by
``(m + pp - 1) / m`` for ``m`` micro-batches; the optimizer step reads and writes its states at HBM (or host)
bandwidth. MFU = model FLOPs per token (``kimi.flops.estimate_flops``) x tokens/s/GPU / the GPU's dense bf16 peak.
The rates are k3.1-pro's: for a narrower preset the times are upper bounds (``kimi plan`` says so).

Each row ends with the ``torchrun ... -m kimi_tools.cli train ...`` command that runs it (:func:`train_command`);
layouts the trainer refuses are left out (:func:`plan`), and a global batch that is not a whole number of
sequences per data-parallel rank is rounded down, announced.

Link bandwidths (:class:`Hardware`, documented in ``docs/scaling.md``): effective, not nominal.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from kimi.config import PRESETS, KimiConfig, load_config
from kimi.layout import TensorSpec, stacked_layout

__all__ = [
    "Hardware",
    "Layout",
    "Policy",
    "OPTIMIZERS",
    "shard_rows",
    "stage_ranges",
    "lora_specs",
    "rank_numel",
    "state_bytes",
    "held_per_microbatch",
    "layer_flops",
    "Calibration",
    "load_calibration",
    "evaluate",
    "plan",
    "render_markdown",
    "add_parser",
    "cmd_plan",
]

CALIBRATION_FILE = Path(__file__).with_name("plan_calibration.json")
GB = 1e9

# Bytes per trained element: (parameter, gradient, optimizer state) on the GPU.
OPTIMIZERS = {"adamw-fp32": (4, 4, 8), "adamw-bf16": (2, 2, 4)}
FROZEN_BYTES = 2  # a LoRA base weight, bf16, no gradient and no state
GATHER_BYTES = 2  # FSDP2 all-gathers bf16 parameters (MixedPrecisionPolicy param_dtype)
RECOMPUTE = ("none", "mlp", "full")
FSDP_POLICIES = ("layer", "stage")
# --recompute-full-layers of the "mlp" mode: layer 0 (the dense MLP) recomputed whole, as in its calibration step
MLP_FULL_LAYERS = 1


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links, effective rates (what NCCL and the kernels reach, not the datasheet's).

    Args:
        gpu_memory_gb: HBM per GPU, GB (10^9 B). reserve_gb: kept free (CUDA context, NCCL buffers, allocator
            fragmentation), GB. peak_tflops: dense bf16 peak, TFLOP/s (H200 SXM: 989.4, the MFU denominator).
        gpus_per_node: GPUs behind one NVLink switch domain. nvlink_gbps: per GPU per direction, GB/s (H200 NVLink 4:
            450 nominal, 360 effective). ib_gbps: per GPU per direction across nodes, GB/s (one 400 Gb/s
            ConnectX-7 per GPU: 50 nominal, 40 effective). hbm_gbps: HBM bandwidth, GB/s (4,800 nominal, 4,000).
            pcie_gbps: host <-> GPU, GB/s (PCIe 5 x16: 64 nominal, 50). host_gbps: a GPU's share of the host's
            memory bandwidth for a CPU optimizer step, GB/s. host_memory_gb: host memory per GPU, GB (2 TB per
            8-GPU node).
    """

    gpu_memory_gb: float = 141.0
    reserve_gb: float = 5.0
    peak_tflops: float = 989.4
    gpus_per_node: int = 8
    nvlink_gbps: float = 360.0
    ib_gbps: float = 40.0
    hbm_gbps: float = 4000.0
    pcie_gbps: float = 50.0
    host_gbps: float = 20.0
    host_memory_gb: float = 250.0


@dataclass(frozen=True)
class Layout:
    """Mesh sizes: ``pp`` pipeline stages, ``dp`` data, ``cp`` context, ``ep`` expert (dividing ``dp x cp``).

    Raises:
        ValueError: a size < 1, or ``ep`` not dividing ``dp x cp`` (naming the sizes)."""

    pp: int
    dp: int
    cp: int
    ep: int

    def __post_init__(self):
        for k in ("pp", "dp", "cp", "ep"):
            if getattr(self, k) < 1:
                raise ValueError(f"layout: got {k}={getattr(self, k)}, expected a positive size")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"layout: got ep={self.ep} with dp={self.dp} x cp={self.cp}, expected ep dividing dp x cp "
                "(expert parallelism borrows the data x context ranks)"
            )

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.cp

    @property
    def efsdp(self) -> int:
        """The routed experts' FSDP degree: ``dp x cp / ep``."""
        return self.dp * self.cp // self.ep

    def name(self) -> str:
        return f"pp{self.pp} dp{self.dp} cp{self.cp} ep{self.ep}"


@dataclass(frozen=True)
class Policy:
    """How a layout is run: ``optimizer`` (:data:`OPTIMIZERS`), ``offload`` ("none" or "cpu"), ``recompute``
    ("none", "mlp", "full"), ``fsdp`` ("layer" or "stage", module docstring; "auto": the trainer's for the layout,
    :func:`trainer_fsdp`)."""

    optimizer: str = "adamw-fp32"
    offload: str = "none"
    recompute: str = "none"
    fsdp: str = "auto"


def trainer_fsdp(pp: int) -> str:
    """The FSDP policy ``kimi train`` runs at ``pp`` stages: "layer" without a pipeline (one unit per layer,
    resharded after its forward, gradients reduce-scattered every micro-batch), "stage" with one (torch's
    ``PipelineStage`` sets ``reshard_after_backward`` and ``requires_gradient_sync`` off until the step's last
    backward: every unit of the stage stays gathered from a micro-batch's backward on, its gradients accumulate
    unsharded in the reduce dtype and are reduce-scattered once per step; ``tests/test_plan.py`` measures it)."""
    return "layer" if pp == 1 else "stage"


def shard_rows(rows: int, n: int, coord: int) -> int:
    """Rows of a dim-0 size ``rows`` that FSDP2 gives coordinate ``coord`` of ``n`` ranks: ``torch.chunk`` pieces of
    ``ceil(rows / n)``, the last ones shorter or empty."""
    c = -(-rows // n)
    return max(0, min(c, rows - coord * c))


def stage_ranges(cfg: KimiConfig, pp: int) -> list[range]:
    """The layers of each of ``pp`` pipeline stages, cut at AttnRes block boundaries (``attn_res_block_size``;
    without AttnRes, blocks of one layer): ``pp`` must divide the number of blocks; each stage gets
    ``blocks / pp`` consecutive blocks (K3.1, pp = 8: [0, 12), ..., [84, 93)).

    Raises:
        ValueError: ``pp`` < 1 or not dividing the number of blocks."""
    L = cfg.num_hidden_layers
    size = cfg.attn_res_block_size or 1
    blocks = -(-L // size)
    if pp < 1 or blocks % pp:
        raise ValueError(
            f"pp: got {pp}, expected a divisor of the {blocks} AttnRes blocks of {size} layers (stages cut at block "
            "boundaries)"
        )
    per = blocks // pp
    return [range(s * per * size, min(L, (s + 1) * per * size)) for s in range(pp)]


def _is_expert(name: str) -> bool:
    return ".experts.w" in name


@functools.lru_cache(maxsize=8)
def _layout_specs(cfg: KimiConfig) -> tuple[tuple[TensorSpec, ...], dict[int, tuple[TensorSpec, ...]]]:
    """(global specs, {layer: specs}) of the torch model's parameters (:func:`kimi.layout.stacked_layout`)."""
    glob, per = [], {}
    for s in stacked_layout(cfg):
        if s.layer is None:
            glob.append(s)
        else:
            per.setdefault(s.layer, []).append(s)
    return tuple(glob), {k: tuple(v) for k, v in per.items()}


@functools.lru_cache(maxsize=16)
def lora_specs(cfg: KimiConfig, rank: int, targets: tuple[str, ...] | None = None) -> dict[int, list[TensorSpec]]:
    """The LoRA adapters ``kimi_tools.lora.apply_lora`` adds, per layer: for each ``nn.Linear`` weight ``[out, in]``
    whose module name ends with a target (default ``kimi_tools.lora.DEFAULT_TARGETS``; never the indexer),
    ``lora_A.default.weight`` ``[rank, in]`` and ``lora_B.default.weight`` ``[out, rank]`` (peft's names).

    Raises:
        ValueError: ``rank`` < 1."""
    from kimi_tools.lora import DEFAULT_TARGETS

    if rank < 1:
        raise ValueError(f"lora rank: got {rank}, expected a positive integer")
    targets = DEFAULT_TARGETS if targets is None else targets
    out: dict[int, list[TensorSpec]] = {}
    for layer, specs in _layout_specs(cfg)[1].items():
        for s in specs:
            mod = s.name.removesuffix(".weight")
            if len(s.shape) != 2 or ".indexer." in s.name or not any(mod.endswith("." + t) for t in targets):
                continue
            o, i = s.shape
            out.setdefault(layer, []).append(TensorSpec(mod + ".lora_A.default.weight", (rank, i), "float32", layer))
            out.setdefault(layer, []).append(TensorSpec(mod + ".lora_B.default.weight", (o, rank), "float32", layer))
    return out


# Parameters the optimizer never updates (no gradient): the router's balancing bias, moved by its own rule.
_FIXED = ("e_score_correction_bias",)


@functools.lru_cache(maxsize=4096)
def _groups(cfg: KimiConfig, layer: int | None, lora_rank: int | None) -> tuple[tuple[str, str, int, int, int], ...]:
    """Parameters of ``layer`` (None: the global ones) as ``(kind, flag, dim-0 rows, elements per row, count)`` with
    kind "dense", "experts" (stacks, rows = E), "embed" or "lora" (``lora_rank``'s adapters) and flag "fixed" (no
    gradient: :data:`_FIXED`), "fp32" (kept fp32 by the checkpoint and ``kernels_torch.model.cast_model``) or "";
    equal shapes merged."""
    glob, per = _layout_specs(cfg)
    counts: dict[tuple[str, str, int, int], int] = {}
    specs = list(glob) if layer is None else list(per[layer])
    for s in specs:
        kind = "experts" if _is_expert(s.name) else "dense"
        if s.name == "model.embed_tokens.weight":  # the first stage's; the other globals are the last stage's
            kind = "embed"
        flag = "fixed" if s.name.endswith(_FIXED) else "fp32" if s.dtype == "float32" else ""
        key = (kind, flag, s.shape[0], math.prod(s.shape[1:]))
        counts[key] = counts.get(key, 0) + 1
    if lora_rank and layer is not None:
        for s in lora_specs(cfg, lora_rank).get(layer, []):
            key = ("lora", "", s.shape[0], math.prod(s.shape[1:]))
            counts[key] = counts.get(key, 0) + 1
    return tuple((*k, c) for k, c in counts.items())


@functools.lru_cache(maxsize=4096)
def rank_numel(
    cfg: KimiConfig,
    layout: Layout,
    stage: int,
    *,
    dp_cp_coord: int = 0,
    efsdp_coord: int = 0,
    lora_rank: int | None = None,
) -> dict[str, int]:
    """Elements of the parameters one rank of pipeline stage ``stage`` holds: ``dense`` (everything but the routed
    experts, sharded over ``dp x cp`` at coordinate ``dp_cp_coord``), ``experts`` (the rank's ``E / ep`` rows of each
    stack, sharded over ``efsdp`` at ``efsdp_coord``), ``lora`` (the adapters, sharded with the dense part); and by
    role: ``trainable`` (all but the fixed ones; with ``lora_rank`` the adapters only), ``trainable_fp32`` (those
    the checkpoint keeps fp32), ``frozen`` / ``frozen_fp32`` (the LoRA base), ``fixed`` (no gradient:
    ``e_score_correction_bias``). FSDP2 shards every parameter along dim 0 (:func:`shard_rows`)."""
    ranges = stage_ranges(cfg, layout.pp)
    n_dc = layout.dp * layout.cp
    tot = dict.fromkeys(("dense", "experts", "lora", "fixed", "fp32"), 0)

    def add(kind, flag, n):
        tot["dense" if kind == "embed" else kind] += n
        if flag:
            tot[flag] += n

    for kind, flag, rows, inner, count in _groups(cfg, None, None):
        if (stage == 0) if kind == "embed" else (stage == layout.pp - 1):
            add(kind, flag, count * shard_rows(rows, n_dc, dp_cp_coord) * inner)
    for i in ranges[stage]:
        for kind, flag, rows, inner, count in _groups(cfg, i, lora_rank):
            if kind == "experts":
                add(kind, flag, count * shard_rows(rows // layout.ep, layout.efsdp, efsdp_coord) * inner)
            else:
                add(kind, flag, count * shard_rows(rows, n_dc, dp_cp_coord) * inner)
    base = tot["dense"] + tot["experts"] - tot["fixed"]
    fp32 = tot.pop("fp32")
    if lora_rank:
        return {**tot, "trainable": tot["lora"], "trainable_fp32": 0, "frozen": base, "frozen_fp32": fp32}
    return {**tot, "trainable": base, "trainable_fp32": fp32, "frozen": 0, "frozen_fp32": 0}


@functools.lru_cache(maxsize=4096)
def _unsharded(cfg: KimiConfig, layer: int | None, ep: int, lora_rank: int | None, stage_of_glob: str = "") -> dict:
    """Elements one rank gathers of ``layer`` (its ``E / ep`` experts): dense, experts, lora; for the globals,
    ``stage_of_glob`` "first" (the embedding) or "last" (the rest)."""
    out = {"dense": 0, "experts": 0, "lora": 0}
    for kind, _, rows, inner, count in _groups(cfg, layer, lora_rank):
        if layer is None:
            if (kind == "embed") != (stage_of_glob == "first"):
                continue
            kind = "dense"
        out[kind] += count * (rows // ep if kind == "experts" else rows) * inner
    return out


def _gets_gradient(name: str) -> bool:
    """Whether the LM loss gives parameter ``name`` a gradient: not the DSA indexer (reached through its top-k
    selection only; the distillation stages train it) nor layer 0's attention-side AttnRes mix (one source)."""
    return ".indexer." not in name and not name.startswith("model.layers.0.self_attention_res_")


@functools.lru_cache(maxsize=4096)
def _fsdp_unit(cfg: KimiConfig, layer: int | None, n_dc: int, ep: int, efsdp: int, lora_rank: int | None, glob: str):
    """One FSDP2 unit of a rank as the trainer builds it (``kernels_torch.parallel.fsdp.apply_fsdp``, bf16 with the
    checkpoint's fp32 tensors ignored: whole on every rank, never gathered): ``(gathered, graded)`` elements, the
    all-gather output of its bf16 parameters (each padded to whole ``torch.chunk`` shards: dense ``ceil(rows / n_dc)
    x n_dc`` rows; the ``E / ep`` expert rows over ``efsdp`` along dim 1 when it divides, else padded dim 0 rows,
    ``kernels_torch.parallel.fsdp._expert_placement``) and the elements of those that get a gradient (trained,
    :func:`_gets_gradient`; with ``lora_rank`` the adapters only). ``layer`` None: the root's globals, ``glob``
    "first" (the embedding) or "last" (the rest)."""
    glob_specs, per = _layout_specs(cfg)
    specs = (
        list(per[layer])
        if layer is not None
        else [s for s in glob_specs if (s.name == "model.embed_tokens.weight") == (glob == "first")]
    )
    if lora_rank and layer is not None:
        specs += lora_specs(cfg, lora_rank).get(layer, [])
    gathered = graded = 0
    for s in specs:
        lora = ".lora_" in s.name
        if s.dtype == "float32" and not lora:  # ignored by FSDP2 (a LoRA adapter is an fp32 master, gathered bf16)
            continue
        inner = math.prod(s.shape[1:])
        if _is_expert(s.name):
            rows = s.shape[0] // ep
            split = len(s.shape) > 1 and s.shape[1] % efsdp == 0
            g = s.numel // ep if split else -(-rows // efsdp) * efsdp * inner
        else:
            g = -(-s.shape[0] // n_dc) * n_dc * inner
        gathered += g
        if (lora or not lora_rank) and _gets_gradient(s.name):
            graded += s.numel // ep if _is_expert(s.name) else s.numel
    return gathered, graded


def stage_fsdp_bytes(cfg: KimiConfig, layout: Layout, stage: int, *, reduce_bytes: int = 4, lora_rank=None) -> int:
    """Bytes FSDP2 holds unsharded on a rank of pipeline stage ``stage`` under the trainer's "stage" policy
    (:func:`trainer_fsdp`, ``pp`` > 1) from the first backward of a step to its end: every unit of the stage (its
    layers, their routed experts, the stage module's root) gathered in bf16 (:func:`_fsdp_unit`, with FSDP2's
    padding) and the gradients of its trained parameters, unsharded, in the reduce dtype (``reduce_bytes``: 4 for
    fp32, 2 for bf16). ``tests/test_plan.py`` measures it on the pipeline trainer between micro-batches."""
    layers = stage_ranges(cfg, layout.pp)[stage]
    n_dc = layout.dp * layout.cp
    units = [_fsdp_unit(cfg, i, n_dc, layout.ep, layout.efsdp, lora_rank, "") for i in layers]
    if stage == 0:
        units.append(_fsdp_unit(cfg, None, n_dc, 1, 1, None, "first"))
    if stage == layout.pp - 1:
        units.append(_fsdp_unit(cfg, None, n_dc, 1, 1, None, "last"))
    return sum(g * GATHER_BYTES + t * reduce_bytes for g, t in units)


def _mix_sources(cfg: KimiConfig, i: int) -> tuple[int, int]:
    """Sources of layer ``i``'s two AttnRes mixes (attention side, MLP side): the blocks stored before it plus the
    partial sum (``kernels_torch.model.DecoderLayer.forward``); (1, 1) without AttnRes (no mix)."""
    if not cfg.has_attn_res:
        return 1, 1
    b = cfg.attn_res_block_size
    return (math.ceil(i / b) + 1 if i else 1), i // b + 2


@functools.lru_cache(maxsize=64)
def _act_table(cfg: KimiConfig, full_layers: int = MLP_FULL_LAYERS) -> tuple[tuple[int, int], ...]:
    """:func:`layer_activation_bytes` of every layer, ("none", "mlp")."""
    return tuple(
        (layer_activation_bytes(cfg, i, "none"), layer_activation_bytes(cfg, i, "mlp", full_layers))
        for i in range(cfg.num_hidden_layers)
    )


def layer_activation_bytes(cfg: KimiConfig, i: int, mode: str = "none", full_layers: int = MLP_FULL_LAYERS) -> int:
    """Bytes per token that layer ``i`` keeps for its backward, from the config's widths (bf16 activations 2 B, the
    tensors the code computes in fp32 4 B), the principal saved tensors of each part (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", section 4's count, for this model's layers):

    * each AttnRes mix over ``M > 1`` sources (:func:`_mix_sources`): three fp32 copies of them, ``12 M D``; each
      RMSNorm ``6 D``;
    * KDA (``P = H x K``): the q/k/v projections and convolutions, the fp32 L2-normalised q, k, the gate and its
      fp32 decay, the output gate and the fp32 gated norm, ``42 P + 2 R + 4 H`` (``R`` the gate rank);
    * MLA: the q and kv latents and their fp32 norms, q, the expanded k and v, the output and its fp32 sigmoid
      gate; DSA adds the selected key ids (``4 x index_topk``);
    * dense MLP ``6 I + 2 D``; MoE: the fp32 router scores (``4 E``), the routing (``12 k``), the latent input, per
      routed slot its rows in and out (``2 Dl + 4 Dl``) and its GLU (``6 I``), the latent norm, up projection and
      shared experts (``6 I x shared``).

    ``mode`` "mlp" (``kernels_torch.activation_memory.recompute_layers(model, "mlp", full_layers)``): the MLP / MoE block with its
    norm keeps only its input (``2 D``), and the first ``full_layers`` layers, recomputed whole, only theirs.
    The count is what a layer saves up to one constant: the planner scales it by each calibration step's measured
    bytes (:class:`Calibration`); ``tests/test_plan.py`` checks its shape against autograd's saved tensors.

    Raises:
        ValueError: ``mode`` not "none" or "mlp"."""
    if mode not in ("none", "mlp"):
        raise ValueError(f"mode: got {mode!r}, expected 'none' or 'mlp'")
    c, D = cfg, cfg.hidden_size
    if mode == "mlp" and i < full_layers:
        return 2 * D
    m_attn, m_mlp = _mix_sources(cfg, i)
    mix = lambda M: 12 * M * D if M > 1 else 0  # noqa: E731
    out = mix(m_attn) + mix(m_mlp) + 6 * D  # the mixes, the attention's input norm
    if c.layer_type(i) == "kda":
        P, H, R = c.kda_num_heads * c.kda_head_dim, c.kda_num_heads, c.kda_gate_rank
        out += 42 * P + 2 * R + 4 * H
    else:
        H, Kn, Rr, V, L = c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank
        out += 6 * (c.q_lora_rank or 0) + 2 * (L + Rr) + 4 * L  # latents, their norms
        out += 2 * H * (Kn + Rr) * 2 + 2 * H * (Kn + V)  # q, k, the kv expansion
        out += 2 * H * V + 8 * H * V + 2 * H * V  # attention output, fp32 gate, gated output
        if c.layer_type(i) == "dsa":
            out += 4 * c.index_topk
    if mode == "mlp":
        return out + 2 * D
    out += 6 * D  # the MLP's input norm
    if c.is_moe_layer(i):
        E, k, inter = c.num_experts, c.num_experts_per_token, c.moe_intermediate_size
        Dl = c.routed_expert_hidden_size or D
        out += 4 * E + 12 * k + 2 * Dl + k * (6 * Dl + 6 * inter) + 4 * Dl + 2 * D
        out += 6 * c.num_shared_experts * inter + 2 * D if c.num_shared_experts else 0
    else:
        out += 6 * c.intermediate_size + 2 * D
    return out


def state_bytes(n: dict, optimizer: str) -> dict[str, int]:
    """Bytes of a rank's sharded parameters, gradients and optimizer states from :func:`rank_numel`'s counts under
    ``optimizer`` (:data:`OPTIMIZERS`): the tensors the checkpoint keeps fp32 stay fp32 under either policy (fp32
    gradients, fp32 moments), the fixed ones are fp32 without gradient or state, a LoRA base is bf16 (its fp32
    tensors fp32)."""
    pb, gb, ob = OPTIMIZERS[optimizer]
    low = n["trainable"] - n["trainable_fp32"]
    frozen = (n["frozen"] - n["frozen_fp32"]) * FROZEN_BYTES + n["frozen_fp32"] * 4
    return {
        "params": low * pb + n["trainable_fp32"] * 4 + frozen + n["fixed"] * 4,
        "grads": low * gb + n["trainable_fp32"] * 4,
        "optimizer": low * ob + n["trainable_fp32"] * 8,
    }


@dataclass(frozen=True)
class Flops:
    """Model FLOPs per token (:func:`layer_flops`): ``layers`` and ``experts`` (the routed experts' part of each
    layer) per layer, ``head`` (``lm_head`` and the AttnRes output mix)."""

    layers: tuple[float, ...]
    experts: tuple[float, ...]
    head: float

    @property
    def total(self) -> float:
        return sum(self.layers) + self.head


@functools.lru_cache(maxsize=64)
def layer_flops(cfg: KimiConfig, seq_len: int, frozen_weights: bool = False) -> Flops:
    """Model FLOPs per token of a training step (forward + backward) for documents of ``seq_len`` tokens, per layer:
    ``kimi.flops.estimate_flops``'s count split by layer (weight matmuls with the routed experts at ``k / E``, short
    convs, KDA recurrences, attention, the indexer forward only); the parts add up to
    ``estimate_flops(cfg, seq_len)["flops_per_token"]`` (``tests/test_plan.py``). ``frozen_weights`` (LoRA): the
    weights get no gradient, so each weight matmul counts forward + input gradient (2x the forward, not 3x); the
    adapters' own FLOPs (rank r, tiny) are left out."""
    w = 2 if frozen_weights else 3
    # the global matmuls: lm_head and the AttnRes output mix (the embedding is a lookup, norms are not counted)
    glob, per = _layout_specs(cfg)
    head = sum(w * 2 * s.numel for s in glob if len(s.shape) == 2 and s.name != "model.embed_tokens.weight")
    share = cfg.num_experts_per_token / cfg.num_experts if cfg.num_experts else 0.0
    out, exp = [], []
    for i in range(cfg.num_hidden_layers):
        f = e = 0.0
        for s in per[i]:
            if ".indexer." in s.name and s.name.endswith(".weight") and len(s.shape) == 2:
                f += 2 * s.numel  # frozen: forward only
            elif _is_expert(s.name):
                e += w * 2 * s.numel * share
            elif "conv1d" in s.name and s.name.endswith(".weight"):
                f += w * 2 * s.numel
            elif s.name.endswith(".weight") and len(s.shape) == 2:
                f += w * 2 * s.numel
        f += _attention_flops(cfg, i, seq_len)
        out.append(f + e)
        exp.append(e)
    return Flops(tuple(out), tuple(exp), head)


def _attention_flops(cfg: KimiConfig, i: int, seq_len: int) -> float:
    """The non-matmul terms of ``kimi.flops.estimate_flops`` for layer ``i`` (training): KDA recurrence, MLA/DSA
    attention (x 3), the indexer scores (forward only)."""
    from kimi.flops import causal_keys

    c = cfg
    kind = c.layer_type(i)
    if kind == "kda":
        return 3.0 * 6 * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim
    if kind == "mla":
        d_qk, d_v = c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim
        return 3.0 * 2 * c.num_attention_heads * (d_qk + d_v) * causal_keys(seq_len)
    d_qk, d_v = c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank
    att = 3.0 * 2 * c.num_attention_heads * (d_qk + d_v) * causal_keys(seq_len, c.index_topk)
    return att + 2 * c.index_n_heads * (c.index_head_dim + 1) * causal_keys(seq_len)


@dataclass(frozen=True)
class Calibration:
    """Measured rates and activation bytes of the 4-layer step, per recompute mode (``plan_calibration.json``).

    Attributes:
        tflops: {mode: model TFLOP/s} for "none" and "mlp" ("full" derived: "none" x 3/4).
        act_per_token_layer: {mode: bytes per token per layer} for "none" and "mlp".
        sources: {mode: "file (date, commit), seq_len, ms, peak GiB"} of each point used.
        rows_per_expert: {mode: rows per expert in that calibration step} (``T k / E`` of the benchmark).
        density: ((rows per expert, TFLOP/s), ...) of the routed experts alone (``expert_density``).
        act_scale: {mode: measured activation bytes / :func:`layer_activation_bytes` of the calibration step's
            layers} for "none" and "mlp": what the count leaves out (workspaces, gradients in flight, the loss
            chunk, the allocator), applied to any config's count (:meth:`layer_bytes`).
    """

    tflops: dict
    act_per_token_layer: dict
    sources: dict = field(default_factory=dict)
    rows_per_expert: dict = field(default_factory=dict)
    density: tuple = ()
    act_scale: dict = field(default_factory=dict)

    def layer_bytes(self, cfg: KimiConfig, layers: range, T: int, mode: str) -> float:
        """Activation bytes of ``layers`` of ``cfg`` for ``T`` tokens under recompute ``mode`` ("none" or "mlp"):
        :func:`layer_activation_bytes` scaled by :attr:`act_scale`."""
        col = 0 if mode == "none" else 1
        table = _act_table(cfg)
        return self.act_scale[mode] * T * sum(table[i][col] for i in layers)

    def working_set(self, cfg: KimiConfig, layers: range, T: int) -> float:
        """One layer's no-recompute activation bytes (the largest of ``layers``), for ``T`` tokens: what a layer
        recomputed whole holds while its backward runs."""
        table = _act_table(cfg)
        return self.act_scale["none"] * T * max((table[i][0] for i in layers), default=0)

    def expert_rate(self, rows: float) -> float:
        """The routed experts' TFLOP/s at ``rows`` per expert (``expert_density`` points: log-linear between them,
        flat above the last, proportional to ``rows`` below the first)."""
        pts = sorted(self.density)
        if not pts:
            return 1.0
        (r0, t0), (r1, t1) = pts[0], pts[-1]
        if rows <= r0:
            return t0 * rows / r0
        if rows >= r1:
            return t1
        for (ra, ta), (rb, tb) in zip(pts, pts[1:]):
            if ra <= rows <= rb:
                return ta + (tb - ta) * math.log(rows / ra) / math.log(rb / ra)
        return t1

    def expert_slowdown(self, rows: float, mode: str) -> float:
        """How much longer the experts take at ``rows`` per expert than in the calibration step of ``mode``."""
        ref = self.rows_per_expert.get("none" if mode == "full" else mode)
        return 1.0 if ref is None or not self.density else self.expert_rate(ref) / self.expert_rate(rows)


def load_calibration(fp8: str | None = None, path: Path = CALIBRATION_FILE) -> Calibration:
    """The calibration for bf16 (``fp8=None``) or an FP8 recipe from ``path``.

    Raises:
        ValueError: no calibration point for that recipe (naming the recipes that have one)."""
    doc = json.loads(Path(path).read_text())
    key = "bf16" if fp8 is None else f"fp8-{fp8}"
    tflops, act, src, rows, scale = {}, {}, {}, {}, {}
    for p in doc["points"]:
        use = p.get("use")
        if not use or not use.startswith(key + "-"):
            continue
        mode = use[len(key) + 1 :]
        tflops[mode] = p["model_tflop"] / (p["ms"] * 1e-3)
        measured = p["peak_gib"] * 2**30 - p["param_bytes"]
        act[mode] = measured / (p["seq_len"] * CALIBRATION_LAYERS)
        ccfg = calibration_config(p["experts"], p["experts_per_token"])
        full = p.get("recompute_full_layers") or 0
        count = sum(layer_activation_bytes(ccfg, i, mode, full) for i in range(CALIBRATION_LAYERS))
        scale[mode] = measured / (p["seq_len"] * count)
        rows[mode] = p["seq_len"] * p["experts_per_token"] / p["experts"]
        src[mode] = (
            f"{p['file']} ({p['date']}, {p['commit']}): {p['seq_len']} tokens, {p['experts']} experts, "
            f"recompute {p['recompute']}, {p['ms']:.1f} ms, peak {p['peak_gib']:.2f} GiB"
        )
    if set(tflops) != {"none", "mlp"}:
        have = sorted({p["use"].rsplit("-", 1)[0] for p in doc["points"] if p.get("use")})
        raise ValueError(f"--fp8: got {fp8!r}, no calibration points for it; calibrated: {have}")
    tflops["full"] = tflops["none"] * 3 / 4
    dens = tuple((q["rows_per_expert"], q["tflops"]) for q in doc.get("expert_density", {}).get("points", []))
    return Calibration(tflops, act, src, rows, dens, scale)


CALIBRATION_LAYERS = 4  # the calibration steps' model: k3.1-pro's first 4 layers (plan_calibration.json "about")


def calibration_config(experts: int, experts_per_token: int) -> KimiConfig:
    """The config of a calibration step: k3.1-pro truncated to :data:`CALIBRATION_LAYERS` layers, with the step's
    routed experts."""
    return (
        load_config("k3.1-pro")
        .truncated(CALIBRATION_LAYERS)
        .replace(num_experts=experts, num_experts_per_token=experts_per_token)
    )


def _bw(group: int, stride: int, hw: Hardware) -> float:
    """Effective bandwidth (B/s) of a ring over ``group`` ranks ``stride`` apart: NVLink inside one node, else IB."""
    return (hw.nvlink_gbps if group * stride <= hw.gpus_per_node else hw.ib_gbps) * GB


def _a2a_time(nbytes: float, ep: int, hw: Hardware) -> float:
    """Seconds for an all-to-all in which each rank sends ``nbytes`` spread evenly over ``ep`` contiguous ranks:
    the share to ranks on the same node over NVLink, the rest over IB, concurrently."""
    if ep == 1:
        return 0.0
    local = min(ep, hw.gpus_per_node)
    intra = nbytes * (local - 1) / ep
    inter = nbytes * (ep - local) / ep
    return max(intra / (hw.nvlink_gbps * GB), inter / (hw.ib_gbps * GB))


@functools.lru_cache(maxsize=4096)
def _sources_after(cfg: KimiConfig, stop: int) -> int:
    """``M`` of the ``[M, B, T, D]`` state after layers ``0 .. stop - 1`` (the AttnRes blocks stored so far plus the
    partial sum; 1 without AttnRes): ``kernels_torch.parallel.pipeline.sources_after``."""
    return math.ceil(stop / cfg.attn_res_block_size) + 1 if cfg.has_attn_res else 1


def _layer_inputs(layers: range, T: int, D: int, first: bool) -> int:
    """Bytes of the layers' bf16 inputs a stage keeps under whole-layer recomputation (each layer's partial sum
    ``p``, ``T x D x 2``); a later stage's first layer reads a view of the received state (counted with it)."""
    return (len(layers) - (0 if first else 1)) * T * D * 2


def held_per_microbatch(
    cfg: KimiConfig, layers: range, T: int, *, first: bool, last: bool, lm_head_grad: bool = True
) -> int:
    """Bytes one in-flight micro-batch keeps on a pipeline stage between its forward and its backward when every
    layer is recomputed (``kernels_torch.activation_memory.recompute_layers(model, "layer")``), in units of ``u = T x D x 2``
    (bf16 activations, ``T`` tokens per rank), as the stage module (``kernels_torch.parallel.pipeline.
    PipelineStageModule``) and the schedule keep them:

    * each layer's input partial sum: ``len(layers)`` u (a later stage's first layer reads a view of the received
      state instead);
    * a later stage's received state ``[M_in, B, T, D]`` (``M_in = sources_after(start)``): ``M_in`` u; a stage
      before the last its sent state (``torch.distributed.pipelining`` keeps a stage's outputs for its backward):
      ``M_out`` u;
    * the last stage's head: the output AttnRes mix over ``M`` sources keeps three fp32 copies of them (the
      stacked sources, their transposed and flattened forms: ``6 M`` u; none when ``M = 1``), the final RMSNorm its
      fp32 input (2 u) and bf16 output (1 u), ``kernels_torch.loss.linear_cross_entropy`` the hidden-state gradient
      (1 u) and, with a trainable ``lm_head``, its ``[V, D]`` gradient (``V x D x 2`` B), computed in the forward.

    ``tests/test_plan.py`` checks the count against the tensors autograd saves for every stage of a split model.
    """
    D = cfg.hidden_size
    u = T * D * 2
    held = _layer_inputs(layers, T, D, first)
    if not first:
        held += _sources_after(cfg, layers.start) * u
    if not last:
        held += _sources_after(cfg, layers.stop) * u
    else:
        M = _sources_after(cfg, layers.stop)
        held += (6 * M if M > 1 else 0) * u + 4 * u
        if lm_head_grad:
            held += cfg.vocab_size * D * 2
    return held


def _stage_static(cfg: KimiConfig, L: Layout, lora_rank: int | None) -> tuple:
    """Per stage, what does not depend on the policy: (:func:`rank_numel`, (gathered, trainable) elements of each
    layer as one FSDP unit, the stage's unsharded elements {dense, experts, lora, train_dense, train_experts}, MoE
    layers)."""
    out = []
    for s, layers in enumerate(stage_ranges(cfg, L.pp)):
        n = rank_numel(cfg, L, s, lora_rank=lora_rank)
        per_layer = [_unsharded(cfg, i, L.ep, lora_rank) for i in layers]
        sizes = [
            (u["dense"] + u["experts"] + u["lora"], u["lora"] if lora_rank else u["dense"] + u["experts"])
            for u in per_layer
        ]
        full = {k: sum(u[k] for u in per_layer) for k in ("dense", "experts", "lora")}
        if s == 0:
            full["dense"] += _unsharded(cfg, None, 1, None, "first")["dense"]
        if s == L.pp - 1:
            full["dense"] += _unsharded(cfg, None, 1, None, "last")["dense"]
        if lora_rank:  # the frozen base is gathered, only the adapters' gradients are reduced
            full["train_dense"], full["train_experts"] = full["lora"], 0
            full["dense"] += full["lora"]
        else:
            full["train_dense"], full["train_experts"] = full["dense"], full["experts"]
        moe = sum(1 for i in layers if cfg.is_moe_layer(i))
        out.append((n, sizes, full, moe))
    return tuple(out)


def evaluate(
    cfg: KimiConfig,
    layout: Layout,
    policy: Policy,
    hw: Hardware,
    cal: Calibration,
    *,
    seq_len: int,
    global_batch: int,
    lora_rank: int | None = None,
    overlap_a2a: bool = False,
) -> dict:
    """One layout under one policy: per-rank bytes (worst stage), communication per step, predicted time and MFU.

    Args:
        seq_len: tokens per sequence (one micro-batch row, cut over ``cp``). global_batch: tokens per optimizer
            step; micro-batches per pipeline ``m = max(1, global_batch // (dp x seq_len))``.
        overlap_a2a: the all-to-all as ``kimi train --ep-overlap chunks`` runs it (module docstring; ep > 1 only).

    Returns:
        A JSON-able dict: ``layout``, ``policy``, ``microbatches``, ``memory`` (bytes: params, grads, optimizer,
        gathered, activations, total; host bytes when offloaded), ``comm`` (bytes per step per rank: all_gather,
        reduce_scatter, all_to_all, pipeline), ``time`` (s: compute, all_to_all, fsdp_exposed, pipeline, bubble,
        optimizer, step), ``tokens_per_s_per_gpu``, ``tflops_per_gpu``, ``mfu``, ``fits``.
    """
    L = layout
    fsdp = trainer_fsdp(L.pp)
    if policy.fsdp not in ("auto", fsdp):
        raise ValueError(
            f"fsdp: got {policy.fsdp!r} with pp={L.pp}, expected {fsdp!r}, the policy the trainer runs there "
            "(trainer_fsdp)"
        )
    policy = dataclasses.replace(policy, fsdp=fsdp)
    m = max(1, global_batch // (L.dp * seq_len))
    T = seq_len // L.cp
    pb, gb, ob = OPTIMIZERS[policy.optimizer]
    rb = 4 if policy.optimizer == "adamw-fp32" else 2  # reduce-scatter dtype
    fl = layer_flops(cfg, seq_len, frozen_weights=bool(lora_rank))
    rows = T * cfg.num_experts_per_token * L.ep / cfg.num_experts if cfg.num_experts else 0.0
    # overlap_a2a: the trainer's --ep-overlap chunks (kernels_torch.parallel.expert): each MoE layer's tokens in two
    # chunks, so the experts run half the rows per expert (the calibrated rate there); the first dispatch and the
    # last combine of a layer (and their reverses) stay exposed, half the all-to-all; the other half travels while
    # the routed experts compute and shows only where it outlasts them
    chunks = bool(overlap_a2a and L.ep > 1 and rows)
    slow = cal.expert_slowdown(rows / 2 if chunks else rows, policy.recompute) if rows else 1.0
    ranges = stage_ranges(cfg, L.pp)
    n_dc = L.dp * L.cp
    D, k = cfg.hidden_size, cfg.num_experts_per_token
    Dl = cfg.routed_expert_hidden_size or D
    block = cfg.attn_res_block_size or 1
    a2a_units = 4 if policy.recompute == "none" else 6  # dispatch + combine, fwd, bwd (and the recomputed fwd)
    stages = []
    static = _stage_static(cfg, L, lora_rank)
    for s, layers in enumerate(ranges):
        n, sizes, full, moe = static[s]
        if fsdp == "layer":
            big = max(sizes)
            gathered = 2 * big[0] * GATHER_BYTES + big[1] * 4
        else:
            gathered = stage_fsdp_bytes(cfg, L, s, reduce_bytes=rb, lora_rank=lora_rank)
        inflight = min(L.pp - s, m)
        first, last = s == 0, s == L.pp - 1
        held = held_per_microbatch(cfg, layers, T, first=first, last=last, lm_head_grad=not lora_rank)
        if policy.recompute == "full":  # the layer inputs are in `held`; one layer's working set beside them
            act = inflight * held + cal.working_set(cfg, layers, T)
        else:  # the calibrated per-layer bytes replace the layer inputs; the stage's I/O and head come on top
            extra = held - _layer_inputs(layers, T, D, first)
            act = inflight * (cal.layer_bytes(cfg, layers, T, policy.recompute) + extra)
        on_gpu = policy.offload == "none"
        sb = state_bytes(n, policy.optimizer)
        mem = {
            "params": sb["params"] if on_gpu else 0,
            "grads": sb["grads"] if on_gpu else 0,
            "optimizer": sb["optimizer"] if on_gpu else 0,
            "gathered": gathered,
            "activations": act,
        }
        mem["total"] = sum(mem.values())
        host = 0 if on_gpu else sum(sb.values())
        # communication per step (bytes per rank)
        # "layer": a forward and a backward gather per micro-batch, a reduce-scatter per micro-batch; "stage": each
        # forward after a backward finds the units still gathered and reshards them (reshard_after_forward), so
        # 1F1B and GPipe gather once per micro-batch's backward plus once for the first forward, m + 1, and reduce
        # once (measured in tests/test_plan.py); a unit that keeps its gathered copy after the forward (FSDP2's
        # reshard policy: torchtitan's leaves the last layer and the root) gathers once: m + 1 is the most
        gathers = 2 * m if fsdp == "layer" else m + 1
        reduces = m if fsdp == "layer" else 1
        f_dc, f_ef = (n_dc - 1) / n_dc, (L.efsdp - 1) / L.efsdp
        ag_d = full["dense"] * GATHER_BYTES * f_dc * gathers
        ag_e = full["experts"] * GATHER_BYTES * f_ef * gathers
        rs_d = full["train_dense"] * rb * f_dc * reduces
        rs_e = full["train_experts"] * rb * f_ef * reduces
        a2a = m * moe * a2a_units * T * k * Dl * 2 * (L.ep - 1) / L.ep
        b_in = layers.start // block  # AttnRes blocks stored when entering this stage
        b_out = layers.stop // block if layers.stop < cfg.num_hidden_layers else None
        pp_bytes = 0.0
        if s > 0:
            pp_bytes += m * 2 * (b_in + 1) * T * D * 2  # receive forward, send the gradient back
        if b_out is not None:
            pp_bytes += m * 2 * (b_out + 1) * T * D * 2
        comm = {"all_gather": ag_d + ag_e, "reduce_scatter": rs_d + rs_e, "all_to_all": a2a, "pipeline": pp_bytes}
        # time
        f_stage = T * (sum(fl.layers[i] for i in layers) + (fl.head if s == L.pp - 1 else 0.0))
        f_exp = T * sum(fl.experts[i] for i in layers)
        # per micro-batch: the calibrated rate, the experts slowed down at a lower density than the calibration's
        t_comp = (f_stage + f_exp * (slow - 1.0)) / (cal.tflops[policy.recompute] * 1e12)
        t_a2a = _a2a_time(a2a / m, L.ep, hw) if a2a else 0.0
        t_exp = f_exp * slow / (cal.tflops[policy.recompute] * 1e12)  # the routed experts' part of t_comp
        t_shown = t_a2a / 2 + max(0.0, t_a2a / 2 - t_exp) if chunks else t_a2a
        bw_dc = _bw(n_dc, 1, hw)
        bw_ef = _bw(L.efsdp, L.ep, hw)
        t_fsdp = (ag_d + rs_d) / bw_dc + (ag_e + rs_e) / bw_ef
        t_pp = pp_bytes / m / _bw(2, n_dc, hw)
        stages.append(
            dict(stage=s, mem=mem, host=host, comm=comm, t_comp=t_comp, t_a2a=t_a2a, t_fsdp=t_fsdp, t_pp=t_pp, n=n)
            | {"t_shown": t_shown}
        )
    worst = max(stages, key=lambda st: st["mem"]["total"])
    t_micro = max(st["t_comp"] + st["t_shown"] + st["t_pp"] for st in stages)
    busy = m * t_micro
    pipeline = (m + L.pp - 1) * t_micro
    fsdp_exposed = max(max(0.0, st["t_fsdp"] - m * st["t_comp"]) for st in stages)
    tr = max(st["n"]["trainable"] for st in stages)
    if policy.offload == "none":
        t_opt = tr * (pb + gb + 2 * ob + pb) / (hw.hbm_gbps * GB)  # read p, g, m, v; write p, m, v
    else:
        t_opt = tr * (pb + gb + 2 * ob + pb) / (hw.host_gbps * GB) + tr * (pb + gb) / (hw.pcie_gbps * GB)
    step = pipeline + fsdp_exposed + t_opt
    tokens = L.dp * m * seq_len
    tps = tokens / step / L.world
    f_tok = fl.total  # = kimi.flops.estimate_flops(cfg, seq_len)["flops_per_token"] (2/3 of the matmuls for LoRA)
    usable = (hw.gpu_memory_gb - hw.reserve_gb) * GB
    fits = worst["mem"]["total"] <= usable and worst["host"] <= hw.host_memory_gb * GB
    return {
        "layout": dataclasses.asdict(L) | {"efsdp": L.efsdp, "world": L.world},
        "policy": dataclasses.asdict(policy),
        "stages": [[r.start, r.stop] for r in ranges],
        "microbatches": m,
        "tokens_per_microbatch_per_rank": T,
        "rows_per_expert": rows,
        "ep_overlap": "chunks" if chunks else "none",
        "expert_slowdown": slow,
        "global_batch_tokens": tokens,
        "worst_stage": worst["stage"],
        "memory": worst["mem"],
        "host_memory": worst["host"],
        "numel": worst["n"],
        "comm": worst["comm"],
        "time": {
            "compute_per_microbatch": max(st["t_comp"] for st in stages),
            "stage_compute_per_microbatch": [st["t_comp"] for st in stages],
            "all_to_all_per_microbatch": max(st["t_a2a"] for st in stages),
            "all_to_all_exposed_per_microbatch": max(st["t_shown"] for st in stages),
            "pipeline_send_per_microbatch": max(st["t_pp"] for st in stages),
            "busy": busy,
            "bubble": pipeline - busy,
            "fsdp_exposed": fsdp_exposed,
            "optimizer": t_opt,
            "step": step,
        },
        "tokens_per_s_per_gpu": tps,
        "tflops_per_gpu": f_tok * tps / 1e12,
        "mfu": f_tok * tps / (hw.peak_tflops * 1e12),
        "fits": fits,
    }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _batch_refusal(L: Layout, seq_len: int, global_batch: int) -> str | None:
    """Why ``kimi train`` cannot run layout ``L`` with steps of ``global_batch`` tokens in ``seq_len`` sequences
    (``kimi_tools.train.parallel.TrainParallel.check_accum`` and its pipeline check), or None."""
    m = global_batch // (L.dp * seq_len)
    if m < 1:
        return (
            f"--global-batch {global_batch:,} is less than one --seq-len {seq_len:,} sequence for each of the "
            f"{L.dp} data-parallel ranks"
        )
    if m < L.pp:
        return f"{m} micro-batch(es) per pipeline, fewer than its {L.pp} stages (1F1B needs one in flight per stage)"
    return None


def _pipeline_refusal(lora_rank: int | None, fp8: str | None) -> str | None:
    """The trainer's refusal of ``--pp`` > 1 for this run (``kimi_tools.train.parallel.refuse_pipeline``), or None."""
    import types

    from kimi_tools.train.parallel import refuse_pipeline

    try:
        refuse_pipeline(2, types.SimpleNamespace(lora_rank=lora_rank, stage="lm", fp8=fp8), bool(lora_rank))
    except ValueError as e:
        return "kimi train " + str(e).replace("--pp 2 with", "refuses --pp > 1 with", 1)
    return None


def plan(
    cfg: KimiConfig,
    gpus: int,
    hw: Hardware,
    *,
    seq_len: int = 8192,
    global_batch: int = 1 << 24,
    lora_rank: int | None = None,
    fp8: str | None = None,
    optimizers: tuple[str, ...] = ("adamw-fp32",),
    offloads: tuple[str, ...] = ("none",),
    overlap_a2a: bool = False,
    cps: tuple[int, ...] = (1, 2, 4, 8),
    only: Layout | None = None,
    dropped: list[tuple[str, str]] | None = None,
) -> list[dict]:
    """Every layout of ``gpus`` GPUs (``pp`` dividing the AttnRes blocks, ``cp`` in ``cps`` dividing ``seq_len``,
    ``ep`` dividing ``dp x cp`` and the expert count) that ``kimi train`` runs, each with the fastest policy
    (recompute mode, then the first of ``optimizers`` x ``offloads`` in order; the FSDP policy the trainer's for the
    layout, :func:`trainer_fsdp`) that fits; layouts where none fits come with their smallest-memory policy and
    ``fits`` false. Sorted: fitting first, then by predicted MFU (descending).

    A step is ``m = global_batch // (dp x seq_len)`` micro-batches of one sequence per pipeline (rounded down: the
    row's ``global_batch_tokens`` says what runs). Left out, with the reason appended to ``dropped``: layouts whose
    ``dp`` ranks cannot each get a sequence (``m`` < 1), pipelines with fewer micro-batches than stages (the
    trainer's 1F1B refuses them), and ``pp`` > 1 where the trainer refuses the pipeline (LoRA, FP8:
    ``kimi_tools.train.parallel.refuse_pipeline``); each as ``(layout, reason)`` in ``dropped``.

    Raises:
        ValueError: ``gpus`` < 1, ``seq_len`` < 1, ``global_batch`` below one sequence; ``only`` not a layout of
            ``gpus`` the trainer runs (naming the flag and why)."""
    if gpus < 1:
        raise ValueError(f"--gpus: got {gpus}, expected a positive integer")
    if seq_len < 1:
        raise ValueError(f"--seq-len: got {seq_len}, expected a positive integer")
    if global_batch < seq_len:
        raise ValueError(
            f"--global-batch: got {global_batch:,} tokens, expected at least one --seq-len sequence ({seq_len:,} "
            "tokens) per step: each data-parallel rank trains whole sequences"
        )
    cal = load_calibration(fp8)
    blocks = -(-cfg.num_hidden_layers // (cfg.attn_res_block_size or 1))
    refusal = _pipeline_refusal(lora_rank, fp8)
    if only is not None:
        if only.world != gpus:
            raise ValueError(f"--layout: got {only.name()} = {only.world} GPUs, expected --gpus {gpus}")
        stage_ranges(cfg, only.pp)  # pp must divide the AttnRes blocks
        if cfg.num_experts and cfg.num_experts % only.ep:
            raise ValueError(f"--layout: got ep={only.ep}, expected a divisor of the {cfg.num_experts} experts")
        if seq_len % only.cp:
            raise ValueError(f"--layout: got cp={only.cp}, expected a divisor of --seq-len {seq_len}")
        why = _batch_refusal(only, seq_len, global_batch) or (refusal if only.pp > 1 else None)
        if why:
            raise ValueError(f"--layout: got {only.name()}, which kimi train does not run: {why}")
        cps = (only.cp,)
    out = []
    for pp in _divisors(blocks):
        if gpus % pp:
            continue
        if pp > 1 and refusal:
            if dropped is not None:
                dropped.append((f"pp{pp}", refusal))
            continue
        n_dc = gpus // pp
        for cp in cps:
            if n_dc % cp or seq_len % cp:
                continue
            for ep in _divisors(n_dc):
                if cfg.num_experts and cfg.num_experts % ep:
                    continue
                if not cfg.num_experts and ep > 1:
                    continue
                L = Layout(pp, n_dc // cp, cp, ep)
                if only is not None and L != only:
                    continue
                why = _batch_refusal(L, seq_len, global_batch)
                if why:
                    if dropped is not None:
                        dropped.append((L.name(), why))
                    continue
                best = None
                for opt in optimizers:
                    for off in offloads:
                        for rc in RECOMPUTE:
                            r = evaluate(
                                cfg,
                                L,
                                Policy(opt, off, rc),
                                hw,
                                cal,
                                seq_len=seq_len,
                                global_batch=global_batch,
                                lora_rank=lora_rank,
                                overlap_a2a=overlap_a2a,
                            )
                            if best is None:
                                best = r
                            elif r["fits"] and (not best["fits"] or r["mfu"] > best["mfu"]):
                                best = r
                            elif not r["fits"] and not best["fits"] and r["memory"]["total"] < best["memory"]["total"]:
                                best = r
                        if best["fits"]:
                            break
                    if best["fits"]:
                        break
                out.append(best)
    out.sort(key=lambda r: (not r["fits"], -r["mfu"] if r["fits"] else r["memory"]["total"]))
    return out


def _gb(x: float) -> str:
    return f"{x / GB:,.1f}"


def _row(r: dict) -> str:
    L, p, mem, c, t = r["layout"], r["policy"], r["memory"], r["comm"], r["time"]
    opt = p["optimizer"] + ("+cpu" if p["offload"] == "cpu" else "")
    return (
        f"| {L['pp']} | {L['dp']} | {L['cp']} | {L['ep']} | {L['efsdp']} | {opt} | {p['recompute']} | {p['fsdp']} "
        f"| {r['microbatches']} | {_gb(mem['params'])} | {_gb(mem['grads'])} | {_gb(mem['optimizer'])} "
        f"| {_gb(mem['gathered'])} | {_gb(mem['activations'])} | **{_gb(mem['total'])}** "
        f"| {_gb(c['all_gather'])} | {_gb(c['reduce_scatter'])} | {_gb(c['all_to_all'])} | {_gb(c['pipeline'])} "
        f"| {t['step']:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | {r['tflops_per_gpu']:.0f} | **{r['mfu']:.1%}** |"
    )


HEADER = (
    "| pp | dp | cp | ep | efsdp | optimizer | recompute | fsdp | micro-batches | params GB | grads GB | optimizer GB "
    "| gathered GB | activations GB | total GB | all-gather GB | reduce-scatter GB | all-to-all GB | pipeline GB "
    "| step s | tokens/s/GPU | TFLOP/s/GPU | MFU |\n"
    "|---:|---:|---:|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def render_markdown(rows: list[dict], top: int = 5) -> str:
    """A markdown table of the first ``top`` fitting rows (or, when none fits, of the ``top`` smallest), memory per
    rank (worst stage) and communication per step per rank in GB, then each shown row's ``kimi train`` command
    (its ``command``, when :func:`run_plan` added one)."""
    fit = [r for r in rows if r["fits"]]
    shown = (fit or rows)[:top]
    lines = [HEADER] + [_row(r) for r in shown]
    if not fit:
        lines.insert(0, f"Nothing fits; the {len(shown)} layouts with the least memory per rank:\n")
    cmds = [(r, r["command"]) for r in shown if r.get("command")]
    if cmds:
        lines += ["", COMMANDS_NOTE, ""]
        lines += [f"* {_layout_name(r)}: `{c}`" for r, c in cmds]
    return "\n".join(lines)


COMMANDS_NOTE = (
    "The `kimi train` command of each row (the same on every node; DATA and OUT to fill in, HOST the first node's "
    "address; `--preset` trains a random init, `--checkpoint DIR` instead fine-tunes a checkpoint):"
)


def _layout_name(r: dict) -> str:
    L = r["layout"]
    return f"pp{L['pp']} dp{L['dp']} cp{L['cp']} ep{L['ep']}"


def train_command(
    row: dict,
    *,
    preset: str,
    seq_len: int,
    layers: int | None = None,
    lora_rank: int | None = None,
    fp8: str | None = None,
    gpus_per_node: int = 8,
) -> list[str]:
    """The ``torchrun ... -m kimi_tools.cli train ...`` command (argv) that runs ``row`` (an :func:`evaluate`
    result): ``torchrun --standalone`` on one node, else ``--nnodes N`` with a c10d rendezvous at ``HOST:29500``
    (``N`` the fewest nodes of at most ``gpus_per_node`` ranks that divide the world); the layout (``--pp``, with
    ``--pp-schedule 1F1B`` and the planned ``--pp-layout``, ``--dp``, ``--cp``, ``--ep``); one ``--seq-len``
    sequence per micro-batch (``--micro-batch-tokens``) and the planned tokens per step (``--batch-tokens`` =
    ``dp x micro-batches x seq_len``); bf16 on the cudnn backend; the recomputation (``--recompute``,
    ``--recompute-mode``, and ``--recompute-full-layers`` :data:`MLP_FULL_LAYERS` for "mlp", as calibrated); LoRA,
    FP8; the optimizer and offload policies where they differ from the trainer's defaults (``--optimizer
    adamw-bf16`` with ``--reduce-dtype bf16``, ``--offload cpu``); ``--ep-overlap chunks`` where the row counted it
    (``--overlap-a2a``). ``DATA`` and ``OUT`` are placeholders."""
    L, p = row["layout"], row["policy"]
    world = L["world"]
    per_node = max(d for d in _divisors(world) if d <= max(1, gpus_per_node))
    if per_node == world:
        cmd = ["torchrun", "--standalone", "--nproc-per-node", str(world)]
    else:
        cmd = ["torchrun", "--nnodes", str(world // per_node), "--nproc-per-node", str(per_node)]
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "HOST:29500"]
    cmd += ["-m", "kimi_tools.cli", "train", "--preset", preset] + (["--layers", str(layers)] if layers else [])
    cmd += ["--data", "DATA", "--out", "OUT", "--device", "cuda", "--backend", "cudnn", "--dtype", "bfloat16"]
    tokens = row["global_batch_tokens"]
    cmd += ["--seq-len", str(seq_len), "--micro-batch-tokens", str(seq_len), "--batch-tokens", str(tokens)]
    if L["pp"] > 1:
        counts = ",".join(str(b - a) for a, b in row["stages"])
        cmd += ["--pp", str(L["pp"]), "--pp-schedule", "1F1B", "--pp-layout", counts]
    cmd += ["--dp", str(L["dp"]), "--cp", str(L["cp"]), "--ep", str(L["ep"])]
    if p["recompute"] == "full":
        cmd += ["--recompute", "--recompute-mode", "layer"]
    elif p["recompute"] == "mlp":
        cmd += ["--recompute", "--recompute-mode", "mlp", "--recompute-full-layers", str(MLP_FULL_LAYERS)]
    if lora_rank:
        cmd += ["--lora-rank", str(lora_rank)]
    if fp8:
        cmd += ["--fp8", fp8]
    if p["optimizer"] != "adamw-fp32":
        cmd += ["--optimizer", p["optimizer"], "--reduce-dtype", "bf16"]
    if p["offload"] != "none":
        cmd += ["--offload", p["offload"]]
    if row.get("ep_overlap") == "chunks":
        cmd += ["--ep-overlap", "chunks"]
    return cmd


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``kimi plan`` on the ``kimi`` subcommand parser."""
    from kimi_tools.common import positive_int

    p = subparsers.add_parser("plan", help="parallel layouts that fit a cluster: memory, communication, step time, MFU")
    p.add_argument("--preset", choices=sorted(PRESETS), default="k3.1-pro")
    p.add_argument("--layers", type=positive_int, help="keep the first N layers (as kimi train --layers)")
    p.add_argument("--gpus", type=positive_int, required=True, help="world size")
    p.add_argument("--gpu-memory", type=float, default=141.0, metavar="GB", help="HBM per GPU in GB (default 141)")
    p.add_argument("--reserve", type=float, default=5.0, metavar="GB", help="HBM kept free per GPU (default 5 GB)")
    p.add_argument("--nodes", type=positive_int, help="nodes (GPUs per node = gpus / nodes; default 8 per node)")
    p.add_argument("--seq-len", type=positive_int, default=8192, help="tokens per sequence (default 8192)")
    p.add_argument(
        "--global-batch",
        type=positive_int,
        default=1 << 24,
        help="tokens per step (default 2^24; rounded down to whole sequences per data-parallel rank, as announced)",
    )
    p.add_argument("--lora-rank", type=positive_int, help="LoRA of the attention projections, frozen base in bf16")
    p.add_argument("--fp8", metavar="RECIPE", help="calibrate on the FP8 step of this recipe (rowwise)")
    p.add_argument(
        "--optimizer",
        choices=["auto", *OPTIMIZERS],
        default="auto",
        help="optimizer states; auto: fp32 AdamW, else bf16 states, else CPU offload, the first that fits",
    )
    p.add_argument(
        "--layout", metavar="PP,DP,CP,EP", help="evaluate this one layout only (pp x dp x cp = --gpus, ep | dp x cp)"
    )
    p.add_argument(
        "--overlap-a2a", action="store_true", help="the all-to-all as kimi train --ep-overlap chunks runs it"
    )
    p.add_argument("--top", type=positive_int, default=8, help="rows shown (default 8)")
    p.add_argument("--json", action="store_true", help="print every layout as one JSON list")
    for name, default, help_ in [
        ("--nvlink-gbps", 360.0, "NVLink GB/s per GPU per direction, effective"),
        ("--ib-gbps", 40.0, "inter-node GB/s per GPU per direction, effective"),
        ("--peak-tflops", 989.4, "dense bf16 peak TFLOP/s (the MFU denominator)"),
    ]:
        p.add_argument(name, type=float, default=default, help=help_ + f" (default {default})")
    p.set_defaults(func=cmd_plan)
    return p


def _modes(optimizer: str) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    if optimizer == "auto":
        return [(("adamw-fp32",), ("none",)), (("adamw-bf16",), ("none",)), (("adamw-fp32", "adamw-bf16"), ("cpu",))]
    return [((optimizer,), ("none",)), ((optimizer,), ("cpu",))]


def run_plan(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """The rows and the notes (which optimizer policies did not fit) of ``kimi plan``'s arguments."""
    from kimi_tools.common import CliError

    if args.gpu_memory <= 0:
        raise CliError(f"--gpu-memory: got {args.gpu_memory}, expected a positive number of GB")
    if not 0 <= args.reserve < args.gpu_memory:
        raise CliError(f"--reserve: got {args.reserve}, expected a number of GB in [0, --gpu-memory)")
    for flag in ("nvlink_gbps", "ib_gbps", "peak_tflops"):
        if getattr(args, flag) <= 0:
            raise CliError(f"--{flag.replace('_', '-')}: got {getattr(args, flag)}, expected a positive number")
    gpn = 8
    if args.nodes:
        if args.gpus % args.nodes:
            raise CliError(f"--nodes: got {args.nodes} for --gpus {args.gpus}, expected a divisor of the GPU count")
        gpn = args.gpus // args.nodes
    hw = Hardware(
        gpu_memory_gb=args.gpu_memory,
        reserve_gb=args.reserve,
        gpus_per_node=gpn,
        nvlink_gbps=args.nvlink_gbps,
        ib_gbps=args.ib_gbps,
        peak_tflops=args.peak_tflops,
    )
    cfg = load_config(args.preset)
    layers = getattr(args, "layers", None)
    if layers:
        if layers > cfg.num_hidden_layers:
            raise CliError(f"--layers: got {layers}, expected at most the {cfg.num_hidden_layers} of {args.preset}")
        cfg = cfg.truncated(layers)
    only = None
    if args.layout:
        parts = args.layout.split(",")
        if len(parts) != 4 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
            raise CliError(
                f"--layout: got {args.layout!r}, expected four positive integers PP,DP,CP,EP (e.g. 8,16,1,16)"
            )
        try:
            only = Layout(*(int(x) for x in parts))
        except ValueError as e:
            raise CliError(str(e).replace("layout:", "--layout:", 1)) from None
    notes = []
    ref = load_config("k3.1-pro").hidden_size
    if cfg.hidden_size != ref:
        notes.append(
            f"compute rates are k3.1-pro's measured ones (hidden {ref}); --preset {args.preset} (hidden "
            f"{cfg.hidden_size}) runs its far narrower matmuls far below them, so its step times, tokens/s and MFU "
            "are upper bounds, not predictions (its memory is counted from its own dimensions)"
        )
    rows: list[dict] = []
    dropped: list[tuple[str, str]] = []
    for opts, offs in _modes(args.optimizer):
        dropped.clear()
        rows = plan(
            cfg,
            args.gpus,
            hw,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            lora_rank=args.lora_rank,
            fp8=args.fp8,
            optimizers=opts,
            offloads=offs,
            overlap_a2a=args.overlap_a2a,
            only=only,
            dropped=dropped,
        )
        if not rows:
            raise CliError(f"--gpus {args.gpus}: no layout that kimi train runs ({_left_out(dropped)})")
        if rows and rows[0]["fits"]:
            break
        least = min((r["memory"]["total"] for r in rows), default=float("nan"))
        host = min((r["host_memory"] for r in rows), default=0.0)
        notes.append(
            f"{'/'.join(opts)} with offload {'/'.join(offs)}: nothing fits {args.gpus} GPUs of {args.gpu_memory:g} GB "
            f"(least memory per rank {least / GB:,.0f} GB"
            + (f"; host memory per GPU {host / GB:,.0f} GB, {hw.host_memory_gb:g} GB available)" if host else ")")
        )
    short = sorted(
        {(r["layout"]["dp"], r["global_batch_tokens"]) for r in rows if r["global_batch_tokens"] != args.global_batch}
    )
    if short:
        runs = ", ".join(f"dp {dp}: {t:,}" for dp, t in short)
        notes.append(
            f"--global-batch {args.global_batch:,} is not a whole number of --seq-len {args.seq_len:,} sequences per "
            f"data-parallel rank for every layout: rounded down to whole micro-batches, those run fewer tokens per "
            f"step ({runs}); their rates are for those steps"
        )
    if dropped:
        notes.append(f"left out, as kimi train does not run them: {_left_out(dropped)}")
    for r in rows:
        argv = train_command(
            r,
            preset=args.preset,
            seq_len=args.seq_len,
            layers=layers,
            lora_rank=args.lora_rank,
            fp8=args.fp8,
            gpus_per_node=gpn,
        )
        r["command"] = " ".join(argv)
    return rows, notes


def _left_out(dropped: list[tuple[str, str]]) -> str:
    """``plan``'s ``dropped`` grouped by reason: "pp2, pp4: reason; ..." (at most 4 layouts named per reason)."""
    by: dict[str, list[str]] = {}
    for name, why in dropped:
        by.setdefault(why, []).append(name)
    return "; ".join(
        ", ".join(n[:4]) + (f" and {len(n) - 4} more" if len(n) > 4 else "") + f": {why}" for why, n in by.items()
    )


def cmd_plan(args: argparse.Namespace) -> int:
    """``kimi plan``: print the layouts (a markdown table, or ``--json``). Returns 0."""
    rows, notes = run_plan(args)
    if args.json:
        print(json.dumps({"notes": notes, "layouts": rows}))
        return 0
    for n in notes:
        print(n)
    print(render_markdown(rows, args.top))
    return 0


# ---------------------------------------------------------------------------------------------- docs/scaling.md

DOC = Path(__file__).resolve().parent.parent / "docs" / "scaling.md"
BEGIN = "<!-- kimi plan: generated by `python -m kimi_tools.plan --write-docs`; do not edit by hand -->"
END = "<!-- kimi plan: end of generated section -->"
DOC_CASES = [(64, None), (64, 16), (256, None), (256, 16), (1024, None), (1024, 16)]
# Published runs, in the same units (TFLOP/s per GPU and MFU against the GPU's dense bf16 peak; H100 SXM 989.4).
ANCHORS = [
    ("torchtitan DeepSeek-V3 671B, 512 H100, bf16, DeepEP", 0.165 * 989.4, 0.165, "torchtitan, published"),
    ("Megatron-LM DeepSeek-V3 671B, 1,024 H100, FP8", 338.0, 338.0 / 989.4, "Megatron-LM, published"),
    ("Megatron-LM Qwen3-235B-A22B, 256 H100, bf16", 276.0, 276.0 / 989.4, "Megatron-LM, published"),
]


def _args(gpus: int, lora: int | None, **kw) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    argv = ["plan", "--gpus", str(gpus)] + (["--lora-rank", str(lora)] if lora else [])
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return ap.parse_args(argv)


def _bounds(r: dict, hw: Hardware, cal: Calibration) -> str:
    """One paragraph: where the step time of row ``r`` goes, as MFU points."""
    t = r["time"]
    step = t["step"]
    mfu = r["mfu"]
    rc = r["policy"]["recompute"]
    comp = (
        t["busy"]
        - r["microbatches"] * t["all_to_all_per_microbatch"]
        - r["microbatches"] * t["pipeline_send_per_microbatch"]
    )
    parts = [
        ("compute", comp),
        ("all-to-all (not overlapped)", r["microbatches"] * t["all_to_all_per_microbatch"]),
        ("pipeline sends", r["microbatches"] * t["pipeline_send_per_microbatch"]),
        ("pipeline bubble", t["bubble"]),
        ("FSDP traffic beyond compute", t["fsdp_exposed"]),
        ("optimizer step", t["optimizer"]),
    ]
    share = ", ".join(f"{name} {v:.1f} s ({v / step:.0%})" for name, v in parts if v > 0.005 * step)
    rate = cal.tflops[rc]
    return (
        f"Step {step:.1f} s: {share}. The compute alone runs at the calibrated {rate:.0f} TFLOP/s of model FLOPs "
        f"(recompute {rc}; {rate / hw.peak_tflops:.1%} of the {hw.peak_tflops:g} TFLOP/s peak"
        + (
            f", experts {r['expert_slowdown']:.2f}x slower at {r['rows_per_expert']:,.0f} rows per expert"
            if r["expert_slowdown"] > 1.001
            else ""
        )
        + f"); every other part lowers the predicted {mfu:.1%}."
    )


def render_docs() -> str:
    """The generated section of ``docs/scaling.md``: ``kimi plan`` for each of :data:`DOC_CASES` (8K tokens, default
    hardware), the anchors, and what bounds the MFU."""
    from kimi.layout import param_counts

    hw = Hardware()
    cal = load_calibration()
    n_params = param_counts(load_config("k3.1-pro"))["total_params"]
    out = [BEGIN, "", "## 7. Planned layouts (`kimi plan`)", ""]
    out.append(
        "Generated by `kimi plan` (`kimi_tools/plan.py`, its docstring has the model) with the defaults: 8,192-token "
        "sequences, 2^24 tokens per step, 8 GPUs per node, 1F1B. Per-rank parameter, gradient and optimizer bytes are "
        "the meta model sharded as the trainer shards it (`tests/test_plan.py` builds each layout on `meta` with "
        "torch's fake process group and compares); activations are counted per layer from the config's widths "
        "(`layer_activation_bytes`) and scaled to the measured 4-layer step, whose rates the compute takes; the "
        "FSDP2 working set is the trainer's (one layer at a time without a pipeline; under pp the whole stage "
        "gathered and its gradients unsharded in fp32 until the step's end, as torch's `PipelineStage` keeps them, "
        "measured on the pipeline trainer by `tests/test_plan.py`); layouts `kimi train` does not run (LoRA or FP8 "
        "under pp, fewer micro-batches than stages) are left out, and each table ends with the `kimi train` command "
        "of each row. The all-to-all is counted unhidden (the code's `all_to_all_single` blocks). LoRA rows count "
        "the model FLOPs of a frozen-weight step (forward and input gradients: 2/3 of the weight matmuls of full "
        "training). Not modelled: interleaved schedules, expert load imbalance, tensor parallelism. Memory per rank "
        "is the worst pipeline stage; communication is per step per rank. GB = 10^9 B. "
        "`benchmarks/rank_rehearsal.py` materialises the worst rank of the chosen layouts at real dimensions on one "
        "GPU (its stage's layers, its E / ep experts, its shard sizes) and runs its forward and backward against "
        "these predictions. Its first H200 run (2026-12-04, `benchmarks/README.md`: full fine-tuning, pp8 "
        "dp16 ep16, stage 0, 8 micro-batches of 8,192 tokens in flight) measured the compute within 0.7% of the "
        "prediction and the peak memory at 1.39x (73.2 GB against 52.9 GB). Two causes, both counted since on the "
        "CPU with autograd's saved-tensor hook (`tests/test_plan.py`): that run ended stage 0 with the output AttnRes "
        "mix, the final norm and an fp32 loss, which keep 17 units of T x D x 2 B per micro-batch (16.0 GB for 8 "
        "in flight) and which a pipeline's first stage does not hold; and the planner counted no stage "
        "input or output. With that run's own head counted, its prediction is 68.9 GB (measured 1.06x). The "
        "rehearsal now runs the trainer's stage module (`split_stage`) and the planner counts each in-flight "
        "micro-batch's received and sent states and the last stage's head (`held_per_microbatch`); the H200 run of "
        "this version is still to come."
    )
    out += ["", "Hardware (effective rates; `kimi plan --nvlink-gbps/--ib-gbps/--peak-tflops` change them):", ""]
    out += [
        "| parameter | default | nominal |",
        "|---|---:|---|",
        f"| HBM per GPU | {hw.gpu_memory_gb:g} GB, {hw.reserve_gb:g} GB kept free | H200 SXM 141 GB |",
        f"| dense bf16 peak (MFU denominator) | {hw.peak_tflops:g} TFLOP/s | H200 SXM datasheet (same as H100 SXM) |",
        f"| NVLink, per GPU per direction | {hw.nvlink_gbps:g} GB/s | NVLink 4: 450 GB/s (900 both ways) |",
        f"| InfiniBand, per GPU per direction | {hw.ib_gbps:g} GB/s | one 400 Gb/s ConnectX-7 per GPU: 50 GB/s |",
        f"| HBM bandwidth (optimizer step) | {hw.hbm_gbps:g} GB/s | 4.8 TB/s |",
        f"| host link / host memory per GPU (offload) | {hw.pcie_gbps:g} GB/s / {hw.host_memory_gb:g} GB | PCIe 5 x16 64 GB/s; 2 TB per 8-GPU node |",
    ]
    out += ["", "Calibration (`kimi_tools/plan_calibration.json`):", ""]
    for mode in ("none", "mlp"):
        out.append(
            f"* recompute {mode}: {cal.tflops[mode]:.1f} TFLOP/s of model FLOPs, "
            f"{cal.act_per_token_layer[mode] / 1e6:.3f} MB of activations per token per layer, "
            f"{cal.act_scale[mode]:.2f}x the width count of its layers; {cal.sources[mode]}"
        )
    out.append(
        f"* recompute full: {cal.tflops['full']:.1f} TFLOP/s (the no-recompute rate x 3/4: one more forward), each "
        "layer's input kept (D x 2 B per token), the stage's received and sent states and the last stage's head "
        "(`held_per_microbatch`, checked against autograd's saved tensors) plus one layer's no-recompute working "
        "set"
    )
    d = json.loads(CALIBRATION_FILE.read_text())["expert_density"]
    pts = "; ".join(f"{p['rows_per_expert']:,.0f} rows per expert: {p['tflops']:.0f} TFLOP/s" for p in d["points"])
    out.append(f"* routed experts against their density: {pts} ({d['file']}, {d['date']}, {d['commit']})")
    best_full = {}
    for gpus, lora in DOC_CASES:
        rows, notes = run_plan(_args(gpus, lora))
        kind = f"LoRA rank {lora} (attention projections, frozen bf16 base)" if lora else "full fine-tuning"
        out += ["", f"### {gpus:,} H200, {kind}", ""]
        out += [f"* {n}" for n in notes]
        if notes:
            out.append("")
        out.append(render_markdown(rows, 3))
        if rows and rows[0]["fits"]:
            out += ["", _bounds(rows[0], hw, cal)]
            hidden, _ = run_plan(_args(gpus, lora, overlap_a2a=True))
            out += [
                "",
                f"With the all-to-all overlapped as `kimi train --ep-overlap chunks` runs it (two chunks per MoE "
                f"layer: the experts at half the rows, the first dispatch and last combine exposed): best "
                f"{hidden[0]['layout']['pp']}/{hidden[0]['layout']['dp']}/{hidden[0]['layout']['cp']}/"
                f"{hidden[0]['layout']['ep']} (pp/dp/cp/ep), {hidden[0]['tflops_per_gpu']:.0f} TFLOP/s per GPU, "
                f"MFU {hidden[0]['mfu']:.1%}.",
            ]
            if not lora:
                best_full[gpus] = (rows[0], hidden[0])
    for gpus in (64, 128, 256, 512, 1024):
        rows, _ = run_plan(_args(gpus, None))
        if rows and rows[0]["fits"]:
            r, L = rows[0], rows[0]["layout"]
            p = r["policy"]
            out += [
                "",
                f"Smallest power-of-two cluster where full fine-tuning fits: **{gpus} H200** (pp {L['pp']}, dp {L['dp']}, "
                f"cp {L['cp']}, ep {L['ep']}; {p['optimizer']}"
                + (", states offloaded to the host" if p["offload"] == "cpu" else "")
                + f", recompute {p['recompute']}; {r['memory']['total'] / GB:.1f} GB per GPU, MFU {r['mfu']:.1%}).",
            ]
            break
    out += ["", "### Beside published runs (TFLOP/s of model FLOPs per GPU; MFU against the dense bf16 peak)", ""]
    out += ["| run | TFLOP/s per GPU | MFU | source |", "|---|---:|---:|---|"]
    out += [f"| {name} | {tf:.0f} | {m:.1%} | {src} |" for name, tf, m, src in ANCHORS]
    for gpus, (r, h) in best_full.items():
        p = r["policy"]
        out.append(
            f"| this plan: K3.1 Pro, {gpus:,} H200, bf16, {p['optimizer']}, recompute {p['recompute']} "
            f"| {r['tflops_per_gpu']:.0f} ({h['tflops_per_gpu']:.0f} with --ep-overlap chunks) "
            f"| {r['mfu']:.1%} ({h['mfu']:.1%}) | `kimi plan --gpus {gpus}` |"
        )
    none = cal.tflops["none"] / hw.peak_tflops
    k31 = load_config("k3.1-pro")
    per_layer = cal.layer_bytes(k31, range(k31.num_hidden_layers), 1, "none") / k31.num_hidden_layers
    extra = [
        r["microbatches"]
        * r["time"]["all_to_all_per_microbatch"]
        / (r["microbatches"] * r["time"]["compute_per_microbatch"])
        for r, _ in best_full.values()
    ]
    extra_txt = f"{min(extra):.0%} to {max(extra):.0%}" if extra else "-"
    out += [
        "",
        "### What bounds the MFU",
        "",
        f"1. **The kernels**: the measured 4-layer step runs {cal.tflops['none']:.0f} TFLOP/s of model FLOPs without "
        f"recomputation, {none:.1%} of the {hw.peak_tflops:g} peak (the H200's bf16 matmuls reach about 778 TFLOP/s in "
        "the same run, so that is 57% of what a matmul gets). No layout can beat this rate in this model.",
        f"2. **Activations force recomputation**: without it a layer holds "
        f"{per_layer / 1e6:.2f} MB per token (K3.1's 93 layers on average; the deeper layers' AttnRes mixes hold "
        "more sources), and a rank holds all 93 layers (pp = 1) or "
        "12 layers x pp micro-batches in flight (1F1B at pp = 8, the first stage): 93 to 96 layer-micro-batches either "
        f"way, {96 * 8192 * per_layer / 1e12:.1f} TB at 8K tokens. Full recomputation keeps "
        f"14.3 KB per token per layer and costs one more forward: the rate drops to {cal.tflops['full']:.0f} TFLOP/s "
        f"({cal.tflops['full'] / hw.peak_tflops:.1%}). Shorter micro-batches (cp) fit MLP-only recomputation "
        f"({cal.tflops['mlp'] / hw.peak_tflops:.1%}) but starve the experts (fewer rows per expert).",
        "3. **The all-to-all**: dispatch + combine in the latent width, 4 x T x 16 x 3584 x 2 B per MoE layer per "
        "micro-batch (6 x with the MoE recomputed), (ep - 8) / ep of it across nodes once ep > 8, at 40 GB/s per GPU; "
        f"unhidden it adds {extra_txt} to the compute time of the best full fine-tuning layouts above. `kimi train --ep-overlap chunks` "
        "hides at most half of it (the first dispatch and last combine of each layer stay exposed) and runs the "
        "experts at half the rows; hiding the rest needs another micro-batch's compute behind it (DualPipe).",
        f"4. **States**: fp32 AdamW needs 16 B per parameter ({n_params * 16 / 1e12:.1f} TB): on 256 H200s the states "
        f"alone are {n_params * 16 / 256 / GB:.0f} GB per GPU, so 256 GPUs need bf16 states (8 B per parameter, "
        f"{n_params * 8 / 256 / GB:.0f} GB per GPU) and 64 GPUs fit only LoRA (the frozen bf16 base is "
        f"{n_params * 2 / 64 / GB:.0f} GB per GPU).",
        "",
        "So the goal of 35% MFU (bf16, full fine-tuning) needs both the all-to-all hidden and less than full "
        "recomputation (selective: the MoE block only, or the activations offloaded); the tables give what the "
        "code as it stands would reach.",
        "",
        END,
    ]
    return "\n".join(out)


def splice_docs(text: str) -> str:
    """``text`` (``docs/scaling.md``) with its generated section replaced by :func:`render_docs` (appended when the
    markers are absent)."""
    new = render_docs()
    if BEGIN in text and END in text:
        a, b = text.index(BEGIN), text.index(END) + len(END)
        return text[:a] + new + text[b:]
    return text.rstrip("\n") + "\n\n" + new + "\n"


if __name__ == "__main__":
    import sys

    from kimi.checkpoint import write_atomic

    if sys.argv[1:] != ["--write-docs"]:
        sys.exit("usage: python -m kimi_tools.plan --write-docs   (regenerates docs/scaling.md section 7)")
    write_atomic(DOC, splice_docs(DOC.read_text()).encode())
