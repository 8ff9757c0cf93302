"""Issue 13, faults 2, 8 and 9: the selection rules every public top-k applies itself, the causal re-mask after the
indexer's top-k, and a traced ``cu_seqlens`` under ``jax.jit``, in both paths.

Mutations tried (each fails a test here): dropping ``+ 0.0`` in ``reference_jax.indexer.topk_indices`` or in
``reference_jax.moe.topk_ids``; ``mask = sparse_mask(topk, T)`` without ``mask[None] &`` in either twin's
``GatedMLA``; removing the tracer check in ``reference_jax.common.check_cu_seqlens`` (the error becomes jax's
TracerArrayConversionError deep inside).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from layer_weights import kda_params, mla_params

import kernels_torch.indexer as ti
import kernels_torch.mla as tm
import kernels_torch.moe as tmoe
import reference_jax.indexer as ji
import reference_jax.kda as jk
import reference_jax.mla as jm
import reference_jax.moe as jmoe
from kimi.config import load_config
from reference_jax.params import to_tree

DSA, KDA = 3, 0  # layers of the tiny preset
TOL_FP32 = 1e-5  # layer output with injected future indices vs without (the re-mask makes them equal)


# ------------------------------------------------------------------------------------------------ fault 2


def test_issue_signed_zero_example_both_twins():
    """The issue's input: [0, -0, 0, -0] are four equal scores -> larger key index first, [3, 2, 1, 0]."""
    s = [[[0.0, -0.0, 0.0, -0.0]]]
    assert ji.topk_indices(jnp.array(s), jnp.ones((1, 4), bool), 4).tolist() == [[[3, 2, 1, 0]]]
    # under jit too: XLA folds "scores + 0.0" away, which once brought back [2, 0, 3, 1]
    jitted = jax.jit(ji.topk_indices, static_argnums=2)
    assert jitted(jnp.array(s), jnp.ones((1, 4), bool), 4).tolist() == [[[3, 2, 1, 0]]]
    assert ti.topk_indices(torch.tensor(s), torch.ones(1, 4, dtype=torch.bool), 4).tolist() == [[[3, 2, 1, 0]]]


@pytest.mark.parametrize("seed", [0, 1])
def test_signed_zero_ties_random_both_twins(seed):
    """Random rows mixing -0.0, +0.0 and a few positive scores, with a causal mask and k cutting inside the zeros:
    both twins give the same indices, and the same as for the scores with every -0.0 made +0.0."""
    rng = np.random.default_rng(seed)
    B, T, k = 2, 37, 9
    s = np.where(rng.random((B, T, T)) < 0.5, -0.0, 0.0).astype(np.float32)
    s = np.where(rng.random((B, T, T)) < 0.1, rng.random((B, T, T)), s).astype(np.float32)
    mask = np.tril(np.ones((T, T), bool))
    canon = np.asarray(ji.topk_indices(jnp.asarray(s + 0.0), jnp.asarray(mask), k))
    got_j = np.asarray(ji.topk_indices(jnp.asarray(s), jnp.asarray(mask), k))
    got_t = ti.topk_indices(torch.from_numpy(s), torch.from_numpy(mask), k).numpy()
    assert np.signbit(s).any()
    assert np.array_equal(got_j, canon) and np.array_equal(got_t, canon)


def test_router_topk_ids_signed_zeros_both_twins():
    """MoE router ``topk_ids``: equal scores -> lower expert index first, -0.0 equal to +0.0."""
    s = np.array([[-0.0, 0.0, -0.0, 0.5, 0.0, -0.0]], np.float32)
    want = [[3, 0, 1, 2, 4, 5]]
    assert jmoe.topk_ids(jnp.asarray(s), 6).tolist() == want
    assert jax.jit(jmoe.topk_ids, static_argnums=1)(jnp.asarray(s), 6).tolist() == want
    assert tmoe.topk_ids(torch.from_numpy(s), 6).tolist() == want


# ------------------------------------------------------------------------------------------------ fault 8


def _future_first(scores, mask, topk):
    """A broken top-k: every key of the row, future ones first (what a dense top-k without -inf masking returns)."""
    B, T, S = scores.shape
    return np.broadcast_to(np.arange(S - 1, -1, -1, dtype=np.int32), (B, T, S))


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_future_indices_are_remasked_jax(monkeypatch, form):
    """Inject indices of future keys into the DSA layer: the causal re-mask after top-k (spec 4.3) must ignore them,
    so the output equals the unpatched layer (T = 9 <= index_topk: every visible key is selected either way)."""
    cfg = load_config("tiny")
    rng = np.random.default_rng(3)
    p = mla_params(cfg, DSA, rng)
    x = jnp.asarray(rng.standard_normal((2, 9, cfg.hidden_size)), jnp.float32)
    layer, tree = jm.GatedMLA(cfg, DSA), {"params": to_tree(p, jnp.float32)}

    def run():  # a fresh function per call, so jit traces again (after the patch); jit: one compile, not one per op
        return jax.jit(lambda t, xx: layer.apply(t, xx, form=form, return_aux=True))(tree, x)

    want, _ = run()
    monkeypatch.setattr(ji, "topk_indices", lambda s, m, k: jnp.asarray(_future_first(s, m, k)))
    got, aux = run()
    assert int(aux["topk_indices"][0, 0, 0]) == 8  # the injected future key reached the layer
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=TOL_FP32, atol=TOL_FP32)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_future_indices_are_remasked_torch(monkeypatch, backend):
    cfg = load_config("tiny")
    rng = np.random.default_rng(3)
    p = mla_params(cfg, DSA, rng)
    layer = tm.GatedMLA(cfg, DSA, backend=backend)
    layer.load_state_dict({k: torch.tensor(v, dtype=torch.float32) for k, v in p.items()})
    x = torch.randn(2, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = layer(x)
        monkeypatch.setattr(ti, "topk_indices", lambda s, m, k: torch.from_numpy(_future_first(s, m, k).copy()))
        got, aux = layer(x, return_aux=True)
    assert int(aux["topk_indices"][0, 0, 0]) == 8
    torch.testing.assert_close(got, want, rtol=TOL_FP32, atol=TOL_FP32)


# ------------------------------------------------------------------------------------------------ fault 9


def test_traced_cu_seqlens_clear_error_functions():
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((1, 6, 1, 4)), jnp.float32)
    q = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    g = -jnp.asarray(rng.uniform(0.1, 1, (1, 6, 1, 4)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.1, 0.9, (1, 6, 1)), jnp.float32)
    for fn in (jk.kda_chunk, jk.kda_recurrent):
        with pytest.raises(ValueError, match="cu_seqlens: got a traced array.*concrete"):
            jax.jit(lambda cu: fn(q, q, q, g, beta, cu_seqlens=cu))(np.array([0, 2, 6]))
        # closed over (concrete) it works under jit
        o, _ = jax.jit(lambda: fn(q, q, q, g, beta, cu_seqlens=np.array([0, 2, 6])))()
        assert np.all(np.isfinite(np.asarray(o)))


@pytest.mark.parametrize("layer_idx", [KDA, DSA], ids=["kda", "dsa"])
def test_traced_cu_seqlens_clear_error_layers(layer_idx):
    cfg = load_config("tiny")
    rng = np.random.default_rng(6)
    p = kda_params(cfg, layer_idx, rng) if layer_idx == KDA else mla_params(cfg, layer_idx, rng)
    layer = jk.KimiDeltaAttention(cfg, layer_idx) if layer_idx == KDA else jm.GatedMLA(cfg, layer_idx)
    tree = {"params": to_tree(p, jnp.float32)}
    x = jnp.asarray(rng.standard_normal((1, 7, cfg.hidden_size)), jnp.float32)
    with pytest.raises(ValueError, match="must be concrete|expected a concrete one"):
        jax.jit(lambda cu: layer.apply(tree, x, cu_seqlens=cu))(jnp.array([0, 3, 7]))
