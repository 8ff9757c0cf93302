"""CPU checks of the indexer distillation stages on the ``cudnn`` backend's own code (issue 11): the DSA layers run
``kernels_torch.dsa_cudnn.gated_mla_forward`` with its two GPU kernels replaced by torch stand-ins (the indexer by
fp64 scores + the canonical top-k, the sparse attention by ``_sparse_mla_torch``, which also hands out the forward's
lse), in fp64, against the same stages on the eager backend: the stage loss, the KL and recall metrics, and every
gradient (indexers included). The sparse stage there takes the KL from the gathered selected rows and the sparse
forward's lse (``sparse_kl_aux``); the warm-up runs the dense DSA layers through causal SDPA. The kernels themselves:
``tests/gpu/test_gpu_distill.py``."""

from __future__ import annotations

import pytest
import torch
from helpers import rel

import kernels_torch.dsa_cudnn as dc
import kernels_torch.indexer as ti
import kernels_torch.mla as tm
from kernels_torch import distill as kd
from kernels_torch.common import causal_document_mask
from kernels_torch.model import model_from_params
from kimi.config import load_config
from kimi.init import init_params
from kimi_tools.data import Batch
from kimi_tools.distill import (
    SparseStage,
    WarmupStage,
    capture_dsa_inputs,
    dense_selection,
    dsa_layers,
    layer_terms,
)

T = 96  # > index_topk = 64 of the tiny preset: the selection really restricts
DSA = 3  # a DSA layer of the tiny preset
TOL_LOSS = 1e-10  # fp64: cudnn layer code (gathered KL, sparse lse) vs the eager stage (dense twins)
TOL_GRAD = 1e-9  # every parameter gradient, same comparison
TOL_RECALL = 1e-10  # sparse_recall (lse_S - lse_dense) vs the dense target's mass on the selected keys


def _indexer_topk_torch(q_I, k_I, weights, topk, cu_seqlens=None, chunk_rows=None, **_):
    """Torch stand-in for :func:`dc.indexer_topk_cudnn`: the eager scores and canonical top-k, -1 padded."""
    n = q_I.shape[0]
    mask = causal_document_mask(n, None if cu_seqlens is None else torch.as_tensor(cu_seqlens))
    idx = ti.topk_indices(ti.indexer_scores(q_I[None], k_I[None], weights[None]), mask, topk)[0]
    idx = torch.nn.functional.pad(idx, (0, topk - idx.shape[1]), value=-1)
    return idx.int(), mask.sum(-1).clamp(max=topk).int()


@pytest.fixture
def cudnn_code(monkeypatch):
    """Run the cudnn layer code on the CPU: no CUDA check, the top-k kernel replaced by its torch stand-in."""
    monkeypatch.setattr(dc, "require_cudnn", lambda x, what="x": None)
    monkeypatch.setattr(dc, "indexer_topk_cudnn", _indexer_topk_torch)


def _models():
    """(eager, cudnn-coded) tiny models in fp64 with the same weights; the cudnn one has its DSA layers switched to the
    cudnn backend (its indexers frozen, as ``GatedMLA`` does), the other layers eager."""
    cfg = load_config("tiny")
    params = init_params(cfg, seed=0)
    out = []
    for backend in ("eager", "cudnn"):
        m = model_from_params(cfg, params, backend="eager", dtype=torch.float64)
        if backend == "cudnn":
            for attn in dsa_layers(m).values():
                attn.backend = "cudnn"
                attn.indexer.requires_grad_(False)
        out.append(m)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, 79] = -100
    return cfg, out[0], out[1], Batch(ids[:, :-1], labels, torch.tensor([0, 80, T]))


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stage_cls", [SparseStage, WarmupStage], ids=["sparse", "warmup"])
def test_cudnn_stage_matches_eager_stage(cudnn_code, stage_cls):
    cfg, eager, fast, batch = _models()
    stage = stage_cls(cfg)
    assert not any(p.requires_grad for a in dsa_layers(fast).values() for p in a.indexer.parameters())
    for m in (eager, fast):
        stage.prepare(m)  # unfreezes the cudnn indexers; the eager ones were never frozen
        for n, p in m.named_parameters():
            p.requires_grad_(p.requires_grad and stage.trainable(n))
    assert all(p.requires_grad for a in dsa_layers(fast).values() for p in a.indexer.parameters())
    loss_e, met_e = stage.loss(eager, batch)
    loss_f, met_f = stage.loss(fast, batch)
    loss_e.backward()
    loss_f.backward()
    assert all(not a.sparse_kl_aux for a in dsa_layers(fast).values())  # the capture block restored the flag
    lf, le = float(loss_f.detach()), float(loss_e.detach())
    assert abs(lf - le) <= TOL_LOSS * abs(le), (lf, le)
    for key in ("kl", "indexer_recall", "lm_loss"):
        assert met_f[key] == pytest.approx(met_e[key], rel=TOL_LOSS, abs=1e-14), (key, met_f[key], met_e[key])
    ge, gf = _grads(eager), _grads(fast)
    assert set(ge) == set(gf) and any(".indexer." in n for n in gf)
    bad = {n: rel(gf[n], ge[n]) for n in ge if not rel(gf[n], ge[n]) <= TOL_GRAD}
    assert not bad, bad


@pytest.mark.parametrize("B,cu", [(2, None), (1, [0, 15, 70, 130])], ids=["B2", "packed"])
def test_cudnn_layer_hands_the_sparse_forward_to_layer_terms(cudnn_code, B, cu):
    """One DSA layer: the aux of ``sparse_kl_aux`` (packed rows, global ids, the forward's lse) gives the eager
    sparse stage's KL per query, indexer gradients and recall; B > 1 runs as packed documents."""
    cfg = load_config("tiny")
    torch.manual_seed(5 + B)
    eager = tm.GatedMLA(cfg, DSA, backend="eager").double()
    with torch.no_grad():  # fresh random weights (the default init leaves some norms at exactly 1)
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5 + (1.0 if p.ndim == 1 else 0.0))
    fast = tm.GatedMLA(cfg, DSA, backend="cudnn").double()
    fast.load_state_dict(eager.state_dict())
    fast.indexer.requires_grad_(True)
    Tn = 130 if cu else 100
    x = torch.randn(B, Tn, cfg.hidden_size, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    fast.sparse_kl_aux = True
    _, aux = fast(x, cu_seqlens=cu_t, return_aux=True)
    H, L, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert aux["lse"].shape == (B * Tn, H) and aux["q_abs"].shape == (B * Tn, H, L + R)
    assert not aux["lse"].requires_grad and not aux["q_abs"].requires_grad
    terms = layer_terms(fast, x, cu_t, "sparse", aux["topk_indices"], aux)
    terms["kl_sum"].backward()
    ref = layer_terms(eager, x, cu_t, "sparse", aux["topk_indices"])
    ref["kl_sum"].backward()
    errs = {"kl": rel(terms["kl"], ref["kl"]), "recall": rel(terms["recall"], ref["recall"])}
    for (n, p), (_, p_e) in zip(fast.indexer.named_parameters(), eager.indexer.named_parameters()):
        errs[n] = rel(p.grad, p_e.grad)
    assert errs["kl"] <= TOL_LOSS and errs["recall"] <= TOL_RECALL, errs
    assert all(v <= TOL_GRAD for v in errs.values()), errs
    with pytest.raises(ValueError, match="missing .*lse"):
        layer_terms(fast, x, cu_t, "sparse", aux["topk_indices"], {k: v for k, v in aux.items() if k != "lse"})


@pytest.mark.parametrize("N,cu,chunk", [(1, None, 1 << 28), (63, None, 1 << 10), (130, [0, 15, 70, 130], 1 << 12)])
def test_sparse_recall_matches_dense_target_mass(N, cu, chunk):
    """``sparse_recall`` = the dense head-summed target's mass on the selected keys, from the sparse lse."""
    g = torch.Generator().manual_seed(N)
    H, D, k = 3, 40, 8
    q = torch.randn(N, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(N, D, generator=g, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    mask = causal_document_mask(N, cu_t)
    idx = ti.topk_indices(torch.randn(1, N, N, generator=g, dtype=torch.float64), mask, k)[0]  # [N, min(k, N)]
    _, lse = dc._sparse_mla_torch(q, kv, idx.int(), (idx >= 0).sum(-1).int(), 0.2, D, return_lse=True)
    got = kd.sparse_recall(q, kv, lse, 0.2, cu_t, chunk_bytes=chunk)
    target = kd.attention_target(q[None], kv[None, :, None].expand(1, N, H, D), mask, 0.2)
    ref = kd.indexer_recall(target, ti.sparse_mask(idx[None], N))[0]
    assert rel(got, ref) <= TOL_RECALL, rel(got, ref)


def test_capture_flag_and_dense_selection_on_cudnn(cudnn_code):
    """``capture_dsa_inputs`` sets and restores ``sparse_kl_aux``; under ``dense_selection`` the cudnn DSA layers run
    dense (no selection in the aux) and equal the eager dense model."""
    _, eager, fast, batch = _models()
    with capture_dsa_inputs(fast) as seen:
        assert all(a.sparse_kl_aux for a in dsa_layers(fast).values())
        with dense_selection(fast), torch.no_grad():
            out = fast(batch.input_ids, cu_seqlens=batch.cu_seqlens)
    assert not any(a.sparse_kl_aux for a in dsa_layers(fast).values())
    assert all(seen[i]["topk_indices"] is None and "lse" not in seen[i]["forward"] for i in dsa_layers(fast))
    with dense_selection(eager), torch.no_grad():
        ref = eager(batch.input_ids, cu_seqlens=batch.cu_seqlens)
    assert rel(out, ref) <= TOL_LOSS
