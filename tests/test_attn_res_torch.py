"""``kernels_torch.attn_res`` against its JAX twin (``reference_jax.attn_res``) on the same random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel

from kernels_torch import attn_res as T_ar
from reference_jax import attn_res as J_ar

TOL_FP32 = 1e-5  # torch vs JAX, fp32
TOL_FP64 = 1e-10  # torch vs JAX, fp64
DTYPES = {"fp32": (torch.float32, jnp.float32, TOL_FP32), "fp64": (torch.float64, jnp.float64, TOL_FP64)}


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("M", [1, 3, 9], ids=["M1", "M3", "M9"])
def test_attn_res_mix_matches_jax(M, dt):
    tdt, jdt, tol = DTYPES[dt]
    rng = np.random.default_rng(M)
    V = rng.standard_normal((M, 2, 5, 24)) * rng.uniform(0.2, 20.0, (M, 1, 1, 1))
    n, p = 1.0 + 0.3 * rng.standard_normal(24), rng.standard_normal((1, 24))
    with jax.enable_x64(True):
        want = J_ar.attn_res_mix([jnp.asarray(v, jdt) for v in V], jnp.asarray(n, jdt), jnp.asarray(p, jdt))
        want_pi = J_ar.attn_res_weights(jnp.asarray(V, jdt), jnp.asarray(n, jdt), jnp.asarray(p, jdt))
    Vt = [torch.from_numpy(v).to(tdt) for v in V]
    got = T_ar.attn_res_mix(Vt, torch.from_numpy(n).to(tdt), torch.nn.Parameter(torch.from_numpy(p).to(tdt)))
    got_pi = T_ar.attn_res_weights(torch.stack(Vt), torch.from_numpy(n).to(tdt), torch.from_numpy(p).to(tdt))
    assert got.dtype == tdt and got.shape == V.shape[1:]
    assert rel(got, want) <= tol and rel(got_pi, want_pi) <= tol
    if M == 1:
        assert torch.equal(got, Vt[0])


def test_attn_res_mix_bf16():
    rng = np.random.default_rng(11)
    V = torch.from_numpy(rng.standard_normal((4, 2, 5, 24)) * rng.uniform(0.2, 20.0, (4, 1, 1, 1))).bfloat16()
    n = torch.from_numpy(1.0 + 0.3 * rng.standard_normal(24)).bfloat16()
    p = torch.from_numpy(rng.standard_normal((1, 24))).bfloat16()
    got = T_ar.attn_res_mix(V, n, p)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, T_ar.attn_res_mix(V.float(), n.float(), p.float()).bfloat16())  # fp32 math, one rounding
    with pytest.raises(ValueError, match="no sources"):
        T_ar.attn_res_mix([], n, p)
    with pytest.raises(ValueError, match="proj_weight"):
        T_ar.attn_res_mix(V, n, p[:, :-1])
