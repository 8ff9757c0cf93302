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
  ``--offload cpu`` keeps all three on the host (``kimi train --offload cpu``: FSDP2 ``CPUOffloadPolicy``), the
  shards and gradients in pinned blocks that torch's host allocator rounds up to powers of two, one per tensor
  (:func:`pinned_numel`; the moments pageable, exact; the fp32 tensors below stay on the device). Activation offload
  pins through the same allocator; its host bytes are counted exact (not rounded). The tensors the checkpoint keeps
  in fp32 (``A_log``, ``dt_bias``, convs, ...) stay fp32 under either policy; the
  router's ``e_score_correction_bias`` has no gradient and no state (:func:`state_bytes`). LoRA: the frozen base in bf16
  (2 B, no gradient, no state), the adapters (``kimi_tools.lora.DEFAULT_TARGETS``: attention projections) trained
  under the policy.
* **gathered**: FSDP2's unsharded working set, under the policy the trainer runs for the layout
  (:func:`trainer_fsdp`; at ``pp`` > 1 both of ``kimi train --pp-fsdp``, :func:`pp_fsdp_policies`). ``fsdp="layer"``
  (the default, with or without a pipeline: ZeRO-3, ``reshard_after_forward=True``, gradients reduce-scattered every
  micro-batch and held sharded): the units kept gathered from their forward to their backward (:func:`layer_fsdp_bytes`,
  per stage under pp). ``fsdp="stage"`` (``--pp-fsdp stage``: torch's ``PipelineStage`` turns resharding after the
  backward and gradient sync off until the step's last backward): every unit of the stage gathered in bf16, with
  FSDP2's padding, and the gradients of its trained parameters unsharded in the reduce dtype
  (:func:`stage_fsdp_bytes`, measured on the pipeline trainer by ``tests/test_plan.py``). ``fsdp="none"`` (one GPU
  under ``adamw-bf16`` without offload, where FSDP2 would only copy: the trainer leaves the model as it is, as
  torchtitan applies FSDP2 only to ``dp_shard > 1 or cp > 1``): nothing gathered.
* **activations**: per layer and region from the config's widths (:func:`block_bytes`: the attention block by
  kind, the MLP / MoE block, the AttnRes mixes, as the eager twin saves them, checked against
  ``saved_bytes_by_block`` at two configs), composed per policy (:func:`policy_bytes`: ``recompute`` "none",
  "attn", "mlp", "full" and ``act_offload`` "none", "attn", "mlp", "all", as ``kimi train --recompute-mode`` and
  ``--offload-activations`` run them: a recomputed region keeps its input, an offloaded one its tensors on the host)
  and scaled to the GPU's kernels by the measured 4-layer steps (``kimi_tools/plan/calibration.json``:
  :class:`Calibration`'s ``act_scale``), plus the largest recomputed region again during its backward. "full"
  keeps what :func:`held_per_microbatch` counts (each layer's input, ``D x 2`` B per token). In every mode each
  in-flight micro-batch also keeps the stage's received and sent states and, on the last stage, the output mix,
  norm and loss tensors and the ``lm_head`` gradient (:func:`held_per_microbatch`). A stage under 1F1B holds
  ``min(pp - s, micro-batches)`` micro-batches in flight (stage ``s``); under a V schedule a rank holds the peak
  of its two stages' in-flight micro-batches as torch's action list orders them
  (:func:`~kimi_tools.plan.schedule.inflight_states`); ``T = seq_len / cp`` tokens per rank.
* **the peak** comes when a backward starts (all activations in flight, no layer's gradient yet): parameters,
  optimizer states, FSDP2's gathered units then (:func:`layer_fsdp_bytes` by ``--reshard-after-forward``;
  :func:`stage_fsdp_bytes` under ``--pp-fsdp stage``), the activations, and the sharded gradients only where an
  earlier micro-batch of the step made them ("layer", more than one micro-batch); or at the optimizer step (parameters, gradients and
  states), whichever is larger (``memory["total"]``).

Communication per step per rank (bytes a rank sends/receives; rings move ``(n - 1) / n`` of the gathered size):
FSDP all-gathers (bf16) and reduce-scatters (fp32; bf16 under ``adamw-bf16``): ``"layer"`` two gathers (its
forward's, its backward's, which a recomputed forward shares) and a reduce per layer and micro-batch, with or
without a pipeline; ``"stage"`` ``m + 1`` gathers of each unit per step under 1F1B (a forward after a backward finds
the unit gathered and reshards it, the next backward gathers it again; a unit that does not reshard after its
forward gathers once, so this is the most), one under a V schedule (torch's runtime gathers the stage once and the
trainer keeps its layers gathered, ``shard_stages``), and one reduce; the MoE all-to-all in the latent width ``Dl`` (dispatch ``T k Dl`` x 2 B, combine the same; the backward
the same again, and once more when the MoE block is recomputed), ``(ep - 1) / ep`` of it leaving the rank; pipeline
sends between stages (the hidden state and the AttnRes blocks stored so far, ``(b + 1) x D x 2`` B per token,
forward and backward).

Time: a stage's compute per micro-batch is its model FLOPs (:func:`layer_flops`, the ``kimi.flops`` count; LoRA:
forward and input gradients only, 2/3 of the weight matmuls) at the measured rate of the 4-layer step without recomputation, the recomputed blocks' forwards added as
work (:meth:`Flops.recomputed`), and an activation offload's host copies at the calibration's host copy rate (the
backward's copies exposed, the forward's beyond the forward's compute), the routed experts slowed down where a rank's experts get fewer rows than in the calibration step
(``T k ep / E`` rows per expert, against the measured grouped-GEMM rate: :meth:`Calibration.expert_slowdown`). The
all-to-all is added unhidden (``kimi train``'s default), or with ``--overlap-a2a`` as ``kimi train --ep-overlap
chunks`` runs it (each MoE layer's tokens in two chunks: the experts at half the rows per expert, the first dispatch
and the last combine of each layer exposed, the rest hidden behind the routed experts' compute); FSDP traffic
overlaps compute (FSDP2's prefetch) and only its excess counts; the pipeline schedule (:mod:`~kimi_tools.plan.schedule`,
searched per layout among 1F1B, DualPipeV and ZBVZeroBubble): 1F1B's bubble multiplies the slowest stage by
``(m + pp - 1) / m`` for ``m`` micro-batches; a V schedule runs ``2 pp`` stages, two per rank (rank ``r``: stages
``r`` and ``2 pp - 1 - r``), its bubble replayed from torch's action lists with each stage's backward split into
equal input and weight parts (an assumption: not measured), its micro-batches in flight on every rank
(``2 pp + 1`` stage-micro-batches under DualPipeV, ``2 pp`` under ZBVZeroBubble), at least ``2 pp`` micro-batches a
step, and a recomputed block's forward (and its all-to-all) paid twice in each backward split into input and
weight parts, once in a full one (counted per stage from torch's action lists); under DualPipeV with
``--overlap-a2a`` also ``kimi train --ep-overlap fb`` (and ``fb+chunks``): in each ``OVERLAP_F_B`` pair of torch's
list the forward of one micro-batch and the full backward of another take turns at the all-to-alls, each transfer
travelling while the other party computes (:func:`~kimi_tools.plan.schedule.pair_time`), plus one transfer's
buffers; the optimizer step reads and writes its states at HBM (or host)
bandwidth. MFU = model FLOPs per token (``kimi.flops.estimate_flops``) x tokens/s/GPU / the GPU's dense bf16 peak.
The rates are k3.1-pro's: for a narrower preset the times are upper bounds (``kimi plan`` says so).

Each row ends with the ``torchrun ... -m kimi_tools.cli train ...`` command that runs it (:func:`train_command`);
layouts the trainer refuses are left out (:func:`plan`), and a global batch that is not a whole number of
sequences per data-parallel rank is rounded down, announced.

Link bandwidths (:class:`Hardware`, documented in ``docs/scaling.md``): effective, not nominal.

The package's parts: :mod:`~kimi_tools.plan.layout` (the hardware, the mesh, the policy, the stage split),
:mod:`~kimi_tools.plan.params` (parameters, gradients, optimizer states, the FSDP2 working set),
:mod:`~kimi_tools.plan.activations` (activation bytes), :mod:`~kimi_tools.plan.timing` (FLOPs, links),
:mod:`~kimi_tools.plan.calibration` (the measured rates, ``calibration.json``), :mod:`~kimi_tools.plan.search`
(:func:`evaluate`, :func:`plan`), :mod:`~kimi_tools.plan.schedule` (the pipeline schedules: stages, in-flight
micro-batches, bubble), :mod:`~kimi_tools.plan.render` (tables, :func:`train_command`),
:mod:`~kimi_tools.plan.cli` (``kimi plan``) and :mod:`~kimi_tools.plan.docs` (``docs/scaling.md``'s section 7).
"""

from __future__ import annotations

from kimi_tools.plan.activations import block_bytes, held_per_microbatch, layer_activation_bytes, policy_bytes
from kimi_tools.plan.calibration import (
    CALIBRATION_FILE,
    CALIBRATION_LAYERS,
    Calibration,
    calibration_config,
    load_calibration,
)
from kimi_tools.plan.cli import add_parser, cmd_plan, run_plan
from kimi_tools.plan.docs import ANCHORS, BEGIN, DOC, DOC_CASES, END, plan_args, render_docs, splice_docs
from kimi_tools.plan.layout import (
    ACT_OFFLOAD,
    FROZEN_BYTES,
    FSDP_POLICIES,
    GATHER_BYTES,
    GB,
    MLP_FULL_LAYERS,
    OPTIMIZERS,
    RECOMPUTE,
    RESHARD,
    Hardware,
    Layout,
    Policy,
    pp_fsdp_policies,
    shard_rows,
    stage_ranges,
    trainer_fsdp,
)
from kimi_tools.plan.params import (
    layer_fsdp_bytes,
    lora_specs,
    pinned_numel,
    rank_numel,
    stage_fsdp_bytes,
    state_bytes,
)
from kimi_tools.plan.render import COMMANDS_NOTE, HEADER, render_markdown, train_command
from kimi_tools.plan.schedule import PLANNED_SCHEDULES, W_SHARE, bubble, inflight_states, replay_bubble
from kimi_tools.plan.search import evaluate, plan, schedule_refusal
from kimi_tools.plan.timing import Flops, layer_flops

_args = plan_args  # the name benchmarks/rank_rehearsal.py calls

__all__ = [
    "ACT_OFFLOAD",
    "ANCHORS",
    "BEGIN",
    "CALIBRATION_FILE",
    "CALIBRATION_LAYERS",
    "COMMANDS_NOTE",
    "DOC",
    "DOC_CASES",
    "END",
    "FROZEN_BYTES",
    "FSDP_POLICIES",
    "GATHER_BYTES",
    "GB",
    "HEADER",
    "MLP_FULL_LAYERS",
    "OPTIMIZERS",
    "PLANNED_SCHEDULES",
    "RECOMPUTE",
    "RESHARD",
    "W_SHARE",
    "Calibration",
    "Flops",
    "Hardware",
    "Layout",
    "Policy",
    "add_parser",
    "block_bytes",
    "bubble",
    "calibration_config",
    "cmd_plan",
    "evaluate",
    "held_per_microbatch",
    "inflight_states",
    "layer_activation_bytes",
    "layer_flops",
    "layer_fsdp_bytes",
    "load_calibration",
    "lora_specs",
    "plan",
    "plan_args",
    "policy_bytes",
    "pinned_numel",
    "rank_numel",
    "render_docs",
    "render_markdown",
    "replay_bubble",
    "run_plan",
    "schedule_refusal",
    "shard_rows",
    "splice_docs",
    "stage_fsdp_bytes",
    "stage_ranges",
    "state_bytes",
    "train_command",
    "trainer_fsdp",
    "pp_fsdp_policies",
]
