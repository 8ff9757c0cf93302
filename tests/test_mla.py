"""Gated MLA / DSA-sparse MLA, JAX reference (spec 3.2-3.4, 4.3, 9; cases 9, 15, 18).

The tiny preset has K != V (qk 16+8 = 24, v 16) and index_topk 64. Relative errors against named tolerances;
fresh seeded random inputs and weights.
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
from reference_jax.mla import GatedMLA, mla_attention, mla_attention_absorbed
from reference_jax.params import to_tree as params_to_tree

TOL_FORMS_FP64 = 1e-10  # absorbed vs expanded
TOL_FORMS_FP32 = 1e-5
TOL_SPEC_FP64 = 1e-10  # module vs the numpy transcription of spec 3.2
TOL_PACKED_FP64 = 1e-12  # packed vs separate documents

DSA, KDA = 3, 0  # layers of the tiny preset


def to_tree(flat: dict, dtype) -> dict:
    return {"params": params_to_tree(flat, dtype)}


def without_indexer(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if not k.startswith("indexer.")}


def rms_np(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def gated_mla_np(p: dict, x: np.ndarray, cfg, mask: np.ndarray) -> np.ndarray:
    """Spec 3.2 transcribed in numpy fp64 (expanded form, NoPE, scale (qk_nope + qk_rope)^-1/2, sigmoid gate).

    mask: [B, T, S] bool, the final attention mask (causal & document & selected)."""
    B, T, _ = x.shape
    H, Kn, R, V, L = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
        cfg.kv_lora_rank,
    )
    if cfg.q_lora_rank is None:
        q = x @ p["q_proj.weight"].T
    else:
        q = rms_np(x @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], cfg.mla_norm_eps) @ p["q_b_proj.weight"].T
    q = q.reshape(B, T, H, Kn + R)
    kv = x @ p["kv_a_proj_with_mqa.weight"].T
    c, k_pe = rms_np(kv[..., :L], p["kv_a_layernorm.weight"], cfg.mla_norm_eps), kv[..., L:]
    kvb = (c @ p["kv_b_proj.weight"].T).reshape(B, T, H, Kn + V)
    k = np.concatenate([kvb[..., :Kn], np.broadcast_to(k_pe[:, :, None], (B, T, H, R))], -1)
    v = kvb[..., Kn:]
    logits = np.einsum("bthk,bshk->bhts", q, k) / np.sqrt(Kn + R)
    logits = np.where(mask[:, None], logits, -np.inf)
    m = np.max(logits, -1, keepdims=True)
    prob = np.exp(logits - m)
    prob /= prob.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshv->bthv", prob, v).reshape(B, T, H * V)
    if cfg.mla_use_output_gate:
        o = o / (1.0 + np.exp(-(x @ p["g_proj.weight"].T)))
    return o @ p["o_proj.weight"].T


def sparse_mask_np(idx: np.ndarray, T: int) -> np.ndarray:
    B = idx.shape[0]
    m = np.zeros((B, T, T), bool)
    for b in range(B):
        for t in range(T):
            for s in idx[b, t]:
                if s >= 0:
                    m[b, t, s] = True
    return m


def random_attention_inputs(rng, B=2, T=9, S=11, H=3, Kn=16, R=8, V=12, L=20):
    """Latent-form inputs and their expanded equivalents (K = Kn + R = 24 != V = 12)."""
    q_nope, q_pe = rng.standard_normal((B, T, H, Kn)), rng.standard_normal((B, T, H, R))
    c_kv, k_pe = rng.standard_normal((B, S, L)), rng.standard_normal((B, S, R))
    w = rng.standard_normal((H * (Kn + V), L)) / np.sqrt(L)
    kvb = np.einsum("bsl,ol->bso", c_kv, w).reshape(B, S, H, Kn + V)
    q = np.concatenate([q_nope, q_pe], -1)
    k = np.concatenate([kvb[..., :Kn], np.broadcast_to(k_pe[:, :, None], (B, S, H, R))], -1)
    v = kvb[..., Kn:]
    mask = rng.random((B, T, S)) < 0.6
    mask[0, 2] = False  # a row with no visible key
    return dict(q_nope=q_nope, q_pe=q_pe, c_kv=c_kv, k_pe=k_pe, w=w, q=q, k=k, v=v, mask=mask, scale=(Kn + R) ** -0.5)


# ------------------------------------------------------------------------------------------------ functions


@pytest.mark.parametrize("dtype", ["fp32", "fp64"])
def test_absorbed_equals_expanded_functions(dtype):
    a = random_attention_inputs(np.random.default_rng(0))
    tol = TOL_FORMS_FP64 if dtype == "fp64" else TOL_FORMS_FP32
    with jax.enable_x64(dtype == "fp64"):
        dt = jnp.float64 if dtype == "fp64" else jnp.float32
        j = {n: jnp.asarray(v, dt) if n not in ("mask", "scale") else v for n, v in a.items()}
        o_exp = mla_attention(j["q"], j["k"], j["v"], jnp.asarray(a["mask"]), a["scale"])
        o_abs = mla_attention_absorbed(
            j["q_nope"], j["q_pe"], j["c_kv"], j["k_pe"], j["w"], jnp.asarray(a["mask"]), a["scale"]
        )
        assert o_exp.dtype == dt and o_exp.shape == (2, 9, 3, 12)
        assert rel(o_abs, o_exp) <= tol
        # the scale is a real argument: (L + R)^-1/2 (the latent width) would be a different function (case 15)
        o_wrong = mla_attention_absorbed(
            j["q_nope"], j["q_pe"], j["c_kv"], j["k_pe"], j["w"], jnp.asarray(a["mask"]), (20 + 8) ** -0.5
        )
        assert rel(o_wrong, o_exp) > 1e-2


def test_attention_matches_numpy_and_empty_rows_give_zero():
    a = random_attention_inputs(np.random.default_rng(1))
    with jax.enable_x64(True):
        o = np.asarray(mla_attention(*(jnp.asarray(a[n]) for n in ("q", "k", "v", "mask")), a["scale"]))
        o_abs = np.asarray(
            mla_attention_absorbed(
                *(jnp.asarray(a[n]) for n in ("q_nope", "q_pe", "c_kv", "k_pe", "w", "mask")), a["scale"]
            )
        )
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(o_abs))
    assert np.all(o[0, 2] == 0) and np.all(o_abs[0, 2] == 0)
    logits = np.einsum("bthk,bshk->bhts", a["q"], a["k"]) * a["scale"]
    logits = np.where(a["mask"][:, None], logits, -np.inf)
    with np.errstate(invalid="ignore"):
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p = np.nan_to_num(p / p.sum(-1, keepdims=True))
    want = np.einsum("bhts,bshv->bthv", p, a["v"])
    assert rel(o, want) <= TOL_SPEC_FP64


def test_fully_masked_fp32_no_nan():
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((1, 4, 2, 8), (1, 4, 2, 8), (1, 4, 2, 5)))
    o = mla_attention(q, k, v, jnp.zeros((4, 4), bool), 0.3)
    assert bool(jnp.all(o == 0))


# ------------------------------------------------------------------------------------------------ module


def run_layer(cfg, layer, p, x, dtype, cu_seqlens=None, **kw):
    """Apply the layer under jax.jit (one compile instead of one per op: keeps the file fast on CPU)."""
    m = GatedMLA(cfg, layer)
    f = jax.jit(lambda tree, xx: m.apply(tree, xx, cu_seqlens=cu_seqlens, **kw))
    return f(to_tree(p, dtype), jnp.asarray(x, dtype))


@pytest.mark.parametrize("kind,T", [("dsa", 65), ("dsa", 200), ("mla", 65)], ids=lambda v: str(v))
def test_layer_matches_spec_and_forms_agree(kind, T):
    """Module == numpy spec 3.2 (fp64); absorbed == expanded (fp64 and fp32), K != V."""
    cfg = load_config("tiny")
    if kind == "mla":
        cfg = cfg.replace(dsa_layers=())
    rng = np.random.default_rng(T)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((1, T, cfg.hidden_size))
    with jax.enable_x64(True):
        out, aux = run_layer(cfg, DSA, p, x, jnp.float64, return_aux=True)
        out_abs = run_layer(cfg, DSA, p, x, jnp.float64, form="absorbed")
    assert out.dtype == jnp.float64 and out.shape == x.shape
    mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (1, T, T))
    if kind == "dsa":
        assert set(aux) == {"topk_indices", "index_scores"}
        mask = mask & sparse_mask_np(np.asarray(aux["topk_indices"]), T)
    else:
        assert aux == {}
    assert rel(out, gated_mla_np(p, x, cfg, mask)) <= TOL_SPEC_FP64
    assert rel(out_abs, out) <= TOL_FORMS_FP64
    o32 = run_layer(cfg, DSA, p, x, jnp.float32)
    o32_abs = run_layer(cfg, DSA, p, x, jnp.float32, form="absorbed")
    assert o32.dtype == jnp.float32
    assert rel(o32_abs, o32) <= TOL_FORMS_FP32
    assert rel(o32, out) <= TOL_FORMS_FP32


@pytest.mark.parametrize(
    "T,form", [(1, "expanded"), (63, "expanded"), (64, "expanded"), (64, "absorbed")], ids=lambda v: str(v)
)
def test_dsa_short_sequence_equals_dense_exactly(T, form):
    """T <= index_topk: every visible key is selected, so DSA == dense causal MLA bit for bit (spec 4.3, case 9)."""
    cfg = load_config("tiny")
    assert T <= cfg.index_topk
    rng = np.random.default_rng(100 + T)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((2, T, cfg.hidden_size))
    out, aux = run_layer(cfg, DSA, p, x, jnp.float32, form=form, return_aux=True)
    dense = run_layer(cfg.replace(dsa_layers=()), DSA, without_indexer(p), x, jnp.float32, form=form)
    assert np.array_equal(np.asarray(out), np.asarray(dense))
    idx = np.asarray(aux["topk_indices"])
    assert idx.shape == (2, T, T)
    for t in range(T):
        assert sorted(idx[0, t][idx[0, t] >= 0].tolist()) == list(range(t + 1))


@pytest.mark.parametrize("T", [65, 200], ids=lambda t: f"T{t}")
def test_dsa_long_sequence_is_sparse_and_causal(T):
    cfg = load_config("tiny")
    k = cfg.index_topk
    rng = np.random.default_rng(200 + T)
    p = mla_params(cfg, DSA, rng)
    x = rng.standard_normal((1, T, cfg.hidden_size))
    out, aux = run_layer(cfg, DSA, p, x, jnp.float32, return_aux=True)
    dense = run_layer(cfg.replace(dsa_layers=()), DSA, without_indexer(p), x, jnp.float32)
    idx = np.asarray(aux["topk_indices"])[0]
    assert idx.shape == (T, k) and idx.dtype == np.int32
    valid = idx >= 0
    assert np.array_equal(valid.sum(1), np.minimum(k, np.arange(T) + 1))
    assert np.all(idx <= np.arange(T)[:, None])
    assert all(len(set(r[r >= 0].tolist())) == (r >= 0).sum() for r in idx)  # no duplicates
    out, dense = np.asarray(out)[0], np.asarray(dense)[0]
    assert np.array_equal(out[:k], dense[:k])  # rows that see <= k keys are dense
    assert rel(out[k:], dense[k:]) > 1e-3  # the others really are sparse


@pytest.mark.parametrize(
    "kind,form", [("dsa", "expanded"), ("dsa", "absorbed"), ("mla", "expanded")], ids=lambda v: str(v)
)
def test_packed_documents_equal_separate_runs(kind, form):
    cfg = load_config("tiny")
    if kind == "mla":
        cfg = cfg.replace(dsa_layers=())
    rng = np.random.default_rng(9)
    p = mla_params(cfg, DSA, rng)
    cu = np.array([0, 70, 71, 200])
    x = rng.standard_normal((1, int(cu[-1]), cfg.hidden_size))
    with jax.enable_x64(True):
        packed, aux = run_layer(cfg, DSA, p, x, jnp.float64, cu_seqlens=cu, form=form, return_aux=True)
        packed = np.asarray(packed)
        for a, b in zip(cu[:-1], cu[1:]):
            sep = np.asarray(run_layer(cfg, DSA, p, x[:, a:b], jnp.float64, form=form))
            assert rel(packed[:, a:b], sep) <= TOL_PACKED_FP64
    if kind == "dsa":
        idx = np.asarray(aux["topk_indices"])[0]
        doc = np.searchsorted(cu[1:], np.arange(200), side="right")
        rows = np.broadcast_to(np.arange(200)[:, None], idx.shape)
        v = idx >= 0
        assert np.all(doc[idx[v]] == doc[rows[v]]) and np.all(idx[v] <= rows[v])


def test_scale_constants_case15():
    assert load_config("k3.1-pro").mla_softmax_scale == 192**-0.5
    cfg = load_config("tiny")
    assert cfg.mla_softmax_scale == 24**-0.5  # qk_nope 16 + qk_rope 8, not kv_lora_rank + rope = 40


def test_param_tree_matches_layout():
    cfg = load_config("tiny")
    for c in (cfg, cfg.replace(dsa_layers=()), cfg.replace(q_lora_rank=None, mla_use_output_gate=False, dsa_layers=())):
        x = jnp.ones((1, 3, c.hidden_size))
        params = jax.eval_shape(GatedMLA(c, DSA).init, jax.random.PRNGKey(0), x)["params"]  # shapes only
        got = {
            ".".join(str(k.key) for k in path): leaf.shape for path, leaf in jax.tree_util.tree_leaves_with_path(params)
        }
        pre = f"model.layers.{DSA}.self_attn."
        want = {s.name[len(pre) :]: s.shape for s in param_layout(c, [DSA]) if s.name.startswith(pre)}
        assert got == want


@pytest.mark.parametrize("T", [63, 200], ids=lambda t: f"T{t}")
def test_kimi_linear_config(T):
    """q_lora_rank None (plain q_proj), no output gate, no indexer."""
    cfg = load_config("tiny").replace(q_lora_rank=None, mla_use_output_gate=False, dsa_layers=())
    rng = np.random.default_rng(300 + T)
    p = mla_params(cfg, DSA, rng)
    assert "q_proj.weight" in p and "g_proj.weight" not in p
    x = rng.standard_normal((1, T, cfg.hidden_size))
    with jax.enable_x64(True):
        out = run_layer(cfg, DSA, p, x, jnp.float64)
        out_abs = run_layer(cfg, DSA, p, x, jnp.float64, form="absorbed")
    assert rel(out, gated_mla_np(p, x, cfg, np.tril(np.ones((T, T), bool))[None])) <= TOL_SPEC_FP64
    assert rel(out_abs, out) <= TOL_FORMS_FP64


def test_output_gate_is_mla_gate_case18():
    """g_proj in an MLA layer is [H*V, D] and gates o before o_proj; a KDA layer index is refused."""
    cfg = load_config("tiny")
    g = {s.name: s.shape for s in param_layout(cfg, [DSA, KDA])}
    assert g[f"model.layers.{DSA}.self_attn.g_proj.weight"] == (
        cfg.num_attention_heads * cfg.v_head_dim,
        cfg.hidden_size,
    )
    assert g[f"model.layers.{KDA}.self_attn.g_proj.weight"] == (cfg.kda_num_heads * cfg.kda_head_dim, cfg.hidden_size)
    x = jnp.ones((1, 3, cfg.hidden_size))
    with pytest.raises(ValueError, match="layer_idx"):
        jax.eval_shape(GatedMLA(cfg, KDA).init, jax.random.PRNGKey(0), x)
    # the gate matters: zeroing g_proj halves o exactly (sigmoid(0) = 1/2), so the output halves
    rng = np.random.default_rng(4)
    c = cfg.replace(dsa_layers=())
    p = mla_params(c, DSA, rng)
    xx = rng.standard_normal((1, 5, c.hidden_size))
    p0 = dict(p, **{"g_proj.weight": np.zeros_like(p["g_proj.weight"])})
    with jax.enable_x64(True):
        gated0 = run_layer(c, DSA, p0, xx, jnp.float64)
        ungated = run_layer(
            c.replace(mla_use_output_gate=False),
            DSA,
            {k: v for k, v in p.items() if k != "g_proj.weight"},
            xx,
            jnp.float64,
        )
    assert rel(gated0, 0.5 * np.asarray(ungated)) <= TOL_SPEC_FP64


def test_bad_arguments():
    cfg = load_config("tiny")
    x = jnp.ones((1, 4, cfg.hidden_size))
    m = GatedMLA(cfg, DSA)
    params = jax.eval_shape(m.init, jax.random.PRNGKey(0), x)  # shapes only: the errors come before any math
    with pytest.raises(ValueError, match="form"):
        jax.eval_shape(lambda p: m.apply(p, x, form="flash"), params)
    with pytest.raises(ValueError, match="cu_seqlens"):
        jax.eval_shape(lambda p: m.apply(p, jnp.ones((2, 4, cfg.hidden_size)), cu_seqlens=np.array([0, 2, 4])), params)
    with pytest.raises(ValueError, match="cu_seqlens"):
        jax.eval_shape(lambda p: m.apply(p, x, cu_seqlens=np.array([0, 2, 5])), params)


def test_row_blocked_attention_equals_one_block(monkeypatch):
    """Long sequences are attended in blocks of query rows; the result must not depend on the block size."""
    import reference_jax.mla as mla_mod

    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        B, T, H, K, V, L, R = 1, 37, 3, 6, 5, 8, 4
        q = jnp.asarray(rng.standard_normal((B, T, H, K)))
        k = jnp.asarray(rng.standard_normal((B, T, H, K)))
        v = jnp.asarray(rng.standard_normal((B, T, H, V)))
        mask = jnp.tril(jnp.ones((T, T), bool))
        qn, qp = jnp.asarray(rng.standard_normal((B, T, H, K))), jnp.asarray(rng.standard_normal((B, T, H, R)))
        c, kp = jnp.asarray(rng.standard_normal((B, T, L))), jnp.asarray(rng.standard_normal((B, T, R)))
        w = jnp.asarray(rng.standard_normal((H * (K + V), L)))
        full = mla_mod.mla_attention(q, k, v, mask, 0.3), mla_mod.mla_attention_absorbed(qn, qp, c, kp, w, mask, 0.3)
        monkeypatch.setattr(mla_mod, "_ROW_BLOCK", 8)
        blocked = mla_mod.mla_attention(q, k, v, mask, 0.3), mla_mod.mla_attention_absorbed(qn, qp, c, kp, w, mask, 0.3)
        for a, b in zip(full, blocked):
            assert float(jnp.linalg.norm(a - b) / jnp.linalg.norm(a)) <= 1e-14
