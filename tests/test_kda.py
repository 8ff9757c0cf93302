"""KDA reference (reference_jax/kda.py): recurrent vs chunk, gates, conv, packing, decode (spec 2; cases.md 1-7).

Relative error ``||a - b|| / ||b||`` with a named tolerance per tensor; fresh seeded random inputs, never zeros.
The module tests use the ``tiny`` preset and a jitted ``apply`` (jit only caches compilation).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel
from layer_weights import kda_params

from kimi.config import load_config
from kimi.layout import param_layout
from reference_jax.kda import (
    KDACache,
    KimiDeltaAttention,
    gated_rms_norm,
    kda_chunk,
    kda_gate,
    kda_recurrent,
    l2norm,
    short_conv,
)
from reference_jax.params import to_tree as params_to_tree

# Tolerances (relative error), one per tensor kind.
TOL_FP64 = 1e-10  # o and S, chunk vs recurrent in fp64
TOL_FP32 = 1e-5  # o and S, chunk vs recurrent in fp32; decode vs prefill in fp32
TOL_LONG = 1e-5  # case 2: fp32 at T = 4096 against fp64
TOL_PACKED = 1e-6  # case 5: packed vs separate (see test_packed_equals_separate)
LB = -5.0

CASE5_CU = [[0, 15], [0, 1, 2, 3, 503], [0, 256, 500, 1000], [0, 15, 100, 300, 1200, 2000]]


def np_l2norm(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def make_inputs(seed, B, T, H, K, V, lower_bound=LB, dtype=np.float32, N=None):
    """q, k (L2-normalised), v, g (a random gate of the given form), beta (sigmoid), S0 [N, H, K, V], built in
    numpy (the gate itself is checked in the case-1 tests) and returned as jax arrays of ``dtype``."""
    rng = np.random.default_rng(seed)
    q = np_l2norm(rng.standard_normal((B, T, H, K)))
    k = np_l2norm(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V))
    x = 3 * rng.standard_normal((B, T, H, K)) + rng.standard_normal((H, K))
    a = np.exp(rng.uniform(-1.0, 1.0, (H, 1)))
    g = lower_bound / (1 + np.exp(-a * x)) if lower_bound is not None else -a * np.logaddexp(0.0, x)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    S0 = rng.standard_normal((N or B, H, K, V))
    return tuple(jnp.asarray(t, dtype) for t in (q, k, v, g, beta, S0))


# ------------------------------------------------------------------------------------------------ recurrent vs chunk


@pytest.mark.parametrize("lower_bound", [LB, None], ids=["lb_sigmoid", "softplus"])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("x64", [False, True], ids=["fp32", "fp64"])
def test_recurrent_vs_chunk(x64, T, lower_bound):
    dtype, tol = (np.float64, TOL_FP64) if x64 else (np.float32, TOL_FP32)
    with jax.enable_x64(x64):
        q, k, v, g, beta, S0 = make_inputs(T, 2, T, 2, 8, 12, lower_bound, dtype)  # K = 8 != V = 12
        o_r, S_r = kda_recurrent(q, k, v, g, beta, initial_state=S0)
        o_c, S_c = kda_chunk(q, k, v, g, beta, initial_state=S0)
        assert o_c.dtype == o_r.dtype == dtype and S_c.dtype == S_r.dtype == dtype
        assert o_c.shape == (2, T, 2, 12) and S_c.shape == (2, 2, 8, 12)
        assert rel(o_c, o_r) <= tol, rel(o_c, o_r)
        assert rel(S_c, S_r) <= tol, rel(S_c, S_r)


def test_single_token_closed_form():
    """T = 1 from a known state: S1 = D S0 + beta k (v - (D S0)ᵀ k)ᵀ, o = S1ᵀ (q / sqrt(K)) (spec 2.2 step 7 order:
    decay, error against the decayed state, write, read the updated state)."""
    K = 8
    with jax.enable_x64(True):
        q, k, v, g, beta, S0 = make_inputs(1, 2, 1, 2, K, 12, dtype=np.float64)
        qn, kn, vn, gn, bn = (np.asarray(x)[:, 0] for x in (q, k, v, g, beta))
        Sd = np.exp(gn)[..., None] * np.asarray(S0)  # [B,H,K,V]
        e = vn - np.einsum("bhk,bhkv->bhv", kn, Sd)
        S1 = Sd + np.einsum("bhk,bhv->bhkv", kn, bn[..., None] * e)
        o = np.einsum("bhk,bhkv->bhv", qn * K**-0.5, S1)
        for fn in (kda_recurrent, kda_chunk):
            o_f, S_f = fn(q, k, v, g, beta, initial_state=S0)
            assert rel(o_f[:, 0], o) <= TOL_FP64 and rel(S_f, S1) <= TOL_FP64, fn.__name__


# ------------------------------------------------------------------------------------------------ case 1: gate form


def test_gate_lower_bound_form_fp64():
    """Case 1: lb * sigmoid(exp(A_log) (f + dt_bias)) lies in (lb, 0) for |f| up to 30, and is not a clamped softplus."""
    rng = np.random.default_rng(1)
    H, K = 4, 16
    f = rng.uniform(-30, 30, (2, 64, H, K))
    A_log = np.log(rng.uniform(0.5, 1.2, H))
    dt_bias = 0.1 * rng.standard_normal(H * K)
    x = f + dt_bias.reshape(H, K)
    a = np.exp(A_log)[:, None]
    want_lb = LB / (1.0 + np.exp(-a * x))
    want_sp = -a * np.logaddexp(0.0, x)
    with jax.enable_x64(True):
        g = np.asarray(kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias), LB))
        g_sp = np.asarray(kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias), None))
    assert g.dtype == np.float64
    assert (g > LB).all() and (g < 0).all()
    assert rel(g, want_lb) <= 1e-14
    assert rel(g_sp, want_sp) <= 1e-14
    clamp = np.maximum(want_sp, LB)  # the wrong "KDA" seen in public code
    assert np.abs(g - clamp).max() > 1.0


def test_gate_fp32_and_bf16_input():
    """fp32 gate matches the fp64 formula; bf16 f still gives an fp32 g (never narrowed, case 2)."""
    rng = np.random.default_rng(2)
    H, K = 2, 8
    f = rng.uniform(-30, 30, (1, 16, H, K)).astype(np.float32)
    A_log = np.log(rng.uniform(1, 16, H)).astype(np.float32)
    dt_bias = rng.standard_normal(H * K).astype(np.float32)
    want = LB / (1.0 + np.exp(-np.exp(A_log.astype(np.float64))[:, None] * (f + dt_bias.reshape(H, K))))
    g = kda_gate(jnp.asarray(f), jnp.asarray(A_log), jnp.asarray(dt_bias), LB)
    assert g.dtype == jnp.float32 and rel(g, want) <= 1e-6
    assert bool(((g >= LB) & (g <= 0)).all())
    g16 = kda_gate(jnp.asarray(f, jnp.bfloat16), jnp.asarray(A_log), jnp.asarray(dt_bias), LB)
    assert g16.dtype == jnp.float32


# ------------------------------------------------------------------------------------------------ case 2: long decay


def test_long_sequence_slow_decay_fp32_vs_fp64():
    """Case 2: T = 4096 with g ~ -1e-3; fp32 (g, beta, state in fp32) stays within TOL_LONG of fp64, while the same
    run with g and beta narrowed to bf16, or with the decay factor exp(g) narrowed, does not (the test sees the fault)."""
    rng = np.random.default_rng(3)
    B, T, H, K, V = 1, 4096, 1, 4, 4
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    v = rng.standard_normal((B, T, H, V))
    g = -1e-3 * rng.uniform(0.5, 1.5, (B, T, H, K))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    ins32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]
    ins32[0], ins32[1] = l2norm(ins32[0]), l2norm(ins32[1])
    with jax.enable_x64(True):
        o_ref, S_ref = kda_recurrent(*(jnp.asarray(np.asarray(x), jnp.float64) for x in ins32))
        o_ref, S_ref = np.asarray(o_ref), np.asarray(S_ref)
    for fn in (kda_chunk, kda_recurrent):
        o, S = fn(*ins32)
        assert rel(o, o_ref) <= TOL_LONG and rel(S, S_ref) <= TOL_LONG, (fn.__name__, rel(o, o_ref), rel(S, S_ref))
    narrow = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    _, S_bad = kda_chunk(ins32[0], ins32[1], ins32[2], narrow(ins32[3]), narrow(ins32[4]))
    assert rel(S_bad, S_ref) > 100 * TOL_LONG
    # the decay factor exp(g) = 0.999 in bf16 rounds to 1: the channels stop forgetting
    _, S_bad = kda_chunk(*ins32[:3], jnp.log(narrow(jnp.exp(ins32[3]))), ins32[4])
    assert rel(S_bad, S_ref) > 100 * TOL_LONG


# ------------------------------------------------------------------------------------------------ case 4: ragged


@pytest.mark.parametrize("T,chunk_size", [(50, 16), (63, 16), (500, 48)])
def test_chunk_size_not_dividing_T(T, chunk_size):
    """Case 4 (T = 1, 63, 65, 500 with C = 64 are in test_recurrent_vs_chunk)."""
    q, k, v, g, beta, S0 = make_inputs(100 + T, 2, T, 2, 8, 12)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o_c, S_c = kda_chunk(q, k, v, g, beta, initial_state=S0, chunk_size=chunk_size)
    assert rel(o_c, o_r) <= TOL_FP32 and rel(S_c, S_r) <= TOL_FP32


def test_length_one_document_in_pack():
    """Case 4: a length-1 document inside a pack sees only itself: o = beta (q·k) v / sqrt(K), S = beta k vᵀ."""
    cu = np.array([0, 20, 21, 40])
    K = 8
    with jax.enable_x64(True):
        q, k, v, g, beta, _ = make_inputs(4, 1, 40, 2, K, 4, dtype=np.float64)
        qn, kn, vn, bn = (np.asarray(x)[0, 20] for x in (q, k, v, beta))
        o_want = (bn * np.einsum("hk,hk->h", qn, kn) * K**-0.5)[:, None] * vn
        S_want = bn[:, None, None] * kn[:, :, None] * vn[:, None, :]
        for fn in (kda_recurrent, functools.partial(kda_chunk, chunk_size=16)):
            o, S = fn(q, k, v, g, beta, cu_seqlens=cu)
            assert S.shape == (3, 2, K, 4)
            assert rel(o[0, 20], o_want) <= TOL_FP64 and rel(S[1], S_want) <= TOL_FP64
        o_r, _ = kda_recurrent(q, k, v, g, beta, cu_seqlens=cu)
        o_c, _ = kda_chunk(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16)
        assert rel(o_c, o_r) <= TOL_FP64


# ------------------------------------------------------------------------------------------------ case 5: packing


@pytest.mark.parametrize("cu", CASE5_CU, ids=lambda c: "cu" + "_".join(map(str, c)))
def test_packed_equals_separate(cu):
    """Case 5: packed == separate runs. kda_chunk and short_conv run documents one at a time, so they are exact.
    kda_recurrent resets inside one scan (a select per token) whose XLA fusion may differ from the unpacked scan's,
    hence TOL_PACKED instead of exact equality (in practice it is exact or within a few ulps)."""
    T, N = cu[-1], len(cu) - 1
    q, k, v, g, beta, S0 = make_inputs(sum(cu), 1, T, 2, 8, 4, N=N)
    cu = np.asarray(cu)
    o_c, S_c = kda_chunk(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
    for n in range(N):
        s, e = cu[n], cu[n + 1]
        part = [x[:, s:e] for x in (q, k, v, g, beta)]
        o_cn, S_cn = kda_chunk(*part, initial_state=S0[n : n + 1])
        o_rn, S_rn = kda_recurrent(*part, initial_state=S0[n : n + 1])
        np.testing.assert_array_equal(np.asarray(o_c[:, s:e]), np.asarray(o_cn))
        np.testing.assert_array_equal(np.asarray(S_c[n]), np.asarray(S_cn[0]))
        assert rel(o_r[:, s:e], o_rn) <= TOL_PACKED and rel(S_r[n], S_rn[0]) <= TOL_PACKED
    assert rel(o_c, o_r) <= TOL_FP32 and rel(S_c, S_r) <= TOL_FP32
    if N > 1:  # the boundaries act: without them the second document sees the first one's state
        o_flat, _ = kda_chunk(q, k, v, g, beta, initial_state=S0[:1])
        s, e = cu[1], cu[2]
        assert rel(o_flat[:, s:e], o_c[:, s:e]) > 1e-3

    # short conv: the window restarts at every document (zeros, or that document's conv_state row)
    rng = np.random.default_rng(len(cu))
    C, W = 6, 4
    x = jnp.asarray(rng.standard_normal((1, T, C)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((C, 1, W)), jnp.float32)
    st = jnp.asarray(rng.standard_normal((N, C, W - 1)), jnp.float32)
    y, new_st = short_conv(x, w, cu_seqlens=cu, conv_state=st)
    for n in range(N):
        y_n, st_n = short_conv(x[:, cu[n] : cu[n + 1]], w, conv_state=st[n : n + 1])
        np.testing.assert_array_equal(np.asarray(y[:, cu[n] : cu[n + 1]]), np.asarray(y_n))
        np.testing.assert_array_equal(np.asarray(new_st[n]), np.asarray(st_n[0]))


# ------------------------------------------------------------------------------------------------ case 6: overflow


def test_chunk_no_overflow_near_lower_bound():
    """Case 6: g close to -5 on every token of full 64-token chunks: exp(-cumsum) alone would overflow fp32."""
    rng = np.random.default_rng(6)
    B, T, H, K, V = 1, 256, 2, 8, 4
    q, k, v, _, beta, S0 = make_inputs(6, B, T, H, K, V)
    g = jnp.asarray(LB + 0.05 * rng.uniform(size=(B, T, H, K)), jnp.float32)
    G = np.cumsum(np.asarray(g)[:, :64], axis=1)
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(-G, dtype=np.float32)).any()  # the hazard is really present in this input
    o_c, S_c = kda_chunk(q, k, v, g, beta, initial_state=S0)
    o_r, S_r = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    assert bool(jnp.isfinite(o_c).all()) and bool(jnp.isfinite(S_c).all())
    assert rel(o_c, o_r) <= TOL_FP32 and rel(S_c, S_r) <= TOL_FP32


# ------------------------------------------------------------------------------------------------ case 7: A_log


def test_gate_refuses_unsliced_A_log():
    """The gate takes the canonical [H] A_log; the checkpoint's padded one is refused, pointing at slice_A_log."""
    H = 4
    with pytest.raises(ValueError, match="slice_A_log"):
        kda_gate(jnp.zeros((1, 1, H, 2)) + 1.0, jnp.asarray(np.zeros(H + 4)), jnp.ones(2 * H), LB)


# ------------------------------------------------------------------------------------------------ helpers


def test_short_conv_formula_state_and_weight_shapes():
    rng = np.random.default_rng(8)
    B, T, C, W = 2, 9, 5, 4
    x = rng.standard_normal((B, T, C)).astype(np.float32)
    w = rng.standard_normal((C, 1, W)).astype(np.float32)
    st = rng.standard_normal((B, C, W - 1)).astype(np.float32)
    xe = np.concatenate([st.transpose(0, 2, 1), x], axis=1).astype(np.float64)
    pre = sum(w[None, None, :, 0, i] * xe[:, i : i + T] for i in range(W))
    want = pre / (1 + np.exp(-pre))
    y, new = short_conv(jnp.asarray(x), jnp.asarray(w), conv_state=jnp.asarray(st))
    assert rel(y, want) <= 1e-6
    np.testing.assert_array_equal(np.asarray(new), x[:, -(W - 1) :].transpose(0, 2, 1))
    y2, _ = short_conv(jnp.asarray(x), jnp.asarray(w[:, 0]), conv_state=jnp.asarray(st))  # [C, W] weight
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y2))
    # zeros before the start when no state; a split run with the carried state equals the one-shot run
    y0, _ = short_conv(jnp.asarray(x), jnp.asarray(w))
    ya, sa = short_conv(jnp.asarray(x[:, :2]), jnp.asarray(w))  # shorter than W-1: state keeps zero rows
    yb, sb = short_conv(jnp.asarray(x[:, 2:]), jnp.asarray(w), conv_state=sa)
    np.testing.assert_allclose(np.concatenate([ya, yb], axis=1), np.asarray(y0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(sa[:, :, 0]), 0)
    with pytest.raises(ValueError, match="weight"):
        short_conv(jnp.asarray(x), jnp.asarray(w[:3]))
    with pytest.raises(ValueError, match="conv_state"):
        short_conv(jnp.asarray(x), jnp.asarray(w), conv_state=jnp.asarray(st[:1]))


def test_gated_rms_norm_formula():
    rng = np.random.default_rng(9)
    o = rng.standard_normal((2, 3, 4, 8))
    gate = rng.standard_normal((2, 3, 4, 8))
    w = rng.standard_normal(8)
    eps = 1e-5
    want = o / np.sqrt((o**2).mean(-1, keepdims=True) + eps) * w / (1 + np.exp(-gate))
    with jax.enable_x64(True):
        got = gated_rms_norm(jnp.asarray(o), jnp.asarray(gate), jnp.asarray(w), eps)
        assert got.dtype == jnp.float64 and rel(got, want) <= 1e-14
    got32 = gated_rms_norm(
        jnp.asarray(o, jnp.bfloat16), jnp.asarray(gate, jnp.float32), jnp.asarray(w, jnp.float32), eps
    )
    assert got32.dtype == jnp.float32


@pytest.mark.parametrize("bad", [[0, 5, 5, 10], [1, 10], [0, 9], [0, 11], [[0, 10]], [0.0, 10.0]], ids=str)
def test_invalid_cu_seqlens_raise(bad):
    q, k, v, g, beta, _ = make_inputs(10, 1, 10, 1, 4, 4)
    for fn in (kda_chunk, kda_recurrent):
        with pytest.raises(ValueError, match="cu_seqlens"):
            fn(q, k, v, g, beta, cu_seqlens=np.asarray(bad))
    with pytest.raises(ValueError, match="cu_seqlens"):
        short_conv(v[:, :, 0], jnp.ones((4, 1, 4)), cu_seqlens=np.asarray(bad))


def test_bad_shapes_and_batch_with_cu_seqlens_raise():
    q, k, v, g, beta, _ = make_inputs(11, 2, 10, 1, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens"):
        kda_chunk(q, k, v, g, beta, cu_seqlens=np.array([0, 10]))  # B = 2
    with pytest.raises(ValueError, match="beta"):
        kda_recurrent(q, k, v, g, beta[:, :, :, None])
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk(q, k, v, g, beta, initial_state=jnp.ones((1, 1, 4, 4)))
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk(q, k, v, g, beta, chunk_size=0)


# ------------------------------------------------------------------------------------------------ the module

PREFIX = "model.layers.{i}.self_attn."


def tiny_configs():
    base = load_config("tiny")
    return {"k3": base, "kimi_linear_gates": base.replace(use_full_rank_gate=False, gate_lower_bound=None)}


def random_kda_params(cfg, i, seed) -> dict[str, np.ndarray]:
    """Random canonical weights for KDA layer i: {name without the self_attn prefix: fp32 array}."""
    return {k: v.astype(np.float32) for k, v in kda_params(cfg, i, np.random.default_rng(seed)).items()}


def to_tree(flat, dtype=jnp.float32) -> dict:
    return {"params": params_to_tree(flat, dtype)}


def jit_apply(model, cu=None):
    """Jitted ``model.apply`` (cu_seqlens is static: it must be concrete)."""
    return jax.jit(
        lambda p, x, cache=None, mode="chunk": model.apply(p, x, cu_seqlens=cu, cache=cache, mode=mode),
        static_argnames="mode",
    )


@pytest.mark.parametrize("name", ["k3", "kimi_linear_gates"])
def test_module_param_tree_is_canonical(name):
    cfg = tiny_configs()[name]
    i = cfg.kda_layers[1]
    model = KimiDeltaAttention(cfg, i)
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.ones((1, 3, cfg.hidden_size)))
    flat = {
        "/".join(str(k.key) for k in path): tuple(v.shape)
        for path, v in jax.tree_util.tree_leaves_with_path(shapes["params"])
    }
    want = {
        n.replace(".", "/"): tuple(s.shape)
        for n, s in (
            (k, v)
            for k, v in (
                (s.name[len(PREFIX.format(i=i)) :], s)
                for s in param_layout(cfg, [i])
                if s.name.startswith(PREFIX.format(i=i))
            )
        )
    }
    assert flat == want
    with pytest.raises(ValueError, match="layer_idx"):
        jax.eval_shape(
            KimiDeltaAttention(cfg, cfg.mla_layers[0]).init, jax.random.PRNGKey(0), jnp.ones((1, 3, cfg.hidden_size))
        )


@pytest.mark.parametrize("name,mode", [("k3", "chunk"), ("kimi_linear_gates", "recurrent")])
def test_module_decode_matches_prefill(name, mode):
    """Case 3: prefill T vs prefill T-8 then 8 single-token decode steps carrying the cache; fp32 rounding only."""
    cfg = tiny_configs()[name]
    model = KimiDeltaAttention(cfg, 0)
    params = to_tree(random_kda_params(cfg, 0, seed=30))
    T = 24
    x = jnp.asarray(np.random.default_rng(31).standard_normal((2, T, cfg.hidden_size)), jnp.float32)
    apply = jit_apply(model)
    out, cache = apply(params, x, mode=mode)
    assert out.shape == x.shape and isinstance(cache, KDACache)
    P, W = cfg.kda_num_heads * cfg.kda_head_dim, cfg.short_conv_kernel_size
    assert cache.conv_q.shape == (2, P, W - 1) and cache.S.shape == (
        2,
        cfg.kda_num_heads,
        cfg.kda_head_dim,
        cfg.kda_head_dim,
    )
    out_p, c = apply(params, x[:, : T - 8], mode=mode)
    steps = []
    for t in range(T - 8, T):
        o_t, c = apply(params, x[:, t : t + 1], c, mode=mode)
        steps.append(o_t)
    assert rel(out_p, out[:, : T - 8]) <= TOL_FP32
    assert rel(jnp.concatenate(steps, axis=1), out[:, T - 8 :]) <= TOL_FP32
    for a, b in zip(c, cache):
        assert rel(a, b) <= TOL_FP32


def test_module_chunk_vs_recurrent_fp64_and_packed():
    """The module's two modes agree in fp64; packed documents equal separate calls, with one cache row per document."""
    cfg = tiny_configs()["k3"]
    model = KimiDeltaAttention(cfg, 0)
    flat = random_kda_params(cfg, 0, seed=40)
    cu = np.array([0, 16, 17, 33])  # a length-1 document in the middle
    with jax.enable_x64(True):
        params = to_tree(flat, jnp.float64)
        x = jnp.asarray(np.random.default_rng(41).standard_normal((1, 33, cfg.hidden_size)))
        packed = jit_apply(model, cu)
        out_c, cache_c = packed(params, x, mode="chunk")
        out_r, cache_r = packed(params, x, mode="recurrent")
        assert out_c.dtype == jnp.float64 and cache_c.S.dtype == jnp.float64
        assert rel(out_c, out_r) <= TOL_FP64 and rel(cache_c.S, cache_r.S) <= TOL_FP64
        assert cache_c.S.shape[0] == 3 and cache_c.conv_k.shape[0] == 3
        single = jit_apply(model)
        for n in range(3):
            s, e = cu[n], cu[n + 1]
            o_n, c_n = single(params, x[:, s:e], mode="chunk")
            assert rel(out_c[:, s:e], o_n) <= TOL_FP64
            for a, b in zip(cache_c, c_n):
                assert rel(a[n], b[0]) <= TOL_FP64
        with pytest.raises(ValueError, match="mode"):
            model.apply(params, x, mode="fused")
