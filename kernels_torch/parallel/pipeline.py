"""Pipeline parallelism of the torch model through ``torch.distributed.pipelining`` (its stages and schedules; no
schedule of our own), with stages cut at Block AttnRes boundaries (``docs/spec.md`` 5.4).

**Stage layout.** A layout is a tuple of contiguous layer ranges, one per stage, covering ``0 ..
num_hidden_layers`` in order (:func:`stage_layout`). With AttnRes every range starts on a block-write layer
(``layer % attn_res_block_size == 0``), so a stage boundary falls where the partial sum ``p`` is about to become a
stored block; without AttnRes any cut is allowed. The embedding sits on the first stage; the output AttnRes mix,
the final norm, ``lm_head`` and the loss on the last. On the command line a layout is written as layer counts per
stage (:func:`parse_stage_layout`: ``"12,24,24,33"``); the default (:func:`stage_layout` with no counts) splits the
blocks into stages of as even a layer count as block granularity allows.

**What travels between stages.** The state of the recurrence after layer ``l``: the stored blocks (``blocks[0]`` is
the embedding, ``blocks[j]`` the partial sum of block ``j``) and the running partial sum ``p``, each ``[B, T, D]``.
A stage sends them stacked as one tensor ``[M, B, T, D]`` (``M`` = the blocks stored so far + 1, ``p`` last; ``M = 1``
without AttnRes): one send and one receive per micro-batch whatever the depth, and its gradient comes back as one
tensor. Stage ``s`` of a layout ending at layer ``stop`` sends ``ceil(stop / attn_res_block_size) + 1`` sources, so
later stages send more (K3.1 at PP8 on blocks of 12: 2, 3, ..., 9 sources of ``T x 7168``).

**Micro-batches.** A step's batch is ``input_ids`` ``[R, T]`` cut into ``n_microbatches`` along the rows. Packed
documents (``cu_seqlens``, one row per micro-batch) travel with each micro-batch as a keyword argument of every
stage: the per-row offsets are padded with ``T`` into one ``[R, N_max + 1]`` int64 tensor (:func:`pack_cu_seqlens`),
which the schedule splits along the rows like the ids, and each stage strips the padding again
(:func:`unpack_cu_seqlens`). ``labels`` travel the same way; the last stage returns the micro-batch's **summed**
next-token NLL (``kernels_torch.loss.linear_cross_entropy``: no logits), and the schedule's loss divides it by the
step's target count, so the micro-batch losses add up to the one-process mean and the gradients to its gradients
(``scale_grads=False``).

**Schedules.** ``1F1B`` and ``GPipe`` (one stage per rank) and ``Interleaved1F1B`` (``stages_per_rank`` >= 2 stages
per rank, looped: stage ``s`` on pipeline rank ``s % pp``). Stage shapes are given to ``PipelineStage`` up front
(static metadata: no trial forward at the first step), built from the first batch and rebuilt when a batch of
another shape comes.

``DualPipeV`` and ``ZBVZeroBubble`` (:data:`V_SCHEDULES`; torch's ``ScheduleDualPipeV``, after DeepSeek-V3's
DualPipe, and ``ScheduleZBVZeroBubble``, Qi et al. 2024 "Zero Bubble Pipeline Parallelism" section 6) run
``2 pp`` stages, two per rank in a V (:func:`stage_ranks`: rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``, so
rank 0 holds the embedding's stage and the head's, and the last rank two adjacent stages, handed over in memory);
the stage cut is the same AttnRes-block layout (``layer_counts`` of ``2 pp`` stages). Both split a stage's backward
into an input part (``I``: the gradient sent to the previous stage) and a weight part (``W``, run later to fill
bubbles; torch's ``stage_backward_input`` / ``stage_backward_weight`` re-run from the saved intermediate gradients).
A layer recomputed in the backward (``torch.utils.checkpoint``) is then replayed in each part, twice per
micro-batch (correct: its context shard is restored each time, ``context.recompute_context``; the compute is paid
twice). DualPipeV needs at least ``2 pp`` micro-batches (torch's rule, checked here); its steady state pairs one
micro-batch's forward on one stage with another's full backward on the other stage as one ``OVERLAP_F_B`` action.
By default **that action runs its forward, then its backward**. With ``Pipeline(overlap_f_b=True)`` (``kimi train
--ep-overlap fb``; the MoE layers expert-parallel in ``overlap="fb"`` or ``"fb+chunks"``) the callback
``kernels_torch.parallel.fb_overlap.overlap_f_b`` is registered for it: the forward on the calling thread and the
backward on a second thread, taking turns (exactly one runs at a time) at every expert all-to-all, each party
handing the turn over after issuing an asynchronous transfer and before waiting for it, so one micro-batch's
dispatch and combine (forward, or their reverses in the backward, also those of a layer recomputed there) travel
while the other micro-batch computes; every rank issues its collectives in one order (that module's docstring).
What stays exposed: the actions that are not ``OVERLAP_F_B`` (the warm-up forwards, the zero-bubble ``I`` / ``W``
parts, the cool-down backwards, the last rank's first steady-state pair: ``3 pp - r - 1`` of rank ``r``'s ``2 M``
stage-micro-batch forwards and as many of its backwards, one more on the last rank, the other ``2 M - 3 pp + r + 1``
of each running in ``OVERLAP_F_B`` pairs), and the all-to-alls of a stage without MoE layer or of the party left alone once the other has ended.
It holds no activation beyond the schedule's, and at most one more all-to-all's send and receive buffers
(``fb_overlap``'s docstring). Refused with another schedule or with context parallelism (whose one
current shard the two parties would overwrite). Tested on gloo in fp64 (``tests/test_pipeline_dualpipe.py``):
pp2 (both), pp2 x ep2 under DualPipeV (the all-to-alls plain, in two chunks, and with ``overlap_f_b``: one chunk,
and two chunks with whole layers recomputed, the turns' order checked), pp2 x cp2 with recomputation (both);
``kimi train --pp 2 --pp-schedule DualPipeV`` in ``tests/test_train_pipeline.py``, with ``--ep 2 --ep-overlap fb``
against the run without it in ``tests/test_pipeline_dualpipe.py``. The evaluation runs
``ZBVZeroBubble``'s ``eval`` (forward only, any micro-batch count) on the same V placement.

Usage (one rank of a ``pp``-rank group; every rank passes the whole step batch)::

    pipe = Pipeline(model, pp_size=4, pp_rank=rank, schedule="Interleaved1F1B", stages_per_rank=2,
                    n_microbatches=8)                       # keeps only this rank's stages of `model`
    opt = torch.optim.AdamW(pipe.parameters())
    loss = pipe.step(input_ids, labels, cu_seqlens=[cu_0, ..., cu_7])   # forward + backward, grads accumulated
    opt.step(); opt.zero_grad()

``kimi train``'s micro-batches (``kimi_tools.data.Batch``, ``[1, T]`` each with its ``cu_seqlens``) of one step are
``pipe.step(torch.cat([b.input_ids for b in batches]), torch.cat([b.labels for b in batches]),
[b.cu_seqlens for b in batches])`` with ``n_microbatches = len(batches)``.

The stage modules keep the full model's parameter names (``model.layers.17.self_attn...``, ``lm_head.weight``), so
a rank's ``state_dict`` is a subset of the one-process model's, DCP states of different ``pp`` sizes address the same
keys, and gradients compare name by name with one process.

**Composing with the other mesh dimensions** (notes for ``docs/scaling.md``). ``pp`` is the outermost mesh dimension
(torchtitan's ``ParallelDims`` order ``pp, dp_replicate, dp_shard, cp, tp``): a pipeline group is the ranks that
share every other coordinate (``group=world_mesh["pp"].get_group()``), and each stage is sharded over the inner
dimensions as the whole model is: :func:`shard_stages` (``kernels_torch.parallel.fsdp.apply_fsdp``, the FSDP2 part
of ``parallelize``) puts one ``fully_shard`` on every decoder layer a rank holds and one on each stage module
(embedding on the first; output mix, norm and ``lm_head`` on the last) over the rank's ``dp x cp`` ranks
(``ParallelMesh["dp_cp"]``, or a 1-D data-parallel mesh), the routed experts over ``efsdp``, bf16 with fp32 masters
and the parameters in another dtype (the checkpoint's fp32 tensors) left out as ``ignored_params``; by default (``fsdp="layer"``) each unit reshards after its forward and backward
and reduce-scatters every micro-batch, as without a pipeline, or (``fsdp="stage"``) ``PipelineStage`` holds the
whole stage gathered and the reduce-scatter until a stage's last micro-batch. Each rank
passes its own data-parallel rows and ``n_tokens`` = the targets summed over the data-parallel ranks (the
reduce-scatter sums). :meth:`Pipeline.rank_module` gives DCP the rank's stages under the one-process names, so a
state saved at one ``pp x dp`` loads at another or in one process (tested: pp2 x dp2 -> pp4 and -> one process,
weights and AdamW moments; the load is partial because a parameter no gradient reached has no AdamW state).

The other dimensions, and what remains:

* Expert parallelism: ``kernels_torch.parallel.expert.shard_experts`` (over ``ParallelMesh["ep"]``) acts on the
  layer instances, which the stages share, so the whole model is made expert-parallel before it is split (tested
  here: pp2 x ep2, each ep rank its own rows, the all-to-alls inside the stages, the replicated gradients summed
  over ep by the test); :func:`shard_stages` given the ``ParallelMesh`` then shards each MoE layer's experts
  (``Shard(0)`` over ``ep``) with FSDP2 over ``efsdp``, as ``parallelize`` does.
* Context parallelism: ``Pipeline(context=cp)`` (tested here: pp2 x cp2 under 1F1B, the gradients summed over cp
  by the test): ``ContextParallel`` keeps **one** current shard, and several micro-batches of different documents
  are in flight on a rank, so each stage makes its micro-batch's shard current from the global ``cu_seqlens``
  before its layers run. A layer recomputed in the backward (``torch.utils.checkpoint``, e.g.
  ``kernels_torch.activation_memory.recompute_layers``) runs after later micro-batches' forwards set their shards: its checkpoint
  takes ``context_fn=kernels_torch.parallel.context.recompute_context``, which replays it with the shard of its
  forward (tested here: 1F1B, Interleaved1F1B and GPipe, whole layers and the MLP-only mode, fp64). With FSDP2 over
  ``dp x cp`` the ``ContextParallel`` takes a group of its own, as ``kernels_torch.parallel.parallelize.parallelize`` makes
  (``own_cp_group``).
* ``kimi train --pp N [--pp-layout 12,24,24,33] [--pp-schedule ...]`` (any of :data:`SCHEDULES`) is wired with
  ``--dp``, ``--cp``, ``--ep`` (``--ep-overlap chunks`` too; ``fb`` / ``fb+chunks`` under DualPipeV) and ``--dtype bfloat16`` (``kimi_tools.train.parallel``; tested on gloo in ``tests/test_train_pipeline.py``: the
  evaluation through :meth:`Pipeline.evaluate`; clipping by the squared norms summed over ``pp``; the export
  written per rank from its stages, ``kernels_torch.parallel.export.export_sharded`` on :meth:`Pipeline.rank_module`;
  the model built on ``meta``, each rank materialising and reading only its stages' shards). Remaining: LoRA, FP8
  and the distillation stages under ``--pp``.
* Activation memory, for the planner: 1F1B keeps the activations of up to ``pp`` micro-batches of its stage on the
  first rank; Interleaved1F1B ``1 + (pp - 1) / (pp * stages_per_rank)`` times that (Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models", section 4.2.3); the sent state grows with depth
  (see above). Interleaved1F1B needs ``n_microbatches`` divisible by ``max(1, n_microbatches // pp)`` (its
  rounds; torch's rule, raised by torch). Under the V schedules a stage holds ``L / (2 pp)`` layers; replaying
  torch's action order (communication free, ``OVERLAP_F_B`` as its forward then its backward; under
  ``overlap_f_b`` the backward frees while the forward allocates, so the peak is no higher) every
  rank peaks at
  ``2 pp + 1`` stage-micro-batches of activations in flight under DualPipeV (``2 pp`` under ZBVZeroBubble):
  ``pp + 1/2`` micro-batches of a one-stage-per-rank stage, on every rank (1F1B: ``pp - r`` on rank ``r``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from kernels_torch.attn_res import attn_res_mix
from kernels_torch.common import check_cu_seqlens, check_token_ids
from kimi.config import KimiConfig
from kimi.tokenizer import IGNORE_INDEX

__all__ = [
    "SCHEDULES",
    "V_SCHEDULES",
    "stage_ranks",
    "stage_layout",
    "parse_stage_layout",
    "sources_after",
    "PipelineStageModule",
    "split_stage",
    "pack_cu_seqlens",
    "unpack_cu_seqlens",
    "Pipeline",
    "PP_FSDP",
    "shard_stages",
]

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "DualPipeV", "ZBVZeroBubble")
V_SCHEDULES = ("DualPipeV", "ZBVZeroBubble")  # two stages per rank in a V: rank r holds stages r and 2 pp - 1 - r
_MULTI = ("Interleaved1F1B", *V_SCHEDULES)  # schedules with several stages per rank
# the FSDP2 policies of a rank's stages (shard_stages; kimi train --pp-fsdp): "layer" every unit on its own, as
# without a pipeline; "stage" torch's PipelineStage holding the whole stage gathered until the step's end
PP_FSDP = ("layer", "stage")


# ------------------------------------------------------------------------------------------------ layout


def _block_size(config: KimiConfig) -> int:
    """The cut granularity in layers: ``attn_res_block_size`` with AttnRes, else 1 (any layer)."""
    return config.attn_res_block_size if config.has_attn_res else 1


def stage_layout(config: KimiConfig, num_stages: int, layer_counts: Sequence[int] | None = None) -> tuple[range, ...]:
    """The layer range of each pipeline stage: ``num_stages`` contiguous ``range``s covering ``0 ..
    num_hidden_layers`` in order, each starting on a block-write layer (AttnRes) so that a cut never falls inside a
    block.

    Args:
        config: the model's config. num_stages: stages in the pipeline (``pp x stages_per_rank``).
        layer_counts: layers per stage (e.g. ``(12, 24, 24, 33)`` for K3.1 at PP4; 0 on the first stage puts the
            embedding alone there, 0 on the last the output mix, norm, ``lm_head`` and loss); None: the AttnRes blocks
            (or layers, without AttnRes) dealt out so that stage ``s`` ends at the block boundary nearest to
            ``(s + 1) / num_stages`` of the layers.

    Returns:
        ``tuple`` of ``num_stages`` ``range(start, stop)``.

    Raises:
        ValueError: ``num_stages`` < 1 or more than the blocks (layers); counts of the wrong number, negative,
            0 on a middle stage, not summing to ``num_hidden_layers``, or a stage starting inside an AttnRes block
            (naming the stage, its first layer and the block size).
    """
    L, bs = config.num_hidden_layers, _block_size(config)
    n_blocks = math.ceil(L / bs)
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"pipeline stages: got {num_stages!r}, expected a positive int")
    if layer_counts is None:
        if num_stages > n_blocks:
            unit = f"AttnRes blocks of {bs} layers" if config.has_attn_res else "layers"
            raise ValueError(
                f"pipeline stages: got {num_stages}, but the model has only {n_blocks} {unit} ({L} layers) and the "
                f"default layout gives each stage one at least: expected at most {n_blocks} stages, or up to "
                f"{n_blocks + 2} with layer_counts putting 0 layers on the first stage (the embedding alone) and / or "
                "the last (the head alone)"
            )
        # block boundaries nearest to an even split of the layers, strictly increasing, the last at L
        bounds, prev = [], 0
        for s in range(1, num_stages):
            b = round(s * L / num_stages / bs)
            b = min(max(b, prev + 1), n_blocks - (num_stages - s))  # leave >= 1 block to every later stage
            bounds.append(b * bs)
            prev = b
        starts = [0, *bounds]
        stops = [*bounds, L]
        return tuple(range(a, b) for a, b in zip(starts, stops))
    counts = list(layer_counts)
    if len(counts) != num_stages:
        raise ValueError(
            f"pipeline layout: got {len(counts)} stage sizes {counts}, expected {num_stages} (one per stage)"
        )
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in counts):
        raise ValueError(f"pipeline layout: got layer counts {counts}, expected non-negative ints")
    empty = [s for s, n in enumerate(counts) if n == 0]
    if any(0 < s < num_stages - 1 for s in empty) or (empty and num_stages == 1):
        raise ValueError(
            f"pipeline layout: got layer counts {counts}, expected 0 layers only on the first stage (the embedding "
            "alone) or the last (output mix, norm, lm_head and loss alone) of several"
        )
    if sum(counts) != L:
        raise ValueError(f"pipeline layout: got layer counts {counts} summing to {sum(counts)}, expected {L} layers")
    ranges, start = [], 0
    for s, n in enumerate(counts):
        if start % bs and n > 0:
            raise ValueError(
                f"pipeline layout: stage {s} starts at layer {start}, inside an AttnRes block; expected every stage "
                f"to start at a multiple of attn_res_block_size={bs} (layer counts {counts})"
            )
        ranges.append(range(start, start + n))
        start += n
    return tuple(ranges)


def parse_stage_layout(text: str) -> tuple[int, ...]:
    """Layer counts per stage from a comma-separated string (``"12,24,24,33"``), for :func:`stage_layout` (which
    checks them against the model).

    Raises:
        ValueError: naming the text, when an entry is not a non-negative integer.
    """
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(
            f"pipeline layout: got {text!r}, expected layer counts per stage like '12,24,24,33' or '0,48,45'"
        )
    return tuple(int(p) for p in parts)


def stage_ranks(schedule: str, pp_size: int, num_stages: int) -> tuple[int, ...]:
    """The pipeline rank that holds each stage: looped (stage ``s`` on rank ``s % pp_size``: ``1F1B``, ``GPipe``,
    ``Interleaved1F1B``) or, under :data:`V_SCHEDULES`, a V of two stages per rank (rank ``r`` holds stages ``r`` and
    ``2 pp_size - 1 - r``: the first and the last stage on rank 0, stages ``pp_size - 1`` and ``pp_size`` side by
    side on the last rank, which hands the state from one to the other without a send). torch's
    ``torch.distributed.pipelining._utils.generate_stage_to_rank_mapping`` (styles ``loop`` and ``v``).

    Raises:
        ValueError: a V schedule with ``num_stages`` other than ``2 pp_size``.
    """
    if schedule in V_SCHEDULES:
        if num_stages != 2 * pp_size:
            raise ValueError(
                f"pipeline stages: got {num_stages} with {schedule} on {pp_size} ranks, expected {2 * pp_size} "
                "(two stages per rank)"
            )
        return tuple(s if s < pp_size else 2 * pp_size - 1 - s for s in range(num_stages))
    return tuple(s % pp_size for s in range(num_stages))


def sources_after(config: KimiConfig, stop: int) -> int:
    """How many ``[B, T, D]`` tensors describe the recurrence after layers ``0 .. stop - 1``: the blocks stored
    so far plus the partial sum (1 without AttnRes). This is the ``M`` of the ``[M, B, T, D]`` a stage sends."""
    if not config.has_attn_res:
        return 1
    return math.ceil(stop / config.attn_res_block_size) + 1


# ------------------------------------------------------------------------------------------------ stage module


class _Holder(nn.Module):
    """Stands for ``KimiK3Model.model`` (the backbone) in a stage, so parameter names stay ``model.*``."""


class PipelineStageModule(nn.Module):
    """One pipeline stage of a :class:`kernels_torch.model.KimiK3Model`: the decoder layers ``layers`` (the same
    module objects, not copies), the embedding on the first stage, the output AttnRes mix, final norm and
    ``lm_head`` on the last. Parameter names are the full model's (``model.layers.{i}.*``: the layers sit in a
    ``ModuleDict`` keyed by their global index).

    ``forward(x, cu_seqlens=None, labels=None)``:

    * ``x``: the first stage's ``input_ids`` ``[B, T]`` int32/int64; a later stage's received state
      ``[M, B, T, D]`` (stored blocks then the partial sum, :func:`sources_after`).
    * ``cu_seqlens``: None, or one padded row ``[1, N_max + 1]`` int64 from :func:`pack_cu_seqlens` (B must be 1);
      under context parallelism (:attr:`context` set) the row's **global** offsets, from which the stage makes the
      micro-batch's shard the current one before its layers run (several micro-batches are in flight on a rank; a
      recomputed layer's checkpoint restores its forward's shard: ``context.recompute_context``).
    * ``labels``: ``[B, T]`` int64 targets (-100: none); read by the last stage only.

    Returns the state ``[M', B, T, D]`` for the next stage, or (last stage) the summed NLL of the micro-batch, a
    scalar in fp32 (fp64 for fp64 weights).

    Raises:
        ValueError: ids or labels as ``KimiK3Model.loss`` refuses them; a received state of the wrong number of
            sources; ``cu_seqlens`` with B > 1; no ``labels`` on the last stage.
    """

    def __init__(self, model: nn.Module, layers: range, *, is_first: bool, is_last: bool, mla_form: str = "expanded"):
        super().__init__()
        c = model.config
        self.config, self.start, self.stop = c, layers.start, layers.stop
        self.is_first, self.is_last, self.mla_form = is_first, is_last, mla_form
        self.context = None  # a kernels_torch.parallel.context.ContextParallel, set by Pipeline(context=...)
        self.model = _Holder()
        if is_first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        if is_last:
            self.model.norm = model.model.norm
            if c.has_attn_res:
                self.model.output_attn_res_norm = model.model.output_attn_res_norm
                self.model.output_attn_res_proj = model.model.output_attn_res_proj
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, labels: torch.Tensor | None = None):
        c = self.config
        if self.is_first:
            check_token_ids(x, c.vocab_size)
            T = x.shape[1]
            p, blocks = self.model.embed_tokens(x), []  # [B, T, D]
        else:
            want = sources_after(c, self.start)
            if x.ndim != 4 or x.shape[0] != want:
                raise ValueError(f"pipeline stage input: got shape {tuple(x.shape)}, expected [{want}, B, T, D]")
            *blocks, p = x.unbind(0)
            blocks = list(blocks) if c.has_attn_res else []
            T = x.shape[2]
        cu = None
        if cu_seqlens is not None:
            if p.shape[0] != 1:
                raise ValueError(f"cu_seqlens: given with a micro-batch of {p.shape[0]} rows, expected 1 row")
            row = cu_seqlens.reshape(-1)
            if self.context is None:
                cu = unpack_cu_seqlens(row, T)
            else:  # global offsets: this micro-batch's shard becomes the current one, its local offsets used
                T_row = int(row[-1])  # the padding value is the row's global length
                ids = torch.empty(1, T_row, dtype=torch.int64, device=p.device)  # only the shape is read
                _, cu = self.context.shard(ids, unpack_cu_seqlens(row, T_row))
        elif self.context is not None:
            raise ValueError("cu_seqlens: got None under context parallelism, expected the global offsets")
        for i in range(self.start, self.stop):
            blocks, p, _ = self.model.layers[str(i)](blocks, p, cu, self.mla_form)
        if not self.is_last:
            return torch.stack([*blocks, p])  # [M', B, T, D]
        if c.has_attn_res:
            p = attn_res_mix(
                blocks + [p], self.model.output_attn_res_norm.weight, self.model.output_attn_res_proj.weight,
                eps=c.rms_norm_eps,
            )  # fmt: skip
        h = self.model.norm(p)  # [B, T, D]
        return _summed_nll(h, self.lm_head, labels, c.vocab_size)


def _summed_nll(h: torch.Tensor, head: nn.Module, labels: torch.Tensor | None, V: int) -> torch.Tensor:
    """The summed next-token NLL of ``h`` ``[B, T, D]`` against ``labels`` ``[B, T]`` (``KimiK3Model.loss``'s rule)."""
    from kernels_torch.loss import linear_cross_entropy

    if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.shape != h.shape[:2]:
        got = f"shape {tuple(labels.shape)} dtype {labels.dtype}" if isinstance(labels, torch.Tensor) else labels
        raise ValueError(f"labels: got {got}, expected [B, T] = {list(h.shape[:2])} int64 (-100: no target)")
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= V))
    if labels.device.type == "cpu" and bool(bad.any()):
        raise ValueError(f"labels: got {int(labels[bad][0])}, expected ids in [0, {V}) or -100 (no target)")
    h2, y = h.reshape(-1, h.shape[-1]), labels.to(h.device).reshape(-1)  # [B*T, D], [B*T]
    if type(head) is not nn.Linear:  # a wrapped lm_head (LoRA, FP8): the logits path, same value
        import torch.nn.functional as F

        from kernels_torch.common import compute_dtype

        logits = head(h2)
        return F.cross_entropy(logits.to(compute_dtype(logits)), y, ignore_index=IGNORE_INDEX, reduction="sum")
    return linear_cross_entropy(h2, head.weight, y, ignore_index=IGNORE_INDEX)


def split_stage(model: nn.Module, layout: Sequence[range], stage_index: int, mla_form: str = "expanded"):
    """Stage ``stage_index`` of ``layout`` (:func:`stage_layout`) as a :class:`PipelineStageModule` sharing
    ``model``'s modules.

    Raises:
        ValueError: a tied-embedding model (the embedding would be on the first and the last stage),
            a layout that does not cover the model (:func:`stage_layout`'s checks), an index outside the layout.
    """
    c = model.config
    layout = stage_layout(c, len(layout), [len(r) for r in layout])  # validated
    if not 0 <= stage_index < len(layout):
        raise ValueError(f"stage_index: got {stage_index}, expected one of 0..{len(layout) - 1}")
    if c.tie_word_embeddings:
        raise ValueError(
            "tie_word_embeddings: got True, but pipeline stages hold the embedding (first stage) and lm_head "
            "(last stage) as separate weights; expected an untied model"
        )
    last = len(layout) - 1
    return PipelineStageModule(
        model, layout[stage_index], is_first=stage_index == 0, is_last=stage_index == last, mla_form=mla_form
    )


# ------------------------------------------------------------------------------------------------ cu_seqlens


def pack_cu_seqlens(cu_seqlens: Sequence[torch.Tensor | Sequence[int] | None], T: int) -> torch.Tensor:
    """Per-row document offsets as one ``[R, N_max + 1]`` int64 tensor the schedule can split by rows: row ``r``
    holds ``cu_seqlens[r]`` (``[0, ..., T]``; None: one document ``[0, T]``) followed by copies of ``T``.

    Raises:
        ValueError: an invalid row (``kernels_torch.common.check_cu_seqlens``), naming the row.
    """
    rows = []
    for r, cu in enumerate(cu_seqlens):
        cu = torch.tensor([0, T]) if cu is None else torch.as_tensor(cu)
        try:
            rows.append(check_cu_seqlens(cu.cpu(), T))
        except ValueError as e:
            raise ValueError(f"cu_seqlens[{r}]: {e}") from None
    if not rows:
        raise ValueError("cu_seqlens: got no rows, expected one offsets tensor per row of input_ids")
    width = max(len(r) for r in rows)
    out = torch.full((len(rows), width), T, dtype=torch.int64)
    for r, cu in enumerate(rows):
        out[r, : len(cu)] = cu
    return out


def unpack_cu_seqlens(row: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of :func:`pack_cu_seqlens` for one row ``[N_max + 1]``: the offsets ``[N + 1]`` ending at the first
    ``T`` (a host read of the row, as the model's own ``cu_seqlens`` check does)."""
    n = int((row < T).sum()) + 1
    return check_cu_seqlens(row[:n], T)


# ------------------------------------------------------------------------------------------------ pipeline


def _stage_class():
    """torch's ``PipelineStage``, made to hand no gradient between two stages of one rank in a forward-only run, and
    to run a split backward whole where asked (``whole_backward``).

    In a V placement the last rank holds two adjacent stages, and torch's runtime passes the input gradient of the
    later one to the earlier one in memory after each backward action (``get_local_bwd_output`` /
    ``set_local_bwd_input``), also under ``eval()``, where the stages have no backward and those two calls raise
    ("can't steal_bwd_input if this stage doesn't have backward"); the backward actions themselves are skipped. Here
    the hand-over is skipped with them (no gradient exists), so that the V schedules' ``eval`` runs.

    ``whole_backward`` (the per-layer FSDP2 policy under a V schedule, :func:`shard_stages`): an input-only backward
    (``BACKWARD_INPUT``, ``full_backward=False``) runs as the stage's full backward, and the weight backward
    (``BACKWARD_WEIGHT``) of that micro-batch does nothing. torch's split collects the weights' autograd nodes from
    ``submod.parameters()`` when the input part runs and computes their gradients later from saved intermediate
    gradients; a layer unit that reshards after its forward and its backward holds its sharded parameters, not the
    gathered ones the graph used, at both moments, so the split would lose the weight gradients (and a weight part
    after the unit's reduce-scatter could not join it). Run whole, the weight gradients are computed while each unit
    is gathered and reduce-scattered by its own post-backward hook, as in any other backward. The schedule's order
    stays torch's; the weight work moves from the ``W`` action to the ``I`` action."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def __init__(self, *args, whole_backward: bool = False, after_backward=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.whole_backward = whole_backward
            self.after_backward = after_backward  # called after each backward action (Pipeline.host_sums)
            self._whole: set[int] = set()  # micro-batches whose split backward ran whole

        def get_local_bwd_output(self, mb_index):
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            if self.whole_backward and not full_backward and self.has_backward:
                self._whole.add(bwd_chunk_id)
                full_backward = True
            out = super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            if self.after_backward is not None:
                self.after_backward()
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            if bwd_chunk_id in self._whole:
                self._whole.discard(bwd_chunk_id)
                return
            return super().backward_weight_one_chunk(bwd_chunk_id, last_backward)

    return _Stage


class _LayerUnits(nn.Module):
    """What ``PipelineStage`` runs under the per-layer FSDP2 policy (:func:`shard_stages` ``fsdp="layer"``): the
    stage module (an FSDP2 unit itself, its layers units of their own) behind a module that is not one, so that
    torch's pipelining leaves FSDP2 alone. torch's ``PipelineStage`` turns resharding after the backward and the
    gradient reduce-scatter off (``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``) on a
    stage module that is an ``FSDPModule``, until its ``perform_reduce_grad`` at the step's end, and its runtime
    gathers every unit of such a stage before the stage's first action (``UNSHARD``); here every unit keeps FSDP2's
    own behaviour, as without a pipeline: gathered in its pre-forward and pre-backward hooks, resharded after its
    forward (torchtitan's policy: not the last layer nor the root, ``apply_fsdp``) and after its backward, its
    gradient reduce-scattered in its post-backward hook and accumulated sharded, every micro-batch; FSDP2's final
    callback (queued by the stage's root unit in each backward) waits for the reductions. Parameter names gain the
    prefix ``stage.`` here only (``PipelineStage`` reads ``parameters()``, never names)."""

    def __init__(self, stage: nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, *args, **kwargs):
        return self.stage(*args, **kwargs)


class _ScaledNLL:
    """The schedule's ``loss_fn``: the last stage's summed NLL times ``scale`` (1 / the step's target count)."""

    def __init__(self):
        self.scale = 1.0

    def __call__(self, nll: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nll * self.scale


def _check_overlap_f_b(model: nn.Module, schedule: str, context) -> None:
    """Refuse ``Pipeline(overlap_f_b=True)`` where it cannot run (one line naming the value and what it needs)."""
    from kernels_torch.moe import KimiMoE
    from kernels_torch.parallel.expert import FB_OVERLAPS

    if schedule != "DualPipeV":
        raise ValueError(
            f"overlap_f_b: got True with schedule {schedule!r}, expected DualPipeV (the schedule whose OVERLAP_F_B "
            "actions pair one micro-batch's forward with another's backward)"
        )
    if context is not None:
        raise ValueError(
            "overlap_f_b: got True with context parallelism, expected context=None (ContextParallel keeps one "
            "current shard, which two micro-batches taking turns inside a layer would overwrite)"
        )
    modes = sorted({str(getattr(m, "expert_overlap", "not expert-parallel")) for m in model.modules()
                    if isinstance(m, KimiMoE)})  # fmt: skip
    if not modes or any(m not in FB_OVERLAPS for m in modes):
        raise ValueError(
            f"overlap_f_b: got True with MoE layers {modes or 'absent'}, expected every MoE layer expert-parallel "
            f"with overlap in {list(FB_OVERLAPS)} (shard_experts(..., overlap='fb'): the turn passes at its "
            "all-to-alls)"
        )


class Pipeline:
    """One rank's part of a pipeline-parallel :class:`kernels_torch.model.KimiK3Model`: its stage modules and a
    ``torch.distributed.pipelining`` schedule over the ``pp`` ranks of ``group``.

    Args:
        model: the whole model (may live on ``meta`` until the caller materialises ``stages``); only this rank's
            stages' modules are kept (:attr:`stages`).
        pp_size: ranks in the pipeline group; pp_rank: this rank's index in it.
        schedule: one of :data:`SCHEDULES`. stages_per_rank: stages per rank (1 for ``1F1B`` / ``GPipe``; >= 2 for
            ``Interleaved1F1B``, stage ``s`` on rank ``s % pp_size``; 2 for ``DualPipeV`` / ``ZBVZeroBubble``, in a
            V: :func:`stage_ranks`).
        n_microbatches: micro-batches per step (rows of the step's batch are split evenly into them).
        layer_counts: layers per stage (:func:`stage_layout`); None: the balanced default.
        group: the pipeline process group (None: the default group, whose size must be ``pp_size``).
        device: where the stage runs (None: the device of the model's parameters).
        context: a ``kernels_torch.parallel.context.ContextParallel`` attached to ``model`` over this rank's
            context-parallel group, or None. With it, :meth:`step` takes this rank's shard of every row (ids and
            labels ``[R, T_r]``) and the rows' **global** ``cu_seqlens`` (required), and each stage sets the shard
            of the micro-batch it runs.
        overlap_f_b: under ``DualPipeV``, run each ``OVERLAP_F_B`` action's forward and backward on two threads
            taking turns at the expert all-to-alls (``kernels_torch.parallel.fb_overlap``), one micro-batch's
            transfers travelling while the other computes; the MoE layers must be expert-parallel in an ``fb``
            overlap mode (``shard_experts(..., overlap="fb")`` or ``"fb+chunks"``). :attr:`overlap_trace`: None, or
            a list that receives the turns' events of every overlapped action.

    Raises:
        ValueError: an unknown schedule, ``stages_per_rank`` not matching it, sizes that are not positive, or
            ``pp_rank`` outside ``[0, pp_size)``; fewer than ``2 pp_size`` micro-batches under ``DualPipeV``;
            :func:`stage_layout` / :func:`split_stage` errors; ``overlap_f_b`` with another schedule than
            ``DualPipeV``, with ``context``, or with a MoE layer that is not expert-parallel in an ``fb`` mode.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        pp_size: int,
        pp_rank: int,
        n_microbatches: int,
        schedule: str = "1F1B",
        stages_per_rank: int = 1,
        layer_counts: Sequence[int] | None = None,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        mla_form: str = "expanded",
        context=None,
        overlap_f_b: bool = False,
    ):
        if schedule not in SCHEDULES:
            raise ValueError(f"pipeline schedule: got {schedule!r}, expected one of {list(SCHEDULES)}")
        for name, v in (("pp_size", pp_size), ("n_microbatches", n_microbatches), ("stages_per_rank", stages_per_rank)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}: got {v!r}, expected a positive int")
        if schedule in V_SCHEDULES and stages_per_rank != 2:
            raise ValueError(f"stages_per_rank: got {stages_per_rank} with {schedule}, expected 2 (a V of two stages)")
        if schedule in _MULTI and stages_per_rank < 2:
            raise ValueError(f"stages_per_rank: got {stages_per_rank} with {schedule}, expected >= 2")
        if schedule not in _MULTI and stages_per_rank != 1:
            raise ValueError(f"stages_per_rank: got {stages_per_rank} with {schedule}, expected 1 (or Interleaved1F1B)")
        if not 0 <= pp_rank < pp_size:
            raise ValueError(f"pp_rank: got {pp_rank}, expected an index in [0, {pp_size})")
        if schedule == "DualPipeV" and n_microbatches < 2 * pp_size:  # torch's rule, said before the first step
            raise ValueError(
                f"n_microbatches: got {n_microbatches} with DualPipeV on {pp_size} ranks, expected at least its "
                f"{2 * pp_size} stages"
            )
        if overlap_f_b:
            _check_overlap_f_b(model, schedule, context)
        self.overlap_f_b = bool(overlap_f_b)
        self.overlap_trace: list[str] | None = None  # kernels_torch.parallel.fb_overlap.Turns' events, if a list
        self.config = model.config
        self.pp_size, self.pp_rank, self.group = pp_size, pp_rank, group
        self.n_microbatches, self.schedule_name = n_microbatches, schedule
        self.num_stages = pp_size * stages_per_rank
        self.layout = stage_layout(self.config, self.num_stages, layer_counts)
        self.stage_ranks = stage_ranks(schedule, pp_size, self.num_stages)
        self.stage_indices = [s for s, r in enumerate(self.stage_ranks) if r == pp_rank]  # ascending
        self.stages = [split_stage(model, self.layout, s, mla_form) for s in self.stage_indices]
        self.context = context
        for st in self.stages:
            st.context = context
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.dtype = model.model.embed_tokens.weight.dtype  # the activations' dtype
        self._loss_fn = _ScaledNLL()
        self._schedules: dict[tuple, object] = {}
        self.fsdp: str | None = None  # the FSDP2 policy of shard_stages (PP_FSDP), None: the stages not sharded
        # under CPUOffloadPolicy and fsdp "layer" (a reduce-scatter every micro-batch): a
        # kernels_torch.parallel.fsdp.HostGradSums taking the host gradients out of .grad after each backward action
        # (so that FSDP2 copies each one non-blocking) and giving them back after the step; None: FSDP2 accumulates
        self.host_sums = None

    @property
    def _eval_schedule(self) -> str:
        """The forward-only schedule of :meth:`evaluate` (any micro-batch count, this placement of the stages):
        GPipe with one stage per rank, LoopedBFS looped, ZBVZeroBubble in a V (its ``eval``: the backward actions
        are skipped, and it takes fewer micro-batches than stages)."""
        if self.schedule_name in V_SCHEDULES:
            return "ZBVZeroBubble"
        return "LoopedBFS" if len(self.stages) > 1 else "GPipe"

    # -------------------------------------------------------------------------------------------- modules

    def parameters(self):
        """This rank's parameters (all its stages), for the optimizer."""
        for st in self.stages:
            yield from st.parameters()

    def named_parameters(self):
        """``(name, parameter)`` of this rank's stages, names as in the one-process model."""
        for st in self.stages:
            yield from st.named_parameters()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's stages' tensors under the one-process model's names (a subset of its ``state_dict``)."""
        return self.rank_module().state_dict()

    def rank_module(self) -> nn.Module:
        """This rank's stages as one module with the one-process model's names (``model.embed_tokens``,
        ``model.layers.{i}``, ``model.norm``, ``lm_head``, ... for the parts it holds), sharing their parameters:
        what ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``get_optimizer_state_dict`` take,
        so that ``kernels_torch.parallel.fsdp.save_checkpoint(path, pipe.rank_module(), optimizer)`` writes a DCP
        state that loads under any other ``pp`` (or in one process, into a ``KimiK3Model``) by key."""
        view = nn.Module()
        view.config = self.config
        view.model = _Holder()
        view.model.layers = nn.ModuleDict()
        for st in self.stages:
            for name, child in st.model.named_children():
                if name != "layers":
                    view.model.add_module(name, child)
            for i, layer in st.model.layers.items():
                view.model.layers.add_module(i, layer)
            if st.is_last:
                view.lm_head = st.lm_head
        return view

    # -------------------------------------------------------------------------------------------- schedule

    def _get_schedule(self, rows_per_mb: int, T: int, ids_dtype: torch.dtype, n_microbatches: int, name: str):
        """The schedule ``name`` for micro-batches of ``[rows_per_mb, T]`` ids, ``n_microbatches`` of them: built
        on first use and kept (one per shape: the training step's and the evaluation's)."""
        key = (rows_per_mb, T, ids_dtype, n_microbatches, name)
        if key not in self._schedules:
            self._schedules[key] = self._build(rows_per_mb, T, ids_dtype, n_microbatches, name)
        return self._schedules[key]

    def _build(self, rows_per_mb: int, T: int, ids_dtype: torch.dtype, n_microbatches: int, name: str):
        from torch.distributed.pipelining.schedules import get_schedule_class

        D, dev, dt = self.config.hidden_size, self.device, self.dtype
        pstages = []
        for st, s in zip(self.stages, self.stage_indices):
            r = self.layout[s]
            if st.is_first:
                inp = torch.empty(rows_per_mb, T, dtype=ids_dtype, device=dev)
            else:
                inp = torch.empty(sources_after(self.config, r.start), rows_per_mb, T, D, dtype=dt, device=dev)
                inp.requires_grad_(True)  # the received state's metadata: its gradient goes back to the sender
            if st.is_last:
                out = torch.empty((), dtype=torch.float64 if dt == torch.float64 else torch.float32, device=dev)
            else:
                out = torch.empty(sources_after(self.config, r.stop), rows_per_mb, T, D, dtype=dt, device=dev)
            out.requires_grad_(True)
            layer = self.fsdp == "layer"  # FSDP2 per layer: the stage module hidden from torch's no-sync
            pstages.append(
                _stage_class()(
                    _LayerUnits(st) if layer else st, s, self.num_stages, dev, input_args=inp, output_args=out,
                    group=self.group, whole_backward=layer and name in V_SCHEDULES, after_backward=self._take_host_grads,
                )
            )  # fmt: skip
        cls = get_schedule_class(name)
        kw = dict(n_microbatches=n_microbatches, loss_fn=self._loss_fn, scale_grads=False)
        schedule = cls(pstages, **kw) if len(self.stages) > 1 or name in _MULTI else cls(pstages[0], **kw)
        if self.overlap_f_b and name == "DualPipeV":
            from torch.distributed.pipelining.schedules import OVERLAP_F_B

            from kernels_torch.parallel.fb_overlap import overlap_f_b

            def callback(action, ctx):  # the trace read at each action: settable after the schedule is built
                overlap_f_b(action, ctx, trace=self.overlap_trace)

            schedule.register_custom_function(OVERLAP_F_B, callback)
        return schedule

    def _take_host_grads(self) -> None:
        if self.host_sums is not None:
            self.host_sums.take()

    def _global_length(self, cu_seqlens, T_local: int) -> int:
        """The rows' global length under context parallelism (the end of the first row's offsets), checked against
        this rank's shard length."""
        from kernels_torch.parallel.context import shard_bounds

        T_row = int(torch.as_tensor(cu_seqlens[0])[-1])
        start, stop = shard_bounds(T_row, self.context.world)[self.context.rank]
        if stop - start != T_local:
            raise ValueError(
                f"input_ids: got {T_local} tokens a row, expected this rank's context shard of {stop - start} "
                f"(tokens {start}..{stop} of the {T_row} that cu_seqlens[0] ends at)"
            )
        return T_row

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens=None, n_tokens=None) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline; gradients **accumulate** in the stage
        parameters' ``.grad`` (zero them between optimizer steps).

        Args:
            input_ids: ``[R, T]`` int32/int64, the same on every pipeline rank; ``R`` a multiple of
                ``n_microbatches``. labels: ``[R, T]`` int64 (-100: no target).
            cu_seqlens: None, or one offsets tensor ``[0, ..., T]`` per row (``R == n_microbatches``: each
                micro-batch is one packed row), or an already packed ``[R, N_max + 1]`` (:func:`pack_cu_seqlens`);
                under context parallelism the global offsets of the whole rows (``[0, ..., T_global]``).
            n_tokens: the count the summed NLL is divided by (the step's targets, summed over data-parallel ranks
                when there are some); None: ``(labels != -100).sum()``.

        Returns:
            the step's loss (the micro-batch losses summed), a scalar on every pipeline rank (broadcast from the
            last stage's rank over ``group``).

        Raises:
            ValueError: ``input_ids`` not ``[R, T]`` with ``R`` a multiple of ``n_microbatches``; labels of another
                shape; ``cu_seqlens`` of the wrong number of rows or invalid rows, or with more than one row per
                micro-batch; ``n_tokens`` not positive.
        """
        return self._run(input_ids, labels, cu_seqlens, n_tokens, self.n_microbatches, backward=True)

    def evaluate(
        self, input_ids: torch.Tensor, labels: torch.Tensor, cu_seqlens=None, n_tokens=None, n_microbatches: int = 1
    ) -> torch.Tensor:
        """Forward only (``eval`` of torch's ``GPipe`` schedule, or ``LoopedBFS`` with several stages per rank: no
        backward, no gradient, any micro-batch count) of one batch through the pipeline, in ``n_microbatches``
        micro-batches (1: the batch whole): the arguments and the returned loss as :meth:`step`'s
        (``n_tokens=1`` gives the summed NLL). Run it under ``torch.no_grad()`` and the stage modules' ``eval()``
        for an evaluation; a schedule is built for each new shape and kept. Sharded stages (:func:`shard_stages`)
        are resharded after it.

        Raises:
            ValueError: as :meth:`step`; ``n_microbatches`` not a positive int.
        """
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"n_microbatches: got {n_microbatches!r}, expected a positive int")
        return self._run(input_ids, labels, cu_seqlens, n_tokens, n_microbatches, backward=False)

    def _run(self, input_ids, labels, cu_seqlens, n_tokens, M: int, backward: bool) -> torch.Tensor:
        """:meth:`step` (``backward``) or :meth:`evaluate` in ``M`` micro-batches."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
            raise ValueError(f"input_ids: got {getattr(input_ids, 'shape', input_ids)}, expected [R, T]")
        R, T = input_ids.shape
        if R % M:
            raise ValueError(f"input_ids: got {R} rows, expected a multiple of n_microbatches={M}")
        if not isinstance(labels, torch.Tensor) or labels.shape != input_ids.shape:
            raise ValueError(f"labels: got {getattr(labels, 'shape', labels)}, expected [R, T] = {[R, T]}")
        kwargs = {"labels": labels.to(self.device)}
        if self.context is not None and cu_seqlens is None:
            raise ValueError("cu_seqlens: got None under context parallelism, expected the rows' global offsets")
        if cu_seqlens is not None:
            if R != M:
                raise ValueError(f"cu_seqlens: given with {R} rows in {M} micro-batches, expected one row each")
            if not (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.ndim == 2):
                if len(cu_seqlens) != R:
                    raise ValueError(f"cu_seqlens: got {len(cu_seqlens)} rows, expected {R} (one per row of input_ids)")
                T_row = T if self.context is None else self._global_length(cu_seqlens, T)
                cu_seqlens = pack_cu_seqlens(cu_seqlens, T_row)
            elif cu_seqlens.shape[0] != R:
                raise ValueError(f"cu_seqlens: got {cu_seqlens.shape[0]} packed rows, expected {R}")
            kwargs["cu_seqlens"] = cu_seqlens.to(self.device)  # as the trainer's Batch.to(device)
        if n_tokens is None:
            n_tokens = int((labels != IGNORE_INDEX).sum())
        if not float(n_tokens) > 0:
            raise ValueError(f"n_tokens: got {n_tokens}, expected a positive target count")
        self._loss_fn.scale = 1.0 / float(n_tokens)
        # forward only: GPipe (one stage per rank) or its looped form (several), which take any micro-batch count
        name = self.schedule_name if backward else self._eval_schedule
        schedule = self._get_schedule(R // M, T, input_ids.dtype, M, name)
        has_last = any(st.is_last for st in self.stages)
        losses: list[torch.Tensor] = []
        args = (input_ids.to(self.device),) if self.stages[0].is_first else ()
        run = schedule.step if backward else schedule.eval
        try:
            run(*args, target=labels.to(self.device), losses=losses, return_outputs=False, **kwargs)
        finally:
            if backward and self.host_sums is not None:
                self.host_sums.give_back()  # the step's summed host gradients back in .grad
        if not backward and self.fsdp is not None:
            # a forward without a backward leaves the units that keep their forward's copy gathered (the stage
            # module's root, the last layer), and then their gathered tensors, not the sharded ones the optimizer
            # steps, are the modules' parameters; torch's runtime reshards an FSDPModule stage after its actions,
            # the per-layer policy's stages (behind _LayerUnits) are resharded here
            from kernels_torch.parallel.fsdp import reshard

            for st in self.stages:
                reshard(st)
        loss_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        loss = torch.stack(losses).sum().detach() if has_last else torch.zeros((), dtype=loss_dtype, device=self.device)
        last_rank = self.stage_ranks[-1]
        src = dist.get_global_rank(self.group, last_rank) if self.group is not None else last_rank
        dist.broadcast(loss, src=src, group=self.group)
        return loss


def shard_stages(
    pipe: Pipeline,
    mesh,
    *,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    reshard_after_forward: bool | str = "auto",
    gradient_divide_factor: float | None = 1.0,
    ignored_params: set[nn.Parameter] | None = None,
    master_dtype: torch.dtype | None = torch.float32,
    offload_policy=None,
    fsdp: str = "layer",
) -> None:
    """FSDP2 over the ranks of one pipeline coordinate that hold the same stages, as
    ``kernels_torch.parallel.parallelize.parallelize`` shards a whole model (the same code:
    ``kernels_torch.parallel.fsdp.apply_fsdp``): ``fully_shard`` on every decoder layer of this rank's stages and on
    each stage module (its embedding, or its final norm, output mix and ``lm_head``) over the flattened ``dp x cp``
    ranks, and under expert parallelism on each MoE layer's routed experts over ``efsdp``. Call it before the
    optimizer is built and before the first :meth:`Pipeline.step`. Context and expert parallelism are attached to the
    whole model before it is split (``ContextParallel`` passed as ``Pipeline(context=)``; ``shard_experts(model,
    mesh=mesh["ep"])``): the stages share its layer instances.

    ``fsdp`` (:data:`PP_FSDP`, ``kimi train --pp-fsdp``) says what a micro-batch's backward does with the units:

    * ``"layer"`` (default): as without a pipeline. ``PipelineStage`` runs the stage module behind a module that is
      not an FSDP2 unit (:class:`_LayerUnits`), so every unit is gathered in its own pre-forward / pre-backward hook,
      resharded after its forward (``reshard_after_forward``) and after its backward, and its gradient is
      reduce-scattered in its post-backward hook and accumulated sharded, every micro-batch: at most a layer (and
      the units kept from the forward) gathered and no unsharded gradient between micro-batches. Per step and
      unit: ``2 m`` all-gathers (``m + 1`` for one that keeps its forward's copy) and ``m`` reduce-scatters. Under a
      V schedule each split backward runs whole at its input part (:func:`_stage_class`'s ``whole_backward``: a
      split cannot give weight gradients to units resharded in between). Under ``CPUOffloadPolicy`` set
      :attr:`Pipeline.host_sums` (``kernels_torch.parallel.fsdp.HostGradSums`` of the offloaded parameters): it
      takes the host gradients out of ``.grad`` after each backward action and gives them back after the step, so
      that FSDP2 copies each micro-batch's gradient to the host non-blocking, not blocking with a host add.
    * ``"stage"``: torch's own handling of a stage module that is an ``FSDPModule``: from a micro-batch's
      backward to the step's end every unit of the stage stays gathered (``set_reshard_after_backward(False)``),
      its gradients accumulate unsharded in the reduce dtype (``set_requires_gradient_sync(False)``) and are
      reduce-scattered once, at the step's end (``perform_reduce_grad``): ``m + 1`` all-gathers and one
      reduce-scatter per unit and step, the whole stage's gathered parameters and fp32 gradients held. Under a V
      schedule (torch's runtime gathers every unit of the stage before its first action and keeps them) the layers
      do not reshard after their forward (``reshard_after_forward`` becomes ``"never"``): a layer resharded there
      held its sharded parameters when the split backward's input part collected the weights, and its weight
      gradients were lost.

    The reduce-scatter **sums** by default (divide factor 1): every rank's loss must already be divided by the
    global target count, i.e. ``pipe.step(..., n_tokens=<targets summed over mesh's ranks>)``.

    Args:
        pipe: a :class:`Pipeline` (its stages' parameters real, or ``meta`` to be materialised after this).
        mesh: a ``kernels_torch.parallel.mesh.ParallelMesh`` (its ``dp_cp`` and, with ``ep`` > 1, ``efsdp``
            meshes), or a 1-D ``DeviceMesh`` of the ranks that hold the same stages (``world_mesh["dp"]``; no
            expert parallelism then).
        param_dtype, reduce_dtype, reshard_after_forward, gradient_divide_factor, ignored_params, master_dtype,
            offload_policy: as ``kernels_torch.parallel.parallelize.parallelize`` (with ``bfloat16``: the trainable bf16
            parameters become ``master_dtype`` masters, the stages' parameters in another dtype must be ignored; fp64
            parameters reduce in fp64), except that the divide factor defaults to 1.0 (None: the mesh's ``dp``).
        fsdp: ``"layer"`` or ``"stage"`` (above).

    Raises:
        ValueError: ``fsdp`` outside :data:`PP_FSDP`; ``mesh`` a DeviceMesh that is not 1-D; the stages already
            sharded; the experts expert-parallel over another mesh than ``mesh["ep"]`` (or under a 1-D mesh);
            parameters outside ``param_dtype`` not in ``ignored_params``.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule

    from kernels_torch.moe import KimiMoE
    from kernels_torch.parallel.fsdp import apply_fsdp, check_expert_layout

    if fsdp not in PP_FSDP:
        raise ValueError(f"fsdp: got {fsdp!r}, expected one of {list(PP_FSDP)}")
    if isinstance(mesh, DeviceMesh) and mesh.ndim != 1:
        raise ValueError(f"mesh: got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}, expected the 1-D data-parallel mesh")
    if any(isinstance(m, FSDPModule) for st in pipe.stages for m in st.modules()):
        raise ValueError("pipe: its stages are already sharded (fully_shard applied), expected plain stage modules")
    moes = [m for st in pipe.stages for m in st.modules() if isinstance(m, KimiMoE)]
    if isinstance(mesh, DeviceMesh):
        if any(m.experts.expert_ids != range(m.config.num_experts) for m in moes):
            raise ValueError(
                "mesh: got a 1-D DeviceMesh for stages whose experts are expert-parallel, expected the "
                "ParallelMesh (its ep and efsdp meshes)"
            )
    else:
        check_expert_layout(moes, mesh)
    layers = [layer for st in pipe.stages for layer in st.model.layers.values()]
    # A stage after the first unbinds the state it receives into the stored blocks and the partial sum (views of one
    # tensor), and a decoder layer returns the stored blocks it was given unchanged, so FSDP2 finds views among a
    # layer's outputs and warns, once per rank, that an in-place op on one "can produce wrong gradients" (it would
    # skip the pre-backward hook). Nothing writes into them: the AttnRes mixes and the stack sent to the next stage
    # only read them, and the gradients equal one process's (tests/test_pipeline.py, tests/test_train_pipeline.py).
    # Spurious here, so silenced for the decoder layers' view outputs alone; a copy would cost a state per micro-batch.
    warnings.filterwarnings(
        "ignore", message=r"FSDP2-wrapped module \(FSDPDecoderLayer\) returned a view tensor", category=UserWarning
    )
    if fsdp == "stage" and pipe.schedule_name in V_SCHEDULES:
        reshard_after_forward = "never"  # the runtime keeps the V's stages gathered; a split needs them so (above)
    apply_fsdp(
        layers, list(pipe.stages), mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        reshard_after_forward=reshard_after_forward, gradient_divide_factor=gradient_divide_factor,
        ignored_params=ignored_params, master_dtype=master_dtype, offload_policy=offload_policy,
    )  # fmt: skip
    if param_dtype is not None:
        pipe.dtype = param_dtype  # the activations sent between stages
    pipe.fsdp = fsdp
    pipe._schedules.clear()  # the PipelineStages wrap the (now sharded) stage modules: rebuild
