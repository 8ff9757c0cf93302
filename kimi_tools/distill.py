"""Indexer distillation stages for ``kimi train`` and indexer-recall measurement on whole models (torch path).

The two stages of DeepSeek-V3.2 (spec 4.4; the math is in ``reference_jax.distill`` / ``kernels_torch.distill``):

* ``--stage indexer-warmup`` (:class:`WarmupStage`): the model runs **dense** (every visible key selected) with every
  parameter frozen except the DSA indexers (``*.indexer.*``); the loss is ``sum_t KL(p_t || softmax(I_t))`` over all
  causal keys, summed over the DSA layers. The forward runs under ``torch.no_grad`` (nothing upstream trains); each
  DSA layer's indexer is re-run from its captured, detached input with gradients. The KL uses the chunked form
  (:func:`kernels_torch.distill.warmup_kl_chunked`), so no ``[T, S, H]`` tensor is formed.
* ``--stage sparse`` (:class:`SparseStage`): the model runs sparse (top-``index_topk``); the LM loss trains every
  parameter except the indexers (hard top-k gives them no gradient anyway) and the router's
  ``e_score_correction_bias``; the KL over the selected set, from the indexer re-run on the **detached** layer input,
  trains the indexers only (case 30). The loss returned is ``lm + kl`` (disjoint parameter sets, so each part moves
  only its own).

Reduction: DeepSeek sums the KL over query tokens. ``kimi train`` weights micro-batches by their target count and
expects a per-target mean, so the stage returns ``sum_layers sum_t KL / num_targets``: the same direction as
DeepSeek's sum (AdamW is invariant to the constant). Metrics appended to each ``metrics.jsonl`` record: ``kl`` (mean
KL per query and DSA layer), ``indexer_recall`` (share of the dense head-summed attention mass on the selected
``index_topk`` keys, averaged over queries and DSA layers), ``lm_loss`` (the LM cross-entropy of the same forward).

The layer inputs are captured with forward hooks on the DSA ``GatedMLA`` modules (:func:`capture_dsa_inputs`); the
model's code is not changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kernels_torch import distill as kd
from kernels_torch.common import causal_document_mask
from kernels_torch.indexer import indexer_scores, sparse_mask, topk_indices
from kimi.config import KimiConfig

__all__ = [
    "dsa_layers",
    "capture_dsa_inputs",
    "dense_selection",
    "layer_terms",
    "model_recall",
    "WarmupStage",
    "SparseStage",
    "IGNORE_INDEX",
    "DENSE_TOPK",
]

IGNORE_INDEX = -100  # labels without a target (kimi_tools.data's convention)
DENSE_TOPK = 2**31 - 1  # an index_topk that selects every visible key: the DSA layer equals dense MLA (spec 9)


def dsa_layers(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer_idx: GatedMLA}`` of a torch ``KimiK3Model``'s DSA layers."""
    layers = model.model.layers
    return {i: layer.self_attn for i, layer in enumerate(layers) if getattr(layer.self_attn, "kind", None) == "dsa"}


@contextlib.contextmanager
def capture_dsa_inputs(model: nn.Module) -> Iterator[dict[int, dict[str, Any]]]:
    """Within the block, every forward of ``model`` (a ``kernels_torch.model.KimiK3Model``) records, per DSA layer
    index, ``{"x": the layer's normalised input [B, T, D], "cu_seqlens": ..., "topk_indices": [B, T, k] or None}``
    (the last forward wins). Forward hooks only; removed on exit."""
    seen: dict[int, dict[str, Any]] = {}
    handles = []
    for i, attn in dsa_layers(model).items():

        def hook(module, args, kwargs, output, i=i):
            x = args[0] if args else kwargs["x"]
            aux = output[1] if isinstance(output, tuple) else {}
            seen[i] = {"x": x, "cu_seqlens": kwargs.get("cu_seqlens"), "topk_indices": aux.get("topk_indices")}

        handles.append(attn.register_forward_hook(hook, with_kwargs=True))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def dense_selection(model: nn.Module) -> Iterator[None]:
    """Within the block, every DSA indexer of ``model`` selects every visible key (``index_topk`` = :data:`DENSE_TOPK`),
    so the DSA layers compute dense causal MLA (spec 9). The eager/sdpa backends only."""
    saved = []
    for attn in dsa_layers(model).values():
        if attn.backend == "cudnn":
            raise ValueError("backend: got 'cudnn'; the dense warm-up needs dense attention: use 'eager' or 'sdpa'")
        saved.append((attn.indexer, attn.indexer.config))
        attn.indexer.config = attn.indexer.config.replace(index_topk=DENSE_TOPK)
    try:
        yield
    finally:
        for indexer, cfg in saved:
            indexer.config = cfg


def layer_terms(
    attn: nn.Module, x: torch.Tensor, cu_seqlens, stage: str, topk: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """The distillation terms of one DSA layer from its captured input.

    Args:
        attn: a DSA ``kernels_torch.mla.GatedMLA``. x: its normalised input ``[B, T, D]`` (detached here).
        cu_seqlens: ``[N+1]`` or None. stage: "warmup" (KL over every visible key) or "sparse" (over ``topk``).
        topk: ``[B, T, k]`` the selection the sparse forward used (needed for "sparse"); for "warmup", None means
            the selection the indexer would make now (``config.index_topk``), used for the recall only.

    Returns:
        ``{"kl_sum": scalar (gradient to the indexer only), "kl": [B, T] per query (detached), "recall": [B, T]}``.

    Raises:
        ValueError: an unknown ``stage``, or "sparse" without ``topk``.
    """
    if stage not in ("warmup", "sparse"):
        raise ValueError(f"stage: got {stage!r}, expected 'warmup' or 'sparse'")
    x = x.detach()
    B, T, _ = x.shape
    scale = attn.config.mla_softmax_scale
    mask = causal_document_mask(T, cu_seqlens, device=x.device)
    with torch.no_grad():
        q, k, c_q = kd.mla_queries_keys(attn, x)
    q_I, k_I, w = attn.indexer.projections(x, c_q)  # the indexer re-run on the detached input (case 30)
    scores = indexer_scores(q_I, k_I, w)  # [B, T, S]
    if stage == "sparse":
        if topk is None:
            raise ValueError("topk: got None, expected the sparse forward's topk_indices for the sparse stage")
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


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor, num_targets: int) -> torch.Tensor:
    total = F.cross_entropy(logits[0].float(), labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
    return total / max(num_targets, 1)


class WarmupStage:
    """``--stage indexer-warmup``: dense forward, only ``*.indexer.*`` trains, loss = KL over every causal key."""

    def __init__(self, config: KimiConfig, args: Any = None):
        if not config.dsa_layers:
            raise ValueError("--stage indexer-warmup: the model has no DSA layer (config.dsa_layers is empty)")
        self.config = config

    def trainable(self, name: str) -> bool:
        return ".indexer." in name

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        with capture_dsa_inputs(model) as seen, dense_selection(model), torch.no_grad():
            logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens)
            lm = _lm_loss(logits, batch.labels, batch.num_targets)
        terms = [layer_terms(a, seen[i]["x"], seen[i]["cu_seqlens"], "warmup") for i, a in dsa_layers(model).items()]
        kl_sum = sum(t["kl_sum"] for t in terms)
        metrics = {
            "kl": float(torch.stack([t["kl"].mean() for t in terms]).mean()),
            "indexer_recall": float(torch.stack([t["recall"].mean() for t in terms]).mean()),
            "lm_loss": float(lm),
        }
        return kl_sum / max(batch.num_targets, 1), metrics


class SparseStage:
    """``--stage sparse``: sparse forward; LM loss trains all but the indexers, the KL over S_t trains the indexers."""

    def __init__(self, config: KimiConfig, args: Any = None):
        if not config.dsa_layers:
            raise ValueError("--stage sparse: the model has no DSA layer (config.dsa_layers is empty)")
        self.config = config

    def trainable(self, name: str) -> bool:
        return not name.endswith("e_score_correction_bias")

    def loss(self, model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, float]]:
        if any(a.backend == "cudnn" for a in dsa_layers(model).values()):
            raise ValueError(
                "backend: got 'cudnn', whose DSA layers freeze the indexer; the sparse stage needs 'eager' or 'sdpa'"
            )
        with capture_dsa_inputs(model) as seen:
            logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens)
        lm = _lm_loss(logits, batch.labels, batch.num_targets)
        terms = [
            layer_terms(a, seen[i]["x"], seen[i]["cu_seqlens"], "sparse", seen[i]["topk_indices"])
            for i, a in dsa_layers(model).items()
        ]
        kl_sum = sum(t["kl_sum"] for t in terms)
        metrics = {
            "kl": float(torch.stack([t["kl"].mean() for t in terms]).mean()),
            "indexer_recall": float(torch.stack([t["recall"].mean() for t in terms]).mean()),
            "lm_loss": float(lm.detach()),
        }
        return lm + kl_sum / max(batch.num_targets, 1), metrics
