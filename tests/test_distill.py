"""Indexer KL distillation (spec 4.4; cases 29-30): the JAX reference against an independent numpy oracle, the torch
twins against the reference (values and gradients, fp64), the chunked / gathered forms against the dense ones, and a
dispatch-mode probe that the chunked warm-up never allocates a ``[T, S, H]`` tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel
from layer_weights import mla_params
from torch.utils._python_dispatch import TorchDispatchMode

import kernels_torch.distill as td
import reference_jax.distill as jd
from kernels_torch.indexer import sparse_mask as t_sparse_mask
from kernels_torch.indexer import topk_indices as t_topk
from kernels_torch.mla import GatedMLA as TGatedMLA
from kimi.config import load_config
from reference_jax.common import causal_document_mask
from reference_jax.indexer import Indexer as JIndexer
from reference_jax.indexer import sparse_mask, topk_indices

TOL_ORACLE_FP64 = 1e-12  # JAX reference vs numpy oracle
TOL_TWIN_FP64 = 1e-10  # torch vs JAX, loss and gradients
TOL_CHUNKED_FP64 = 1e-10  # chunked / gathered vs dense torch
TOL_CHUNKED_FP32 = 1e-5
DSA = 3  # a DSA layer of the tiny preset
STAGES = ("warmup", "sparse")


def rand_inputs(B, T, H, K, seed, HI=3, KI=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    scores = 2.0 * rng.standard_normal((B, T, T))
    return q, k, scores


def oracle(q, k, scores, mask, scale):
    """numpy fp64: per-head masked softmax, head sum, L1 norm; KL per row over the mask (loop over rows)."""
    B, T, H, _ = q.shape
    kl = np.zeros((B, T))
    target = np.zeros((B, T, T))
    for b in range(B):
        for t in range(T):
            vis = np.nonzero(mask[b, t])[0]
            if vis.size == 0:
                continue
            p = np.zeros(vis.size)
            for h in range(H):
                lg = scale * k[b, vis, h] @ q[b, t, h]
                e = np.exp(lg - lg.max())
                p += e / e.sum()
            p /= p.sum()
            s = scores[b, t, vis]
            log_q = s - s.max() - np.log(np.exp(s - s.max()).sum())
            kl[b, t] = np.sum(np.where(p > 0, p * (np.log(np.where(p > 0, p, 1)) - log_q), 0))
            target[b, t, vis] = p
    return target, kl


# ------------------------------------------------------------------------------------------ reference vs oracle


@pytest.mark.parametrize("T", [1, 63])
def test_reference_matches_numpy_oracle(T):
    B, H, K, scale = 2, 3, 5, 0.4
    q, k, scores = rand_inputs(B, T, H, K, seed=T)
    mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)).copy()
    mask[1, T // 2] = False  # an empty row: zero loss, zero gradient, no NaN
    target_np, kl_np = oracle(q, k, scores, mask, scale)
    with jax.enable_x64(True):
        args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(scores), jnp.asarray(mask))
        target = jax.jit(lambda q, k, s, m: jd.attention_target(q, k, m, scale))(*args)
        (loss, kl), grad = jax.jit(
            jax.value_and_grad(lambda q, k, s, m: jd.warmup_loss(q, k, s, m, scale), argnums=2, has_aux=True)
        )(*args)
    assert rel(target, target_np) < TOL_ORACLE_FP64
    assert rel(kl, kl_np) < TOL_ORACLE_FP64
    assert abs(float(loss) - kl_np.sum()) <= TOL_ORACLE_FP64 * max(1.0, kl_np.sum())  # summed over queries
    g = np.asarray(grad)
    assert np.all(np.isfinite(g)) and np.all(g[1, T // 2] == 0)
    # d/dI KL(p || softmax(I)) = softmax(I) - p on visible keys, 0 elsewhere
    soft = np.where(mask, np.exp(scores - np.where(mask, scores, -np.inf).max(-1, keepdims=True)), 0)
    soft = soft / np.where(soft.sum(-1, keepdims=True) > 0, soft.sum(-1, keepdims=True), 1)
    assert rel(g, soft - target_np) < TOL_ORACLE_FP64


def test_kl_is_zero_when_student_equals_teacher_and_recall_is_one_when_all_selected():
    B, T, H, K = 1, 40, 2, 4
    q, k, _ = rand_inputs(B, T, H, K, seed=1)
    mask = jnp.tril(jnp.ones((T, T), bool))
    with jax.enable_x64(True):

        @jax.jit
        def run(q, k):
            p = jd.attention_target(q, k, mask, 0.5)
            kl = jd.indexer_kl(p, jnp.log(jnp.where(p > 0, p, 1.0)) + 3.0, mask)  # shift-invariant
            return p, kl, jd.indexer_recall(p, jnp.broadcast_to(mask, (B, T, T)))

        p, kl, rec = run(jnp.asarray(q), jnp.asarray(k))
    np.testing.assert_allclose(np.asarray(p).sum(-1), 1.0, rtol=1e-12)
    assert np.abs(np.asarray(kl)).max() < 1e-12
    np.testing.assert_allclose(np.asarray(rec), 1.0, rtol=1e-12)


def test_sparse_target_is_per_head_softmax_over_selected_set():
    """Case 29: the sparse target is the head-summed attention over S_t itself, not the dense target renormalised."""
    B, T, H, K, topk = 1, 50, 3, 4, 8
    q, k, scores = rand_inputs(B, T, H, K, seed=2)
    with jax.enable_x64(True):
        mask = causal_document_mask(T)

        @jax.jit
        def run(q, k, s):
            sel = sparse_mask(topk_indices(s, mask, topk), T)
            return sel, jd.sparse_loss(q, k, s, mask, sel, 0.5)[1]

        sel, kl = run(jnp.asarray(q), jnp.asarray(k), jnp.asarray(scores))
    _, kl_np = oracle(q, k, scores, np.asarray(sel) & np.asarray(mask)[None], 0.5)
    assert rel(kl, kl_np) < TOL_ORACLE_FP64


def test_teacher_gets_no_gradient_in_both_stages():
    """The attention is the teacher (``stop_gradient``): ``jax.grad`` of either stage's loss with respect to q and k
    is exactly zero, while the gradient to the scores is not (mutation: the target without ``stop_gradient``)."""
    B, T, H, K, topk, scale = 1, 20, 2, 4, 6, 0.5
    q, k, scores = rand_inputs(B, T, H, K, seed=4)
    with jax.enable_x64(True):
        mask = causal_document_mask(T, np.array([0, 7, T]))
        sel = sparse_mask(topk_indices(jnp.asarray(scores), mask, topk), T)
        losses = {
            "warmup": lambda q, k, s: jd.warmup_loss(q, k, s, mask, scale)[0],
            "sparse": lambda q, k, s: jd.sparse_loss(q, k, s, mask, sel, scale)[0],
        }
        for stage, f in losses.items():
            gq, gk, gs = jax.grad(f, argnums=(0, 1, 2))(jnp.asarray(q), jnp.asarray(k), jnp.asarray(scores))
            assert not np.asarray(gq).any() and not np.asarray(gk).any(), stage
            assert np.abs(np.asarray(gs)).max() > 1e-3, stage  # the student does learn


# ------------------------------------------------------------------------------------------ torch twin vs reference


def _tree(p: dict, dtype) -> dict:
    tree: dict = {}
    for name, a in p.items():
        node = tree
        *path, leaf = name.split(".")
        for seg in path:
            node = node.setdefault(seg, {})
        node[leaf] = jnp.asarray(a, dtype)
    return tree


@pytest.mark.parametrize("T", [1, 100])
def test_torch_twin_matches_reference_through_the_layer_fp64(T):
    """Both stages' loss and indexer-parameter gradients from a real DSA layer's weights (K != V in tiny), torch vs
    JAX, fp64. T = 100 > index_topk = 64, so the sparse stage really restricts the set."""
    cfg = load_config("tiny")
    rng = np.random.default_rng(T)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((2, T, cfg.hidden_size))
    scale = cfg.mla_softmax_scale
    idx_names = [n[len("indexer.") :] for n in p if n.startswith("indexer.")]
    layer = TGatedMLA(cfg, DSA).double()
    layer.load_state_dict({n: torch.from_numpy(v) for n, v in p.items()})
    xt = torch.from_numpy(x)
    tq, tk, tc_q = td.mla_queries_keys(layer, xt)
    tmask = torch.ones(T, T, dtype=torch.bool).tril()

    with jax.enable_x64(True):
        tree = _tree(p, jnp.float64)
        xj = jnp.asarray(x)
        q, k, c_q = jax.jit(lambda t, xx: jd.mla_queries_keys(t, xx, cfg))(tree, xj)
        mask = causal_document_mask(T)

        def jloss(ip, stage):
            topk, scores = JIndexer(cfg).apply({"params": ip}, jax.lax.stop_gradient(xj), jax.lax.stop_gradient(c_q))
            if stage == "warmup":
                return jd.warmup_loss(q, k, scores, mask, scale)[0]
            return jd.sparse_loss(q, k, scores, mask, sparse_mask(topk, T), scale)[0]

        jres = {st: jax.jit(jax.value_and_grad(lambda ip, st=st: jloss(ip, st)))(tree["indexer"]) for st in STAGES}
    assert rel(tq, q) < TOL_TWIN_FP64 and rel(tk, k) < TOL_TWIN_FP64

    for stage in STAGES:
        layer.zero_grad(set_to_none=True)
        topk, scores = layer.indexer(xt.detach(), tc_q.detach())
        if stage == "warmup":
            t_loss, _ = td.warmup_loss(tq, tk, scores, tmask, scale)
        else:
            t_loss, _ = td.sparse_loss(tq, tk, scores, tmask, t_sparse_mask(topk, T), scale)
        t_loss.backward(retain_graph=True)
        j_loss, j_grads = jres[stage]
        assert abs(float(t_loss.detach()) - float(j_loss)) <= TOL_TWIN_FP64 * max(1.0, abs(float(j_loss))), stage
        for name in idx_names:
            mod, leaf = name.rsplit(".", 1)
            g_t = layer.indexer.get_parameter(name).grad
            assert g_t is not None, (stage, name)
            assert rel(g_t, j_grads[mod][leaf]) < TOL_TWIN_FP64, (stage, name)
        # gradient isolation (case 30): no other parameter of the layer received a gradient from the KL
        others = [n for n, prm in layer.named_parameters() if not n.startswith("indexer.") and prm.grad is not None]
        assert others == [], stage


# ------------------------------------------------------------------------------------------ chunked vs dense


@pytest.mark.parametrize(
    "T,dtype,chunk_bytes,packed",
    [(1, torch.float64, 64, False), (63, torch.float64, 2000, True), (257, torch.float32, 200_000, False)],
    ids=["T1-fp64", "T63-fp64-packed", "T257-fp32"],
)
def test_warmup_chunked_matches_dense(T, dtype, chunk_bytes, packed):
    B, H, K, scale, topk = 1, 3, 6, 0.3, 16
    q, k, scores = (torch.from_numpy(a).to(dtype) for a in rand_inputs(B, T, H, K, seed=T))
    cu = torch.tensor([0, T // 3, T]) if packed else None
    from kernels_torch.common import causal_document_mask as t_mask

    mask = t_mask(T, cu)
    idx = t_topk(scores, mask, topk)
    s1 = scores.clone().requires_grad_(True)
    _, kl_dense = td.warmup_loss(q, k, s1, mask, scale)
    kl_dense.sum().backward()
    rec_dense = td.indexer_recall(td.attention_target(q, k, mask, scale), t_sparse_mask(idx, T))
    s2 = scores.clone().requires_grad_(True)
    kl, rec = td.warmup_kl_chunked(q, k, s2, scale, cu, topk_indices=idx, chunk_bytes=chunk_bytes)
    kl.sum().backward()
    tol = TOL_CHUNKED_FP64 if dtype == torch.float64 else TOL_CHUNKED_FP32
    assert rel(kl, kl_dense) < tol
    assert rel(s2.grad, s1.grad) < tol
    assert rel(rec, rec_dense) < tol
    # the same with an lse handed in (as from a flash forward), and with one key shared by every head (absorbed form)
    lse = torch.logsumexp((torch.einsum("bthk,bshk->bhts", q, k) * scale).masked_fill(~mask, float("-inf")), -1)
    kl_lse, _ = td.warmup_kl_chunked(q, k, scores, scale, cu, lse=lse, chunk_bytes=chunk_bytes)
    assert rel(kl_lse, kl_dense) < tol
    k_shared = k[:, :, 0]
    _, kl_shared_dense = td.warmup_loss(q, k_shared[:, :, None].expand(B, T, H, K), scores, mask, scale)
    kl_shared, _ = td.warmup_kl_chunked(q, k_shared, scores, scale, cu, chunk_bytes=chunk_bytes)
    assert rel(kl_shared, kl_shared_dense) < tol


def test_warmup_chunked_backward_scales_by_the_upstream_gradient():
    """``(kl * w).sum()`` with random per-row ``w``: the chunked backward multiplies by ``dkl`` (mutation: the
    gradient of ``kl.sum()`` whatever the upstream), equal to the dense form's autograd."""
    B, T, H, K, scale = 2, 37, 3, 5, 0.4
    q, k, scores = (torch.from_numpy(a) for a in rand_inputs(B, T, H, K, seed=5))
    w = torch.from_numpy(np.random.default_rng(6).standard_normal((B, T)))  # signs and sizes differ per row
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    s1 = scores.clone().requires_grad_(True)
    (td.warmup_loss(q, k, s1, mask, scale)[1] * w).sum().backward()
    s2 = scores.clone().requires_grad_(True)
    kl, _ = td.warmup_kl_chunked(q, k, s2, scale, chunk_bytes=B * H * T * 8 * 5)  # 5 rows a chunk
    (kl * w).sum().backward()
    assert rel(s2.grad, s1.grad) < TOL_CHUNKED_FP64


@pytest.mark.parametrize("T", [1, 63, 130])
def test_sparse_gathered_matches_dense(T):
    """The sparse stage on the selected rows (absorbed layout, indexer scores gathered) equals the dense twin."""
    rng = np.random.default_rng(T)
    H, D, HI, KI, topk, scale = 3, 7, 2, 5, 32, 0.35
    q = torch.from_numpy(rng.standard_normal((T, H, D)))
    kv = torch.from_numpy(rng.standard_normal((T, D)))
    q_I = torch.from_numpy(rng.standard_normal((1, T, HI, KI)))
    k_I = torch.from_numpy(rng.standard_normal((1, T, KI)))
    w = torch.from_numpy(rng.standard_normal((1, T, HI)))
    from kernels_torch.indexer import indexer_scores

    mask = torch.ones(T, T, dtype=torch.bool).tril()
    w1 = w.clone().requires_grad_(True)
    dense_scores = indexer_scores(q_I, k_I, w1)
    idx = t_topk(dense_scores.detach(), mask, topk)
    _, kl_dense = td.sparse_loss(
        q[None], kv[:, None, :].expand(T, H, D)[None], dense_scores, mask, t_sparse_mask(idx, T), scale
    )
    kl_dense.sum().backward()
    w2 = w.clone().requires_grad_(True)
    at = td.indexer_scores_at(q_I, k_I, w2, idx, rows=17)
    logits = torch.einsum("thd,sd->hts", q, kv) * scale
    sel = t_sparse_mask(idx, T)[0] & mask
    lse = torch.logsumexp(logits.masked_fill(~sel, float("-inf")), -1).T  # [T, H]: the sparse forward's lse
    for given in (None, lse):
        kl = td.sparse_kl_gathered(q, kv, idx[0], at[0], scale, lse=given, rows=19)
        assert rel(kl, kl_dense[0]) < TOL_CHUNKED_FP64
    kl.sum().backward()
    assert rel(w2.grad, w1.grad) < TOL_CHUNKED_FP64


class _Sizes(TorchDispatchMode):
    """Records the largest tensor (in elements) any aten op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_warmup_never_allocates_T_by_S_by_H():
    B, T, H, K, scale = 1, 128, 8, 4, 0.5
    q, k, scores = (torch.from_numpy(a).float() for a in rand_inputs(B, T, H, K, seed=3))
    s = scores.clone().requires_grad_(True)
    with _Sizes() as probe:
        kl, _ = td.warmup_kl_chunked(q, k, s, scale, chunk_bytes=H * T * 4 * 16)  # 16 rows per chunk
        kl.sum().backward()
    assert probe.largest <= B * T * T, probe.largest  # the [B, T, S] scores / gradient, never [B, H, T, S]
    assert probe.largest < B * H * T * T // 4
    with _Sizes() as dense:  # the probe does see the dense form's [B, H, T, S]
        td.warmup_loss(q, k, scores, torch.ones(T, T, dtype=torch.bool).tril(), scale)
    assert dense.largest >= B * H * T * T


def test_bad_shapes_raise_naming_the_tensor():
    q = torch.randn(1, 5, 2, 3)
    with pytest.raises(ValueError, match="index_scores"):
        td.warmup_kl_chunked(q, torch.randn(1, 5, 2, 3), torch.randn(1, 5, 4), 1.0)
    with pytest.raises(ValueError, match="lse"):
        td.warmup_kl_chunked(q, torch.randn(1, 5, 2, 3), torch.randn(1, 5, 5), 1.0, lse=torch.randn(1, 5))
    with pytest.raises(ValueError, match="mask"):
        td.indexer_kl(torch.rand(1, 5, 5), torch.randn(1, 5, 5), torch.ones(4, 4, dtype=torch.bool))
