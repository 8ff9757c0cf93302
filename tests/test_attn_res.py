"""AttnRes depth mix ``reference_jax.attn_res`` against a hand computation of spec 5.4 in fp64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import rel

from reference_jax.attn_res import attn_res_mix, attn_res_weights

TOL_FP64 = 1e-12  # reference vs numpy, fp64
TOL_SUM = 1e-6  # softmax weights sum to 1 (fp32)


def np_mix(V, n, p, eps):
    """Spec 5.4, written out: V [M, B, T, D] fp64 -> ([B, T, D], pi [M, B, T])."""
    key = V / np.sqrt(np.mean(V * V, axis=-1, keepdims=True) + eps)
    score = key @ (n * p.reshape(-1))  # [M, B, T]
    pi = np.exp(score - score.max(0))
    pi = pi / pi.sum(0)
    return (pi[..., None] * V).sum(0), pi


def inputs(M, B=2, T=5, D=24, seed=0):
    rng = np.random.default_rng(seed)
    # sources of very different magnitudes, as block sums are
    V = rng.standard_normal((M, B, T, D)) * rng.uniform(0.2, 20.0, (M, 1, 1, 1))
    n = 1.0 + 0.3 * rng.standard_normal(D)
    p = rng.standard_normal((1, D))  # [1, D], as *_res_proj.weight
    return V, n, p


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_one_source_is_identity(dtype):
    V, n, p = inputs(1)
    v = jnp.asarray(V[0], dtype)
    for src in ([v], v[None]):
        out = attn_res_mix(src, jnp.asarray(n, dtype), jnp.asarray(p, dtype))
        assert out.dtype == dtype and bool(jnp.all(out == v))


@pytest.mark.parametrize("M", [2, 3, 9], ids=["M2", "M3", "M9"])
def test_matches_hand_computation_fp64(M):
    V, n, p = inputs(M, seed=M)
    want, want_pi = np_mix(V, n, p, 1e-5)
    with jax.enable_x64(True):
        out = attn_res_mix([jnp.asarray(v) for v in V], jnp.asarray(n), jnp.asarray(p))
        pi = attn_res_weights(jnp.asarray(V), jnp.asarray(n), jnp.asarray(p))
        assert out.dtype == jnp.float64 and out.shape == V.shape[1:]
    assert rel(out, want) <= TOL_FP64
    assert rel(pi, want_pi) <= TOL_FP64
    # the depth softmax is not flat here (no hidden 1/sqrt(D) would keep it so): the test has teeth
    assert float(np.asarray(pi).max()) > 0.5


def test_weights_are_a_softmax_over_depth():
    V, n, p = inputs(4, seed=1)
    pi = np.asarray(
        attn_res_weights(jnp.asarray(V, jnp.float32), jnp.asarray(n, jnp.float32), jnp.asarray(p, jnp.float32))
    )
    assert pi.shape == V.shape[:3] and pi.dtype == np.float32
    assert np.all(pi >= 0) and np.abs(pi.sum(0) - 1).max() <= TOL_SUM
    # equal sources: a convex combination returns the source
    same = jnp.asarray(np.stack([V[0]] * 3), jnp.float32)
    assert rel(attn_res_mix(same, jnp.asarray(n, jnp.float32), jnp.asarray(p, jnp.float32)), V[0]) <= 1e-6


def test_scale_changes_the_value_not_the_key():
    V, n, p = inputs(3, seed=2)
    c = 7.5
    W = V.copy()
    W[1] *= c
    with jax.enable_x64(True):
        args = (jnp.asarray(n), jnp.asarray(p))
        pi = attn_res_weights(jnp.asarray(V), *args, eps=0.0)
        pi_scaled = attn_res_weights(jnp.asarray(W), *args, eps=0.0)
        out = attn_res_mix(jnp.asarray(V), *args, eps=0.0)
        out_scaled = attn_res_mix(jnp.asarray(W), *args, eps=0.0)
        # with the default eps the key is invariant up to eps / mean(v²)
        pi_eps = attn_res_weights(jnp.asarray(W), *args)
    assert rel(pi_scaled, pi) <= TOL_FP64  # the key is RMS-normalised: scale-free
    assert rel(pi_eps, pi) <= 1e-5
    pi = np.asarray(pi)
    # the value is raw: out moves by (c - 1) * pi_1 * v_1
    assert rel(out_scaled, np.asarray(out) + (c - 1) * pi[1][..., None] * V[1]) <= TOL_FP64
    assert rel(out_scaled, out) > 0.1


def test_bf16_is_fp32_math_rounded_once():
    V, n, p = inputs(3, seed=3)
    V16 = jnp.asarray(V, jnp.bfloat16)
    n16, p16 = jnp.asarray(n, jnp.bfloat16), jnp.asarray(p, jnp.bfloat16)
    out = attn_res_mix(V16, n16, p16)
    assert out.dtype == jnp.bfloat16
    want = attn_res_mix(V16.astype(jnp.float32), n16.astype(jnp.float32), p16.astype(jnp.float32)).astype(jnp.bfloat16)
    assert bool(jnp.all(out == want))


def test_proj_weight_as_row_or_vector():
    V, n, p = inputs(3, seed=4)
    a = attn_res_mix(jnp.asarray(V, jnp.float32), jnp.asarray(n, jnp.float32), jnp.asarray(p, jnp.float32))
    b = attn_res_mix(jnp.asarray(V, jnp.float32), jnp.asarray(n, jnp.float32), jnp.asarray(p[0], jnp.float32))
    assert bool(jnp.all(a == b))


def test_rejects_bad_arguments():
    V, n, p = inputs(2)
    v = jnp.asarray(V[0], jnp.float32)
    nn_, pp = jnp.asarray(n, jnp.float32), jnp.asarray(p, jnp.float32)
    with pytest.raises(ValueError, match="no sources"):
        attn_res_mix([], nn_, pp)
    with pytest.raises(ValueError, match="shapes"):
        attn_res_mix([v, v[:, :-1]], nn_, pp)
    with pytest.raises(ValueError, match="dtypes"):
        attn_res_mix([v, v.astype(jnp.bfloat16)], nn_, pp)
    with pytest.raises(ValueError, match="proj_weight"):
        attn_res_mix([v, v], nn_, pp[:, :-1])
