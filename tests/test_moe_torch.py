"""``kernels_torch.moe`` against its JAX twin with identical random weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import rel
from layer_weights import layer_shapes, mlp_params

from kernels_torch import moe as T
from kernels_torch.params import canonical_state_dict, load_canonical
from kimi.config import PRESETS
from kimi.layout import stacked_layout
from reference_jax import moe as J
from reference_jax.params import name_to_path

TOL_FP32 = 1e-5  # torch vs JAX, fp32
TOL_FP64 = 1e-10  # torch vs JAX, fp64
TOL_BF16 = 3e-2  # bf16 run vs fp32 run (same bf16-exact weights and inputs)

TINY = PRESETS["tiny"]()
CONFIGS = {
    "tiny-latent-situ": TINY,
    "kimi-linear-standard-silu": TINY.replace(
        routed_expert_hidden_size=None,
        hidden_act="silu",
        activation_situ_linear_beta=None,
        routed_scaling_factor=2.446,
        quant_method=None,
    ),
    "latent-no-norm-no-shared": TINY.replace(latent_moe_use_norm=False, num_shared_experts=0),
    "softmax-no-renorm": TINY.replace(moe_router_activation_func="softmax", moe_renormalize=False),
    "grouped-4x2": TINY.replace(num_experts=16, num_experts_per_token=4, num_expert_group=4, topk_group=2),
}
DTYPES = {"fp32": (torch.float32, jnp.float32, TOL_FP32), "fp64": (torch.float64, jnp.float64, TOL_FP64)}


def jax_tree(flat: dict, dtype) -> dict:
    tree: dict = {}
    for name, v in flat.items():
        node = tree
        path = name_to_path(name)
        for seg in path[:-1]:
            node = node.setdefault(seg, {})
        node[path[-1]] = jnp.asarray(v, dtype)
    return tree


def torch_module(module: torch.nn.Module, flat: dict, dtype) -> torch.nn.Module:
    """``module`` in ``dtype`` holding the canonical (per-expert) weights ``flat``: routed experts into their stacks."""
    assert set(canonical_state_dict(module)) == set(flat)
    module = module.to(dtype)
    return load_canonical(module, {k: torch.from_numpy(np.asarray(v, np.float64)).to(dtype) for k, v in flat.items()})


def bf16_exact(a: np.ndarray) -> np.ndarray:
    return np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float64)


# ---------------------------------------------------------------------------------------------- SiTU / GLU


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("name", ["tiny-latent-situ", "kimi-linear-standard-silu"])
def test_glu_act_matches_jax(name, dt):
    cfg = CONFIGS[name]
    tdt, jdt, tol = DTYPES[dt]
    rng = np.random.default_rng(0)
    a, b = 8 * rng.standard_normal((3, 65)), 40 * rng.standard_normal((3, 65))
    with jax.enable_x64(True):
        want = J.glu_act(jnp.asarray(a, jdt), jnp.asarray(b, jdt), cfg)
    got = T.glu_act(torch.from_numpy(a).to(tdt), torch.from_numpy(b).to(tdt), cfg)
    assert got.dtype == tdt and rel(got, want) <= tol
    for lb in (25.0, None):
        with jax.enable_x64(True):
            want = J.situ(jnp.asarray(a, jdt), jnp.asarray(b, jdt), 4.0, lb)
        assert rel(T.situ(torch.from_numpy(a).to(tdt), torch.from_numpy(b).to(tdt), 4.0, lb), want) <= tol


def test_situ_bf16_rounds_once_and_errors():
    rng = np.random.default_rng(1)
    a = torch.from_numpy(6 * rng.standard_normal((4, 33))).bfloat16()
    b = torch.from_numpy(30 * rng.standard_normal((4, 33))).bfloat16()
    got = T.situ(a, b)
    assert got.dtype == torch.bfloat16 and torch.equal(got, T.situ(a.float(), b.float()).bfloat16())
    with pytest.raises(ValueError, match="beta"):
        T.situ(a, b, beta=-1.0)
    with pytest.raises(ValueError, match="shape"):
        T.situ(a, b[:, :-1])


# ---------------------------------------------------------------------------------------------- router


def test_topk_ties_lower_index_first():
    scores = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.5] * 5, [0.0] * 5])
    assert T.topk_ids(scores, 3).tolist() == [[1, 2, 4], [0, 1, 2], [0, 1, 2]]
    cfg = TINY.replace(num_experts=6, num_experts_per_token=3)
    W = [[0.5], [1.0], [0.5], [1.0], [1.0], [0.25]]  # D = 1: equal rows give bitwise-equal logits
    x = [[2.0], [-2.0]]
    ids_t, _ = T.route(torch.tensor(x), torch.tensor(W), torch.zeros(6), cfg)
    ids_j, _ = J.route(jnp.asarray(x), jnp.asarray(W), jnp.zeros(6), cfg)
    assert ids_t.tolist() == np.asarray(ids_j).tolist() == [[1, 3, 4], [5, 0, 2]]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_route_matches_jax(name, dt):
    cfg = CONFIGS[name]
    tdt, jdt, tol = DTYPES[dt]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((37, cfg.hidden_size))
    W = rng.standard_normal((cfg.num_experts, cfg.hidden_size)) / np.sqrt(cfg.hidden_size)
    bias = 0.1 * rng.standard_normal(cfg.num_experts)
    with jax.enable_x64(True):
        ids_j, w_j = J.route(jnp.asarray(x, jdt), jnp.asarray(W, jdt), jnp.asarray(bias, jdt), cfg)
    ids_t, w_t = T.route(torch.from_numpy(x).to(tdt), torch.from_numpy(W).to(tdt), torch.from_numpy(bias).to(tdt), cfg)
    assert ids_t.dtype == torch.int64 and w_t.dtype == tdt
    np.testing.assert_array_equal(ids_t.numpy(), np.asarray(ids_j))
    assert rel(w_t, w_j) <= tol


def test_route_bias_selects_only_and_renormalises():
    cfg = TINY.replace(routed_scaling_factor=2.446)
    rng = np.random.default_rng(3)
    x = torch.from_numpy(rng.standard_normal((29, cfg.hidden_size))).float()
    W = torch.from_numpy(rng.standard_normal((cfg.num_experts, cfg.hidden_size))).float() / cfg.hidden_size**0.5
    bias = torch.zeros(cfg.num_experts)
    bias[6] = 10.0
    ids, w = T.route(x, W, bias, cfg)
    assert bool((ids[:, 0] == 6).all())
    s = torch.sigmoid(x @ W.T).gather(-1, ids)
    assert rel(w, 2.446 * s / s.sum(-1, keepdim=True)) <= 1e-6
    assert float((w.sum(-1) / 2.446 - 1).abs().max()) <= 1e-6


# ---------------------------------------------------------------------------------------------- modules


@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_state_dict_keys_match_layout(name):
    cfg = CONFIGS[name]
    moe = T.KimiMoE(cfg)
    canonical = canonical_state_dict(moe)
    assert {k: tuple(v.shape) for k, v in canonical.items()} == layer_shapes(cfg, 1, "block_sparse_moe.")
    pre = "model.layers.1.block_sparse_moe."
    stacked = {s.name[len(pre) :]: s.shape for s in stacked_layout(cfg, [1]) if s.name.startswith(pre)}
    sd = moe.state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == stacked
    assert sd["gate.e_score_correction_bias"].dtype == torch.float32
    e = cfg.num_experts - 1  # a canonical expert tensor is a view of its slice of the stack
    assert canonical[f"experts.{e}.w2.weight"].data_ptr() == sd["experts.w2"][e].data_ptr()
    sd = T.DenseMLP(cfg, cfg.intermediate_size).state_dict()
    assert {k: tuple(v.shape) for k, v in sd.items()} == layer_shapes(cfg, 0, "mlp.")


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("name", ["tiny-latent-situ", "kimi-linear-standard-silu"])
def test_dense_mlp_matches_jax(name, dt):
    cfg = CONFIGS[name]
    tdt, jdt, tol = DTYPES[dt]
    P = mlp_params(layer_shapes(cfg, 0, "mlp."), np.random.default_rng(4))
    x = 3 * np.random.default_rng(5).standard_normal((2, 7, cfg.hidden_size))
    with jax.enable_x64(True):
        want = J.DenseMLP(cfg, cfg.intermediate_size).apply({"params": jax_tree(P, jdt)}, jnp.asarray(x, jdt))
    got = torch_module(T.DenseMLP(cfg, cfg.intermediate_size), P, tdt)(torch.from_numpy(x).to(tdt))
    assert got.dtype == tdt and rel(got, want) <= tol


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_moe_matches_jax(name, dt):
    cfg = CONFIGS[name]
    tdt, jdt, tol = DTYPES[dt]
    P = mlp_params(layer_shapes(cfg, 1, "block_sparse_moe."), np.random.default_rng(6))
    x = 2 * np.random.default_rng(7).standard_normal((2, 7, cfg.hidden_size))
    with jax.enable_x64(True):
        want = J.KimiMoE(cfg).apply({"params": jax_tree(P, jdt)}, jnp.asarray(x, jdt))
    got = torch_module(T.KimiMoE(cfg), P, tdt)(torch.from_numpy(x).to(tdt))
    assert got.dtype == tdt and got.shape == x.shape
    assert rel(got, want) <= tol


def test_moe_bf16_close_to_fp32_and_to_jax_bf16():
    """The tiny preset's MoE layer in bf16 (weights and activations) against the same bf16-exact numbers in fp32."""
    cfg = TINY
    P = {
        k: bf16_exact(v)
        for k, v in mlp_params(layer_shapes(cfg, 1, "block_sparse_moe."), np.random.default_rng(8)).items()
    }
    x = bf16_exact(np.random.default_rng(9).standard_normal((2, 11, cfg.hidden_size)))
    y32 = torch_module(T.KimiMoE(cfg), P, torch.float32)(torch.from_numpy(x).float())
    y16 = torch_module(T.KimiMoE(cfg), P, torch.bfloat16)(torch.from_numpy(x).bfloat16())
    assert y16.dtype == torch.bfloat16
    assert rel(y16, y32) <= TOL_BF16
    j16 = J.KimiMoE(cfg).apply({"params": jax_tree(P, jnp.bfloat16)}, jnp.asarray(x, jnp.bfloat16))
    assert rel(y16, np.asarray(j16.astype(jnp.float32))) <= TOL_BF16
    # dense MLP too
    Pm = {k: bf16_exact(v) for k, v in mlp_params(layer_shapes(cfg, 0, "mlp."), np.random.default_rng(10)).items()}
    m32 = torch_module(T.DenseMLP(cfg, cfg.intermediate_size), Pm, torch.float32)(torch.from_numpy(x).float())
    m16 = torch_module(T.DenseMLP(cfg, cfg.intermediate_size), Pm, torch.bfloat16)(torch.from_numpy(x).bfloat16())
    assert rel(m16, m32) <= TOL_BF16
