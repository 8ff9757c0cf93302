"""SiTU, the dense MLP, the router and the (latent) MoE of ``reference_jax.moe`` against hand-written numpy (spec 5.1-5.3).

The numpy oracles below are written from the spec text, one token at a time, in fp64; the reference runs under
``jax.enable_x64(True)`` for the exact comparisons.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel
from layer_weights import layer_shapes, mlp_params

from kimi.config import PRESETS, ConfigError
from reference_jax.moe import DenseMLP, KimiMoE, glu_act, route, situ, topk_ids
from reference_jax.params import path_to_name
from reference_jax.params import to_tree as params_to_tree

TOL_FP64 = 1e-10  # fp64 reference vs fp64 numpy oracle
TOL_SITU_FP64 = 1e-13  # elementwise formula, fp64
TOL_SUM = 1e-6  # renormalised router weights, fp32

TINY = PRESETS["tiny"]()
# Kimi-Linear style: standard (non-latent) MoE, SiLU-GLU, scaling 2.446, bf16 experts.
KIMI_LINEAR = TINY.replace(
    routed_expert_hidden_size=None,
    hidden_act="silu",
    activation_situ_linear_beta=None,
    routed_scaling_factor=2.446,
    quant_method=None,
)
GROUPED = TINY.replace(num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2)
CONFIGS = {
    "tiny-latent-situ": TINY,
    "kimi-linear-standard-silu": KIMI_LINEAR,
    "latent-no-norm": TINY.replace(latent_moe_use_norm=False),
    "no-shared": TINY.replace(num_shared_experts=0),
    "softmax-no-renorm": TINY.replace(
        moe_router_activation_func="softmax", moe_renormalize=False, routed_scaling_factor=1.7
    ),
    "grouped-4x2": GROUPED,
}


# ---------------------------------------------------------------------------------------------- numpy oracles


def np_sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def np_situ(a, b, beta=4.0, linear_beta=25.0):
    up = b if linear_beta is None else linear_beta * np.tanh(b / linear_beta)
    return beta * np.tanh(a / beta) * np_sigmoid(a) * up


def np_act(a, b, cfg):
    if cfg.hidden_act == "situ":
        return np_situ(a, b, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return a * np_sigmoid(a) * b


def np_route_token(x, W, bias, cfg):
    """One token: x [D] -> (ids [k], weights [k]), spec 5.3 steps 1-3, DeepSeek-V3 grouping, ties to lower index."""
    logits = W @ x
    if cfg.moe_router_activation_func == "sigmoid":
        s = np_sigmoid(logits)
    else:
        s = np.exp(logits - logits.max())
        s = s / s.sum()
    choice = s + bias
    E, k = len(s), cfg.num_experts_per_token
    allowed = list(range(E))
    if cfg.use_grouped_topk:
        per = E // cfg.num_expert_group
        gscore = [sum(sorted(choice[g * per : (g + 1) * per], reverse=True)[:2]) for g in range(cfg.num_expert_group)]
        groups = sorted(range(cfg.num_expert_group), key=lambda g: (-gscore[g], g))[: cfg.topk_group]
        allowed = [e for e in range(E) if e // per in groups]
    ids = sorted(allowed, key=lambda e: (-choice[e], e))[:k]
    w = s[ids]
    if cfg.moe_renormalize:
        w = w / (w.sum() + 1e-20)
    return np.array(ids), w * cfg.routed_scaling_factor


def np_glu_mlp(P, pre, x, cfg, names=("gate_proj", "up_proj", "down_proj")):
    g, u, d = (P[f"{pre}{n}.weight"] for n in names)
    return d @ np_act(g @ x, u @ x, cfg)


def np_moe(P, x, cfg):
    """Per-token loop over the selected experts (spec 5.3 steps 1-9). P: canonical names under block_sparse_moe."""
    B, T, D = x.shape
    y = np.zeros_like(x)
    for b in range(B):
        for t in range(T):
            xt = x[b, t]
            ids, w = np_route_token(xt, P["gate.weight"], P["gate.e_score_correction_bias"], cfg)
            z = P["routed_expert_down_proj.weight"] @ xt if cfg.has_latent_moe else xt
            r = sum(wk * np_glu_mlp(P, f"experts.{e}.", z, cfg, ("w1", "w3", "w2")) for e, wk in zip(ids, w))
            if cfg.has_latent_moe:
                if cfg.latent_moe_use_norm:
                    r = r / np.sqrt(np.mean(r * r) + cfg.rms_norm_eps) * P["routed_expert_norm.weight"]
                r = P["routed_expert_up_proj.weight"] @ r
            if cfg.num_shared_experts:
                r = r + np_glu_mlp(P, "shared_experts.", xt, cfg)
            y[b, t] = r
    return y


# ---------------------------------------------------------------------------------------------- helpers


def flat_names(tree) -> dict:
    return {path_to_name(tuple(k.key for k in path)): v for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def to_tree(flat: dict, dtype) -> dict:
    return params_to_tree(flat, dtype)


# ---------------------------------------------------------------------------------------------- SiTU


@pytest.mark.parametrize("linear_beta", [25.0, None], ids=["lin25", "lin-none"])
def test_situ_matches_formula_fp64(linear_beta):
    rng = np.random.default_rng(0)
    a, b = 12 * rng.standard_normal((3, 65)), 40 * rng.standard_normal((3, 65))  # large enough for the caps to bite
    with jax.enable_x64(True):
        got = situ(jnp.asarray(a), jnp.asarray(b), 4.0, linear_beta)
        assert got.dtype == jnp.float64
        assert rel(got, np_situ(a, b, 4.0, linear_beta)) <= TOL_SITU_FP64
        # the caps are active: SiTU is not the plain SiLU-GLU here
        assert rel(got, a * np_sigmoid(a) * b) > 0.05


def test_situ_caps_for_large_inputs():
    big = jnp.asarray([-1e6, -1e3, -40.0, -8.0, 8.0, 40.0, 1e3, 1e6], jnp.float32)
    ones = jnp.ones_like(big)
    gate = situ(big, ones, 4.0, None)  # the gate branch alone
    assert bool(jnp.all(jnp.isfinite(gate)))
    assert bool(jnp.all(jnp.abs(gate) <= 4.0))
    np.testing.assert_allclose(float(situ(jnp.float32(1e4), jnp.float32(1.0), 4.0, None)), 4.0, rtol=1e-6)
    up = situ(jnp.full_like(big, 1e4), big, 4.0, 25.0)  # gate factor = 4, up branch soft-capped
    assert bool(jnp.all(jnp.abs(up) <= 4.0 * 25.0))
    np.testing.assert_allclose(np.asarray(up)[[0, -1]], [-100.0, 100.0], rtol=1e-6)
    # large negative gate: sigmoid kills it (SiLU-like), whatever the up branch
    assert abs(float(situ(jnp.float32(-1e3), jnp.float32(1e6)))) < 1e-30


def test_situ_bf16_is_fp32_math_rounded_once():
    rng = np.random.default_rng(1)
    a = jnp.asarray(6 * rng.standard_normal((4, 33)), jnp.bfloat16)
    b = jnp.asarray(30 * rng.standard_normal((4, 33)), jnp.bfloat16)
    got = situ(a, b)
    assert got.dtype == jnp.bfloat16
    want = situ(a.astype(jnp.float32), b.astype(jnp.float32)).astype(jnp.bfloat16)
    assert bool(jnp.all(got == want))


def test_situ_rejects_bad_arguments():
    a = jnp.ones((2, 3))
    with pytest.raises(ValueError, match="shape"):
        situ(a, jnp.ones((3, 2)))
    with pytest.raises(ValueError, match="beta"):
        situ(a, a, beta=0.0)
    with pytest.raises(ValueError, match="linear_beta"):
        situ(a, a, linear_beta=-1.0)


def test_glu_act_picks_situ_or_silu():
    rng = np.random.default_rng(2)
    a, b = 6 * rng.standard_normal((5, 7)), 30 * rng.standard_normal((5, 7))
    with jax.enable_x64(True):
        for cfg in (TINY, KIMI_LINEAR):
            got = glu_act(jnp.asarray(a), jnp.asarray(b), cfg)
            assert rel(got, np_act(a, b, cfg)) <= TOL_SITU_FP64
    assert rel(glu_act(jnp.asarray(a), jnp.asarray(b), KIMI_LINEAR), a * np_sigmoid(a) * b) <= 1e-6


def test_kimi_linear_style_config_validates():
    cfg = TINY.replace(
        routed_expert_hidden_size=None,
        hidden_act="silu",
        activation_situ_linear_beta=None,
        routed_scaling_factor=2.446,
        quant_method=None,
    )
    assert not cfg.has_latent_moe and cfg.hidden_act == "silu"
    names = layer_shapes(cfg, 1, "block_sparse_moe.")
    assert not any(n.startswith("routed_expert_") for n in names)
    with pytest.raises(ConfigError):
        TINY.replace(hidden_act="gelu")


# ---------------------------------------------------------------------------------------------- router


def _router_inputs(cfg, N=23, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, cfg.hidden_size))
    W = rng.standard_normal((cfg.num_experts, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)
    bias = 0.1 * rng.standard_normal(cfg.num_experts)
    return x, W, bias


@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_route_matches_numpy_fp64(name):
    cfg = CONFIGS[name]
    x, W, bias = _router_inputs(cfg)
    with jax.enable_x64(True):
        ids, w = route(jnp.asarray(x), jnp.asarray(W), jnp.asarray(bias), cfg)
        assert ids.shape == w.shape == (x.shape[0], cfg.num_experts_per_token) and w.dtype == jnp.float64
    for n in range(x.shape[0]):
        want_ids, want_w = np_route_token(x[n], W, bias, cfg)
        np.testing.assert_array_equal(np.asarray(ids[n]), want_ids)
        assert rel(w[n], want_w) <= TOL_FP64


def test_route_bias_selects_but_does_not_weight():
    cfg = TINY.replace(routed_scaling_factor=1.0)
    x, W, _ = _router_inputs(cfg, N=31)
    s = np_sigmoid(x @ W.T)
    bias = np.zeros(cfg.num_experts, np.float32)
    bias[5] = 10.0  # force expert 5 into every token's selection
    ids0, _ = route(jnp.asarray(x, jnp.float32), jnp.asarray(W, jnp.float32), jnp.zeros_like(bias), cfg)
    ids, w = route(jnp.asarray(x, jnp.float32), jnp.asarray(W, jnp.float32), jnp.asarray(bias), cfg)
    ids, w = np.asarray(ids), np.asarray(w)
    assert np.all(ids[:, 0] == 5), "the bias must change the selection"
    assert np.any(np.asarray(ids0) != ids)
    # the weights are the *uncorrected* scores of the chosen experts, renormalised
    sel = np.take_along_axis(s, ids, axis=-1)
    assert rel(w, sel / sel.sum(-1, keepdims=True)) <= 1e-6
    batched = route(jnp.asarray(x[None], jnp.float32), jnp.asarray(W, jnp.float32), jnp.asarray(bias), cfg)
    assert batched[0].shape == (1, x.shape[0], cfg.num_experts_per_token)


@pytest.mark.parametrize("renorm", [True, False], ids=["renorm", "no-renorm"])
def test_route_weights_sum_to_scaling_factor(renorm):
    cfg = TINY.replace(routed_scaling_factor=2.446, moe_renormalize=renorm)
    x, W, bias = _router_inputs(cfg, N=40)
    _, w = route(jnp.asarray(x, jnp.float32), jnp.asarray(W, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    assert w.dtype == jnp.float32
    err = np.abs(np.asarray(w).sum(-1) / 2.446 - 1.0).max()
    assert (err <= TOL_SUM) if renorm else (err > 0.01)


def test_grouped_topk_restricts_to_best_groups():
    cfg = GROUPED  # 16 experts in 4 groups of 4; the best 2 groups survive; top-4
    x, W, bias = _router_inputs(cfg, N=64, seed=4)
    bias = 0.3 * bias
    ids, _ = route(jnp.asarray(x, jnp.float32), jnp.asarray(W, jnp.float32), jnp.asarray(bias, jnp.float32), cfg)
    ids_flat, _ = route(
        jnp.asarray(x, jnp.float32),
        jnp.asarray(W, jnp.float32),
        jnp.asarray(bias, jnp.float32),
        cfg.replace(use_grouped_topk=False),
    )
    ids, ids_flat = np.asarray(ids), np.asarray(ids_flat)
    choice = np_sigmoid(x @ W.T) + bias
    gscore = np.sort(choice.reshape(-1, 4, 4), axis=-1)[..., -2:].sum(-1)  # [N, G]: sum of the two best
    best = np.argsort(-gscore, axis=-1, kind="stable")[:, :2]
    for n in range(len(x)):
        assert set(ids[n] // 4) <= set(best[n]), f"token {n}: experts {ids[n]} outside groups {best[n]}"
    assert np.any(np.sort(ids, -1) != np.sort(ids_flat, -1)), "grouping should matter for some token"
    # one group (K3): grouped top-k is a no-op
    one = TINY.replace(use_grouped_topk=True, num_expert_group=1, topk_group=1)
    x, W, bias = _router_inputs(one, N=30)
    args = (jnp.asarray(x, jnp.float32), jnp.asarray(W, jnp.float32), jnp.asarray(bias, jnp.float32))
    np.testing.assert_array_equal(route(*args, one)[0], route(*args, one.replace(use_grouped_topk=False))[0])


def test_topk_ties_lower_index_first():
    scores = jnp.asarray([[1.0, 3.0, 3.0, 2.0, 3.0], [0.5] * 5])
    np.testing.assert_array_equal(topk_ids(scores, 3), [[1, 2, 4], [0, 1, 2]])
    # through the router: D = 1 so that equal gate rows give bitwise-equal logits
    cfg = TINY.replace(num_experts=6, num_experts_per_token=3)
    W = jnp.asarray([[0.5], [1.0], [0.5], [1.0], [1.0], [0.25]])
    ids, w = route(jnp.asarray([[2.0], [-2.0]]), W, jnp.zeros(6), cfg)
    np.testing.assert_array_equal(ids, [[1, 3, 4], [5, 0, 2]])
    assert rel(w.sum(-1), np.ones(2)) <= TOL_SUM


def test_route_rejects_impossible_grouping_and_shapes():
    cfg = TINY.replace(num_experts=16, num_experts_per_token=5, num_expert_group=4, topk_group=1)
    x, W, bias = _router_inputs(cfg, N=3)
    with pytest.raises(ValueError, match="topk_group"):
        route(jnp.asarray(x), jnp.asarray(W), jnp.asarray(bias), cfg)
    with pytest.raises(ValueError, match="width"):
        route(jnp.asarray(x[:, :-1]), jnp.asarray(W), jnp.asarray(bias), cfg)
    with pytest.raises(ValueError, match="e_score_correction_bias"):
        route(jnp.asarray(x), jnp.asarray(W), jnp.asarray(bias[:-1]), cfg)


# ---------------------------------------------------------------------------------------------- modules


@pytest.mark.parametrize("name", ["tiny-latent-situ", "kimi-linear-standard-silu"])
def test_param_names_and_shapes_match_layout(name):
    cfg = CONFIGS[name]
    x = jnp.ones((1, 2, cfg.hidden_size))
    init = lambda m: jax.eval_shape(m.init, jax.random.PRNGKey(0), x)["params"]  # noqa: E731  (shapes only)
    moe = flat_names(init(KimiMoE(cfg)))
    assert {k: tuple(v.shape) for k, v in moe.items()} == layer_shapes(cfg, 1, "block_sparse_moe.")
    assert moe["gate.e_score_correction_bias"].dtype == jnp.float32
    mlp = flat_names(init(DenseMLP(cfg, cfg.intermediate_size)))
    assert {k: tuple(v.shape) for k, v in mlp.items()} == layer_shapes(cfg, 0, "mlp.")


@pytest.mark.parametrize("B,T", [(1, 1), (2, 7)], ids=["B1T1", "B2T7"])
@pytest.mark.parametrize("name", ["tiny-latent-situ", "kimi-linear-standard-silu"])
def test_dense_mlp_matches_numpy_fp64(name, B, T):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(5)
    P = mlp_params(layer_shapes(cfg, 0, "mlp."), rng)
    x = 3 * rng.standard_normal((B, T, cfg.hidden_size))  # x3 so that the SiTU caps matter
    with jax.enable_x64(True):
        y = DenseMLP(cfg, cfg.intermediate_size).apply({"params": to_tree(P, jnp.float64)}, jnp.asarray(x))
        assert y.dtype == jnp.float64 and y.shape == x.shape
    want = np.stack([[np_glu_mlp(P, "", x[b, t], cfg) for t in range(T)] for b in range(B)])
    assert rel(y, want) <= TOL_FP64


@pytest.mark.parametrize(
    "name,B,T",
    [(n, 2, 5) for n in CONFIGS] + [("tiny-latent-situ", 1, 1)],
    ids=[f"{n}-B2T5" for n in CONFIGS] + ["tiny-latent-situ-B1T1"],
)
def test_moe_matches_per_token_loop_fp64(name, B, T):
    cfg = CONFIGS[name]
    rng = np.random.default_rng(6)
    P = mlp_params(layer_shapes(cfg, 1, "block_sparse_moe."), rng)
    x = 2 * rng.standard_normal((B, T, cfg.hidden_size))
    with jax.enable_x64(True):
        y = KimiMoE(cfg).apply({"params": to_tree(P, jnp.float64)}, jnp.asarray(x))
        assert y.dtype == jnp.float64 and y.shape == x.shape
    assert rel(y, np_moe(P, x, cfg)) <= TOL_FP64


def test_moe_bf16_close_to_fp32():
    cfg = TINY
    rng = np.random.default_rng(7)
    P = mlp_params(layer_shapes(cfg, 1, "block_sparse_moe."), rng)
    P = {k: np.asarray(jnp.asarray(v, jnp.bfloat16).astype(jnp.float32)) for k, v in P.items()}  # bf16-exact weights
    x = jnp.asarray(rng.standard_normal((2, 9, cfg.hidden_size)), jnp.bfloat16)
    moe = KimiMoE(cfg)
    y16 = moe.apply({"params": to_tree(P, jnp.bfloat16)}, x)
    y32 = moe.apply({"params": to_tree(P, jnp.float32)}, x.astype(jnp.float32))
    assert y16.dtype == jnp.bfloat16
    assert rel(y16.astype(jnp.float32), y32) <= 3e-2


def test_moe_rejects_bad_input_shape():
    with pytest.raises(ValueError, match=r"\[B, T"):
        jax.eval_shape(KimiMoE(TINY).init, jax.random.PRNGKey(0), jnp.ones((6, TINY.hidden_size)))
