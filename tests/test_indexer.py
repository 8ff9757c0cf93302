"""DSA lightning indexer, JAX reference (spec 4.2, 4.3, 9; cases 8-11).

Every comparison is a relative error against a named tolerance, on fresh seeded random inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel
from layer_weights import mla_params

from kimi.config import load_config
from kimi.layout import param_layout
from reference_jax.common import causal_document_mask
from reference_jax.indexer import Indexer, indexer_scores, sparse_mask, topk_indices
from reference_jax.params import to_tree as params_to_tree

TOL_SCORES_FP64 = 1e-12  # scores vs the numpy fp64 formula
TOL_SCORES_FP32 = 1e-5
TOL_PACKED_FP64 = 1e-12  # packed vs separate documents

LAYER = 3  # a DSA layer of the tiny preset


def canonical_topk_np(scores: np.ndarray, mask: np.ndarray, k: int) -> np.ndarray:
    """Independent numpy oracle of spec 9: visible keys by (score desc, index desc), then -1. scores/mask [T, S]."""
    T, S = scores.shape
    k = min(k, S)
    out = np.full((T, k), -1, np.int64)
    idx = np.arange(S)
    for t in range(T):
        vis = idx[mask[t]]
        order = vis[np.lexsort((-vis, -scores[t, vis]))][:k]  # last key = primary: score desc, then index desc
        out[t, : len(order)] = order
    return out


def scores_np(q, k, w) -> np.ndarray:
    """sum_j w[t,j] * HI^-1/2 * ReLU(KI^-1/2 q[t,j].k[s]) in numpy fp64."""
    q, k, w = (np.asarray(a, np.float64) for a in (q, k, w))
    HI, KI = q.shape[-2:]
    dots = np.einsum("btjk,bsk->btjs", q, k) / np.sqrt(KI)
    return np.einsum("btj,btjs->bts", w / np.sqrt(HI), np.maximum(dots, 0.0))


def to_tree(flat: dict, dtype) -> dict:
    return {"params": params_to_tree(flat, dtype)}


def indexer_np(p: dict, x, c_q, cfg) -> np.ndarray:
    """The Indexer's scores from its weights, in numpy fp64 (spec 4.1/4.2)."""
    x, c_q = np.asarray(x, np.float64), np.asarray(c_q, np.float64)
    B, T, _ = x.shape
    HI, KI = cfg.index_n_heads, cfg.index_head_dim
    q = (c_q @ p["wq_b.weight"].T).reshape(B, T, HI, KI)
    k = x @ p["wk.weight"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + cfg.rms_norm_eps)
    k = k * p["k_norm.weight"] + p["k_norm.bias"]
    w = x @ p["weights_proj.weight"].T
    return scores_np(q, k, w)


# ------------------------------------------------------------------------------------------------ scores


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_scores_formula(dtype):
    rng = np.random.default_rng(0)
    B, T, S, HI, KI = 2, 7, 9, 3, 5
    q, k, w = rng.standard_normal((B, T, HI, KI)), rng.standard_normal((B, S, KI)), rng.standard_normal((B, T, HI))
    want = scores_np(q, k, w)
    if dtype == "fp64":
        with jax.enable_x64(True):
            got = indexer_scores(*(jnp.asarray(a, jnp.float64) for a in (q, k, w)))
            assert got.dtype == jnp.float64
            assert rel(got, want) <= TOL_SCORES_FP64
    else:
        got = indexer_scores(*(jnp.asarray(a, jnp.float32) for a in (q, k, w)))
        assert got.dtype == jnp.float32 and got.shape == (B, T, S)
        assert rel(got, want) <= TOL_SCORES_FP32


def test_scores_bf16_inputs_accumulate_in_fp32():
    rng = np.random.default_rng(1)
    q, k, w = rng.standard_normal((1, 4, 2, 8)), rng.standard_normal((1, 6, 8)), rng.standard_normal((1, 4, 2))
    qb, kb = jnp.asarray(q, jnp.bfloat16), jnp.asarray(k, jnp.bfloat16)
    got = indexer_scores(qb, kb, jnp.asarray(w, jnp.float32))
    assert got.dtype == jnp.float32
    want = scores_np(np.asarray(qb.astype(jnp.float32)), np.asarray(kb.astype(jnp.float32)), w)
    assert rel(got, want) <= TOL_SCORES_FP32


def test_scale_constants_case10():
    """HI^-1/2 on the weights and KI^-1/2 inside the ReLU, checked on a hand-computed value."""
    HI, KI = 4, 16
    q = np.zeros((1, 1, HI, KI))
    q[0, 0, :, 0] = [1.0, 2.0, 3.0, -4.0]  # the last head has q.k < 0: ReLU drops it
    k = np.zeros((1, 1, KI))
    k[0, 0, 0] = 2.0
    w = np.ones((1, 1, HI))
    # sum_j 4^-1/2 * ReLU(16^-1/2 * 2 * q_j) = 0.5 * 0.25 * 2 * (1 + 2 + 3) = 1.5
    got = float(
        indexer_scores(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(w, jnp.float32))[0, 0, 0]
    )
    assert got == 1.5
    # The 128^-1/2 and 32^-1/2 of K3.1 follow from the config, not from literals.
    cfg = load_config("k3.1-pro")
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.indexer_rope) == (32, 128, 2048, "none")


# ------------------------------------------------------------------------------------------------ selection


def test_tie_rule_hand_example():
    scores = jnp.asarray([[[0.0, 0.0, 1.0, 0.0, 0.5]]])
    mask = jnp.ones((1, 5), bool)
    assert topk_indices(scores, mask, 4).tolist() == [[[2, 4, 3, 1]]]  # equal zeros: larger key index first
    mask = jnp.asarray([[True, True, True, False, True]])
    assert topk_indices(scores, mask, 5).tolist() == [[[2, 4, 1, 0, -1]]]


@pytest.mark.parametrize("T", [2049, 4096], ids=lambda t: f"T{t}")
def test_masked_before_topk_case8(T):
    """Future keys get the highest raw scores: selection must still be causal (k = 2048)."""
    rng = np.random.default_rng(T)
    k = 2048
    scores = np.arange(T, dtype=np.float32)[None, None, :] + rng.random((1, T, T), np.float32)  # rising with s
    mask = causal_document_mask(T)
    idx = np.asarray(topk_indices(jnp.asarray(scores), mask, k))[0]
    assert idx.shape == (T, k) and idx.dtype == np.int32
    t = np.arange(T)[:, None]
    valid = idx >= 0
    assert np.all(idx[valid] <= np.broadcast_to(t, idx.shape)[valid])  # causal
    assert np.array_equal(valid.sum(1), np.minimum(k, np.arange(T) + 1))  # min(k, visible) keys
    assert np.all(valid[:, :-1] >= valid[:, 1:])  # -1 only as a suffix
    rows = [0, 1, 1000, 2047, 2048, T - 1]
    want = canonical_topk_np(scores[0][rows], np.asarray(mask)[rows], k)
    assert np.array_equal(idx[rows], want)


def test_real_scores_long_rows():
    """T = 2049 with k = 2048 through indexer_scores (small HI/KI): causal, full counts, canonical order."""
    rng = np.random.default_rng(5)
    T, HI, KI, k = 2049, 2, 4, 2048
    q, kk, w = rng.standard_normal((1, T, HI, KI)), rng.standard_normal((1, T, KI)), rng.standard_normal((1, T, HI))
    scores = indexer_scores(*(jnp.asarray(a, jnp.float32) for a in (q, kk, w)))
    mask = causal_document_mask(T)
    idx = np.asarray(topk_indices(scores, mask, k))[0]
    assert np.array_equal((idx >= 0).sum(1), np.minimum(k, np.arange(T) + 1))
    assert np.all(idx <= np.arange(T)[:, None])
    rows = [0, 5, 2047, 2048]
    assert np.array_equal(idx[rows], canonical_topk_np(np.asarray(scores[0])[rows], np.asarray(mask)[rows], k))
    # the last row sees 2049 keys and drops exactly one: the canonical last (lowest score, then smallest index)
    last = np.asarray(scores[0, -1])
    dropped = set(range(T)) - set(idx[-1].tolist())
    assert dropped == {int(canonical_topk_np(last[None], np.ones((1, T), bool), T)[0, -1])}


@pytest.mark.parametrize("T", [1, 63, 64, 65, 200], ids=lambda t: f"T{t}")
def test_fewer_visible_than_k_case9(T):
    rng = np.random.default_rng(T)
    k = 64
    scores = rng.standard_normal((2, T, T)).astype(np.float32)
    mask = causal_document_mask(T)
    idx = np.asarray(topk_indices(jnp.asarray(scores), mask, k))
    assert idx.shape == (2, T, min(k, T))
    for b in range(2):
        for t in range(T):
            row = idx[b, t]
            sel = row[row >= 0]
            if t + 1 <= k:  # every visible key selected, then -1
                assert sorted(sel.tolist()) == list(range(t + 1))
                assert np.all(row[t + 1 :] == -1)
            else:
                assert len(set(sel.tolist())) == k and sel.max() <= t
        assert np.array_equal(idx[b], canonical_topk_np(scores[b], np.asarray(mask), k))


def tie_heavy_inputs(T: int, seed: int, frac_positive: float = 0.1):
    """Indexer q/k/w where ~90% of keys have q.k < 0 for every head, so their score is exactly 0 (ReLU ties)."""
    rng = np.random.default_rng(seed)
    HI, KI = 3, 8
    q = np.abs(rng.standard_normal((1, T, HI, KI)))  # positive queries
    sign = np.where(rng.random(T) < frac_positive, 1.0, -1.0)
    k = sign[None, :, None] * np.abs(rng.standard_normal((1, T, KI)))  # negative keys: every dot < 0
    w = np.abs(rng.standard_normal((1, T, HI))) + 0.1
    return q, k, w


def test_tie_heavy_canonical_order():
    T, k = 200, 64
    q, kk, w = tie_heavy_inputs(T, seed=11)
    scores = indexer_scores(*(jnp.asarray(a, jnp.float32) for a in (q, kk, w)))
    s = np.asarray(scores[0])
    assert (s == 0).mean() > 0.5  # really tie-heavy
    mask = causal_document_mask(T)
    idx = np.asarray(topk_indices(scores, mask, k))[0]
    want = canonical_topk_np(s, np.asarray(mask), k)
    assert np.array_equal(idx, want)
    # the opposite tie rule (smaller index first) selects different sets on this input: the test can tell them apart
    lower_first = np.full_like(want, -1)
    for t in range(T):
        vis = np.arange(t + 1)
        order = vis[np.lexsort((vis, -s[t, vis]))][:k]
        lower_first[t, : len(order)] = order
    assert any(set(want[t]) != set(lower_first[t]) for t in range(T))
    # last row: after the positive keys come the zero-score keys, largest index first
    row = idx[-1]
    n_pos = int((s[-1] > 0).sum())
    zeros_part = row[n_pos:]
    assert (
        np.all(s[-1, zeros_part] == 0)
        and np.all(np.diff(zeros_part) < 0)
        and zeros_part[0] == T - 1 - np.argmax(s[-1, ::-1] == 0)
    )


def test_sparse_mask():
    rng = np.random.default_rng(3)
    B, T, S, k = 2, 5, 11, 4
    idx = np.stack([np.stack([rng.permutation(S)[:k] for _ in range(T)]) for _ in range(B)]).astype(np.int32)
    idx[0, 1, 2:] = -1
    idx[1, 4, :] = -1
    got = np.asarray(sparse_mask(jnp.asarray(idx), S))
    want = np.zeros((B, T, S), bool)
    for b in range(B):
        for t in range(T):
            for s in idx[b, t]:
                if s >= 0:
                    want[b, t, s] = True
    assert got.shape == (B, T, S) and np.array_equal(got, want)


# ------------------------------------------------------------------------------------------------ module


def test_indexer_param_names_match_layout():
    cfg = load_config("tiny")
    x = jnp.ones((1, 3, cfg.hidden_size))
    c_q = jnp.ones((1, 3, cfg.q_lora_rank))
    params = jax.eval_shape(Indexer(cfg).init, jax.random.PRNGKey(0), x, c_q)["params"]  # shapes only
    got = {"/".join(str(k.key) for k in path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    pre = f"model.layers.{LAYER}.self_attn.indexer."
    want = {s.name[len(pre) :].replace(".", "/"): s.shape for s in param_layout(cfg, [LAYER]) if s.name.startswith(pre)}
    assert got == want


@pytest.mark.parametrize("T", [1, 65, 200], ids=lambda t: f"T{t}")
def test_indexer_module_matches_formula_fp64(T):
    cfg = load_config("tiny")
    rng = np.random.default_rng(T)
    p = mla_params(cfg, LAYER, rng, prefix="self_attn.indexer.")
    x, c_q = rng.standard_normal((1, T, cfg.hidden_size)), rng.standard_normal((1, T, cfg.q_lora_rank))
    with jax.enable_x64(True):
        idx, scores = Indexer(cfg).apply(to_tree(p, jnp.float64), jnp.asarray(x), jnp.asarray(c_q))
        assert scores.dtype == jnp.float64
    want = indexer_np(p, x, c_q, cfg)
    assert rel(scores, want) <= TOL_SCORES_FP64
    assert np.array_equal(
        np.asarray(idx)[0], canonical_topk_np(want[0], np.tril(np.ones((T, T), bool)), cfg.index_topk)
    )


def test_indexer_module_bf16_input_gives_fp32_scores():
    cfg = load_config("tiny")
    rng = np.random.default_rng(2)
    p = mla_params(cfg, LAYER, rng, prefix="self_attn.indexer.")
    x = jnp.asarray(rng.standard_normal((1, 9, cfg.hidden_size)), jnp.bfloat16)
    c_q = jnp.asarray(rng.standard_normal((1, 9, cfg.q_lora_rank)), jnp.bfloat16)
    idx, scores = Indexer(cfg).apply(to_tree(p, jnp.float32), x, c_q)
    assert scores.dtype == jnp.float32 and idx.dtype == jnp.int32
    assert bool(jnp.all(jnp.isfinite(scores)))


def test_indexer_packed_equals_separate():
    """Packed documents: no selected key crosses a boundary, and each document's result equals its own run."""
    cfg = load_config("tiny")
    rng = np.random.default_rng(7)
    p = mla_params(cfg, LAYER, rng, prefix="self_attn.indexer.")
    cu = np.array([0, 70, 71, 200])
    T = int(cu[-1])
    x, c_q = rng.standard_normal((1, T, cfg.hidden_size)), rng.standard_normal((1, T, cfg.q_lora_rank))
    k = cfg.index_topk
    with jax.enable_x64(True):
        tree = to_tree(p, jnp.float64)
        idx, scores = Indexer(cfg).apply(tree, jnp.asarray(x), jnp.asarray(c_q), cu_seqlens=cu)
        idx, scores = np.asarray(idx)[0], np.asarray(scores)[0]
        doc = np.searchsorted(cu[1:], np.arange(T), side="right")
        valid = idx >= 0
        rows = np.broadcast_to(np.arange(T)[:, None], idx.shape)
        assert np.all(idx[valid] <= rows[valid]) and np.all(doc[idx[valid]] == doc[rows[valid]])
        for a, b in zip(cu[:-1], cu[1:]):
            sidx, sscores = Indexer(cfg).apply(tree, jnp.asarray(x[:, a:b]), jnp.asarray(c_q[:, a:b]))
            sidx, sscores = np.asarray(sidx)[0], np.asarray(sscores)[0]
            assert rel(scores[a:b, a:b], sscores) <= TOL_PACKED_FP64
            w = sidx.shape[1]
            assert np.array_equal(idx[a:b, :w], np.where(sidx >= 0, sidx + a, -1))
            assert np.all(idx[a:b, w:] == -1)
            assert np.array_equal((idx[a:b] >= 0).sum(1), np.minimum(k, np.arange(b - a) + 1))


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_indexer_rope_is_a_config_choice_case11(rope):
    """The config's indexer_rope switches the rotation (tests/test_indexer_rope.py checks its values); an odd
    qk_rope_head_dim cannot be rotated and is refused."""
    cfg = load_config("tiny")
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 5, cfg.hidden_size)), jnp.float32)
    c_q = jnp.asarray(rng.standard_normal((1, 5, cfg.q_lora_rank)), jnp.float32)
    tree = jax.jit(Indexer(cfg).init)(jax.random.PRNGKey(0), x, c_q)
    s_none = np.asarray(jax.jit(Indexer(cfg).apply)(tree, x, c_q)[1])
    s_rope = np.asarray(jax.jit(Indexer(cfg.replace(indexer_rope=rope)).apply)(tree, x, c_q)[1])
    assert rel(s_rope, s_none) > 1e-3  # rotated q_I, k_I: other scores
    with pytest.raises(ValueError, match="rope_dim"):
        jax.eval_shape(Indexer(cfg.replace(indexer_rope=rope, qk_rope_head_dim=7)).apply, tree, x, c_q)


def test_topk_rejects_bad_arguments():
    scores = jnp.zeros((1, 3, 3))
    with pytest.raises(ValueError, match="topk"):
        topk_indices(scores, jnp.ones((3, 3), bool), 0)
    with pytest.raises(ValueError, match="mask"):
        topk_indices(scores, jnp.ones((4, 3), bool), 2)
