"""The error measures the GPU tests compare by (``tests/gpu/_helpers.py``), on the CPU: a NaN or an infinity must fail a
``<= tol`` check, and a reference the math makes exactly zero is measured in units of the same quantity elsewhere.

The second half checks that math on the eager KDA layer (fp64): from a zero state the gate's parameters get an exactly
zero gradient at T = 1 (the decay only multiplies that state) and a non-zero one at T = 2, which
``tests/gpu/test_gpu_kda_cudnn.py`` relies on when it scales the T = 1 gate gradients by the T = 2 ones.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "gpu"))
from _helpers import init_layer, rel_or_scaled  # noqa: E402
from helpers import rel

import kernels_torch.kda as tk  # noqa: E402
from kimi.config import load_config  # noqa: E402

GATE_PARAMS = ("A_log", "dt_bias", "f_a_proj.weight", "f_b_proj.weight")


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_rel_is_the_relative_frobenius_error():
    b = _randn(5, 7, seed=0)
    a = b + 1e-3 * _randn(5, 7, seed=1)
    want = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))
    assert rel(a, b) == pytest.approx(want, rel=1e-12)
    assert rel(a.float(), b) == pytest.approx(want, rel=1e-5)  # any dtype, compared in fp64


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_rel_is_inf_for_a_non_finite_value_so_a_tolerance_check_fails(bad):
    b = _randn(4, 3, seed=2)
    a = b.clone()
    a[1, 2] = bad
    e = rel(a, b)
    assert e == math.inf and not e <= 1e9


def test_rel_on_zero_references():
    z = torch.zeros(3, 4, dtype=torch.float64)
    assert rel(z, z) == 0.0  # exact zeros match
    assert rel(1e-12 * _randn(3, 4, seed=3), z) == math.inf  # only the reference is zero: no relative scale


def test_rel_or_scaled():
    b = _randn(6, seed=4)
    a = b + 1e-2 * _randn(6, seed=5)
    scale = _randn(6, seed=6)
    assert rel_or_scaled(a, b, scale) == rel(a, b)  # a non-zero reference: plain rel, scale unused
    z = torch.zeros(6, dtype=torch.float64)
    noise = 1e-4 * _randn(6, seed=7)
    assert rel_or_scaled(noise, z, scale) == pytest.approx(float(noise.norm() / scale.norm()), rel=1e-12)
    assert rel_or_scaled(z, z, scale) == 0.0
    noise[2] = math.nan
    assert rel_or_scaled(noise, z, scale) == math.inf
    for bad in (z, torch.full((6,), math.inf), torch.full((6,), math.nan)):
        with pytest.raises(ValueError, match="scale: got a tensor of norm"):
            rel_or_scaled(1e-4 * _randn(6, seed=8), z, bad)


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["k3_lb_sigmoid", "kimi_linear_softplus"])
def test_eager_gate_gradient_is_zero_at_T1_and_not_at_T2(lower_bound):
    cfg = load_config("tiny").replace(gate_lower_bound=lower_bound)
    layer = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="eager").double()
    init_layer(layer, seed=9)
    grads = {}
    for T in (1, 2):
        layer.zero_grad(set_to_none=True)
        x = _randn(2, T, cfg.hidden_size, seed=10)
        out, _ = layer(x)
        out.backward(_randn(*out.shape, seed=11))
        grads[T] = {n: p.grad.clone() for n, p in layer.named_parameters()}
    for n in GATE_PARAMS:
        assert not grads[1][n].ne(0).any(), f"{n}: non-zero gradient at T = 1 from a zero state"
        assert grads[2][n].norm() > 0, f"{n}: zero gradient at T = 2"
    assert grads[1]["q_proj.weight"].norm() > 0  # the rest of the layer does get a gradient at T = 1
