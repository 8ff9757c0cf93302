"""PyTorch MLA / DSA indexer (backends eager, sdpa) against the JAX reference twins, with the same weights.

Random canonical weights are drawn once as numpy arrays and loaded into both frameworks. Relative errors against
named tolerances; the top-k indices must match index for index.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel
from layer_weights import mla_params

import kernels_torch.mla as tm
import reference_jax.mla as jm
from kimi.config import load_config
from kimi.layout import param_layout

TOL_FP32 = 1e-5  # torch vs JAX, fp32
TOL_FP64 = 1e-10  # torch vs JAX, fp64
TOL_SDPA_FP32 = 1e-5  # sdpa vs eager, fp32
TOL_PACKED_FP64 = 1e-12  # packed vs separate documents
TOL_BF16 = 3e-2  # bf16 activations vs fp32

DSA = 3  # a DSA layer of the tiny preset
BACKENDS = ["eager", "sdpa"]


def jax_layer(cfg, p: dict, x: np.ndarray, dtype, cu_seqlens=None, **kw):
    tree: dict = {}
    for name, a in p.items():
        node = tree
        *path, leaf = name.split(".")
        for seg in path:
            node = node.setdefault(seg, {})
        node[leaf] = jnp.asarray(a, dtype)
    m = jm.GatedMLA(cfg, DSA)
    f = jax.jit(lambda t, xx: m.apply(t, xx, cu_seqlens=cu_seqlens, **kw))  # one compile, not one per op
    return f({"params": tree}, jnp.asarray(x, dtype))


def torch_layer(cfg, p: dict, dtype, backend="eager") -> tm.GatedMLA:
    m = tm.GatedMLA(cfg, DSA, backend=backend).to(dtype)  # cast first: loading fp64 into fp32 params would round
    m.load_state_dict({k: torch.from_numpy(v) for k, v in p.items()})
    return m


# ------------------------------------------------------------------------------------------------ attention functions


def attention_inputs(rng, B=2, T=9, S=11, H=3, Kn=16, R=8, V=12, L=20):
    q_nope, q_pe = rng.standard_normal((B, T, H, Kn)), rng.standard_normal((B, T, H, R))
    c_kv, k_pe = rng.standard_normal((B, S, L)), rng.standard_normal((B, S, R))
    w = rng.standard_normal((H * (Kn + V), L)) / np.sqrt(L)
    kvb = np.einsum("bsl,ol->bso", c_kv, w).reshape(B, S, H, Kn + V)
    q = np.concatenate([q_nope, q_pe], -1)
    k = np.concatenate([kvb[..., :Kn], np.broadcast_to(k_pe[:, :, None], (B, S, H, R))], -1)
    mask = rng.random((B, T, S)) < 0.6
    mask[1, 3] = False  # a row with no visible key
    return dict(q=q, k=k, v=kvb[..., Kn:], q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w=w, mask=mask)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_attention_functions_match_jax(dtype, backend):
    a = attention_inputs(np.random.default_rng(1))
    scale = 24**-0.5
    tdt, jdt, tol = (
        (torch.float64, jnp.float64, TOL_FP64) if dtype == "fp64" else (torch.float32, jnp.float32, TOL_FP32)
    )
    t = {
        n: torch.from_numpy(np.ascontiguousarray(v)).to(tdt) if n != "mask" else torch.from_numpy(v)
        for n, v in a.items()
    }
    with jax.enable_x64(dtype == "fp64"):
        j = {n: jnp.asarray(v, jdt) if n != "mask" else jnp.asarray(v) for n, v in a.items()}
        o_j = np.asarray(jm.mla_attention(j["q"], j["k"], j["v"], j["mask"], scale))
        oa_j = np.asarray(
            jm.mla_attention_absorbed(j["q_nope"], j["q_pe"], j["c_kv"], j["k_pe"], j["w"], j["mask"], scale)
        )
    o_t = tm.mla_attention(t["q"], t["k"], t["v"], t["mask"], scale, backend=backend)
    oa_t = tm.mla_attention_absorbed(
        t["q_nope"], t["q_pe"], t["c_kv"], t["k_pe"], t["w"], t["mask"], scale, backend=backend
    )
    assert o_t.dtype == tdt and o_t.shape == (2, 9, 3, 12)
    assert rel(o_t, o_j) <= tol and rel(oa_t, oa_j) <= tol
    for o in (o_t, oa_t):  # the fully masked row: 0, not NaN
        assert bool(torch.isfinite(o).all()) and bool((o[1, 3] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_masked_give_zero(backend):
    rng = np.random.default_rng(2)
    q, k, v = (torch.from_numpy(rng.standard_normal(s)).float() for s in ((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 5)))
    o = tm.mla_attention(q, k, v, torch.zeros(4, 4, dtype=torch.bool), 0.3, backend=backend)
    assert bool((o == 0).all())


def test_unknown_backend_rejected():
    cfg = load_config("tiny")
    with pytest.raises(ValueError, match=r"backend.*flash.*eager.*sdpa.*cudnn"):
        tm.GatedMLA(cfg, DSA, backend="flash")
    for bad in ("cudnn", "flash"):  # "cudnn" is a GatedMLA backend (kernels_torch.dsa_cudnn), not a dense-mask one
        with pytest.raises(ValueError, match="backend"):
            tm.mla_attention(
                torch.ones(1, 1, 1, 2),
                torch.ones(1, 1, 1, 2),
                torch.ones(1, 1, 1, 2),
                torch.ones(1, 1, dtype=torch.bool),
                1.0,
                backend=bad,
            )


# ------------------------------------------------------------------------------------------------ GatedMLA


@pytest.mark.parametrize("T", [1, 63, 65, 200], ids=lambda t: f"T{t}")
def test_gated_mla_eager_matches_jax_fp32(T):
    cfg = load_config("tiny")
    rng = np.random.default_rng(T)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((1, T, cfg.hidden_size))
    o_j, aux_j = jax_layer(cfg, p, x, jnp.float32, return_aux=True)
    m = torch_layer(cfg, p, torch.float32)
    with torch.no_grad():
        o_t, aux_t = m(torch.from_numpy(x).float(), return_aux=True)
        o_ta = m(torch.from_numpy(x).float(), form="absorbed")
    assert np.array_equal(aux_t["topk_indices"].numpy(), np.asarray(aux_j["topk_indices"]))
    assert rel(aux_t["index_scores"], aux_j["index_scores"]) <= TOL_FP32
    assert o_t.dtype == torch.float32 and rel(o_t, o_j) <= TOL_FP32
    assert rel(o_ta, o_j) <= TOL_FP32


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_gated_mla_eager_matches_jax_fp64(form):
    cfg = load_config("tiny")
    T = 200
    rng = np.random.default_rng(11)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((1, T, cfg.hidden_size))
    with jax.enable_x64(True):
        o_j, aux_j = jax_layer(cfg, p, x, jnp.float64, form=form, return_aux=True)
        o_j, idx_j = np.asarray(o_j), np.asarray(aux_j["topk_indices"])
    with torch.no_grad():
        o_t, aux_t = torch_layer(cfg, p, torch.float64)(torch.from_numpy(x), form=form, return_aux=True)
    assert o_t.dtype == torch.float64 and rel(o_t, o_j) <= TOL_FP64
    assert np.array_equal(aux_t["topk_indices"].numpy(), idx_j)


@pytest.mark.parametrize("T", [1, 63, 65, 200], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_sdpa_matches_eager(form, T):
    cfg = load_config("tiny")
    rng = np.random.default_rng(50 + T)
    p = mla_params(cfg, DSA, rng)
    x = torch.from_numpy(rng.standard_normal((1, T, cfg.hidden_size))).float()
    with torch.no_grad():
        o_e = torch_layer(cfg, p, torch.float32, "eager")(x, form=form)
        o_s = torch_layer(cfg, p, torch.float32, "sdpa")(x, form=form)
    assert rel(o_s, o_e) <= TOL_SDPA_FP32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["expanded", "absorbed"])
def test_packed_documents_equal_separate_runs(form, backend):
    cfg = load_config("tiny")
    rng = np.random.default_rng(9)
    p = mla_params(cfg, DSA, rng)
    cu = torch.tensor([0, 70, 71, 200])
    x = torch.from_numpy(rng.standard_normal((1, 200, cfg.hidden_size)))
    m = torch_layer(cfg, p, torch.float64, backend)
    with torch.no_grad():
        packed, aux = m(x, cu_seqlens=cu, form=form, return_aux=True)
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            assert rel(packed[:, a:b], m(x[:, a:b], form=form)) <= TOL_PACKED_FP64
    idx = aux["topk_indices"][0]
    doc = torch.searchsorted(cu[1:], torch.arange(200), right=True)
    rows = torch.arange(200)[:, None].expand_as(idx)
    v = idx >= 0
    assert bool((doc[idx[v].long()] == doc[rows[v]]).all()) and bool((idx[v] <= rows[v]).all())


@pytest.mark.parametrize("T", [1, 65], ids=lambda t: f"T{t}")
def test_kimi_linear_config_matches_jax(T):
    cfg = load_config("tiny").replace(q_lora_rank=None, mla_use_output_gate=False, dsa_layers=())
    rng = np.random.default_rng(70 + T)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((1, T, cfg.hidden_size))
    o_j = jax_layer(cfg, p, x, jnp.float32)
    with torch.no_grad():
        for backend in BACKENDS:
            m = torch_layer(cfg, p, torch.float32, backend)
            o_t, aux = m(torch.from_numpy(x).float(), return_aux=True)
            assert aux == {} and not hasattr(m, "indexer") and not hasattr(m, "g_proj")
            assert rel(o_t, o_j) <= TOL_FP32
            assert rel(m(torch.from_numpy(x).float(), form="absorbed"), o_j) <= TOL_FP32


def test_state_dict_keys_match_layout():
    cfg = load_config("tiny")
    for c in (cfg, cfg.replace(dsa_layers=()), cfg.replace(q_lora_rank=None, mla_use_output_gate=False, dsa_layers=())):
        pre = f"model.layers.{DSA}.self_attn."
        want = {s.name[len(pre) :]: s.shape for s in param_layout(c, [DSA]) if s.name.startswith(pre)}
        got = {k: tuple(v.shape) for k, v in tm.GatedMLA(c, DSA).state_dict().items()}
        assert got == want


def test_kda_layer_and_indexer_rope_rejected():
    cfg = load_config("tiny")
    with pytest.raises(ValueError, match="layer_idx"):
        tm.GatedMLA(cfg, 0)  # a KDA layer: its g_proj is KDA's output gate (case 18)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):  # RoPE on: the rotated dims must be even
        tm.GatedMLA(cfg.replace(indexer_rope="half", qk_rope_head_dim=7), DSA)
    m = tm.GatedMLA(cfg, DSA)
    with pytest.raises(ValueError, match="form"):
        m(torch.ones(1, 2, cfg.hidden_size), form="flash")
    with pytest.raises(ValueError, match="cu_seqlens"):
        m(torch.ones(2, 4, cfg.hidden_size), cu_seqlens=torch.tensor([0, 2, 4]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_activations(backend):
    cfg = load_config("tiny")
    rng = np.random.default_rng(13)
    p = mla_params(cfg, DSA, rng)
    x = torch.from_numpy(rng.standard_normal((1, 65, cfg.hidden_size))).float()
    with torch.no_grad():
        ref = torch_layer(cfg, p, torch.float32, "eager")(x)
        o, aux = torch_layer(cfg, p, torch.bfloat16, backend)(x.bfloat16(), return_aux=True)
    assert o.dtype == torch.bfloat16 and aux["index_scores"].dtype == torch.float32
    assert bool(torch.isfinite(o).all()) and rel(o, ref) <= TOL_BF16
