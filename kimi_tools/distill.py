"""Indexer distillation stages for ``kimi train`` and indexer-recall measurement on whole models (torch path).

The two stages of DeepSeek-V3.2 (spec 4.4; the math is in ``reference_jax.distill`` / ``kernels_torch.distill``):

* ``--stage indexer-warmup`` (:class:`WarmupStage`): the model runs **dense** (every visible key selected) with every
  parameter frozen except the DSA indexers (``*.indexer.*``); the loss is ``sum_t KL(p_t || softmax(I_t))`` over all
  causal keys, summed over the DSA layers. The forward runs under ``torch.no_grad`` (nothing upstream trains); each
  DSA layer's indexer is re-run from its captured, detached input with gradients. The KL uses the chunked form
  (:func:`kernels_torch.distill.warmup_kl_chunked`: query-row chunks of the attention logits and their lse), so no
  ``[T, S, H]`` tensor is formed. On ``cudnn`` the dense DSA layers run causal SDPA (``dense_selection``).
* ``--stage sparse`` (:class:`SparseStage`): the model runs sparse (top-``index_topk``); the LM loss trains every
  parameter except the indexers (hard top-k gives them no gradient anyway) and the router's
  ``e_score_correction_bias``; the KL over the selected set, from the indexer re-run on the **detached** layer input,
  trains the indexers only (DeepSeek-V3.2: the indexer's input is detached, so the KL moves nothing but the indexer).
  The loss returned is ``lm + kl`` (disjoint parameter sets, so each part moves only its own). On ``eager``/``sdpa`` the
  KL is the dense twin (``[B, H, T, S]`` logits, CPU sizes); on ``cudnn`` it is
  :func:`kernels_torch.distill.sparse_kl_gathered` on the sparse forward's own absorbed queries, latent rows, selection
  and natural-log lse (the layer's ``sparse_kl_aux``), in query-row chunks of the selected keys only, with the indexer
  scored at the selected keys only (:func:`kernels_torch.distill.indexer_scores_at`); the recall comes from that lse and
  a chunked dense lse (:func:`kernels_torch.distill.sparse_recall`).

The cudnn backend freezes the indexers (hard top-k); both stages unfreeze them in :meth:`WarmupStage.prepare` /
:meth:`SparseStage.prepare`, which ``kimi train`` calls before choosing the trainable set.

Reduction: DeepSeek sums the KL over query tokens. ``kimi train`` weights micro-batches by their target count and
expects a per-target mean, so the stage returns ``sum_layers sum_t KL / num_targets``: the same direction as
DeepSeek's sum (AdamW is invariant to the constant). Metrics appended to each ``metrics.jsonl`` record: ``kl`` (mean
KL per query and DSA layer), ``indexer_recall`` (share of the dense head-summed attention mass on the selected
``index_topk`` keys, averaged over queries and DSA layers), ``lm_loss`` (the LM cross-entropy of the same forward).

The layer inputs are captured with forward hooks on the DSA ``GatedMLA`` modules (:func:`capture_dsa_inputs`); the
model's code is not changed.

Parallel layouts: under ``torchrun`` with FSDP2 (``--cp 1``) both stages equal one process. The indexers stay whole
on every rank (:meth:`_IndexerStage.replicated`: their re-run happens outside the layer's forward, where FSDP2 has
not gathered them; ``kimi train`` all-reduces their gradients), and the teacher's queries and keys are computed
with the layer's weights gathered (``FSDPModule.unshard``, under ``no_grad``). Context parallelism (``--cp > 1``) is
refused, by ``kimi train`` up front (``check_parallel``) and by the library on a model under
``kernels_torch.parallel.context.ContextParallel`` (:func:`refuse_context_parallel`, in :func:`capture_dsa_inputs`
and :func:`layer_terms`, so the stages' ``loss`` and :func:`model_recall` too): the teacher distribution ``p_t`` is
the attention of query t over **every** causal key of its document, and the KL normalises over all of them, while
under CP each rank holds only its shard's queries (the CP forward also selects with the layer's own ``index_topk``,
so the warm-up's dense view would not hold); the KL would be computed over the wrong key set without an error.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from kernels_torch import distill as kd
from kernels_torch.common import causal_document_mask
from kernels_torch.indexer import indexer_scores, sparse_mask, topk_indices
from kimi.config import KimiConfig
from kimi_tools.data import IGNORE_INDEX  # noqa: F401 - re-exported: labels without a target

__all__ = [
    "refuse_context_parallel",
    "dsa_layers",
    "capture_dsa_inputs",
    "dense_selection",
    "layer_terms",
    "model_recall",
    "gathered",
    "WarmupStage",
    "SparseStage",
    "IGNORE_INDEX",
    "DENSE_TOPK",
]

DENSE_TOPK = 2**31 - 1  # an index_topk that selects every visible key: the DSA layer equals dense MLA (spec 9)


def refuse_context_parallel(module: nn.Module) -> None:
    """Refuse a model (or DSA layer) under :class:`kernels_torch.parallel.context.ContextParallel`: the teacher of
    both stages and of the recall is each query's attention over every causal key of its document, while under CP a
    layer holds only this rank's shard of the queries (and selects with its own ``index_topk``), so the KL, its
    gradients and the recall would be wrong without an error (module docstring, parallel layouts).

    Raises:
        ValueError: ``module`` or one of its layers runs a ``ContextParallel`` forward.
    """
    from kernels_torch.parallel.context import attached_context_parallel

    cp = attached_context_parallel(module)
    if cp is not None:
        raise ValueError(
            f"model: runs under ContextParallel ({cp.world} ranks), but the indexer distillation (and its recall) "
            "needs each query's attention over every causal key of its document, which context parallelism splits "
            "across ranks; run it on the whole row (ContextParallel.remove(), or kimi train --cp 1)"
        )


def dsa_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer_idx: GatedMLA}`` of a torch ``KimiK3Model``'s DSA layers."""
    layers = model.model.layers
    return {i: layer.self_attn for i, layer in enumerate(layers) if getattr(layer.self_attn, "kind", None) == "dsa"}


@contextlib.contextmanager
def capture_dsa_inputs(model: nn.Module) -> Iterator[dict[int, dict[str, Any]]]:
    """Within the block, every forward of ``model`` (a ``kernels_torch.model.KimiK3Model``) records, per DSA layer
    index, ``{"x": the layer's normalised input [B, T, D], "cu_seqlens": ..., "topk_indices": [B, T, k] or None,
    "forward": the layer's aux}`` (the last forward wins). On ``cudnn`` the block sets each DSA layer's
    ``sparse_kl_aux``, so that aux also holds the sparse forward's rows and lse
    (:func:`kernels_torch.dsa_cudnn.gated_mla_forward`). Forward hooks only; hooks and flags restored on exit.

    Raises:
        ValueError: ``model`` runs under ``ContextParallel`` (:func:`refuse_context_parallel`)."""
    refuse_context_parallel(model)
    seen: dict[int, dict[str, Any]] = {}
    handles, flags = [], []
    for i, attn in dsa_layers(model).items():

        def hook(module, args, kwargs, output, i=i):
            x = args[0] if args else kwargs["x"]
            aux = output[1] if isinstance(output, tuple) else {}
            seen[i] = {
                "x": x,
                "cu_seqlens": kwargs.get("cu_seqlens"),
                "topk_indices": aux.get("topk_indices"),
                "forward": aux,
            }

        handles.append(attn.register_forward_hook(hook, with_kwargs=True))
        flags.append((attn, getattr(attn, "sparse_kl_aux", False)))
        attn.sparse_kl_aux = attn.backend == "cudnn"
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
        for attn, flag in flags:
            attn.sparse_kl_aux = flag


@contextlib.contextmanager
def dense_selection(model: nn.Module) -> Iterator[None]:
    """Within the block, every DSA indexer of ``model`` selects every visible key (``index_topk`` = :data:`DENSE_TOPK`),
    so the DSA layers compute dense causal MLA (spec 9); on ``cudnn`` they then run causal SDPA and report no
    ``topk_indices`` (:func:`kernels_torch.dsa_cudnn.gated_mla_forward`)."""
    saved = []
    for attn in dsa_layers(model).values():
        saved.append((attn.indexer, attn.indexer.config))
        attn.indexer.config = attn.indexer.config.replace(index_topk=DENSE_TOPK)
    try:
        yield
    finally:
        for indexer, cfg in saved:
            indexer.config = cfg


_SPARSE_KL_AUX = ("q_abs", "kv_rows", "topk_global", "lse", "c_q")  # what the cudnn sparse forward hands over


def _sparse_terms_gathered(attn, x, cu_seqlens, topk, forward_aux) -> dict[str, torch.Tensor]:
    """The sparse stage on ``cudnn``: KL over ``S_t`` from the sparse forward's own rows and lse (module docstring)."""
    missing = [n for n in _SPARSE_KL_AUX if (forward_aux or {}).get(n) is None]
    if missing:
        raise ValueError(
            f"forward_aux: missing {missing}; the cudnn sparse stage needs the DSA layer's sparse_kl_aux output "
            "(run the forward inside kimi_tools.distill.capture_dsa_inputs)"
        )
    f = forward_aux
    B, T, _ = x.shape
    N, H, D = f["q_abs"].shape
    k = f["topk_global"].shape[-1]
    if N != B * T or tuple(topk.shape) != (B, T, k):
        raise ValueError(f"forward_aux: q_abs {tuple(f['q_abs'].shape)} / topk {tuple(topk.shape)} do not fit x {B, T}")
    scale = attn.config.mla_softmax_scale
    q_I, k_I, w = attn.indexer.projections(x, f["c_q"], cu_seqlens)  # the indexer re-run on the detached input
    scores_at = kd.indexer_scores_at(q_I, k_I, w, topk).reshape(N, k)  # [N, k], the student at the selected keys
    rows = max(1, kd.CHUNK_BYTES // (k * (D + H) * 4))  # gathered fp32 keys [C, k, D] + logits [C, H, k]
    kl = kd.sparse_kl_gathered(f["q_abs"], f["kv_rows"], f["topk_global"], scores_at, scale, lse=f["lse"], rows=rows)
    cu = cu_seqlens if cu_seqlens is not None or B == 1 else torch.arange(B + 1) * T  # B rows ran as documents
    recall = kd.sparse_recall(f["q_abs"], f["kv_rows"], f["lse"], scale, cu)
    return {"kl_sum": kl.sum(), "kl": kl.detach().view(B, T), "recall": recall.view(B, T)}


def layer_terms(
    attn: nn.Module,
    x: torch.Tensor,
    cu_seqlens,
    stage: str,
    topk: torch.Tensor | None = None,
    forward_aux: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """The distillation terms of one DSA layer from its captured input.

    Args:
        attn: a DSA ``kernels_torch.mla.GatedMLA``. x: its normalised input ``[B, T, D]`` (detached here).
        cu_seqlens: ``[N+1]`` or None. stage: "warmup" (KL over every visible key) or "sparse" (over ``topk``).
        topk: ``[B, T, k]`` the selection the sparse forward used (needed for "sparse"); for "warmup", None means
            the selection the indexer would make now (``config.index_topk``), used for the recall only.
        forward_aux: the layer's aux from that forward (:func:`capture_dsa_inputs`); needed for "sparse" on the
            ``cudnn`` backend, whose KL reuses the sparse forward's rows and lse (``sparse_kl_aux``).

    Returns:
        ``{"kl_sum": scalar (gradient to the indexer only), "kl": [B, T] per query (detached), "recall": [B, T]}``.

    Raises:
        ValueError: an unknown ``stage``, "sparse" without ``topk``, "sparse" on ``cudnn`` without the sparse
            forward's aux, or ``attn`` under ``ContextParallel`` (:func:`refuse_context_parallel`).
    """
    if stage not in ("warmup", "sparse"):
        raise ValueError(f"stage: got {stage!r}, expected 'warmup' or 'sparse'")
    refuse_context_parallel(attn)
    if stage == "sparse" and topk is None:
        raise ValueError("topk: got None, expected the sparse forward's topk_indices for the sparse stage")
    x = x.detach()
    if stage == "sparse" and attn.backend == "cudnn":
        return _sparse_terms_gathered(attn, x, cu_seqlens, topk, forward_aux)
    B, T, _ = x.shape
    scale = attn.config.mla_softmax_scale
    mask = causal_document_mask(T, cu_seqlens, device=x.device)
    with torch.no_grad():
        q, k, c_q = kd.mla_queries_keys(attn, x)
    # the indexer re-run on the detached input (the KL trains the indexer alone), per-document positions as forward
    q_I, k_I, w = attn.indexer.projections(x, c_q, cu_seqlens)
    scores = indexer_scores(q_I, k_I, w)  # [B, T, S]
    if stage == "sparse":
        selected = sparse_mask(topk, T)
        kl_sum, kl = kd.sparse_loss(q, k, scores, mask, selected, scale)
        with torch.no_grad():
            _, recall = kd.warmup_kl_chunked(q, k, scores.detach(), scale, cu_seqlens, topk_indices=topk)
        return {"kl_sum": kl_sum, "kl": kl.detach(), "recall": recall}
    if topk is None:
        topk = topk_indices(scores.detach(), mask, attn.config.index_topk)
    kl, recall = kd.warmup_kl_chunked(q, k, scores, scale, cu_seqlens, topk_indices=topk)
    return {"kl_sum": kl.sum(), "kl": kl.detach(), "recall": recall}


@torch.no_grad()
def model_recall(model: nn.Module, input_ids: torch.Tensor, cu_seqlens=None, dense: bool = False) -> dict[int, float]:
    """Indexer recall per DSA layer: share of the dense head-summed attention mass on the ``index_topk`` keys the
    indexer selects, averaged over queries. ``dense=True`` runs the model dense (the warm-up's view: each layer's
    input comes from dense layers below); otherwise the model runs as configured (sparse). Returns
    ``{layer_idx: recall}`` (empty for a model without DSA layers)."""
    with contextlib.ExitStack() as stack:
        seen = stack.enter_context(capture_dsa_inputs(model))
        if dense:
            stack.enter_context(dense_selection(model))
        model(input_ids, cu_seqlens=cu_seqlens)
    out = {}
    for i, attn in dsa_layers(model).items():
        rec = seen[i]
        topk = None if dense else rec["topk_indices"]
        out[i] = float(layer_terms(attn, rec["x"], rec["cu_seqlens"], "warmup", topk)["recall"].mean())
    return out


@contextlib.contextmanager
def gathered(module: nn.Module) -> Iterator[None]:
    """Within the block, an FSDP2-sharded ``module`` (``fully_shard``) holds its whole parameters (``unshard()``,
    a collective: every rank enters the block in the same order), so code outside its forward can use them (the
    teacher's queries and keys); ``reshard()`` on exit. Any other module: nothing to do."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def _lm_loss(model: nn.Module, batch) -> torch.Tensor:
    """The mean next-token NLL of ``batch``, from the model's chunked loss path (``KimiK3Model.loss``)."""
    return model.loss(batch.input_ids, batch.labels, batch.cu_seqlens) / max(batch.num_targets, 1)


def _unfreeze_indexers(model: nn.Module) -> None:
    """The ``cudnn`` backend freezes its DSA indexers (hard top-k); the distillation's KL trains them, from the
    layer's detached input outside the layer's forward (which still runs the indexer under ``no_grad``)."""
    for attn in dsa_layers(model).values():
        if attn.backend == "cudnn":
            attn.indexer.requires_grad_(True)


class _IndexerStage:
    """What both distillation stages share: a model with DSA layers, and the ``cudnn`` indexers unfrozen."""

    name = ""

    def __init__(self, config: KimiConfig, args: Any = None):
        if not config.dsa_layers:
            raise ValueError(f"--stage {self.name}: the model has no DSA layer (config.dsa_layers is empty)")
        self.config = config

    def prepare(self, model: nn.Module) -> None:
        """Unfreeze the ``cudnn`` backend's indexers (``kimi train`` calls this before choosing the trainable set)."""
        _unfreeze_indexers(model)

    def replicated(self, name: str) -> bool:
        """The DSA indexers stay whole on every rank under FSDP2 (module docstring, parallel layouts)."""
        return ".indexer." in name

    def check_parallel(self, dp: int, cp: int) -> None:
        """Refuse context parallelism (module docstring, parallel layouts)."""
        if cp > 1:
            raise ValueError(
                f"--stage {self.name} with --cp {cp}: the distillation's teacher is each query's attention over every "
                "causal key of its document, which context parallelism splits across ranks (each rank holds its own "
                "shard's keys); run it with --cp 1 (FSDP2 alone shards the weights over the torchrun ranks)"
            )

    def _terms(self, model: nn.Module, seen: dict, stage: str) -> list[dict[str, torch.Tensor]]:
        """Each DSA layer's :func:`layer_terms` from its captured forward, its weights gathered under FSDP2."""
        terms = []
        for i, attn in dsa_layers(model).items():
            s = seen[i]
            with gathered(model.model.layers[i]):
                if stage == "warmup":
                    terms.append(layer_terms(attn, s["x"], s["cu_seqlens"], "warmup"))
                else:
                    terms.append(layer_terms(attn, s["x"], s["cu_seqlens"], "sparse", s["topk_indices"], s["forward"]))
        return terms


class WarmupStage(_IndexerStage):
    """``--stage indexer-warmup``: dense forward, only ``*.indexer.*`` trains, loss = KL over every causal key."""

    name = "indexer-warmup"

    def trainable(self, name: str) -> bool:
        return ".indexer." in name

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        with capture_dsa_inputs(model) as seen, dense_selection(model), torch.no_grad():
            lm = _lm_loss(model, batch)
        terms = self._terms(model, seen, "warmup")
        kl_sum = sum(t["kl_sum"] for t in terms)
        metrics = {
            "kl": float(torch.stack([t["kl"].mean() for t in terms]).mean()),
            "indexer_recall": float(torch.stack([t["recall"].mean() for t in terms]).mean()),
            "lm_loss": float(lm),
        }
        return kl_sum / max(batch.num_targets, 1), metrics


class SparseStage(_IndexerStage):
    """``--stage sparse``: sparse forward; LM loss trains all but the indexers, the KL over S_t trains the indexers."""

    name = "sparse"

    def check_data(self, docs, seq_len: int) -> None:
        """Warn (``UserWarning``) when no query of the run can see more than ``index_topk`` keys: the longest causal
        span is ``min(seq_len, longest document)`` tokens, and when it is ``<= index_topk`` the top-k selects every
        visible key, so the sparse forward is the dense one and the sparse KL equals the warm-up's."""
        longest = min(seq_len, max((len(d) for d in docs), default=0))
        if longest <= self.config.index_topk:
            warnings.warn(
                f"--stage sparse: every query sees at most {longest} keys (min(--seq-len {seq_len}, the longest "
                f"document)) <= index_topk {self.config.index_topk}, so the top-k keeps every key: the model runs "
                "dense and the sparse KL is the dense warm-up's; use a --seq-len above index_topk and longer documents",
                UserWarning,
                stacklevel=2,
            )

    def trainable(self, name: str) -> bool:
        return not name.endswith("e_score_correction_bias")

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        with capture_dsa_inputs(model) as seen:
            lm = _lm_loss(model, batch)
        terms = self._terms(model, seen, "sparse")
        kl_sum = sum(t["kl_sum"] for t in terms)
        metrics = {
            "kl": float(torch.stack([t["kl"].mean() for t in terms]).mean()),
            "indexer_recall": float(torch.stack([t["recall"].mean() for t in terms]).mean()),
            "lm_loss": float(lm.detach()),
        }
        return lm + kl_sum / max(batch.num_targets, 1), metrics
