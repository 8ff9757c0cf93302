"""The distillation stages on a whole tiny model (torch): trainable sets, gradient isolation (case 30), the dense
warm-up's view, and that a few warm-up steps lower the KL and raise the recall."""

from __future__ import annotations

import pytest
import torch

from kernels_torch.model import model_from_params
from kimi.config import load_config
from kimi.init import init_params
from kimi_tools.data import Batch
from kimi_tools.distill import SparseStage, WarmupStage, capture_dsa_inputs, dense_selection, layer_terms, model_recall

T = 96  # > index_topk = 64 of the tiny preset: the selection really restricts


@pytest.fixture(scope="module")
def setup():
    cfg = load_config("tiny")
    params = init_params(cfg, seed=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, T + 1), generator=g)
    labels = ids[:, 1:].clone()
    labels[0, 79] = -100  # a document's last token has no target
    batch = Batch(ids[:, :-1], labels, torch.tensor([0, 80, T]))
    return cfg, params, batch


def fresh(cfg, params, backend="eager"):
    return model_from_params(cfg, params, backend)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_warmup_trains_only_indexers_and_lowers_kl(setup):
    cfg, params, batch = setup
    m = fresh(cfg, params)
    st = WarmupStage(cfg)
    for n, p in m.named_parameters():
        p.requires_grad_(st.trainable(n))
    assert {n for n, p in m.named_parameters() if p.requires_grad} == {n for n in params if ".indexer." in n}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
    history = []
    for _ in range(4):
        loss, metrics = st.loss(m, batch)
        assert set(metrics) == {"kl", "indexer_recall", "lm_loss"}
        loss.backward()
        assert all(".indexer." in n for n in grads(m))
        opt.step()
        opt.zero_grad()
        history.append(metrics)
    assert history[-1]["kl"] < 0.8 * history[0]["kl"]
    assert history[-1]["indexer_recall"] > history[0]["indexer_recall"]
    assert history[0]["lm_loss"] == pytest.approx(history[-1]["lm_loss"], rel=1e-6)  # the model itself is frozen


def test_sparse_stage_isolates_gradients(setup):
    """LM loss -> every parameter but the indexers; KL -> the indexers only; their sum = the stage's loss."""
    cfg, params, batch = setup
    m = fresh(cfg, params)
    st = SparseStage(cfg)
    loss, metrics = st.loss(m, batch)
    loss.backward()
    both = grads(m)
    assert any(".indexer." in n for n in both) and any(".indexer." not in n for n in both)

    m.zero_grad(set_to_none=True)
    with capture_dsa_inputs(m) as seen:  # the stage's LM term: the model's chunked loss (= F.cross_entropy of the
        # logits to fp32 rounding, tests/test_linear_cross_entropy.py; that rounding, ~4e-6 on dt_bias, is above rtol)
        lm = m.loss(batch.input_ids, batch.labels, batch.cu_seqlens) / batch.num_targets
    lm.backward()
    lm_grads = grads(m)
    assert not any(".indexer." in n for n in lm_grads)  # hard top-k: no LM gradient into the indexer
    m.zero_grad(set_to_none=True)
    dsa = {i: layer.self_attn for i, layer in enumerate(m.model.layers) if i in cfg.dsa_layers}
    kl = sum(
        layer_terms(a, seen[i]["x"], seen[i]["cu_seqlens"], "sparse", seen[i]["topk_indices"])["kl_sum"]
        for i, a in dsa.items()
    )
    (kl / batch.num_targets).backward()
    kl_grads = grads(m)
    assert kl_grads and all(".indexer." in n for n in kl_grads)  # detached input: the KL reaches only the indexer
    for n, g in both.items():
        ref = kl_grads[n] if ".indexer." in n else lm_grads[n]
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7, msg=n)
    assert metrics["lm_loss"] == pytest.approx(float(lm.detach()), rel=1e-5)


def test_dense_selection_equals_large_topk_and_restores(setup):
    cfg, params, batch = setup
    m = fresh(cfg, params)
    dense_model = fresh(cfg.replace(index_topk=T), params)
    with torch.no_grad(), dense_selection(m):
        a = m(batch.input_ids)
    with torch.no_grad():
        b = dense_model(batch.input_ids)
        c = m(batch.input_ids)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(a, c, atol=1e-4)  # T > index_topk: sparse differs from dense, and the topk is restored
    rec = model_recall(m, batch.input_ids)
    assert set(rec) == set(cfg.dsa_layers) and all(0.3 < r < 1.0 for r in rec.values())


def test_stage_errors(setup):
    cfg, params, batch = setup
    with pytest.raises(ValueError, match="no DSA layer"):
        WarmupStage(cfg.replace(dsa_layers=()))
    with pytest.raises(ValueError, match="stage"):
        layer_terms(fresh(cfg, params).model.layers[3].self_attn, torch.randn(1, 4, cfg.hidden_size), None, "x")


@pytest.mark.parametrize("stage", ["indexer-warmup", "sparse"])
def test_kimi_train_stage_writes_kl_and_recall(tmp_path, stage):
    """``kimi train --stage indexer-warmup | sparse``: the registry resolves the stage, metrics.jsonl gains the keys."""
    import json

    from kimi_tools.cli import main

    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 12)
    out = tmp_path / "run"
    argv = ["train", "--preset", "tiny", "--layers", "4", "--data", str(text), "--out", str(out), "--steps", "2"]
    argv += ["--seq-len", "80", "--eval-tokens", "80", "--warmup-steps", "0", "--stage", stage, "--quiet"]
    assert main(argv) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [0, 1, 2]
    for r in recs[1:]:
        assert r["kl"] >= 0 and 0 < r["indexer_recall"] <= 1 and r["lm_loss"] > 0
    assert "eval_kl" in recs[0] and "eval_indexer_recall" in recs[0]


def test_sparse_stage_warns_when_it_would_run_dense(setup):
    """Every query sees at most min(seq_len, longest document) keys; at or below index_topk (64 in tiny) the top-k
    keeps them all, so the sparse stage is the dense one: a UserWarning says so. Above it, no warning."""
    import warnings

    import numpy as np

    cfg, _, _ = setup
    st = SparseStage(cfg)
    with pytest.warns(UserWarning, match=r"every query sees at most 64 keys .* <= index_topk 64"):
        st.check_data([np.zeros(500, np.int64)], seq_len=64)
    with pytest.warns(UserWarning, match="at most 40 keys"):
        st.check_data([np.zeros(40, np.int64)] * 3, seq_len=256)  # short documents
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.check_data([np.zeros(40, np.int64), np.zeros(65, np.int64)], seq_len=96)


def test_stages_refuse_context_parallelism_and_keep_indexers_whole(setup):
    """Both stages: --cp > 1 refused with the reason (the teacher needs every causal key; CP splits them), --cp 1
    accepted at any dp; the indexer parameters, and only they, stay whole under FSDP2."""
    cfg, params, _ = setup
    for st in (WarmupStage(cfg), SparseStage(cfg)):
        with pytest.raises(ValueError, match=rf"--stage {st.name} with --cp 2: the distillation's teacher"):
            st.check_parallel(1, 2)
        st.check_parallel(4, 1)
        assert {n for n in params if st.replicated(n)} == {n for n in params if ".indexer." in n}


def _cp_worker(rank: int, world: int) -> None:
    from kernels_torch.parallel.context import ContextParallel, attached_context_parallel

    cfg = load_config("tiny")
    params = init_params(cfg, seed=0)
    ids = torch.randint(0, 256, (1, T + 1), generator=torch.Generator().manual_seed(0))
    batch = Batch(ids[:, :-1], ids[:, 1:].clone(), torch.tensor([0, 80, T]))
    model = fresh(cfg, params)
    cp = ContextParallel(model)
    assert attached_context_parallel(model) is cp
    local_ids, local_cu = cp.shard(batch.input_ids, batch.cu_seqlens)
    part = Batch(local_ids, cp.shard_like(batch.labels), local_cu)
    message = rf"model: runs under ContextParallel \({world} ranks\), but the indexer distillation"
    for st in (WarmupStage(cfg), SparseStage(cfg)):
        with pytest.raises(ValueError, match=message):
            st.loss(model, part)
    with pytest.raises(ValueError, match=message):
        model_recall(model, local_ids, local_cu)
    from kimi_tools.distill import dsa_layers

    attn = next(iter(dsa_layers(model).values()))
    x = torch.randn(1, local_ids.shape[1], cfg.hidden_size)
    with pytest.raises(ValueError, match=message):
        layer_terms(attn, x, local_cu, "warmup")
    cp.remove()  # the whole row again: the stage runs
    assert attached_context_parallel(model) is None
    loss, _ = WarmupStage(cfg).loss(model, batch)
    assert torch.isfinite(loss)


@pytest.mark.distributed
def test_stages_called_from_the_library_refuse_a_model_under_context_parallel():
    """What ``kimi train --cp 2`` refuses up front, the library refuses too: the stages' loss, ``model_recall`` and
    ``layer_terms`` on a model (or layer) under ``ContextParallel`` raise one error naming it (today's alternative:
    a KL over each rank's shard, wrong without an error); after ``ContextParallel.remove()`` the stage runs."""
    from dist_helpers import run_workers

    run_workers(_cp_worker, 2)
