"""Issue 13, fault 1: a saturated or overflowing KDA decay gate gives finite values and gradients, in both gate forms
(lower-bound sigmoid, K3; softplus, Kimi-Linear), in both paths, and the layers and recurrences stay finite after it.

``exp(A_log)`` overflows fp32 past A_log = 88.7; before the fix ``inf * 0`` gave g = NaN at ``f + dt_bias = 0`` and
NaN gradients where the sigmoid saturates. Mutations tried (each makes a test below fail): removing the A_log cap in
either twin; removing the G_MIN floor of the softplus form in either twin; a cap of 100 (> 88.7) in ``kimi.kda_gate``,
where both twins take the constants from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kernels_torch.kda as tk
import reference_jax.kda as jk

LB = -5.0


def _torch_gate(f, A_log, dt_bias, lb):
    f, A_log = f.clone().requires_grad_(True), A_log.clone().requires_grad_(True)
    dt_bias = dt_bias.clone().requires_grad_(True)
    g = tk.kda_gate(f, A_log, dt_bias, lb)
    g.sum().backward()
    return g.detach(), f.grad, A_log.grad, dt_bias.grad


def _jax_gate(f, A_log, dt_bias, lb):
    fn = lambda f, a, b: jk.kda_gate(f, a, b, lb).sum()  # noqa: E731
    grads = jax.grad(fn, argnums=(0, 1, 2))(f, A_log, dt_bias)
    return (jk.kda_gate(f, A_log, dt_bias, lb), *grads)


def test_constants_agree_between_twins():
    assert (tk.A_LOG_MAX, tk.G_MIN) == (jk.A_LOG_MAX, jk.G_MIN)


@pytest.mark.parametrize("path", ["torch", "jax"])
def test_issue_input_lower_bound(path):
    """The issue's exact input: f = 30, A_log = 89 -> g = -5 with zero gradients; f = 0 -> g = -2.5 (not NaN)."""
    for fval, want in ((30.0, LB), (0.0, LB / 2)):
        if path == "torch":
            out = _torch_gate(torch.full((1, 1, 1, 2), fval), torch.tensor([89.0]), torch.zeros(2), LB)
        else:
            out = _jax_gate(jnp.full((1, 1, 1, 2), fval), jnp.array([89.0]), jnp.zeros(2), LB)
        g, df, dA, db = (np.asarray(t) for t in out)
        assert np.all(g == want), (fval, g)
        for name, d in (("df", df), ("dA_log", dA), ("ddt_bias", db)):
            assert np.all(np.isfinite(d)), (fval, name, d)
        if fval == 30.0:  # saturated: the sigmoid is flat, so every gradient is exactly 0
            assert not np.any(df) and not np.any(dA) and not np.any(db)


@pytest.mark.parametrize("path", ["torch", "jax"])
@pytest.mark.parametrize("lb", [LB, None], ids=["lower_bound", "softplus"])
def test_overflowing_gate_finite_everywhere(path, lb):
    """A grid of extreme inputs (A_log up to 1e4, f + dt_bias from -1e30 to 1e30 and exactly 0): every g and every
    gradient finite; g within (lb, 0] for the lower-bound form and within [G_MIN, 0] for softplus."""
    xs = np.array([-1e30, -1e6, -200.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 200.0, 1e6, 1e30], np.float32)
    A = np.array([-50.0, 0.5, 60.0, 88.0, 89.0, 1e4], np.float32)
    f = np.broadcast_to(xs[:, None, None], (len(xs), len(A), 1)).reshape(1, len(xs), len(A), 1).copy()
    if path == "torch":
        out = _torch_gate(torch.tensor(f), torch.tensor(A), torch.zeros(len(A)), lb)
    else:
        out = _jax_gate(jnp.asarray(f), jnp.asarray(A), jnp.zeros(len(A)), lb)
    g, df, dA, db = (np.asarray(t) for t in out)
    for name, t in (("g", g), ("df", df), ("dA_log", dA), ("ddt_bias", db)):
        assert np.all(np.isfinite(t)), (name, t)
    assert np.all(g <= 0)
    assert np.all(g >= (LB if lb is not None else tk.G_MIN))


def test_twins_agree_on_saturated_inputs():
    """Torch and JAX give the same g and gradients on the saturated grid (fp32), both forms."""
    rng = np.random.default_rng(0)
    f = (rng.standard_normal((1, 5, 3, 4)) * np.array([1.0, 1e3, 1e8])[None, None, :, None]).astype(np.float32)
    A = np.array([1.0, 70.0, 95.0], np.float32)
    b = rng.standard_normal(12).astype(np.float32)
    for lb in (LB, None):
        t = _torch_gate(torch.tensor(f), torch.tensor(A), torch.tensor(b), lb)
        j = _jax_gate(jnp.asarray(f), jnp.asarray(A), jnp.asarray(b), lb)
        for name, a, bb in zip(("g", "df", "dA_log", "ddt_bias"), t, j):
            np.testing.assert_allclose(a.numpy(), np.asarray(bb), rtol=1e-5, atol=1e-6, err_msg=f"{lb} {name}")


@pytest.mark.parametrize("path", ["torch", "jax"])
def test_layer_recurrence_finite_after_saturated_gate(path):
    """A saturated gate token inside a chunk (softplus form floored at G_MIN) keeps kda_chunk finite and equal to
    kda_recurrent; without the floor, the chunk form's cumulative sums give NaN."""
    rng = np.random.default_rng(1)
    B, T, H, K, V = 1, 9, 2, 4, 3
    q, k = (rng.standard_normal((B, T, H, K)).astype(np.float32) for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((B, T, H, V)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (B, T, H)).astype(np.float32)
    f = rng.standard_normal((B, T, H, K)).astype(np.float32)
    f[:, 4] = 1e12  # one token whose softplus gate overflows: -exp(A_log) * 1e12 -> floored
    A = np.array([2.0, 89.0], np.float32)
    dt_b = rng.standard_normal(H * K).astype(np.float32)
    mod, conv = (tk, torch.tensor) if path == "torch" else (jk, jnp.asarray)
    g = mod.kda_gate(conv(f), conv(A), conv(dt_b), None)
    o_c, S_c = mod.kda_chunk(conv(q), conv(k), conv(v), g, conv(beta), chunk_size=4)
    o_r, S_r = mod.kda_recurrent(conv(q), conv(k), conv(v), g, conv(beta))
    for a in (g, o_c, S_c, o_r, S_r):
        assert np.all(np.isfinite(np.asarray(a)))
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(S_c), np.asarray(S_r), rtol=1e-4, atol=1e-5)


def test_normal_inputs_unchanged_fp64():
    """Below the caps the gate is the plain formula, bit for bit (fp64 and fp32, both forms, both twins)."""
    rng = np.random.default_rng(2)
    for ndt in (np.float32, np.float64):
        f = (rng.standard_normal((2, 7, 3, 5)) * 4).astype(ndt)
        A = np.log(rng.uniform(1, 16, 3)).astype(ndt)
        b = rng.standard_normal(15).astype(ndt)
        x = f + b.reshape(3, 5)
        with jax.enable_x64(ndt == np.float64):
            for lb in (LB, None):
                if lb is None:
                    want = -np.exp(A)[:, None] * np.logaddexp(x, 0)
                else:
                    want = lb / (1 + np.exp(-np.exp(A)[:, None] * x))
                gt = tk.kda_gate(torch.tensor(f), torch.tensor(A), torch.tensor(b), lb).numpy()
                gj = np.asarray(jk.kda_gate(jnp.asarray(f), jnp.asarray(A), jnp.asarray(b), lb))
                tol = 3e-6 if ndt == np.float32 else 1e-13
                np.testing.assert_allclose(gt, want, rtol=tol)
                np.testing.assert_allclose(gj, want, rtol=tol)
