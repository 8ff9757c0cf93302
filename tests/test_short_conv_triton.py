"""The Triton short convolution (``kernels_torch.ops.short_conv.short_conv_silu``) against the eager
``kernels_torch.kda.short_conv`` in fp64 with autograd: y, the new conv state, dx and dweight, with packed documents
(a length-1 one among them), conv states, T = 1 and row / channel counts that are not multiples of the blocks, on the
CPU through Triton's interpreter.

The kernel tests run only where Triton imports and ``TRITON_INTERPRET=1`` was set before it was imported (CI has no
Triton; they skip with the reason). To run them here::

    TRITON_INTERPRET=1 PYTHONPATH=.:/path/to/triton python -m pytest -q tests/test_short_conv_triton.py

On CUDA and inside the cuDNN KDA layer: ``tests/gpu/test_gpu_kda_prep.py``. The argument checks run everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

import kernels_torch.kda as tk
from kernels_torch.ops import short_conv as sc

TRITON_CPU = sc.triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(
    not TRITON_CPU,
    reason="needs Triton with TRITON_INTERPRET=1 set before import (CPU interpreter); CUDA: tests/gpu/test_gpu_kda_prep.py",
)
# ||a - b|| / ||b|| against fp64 eager autograd, per tensor: fp32 math and fp32 inputs here
TOL = {"y": 1e-6, "state": 0.0, "dx": 1e-6, "dw": 1e-6}

CASES = {  # name -> (B, T, C, cu_seqlens, with a conv state)
    "T1": (2, 1, 70, None, False),
    "T63-state": (2, 63, 70, None, True),
    "packed-len1-state": (1, 75, 130, [0, 1, 2, 40, 41, 75], True),
    "packed-nostate": (1, 100, 64, [0, 37, 38, 100], False),
}


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    n = torch.linalg.vector_norm(b)
    return float(torch.linalg.vector_norm(a - b) / n) if n > 0 else float(torch.linalg.vector_norm(a))


@needs_interpreter
@pytest.mark.parametrize("case", list(CASES))
def test_matches_eager_with_gradients(case, monkeypatch):
    B, T, C, cu, with_state = CASES[case]
    W = 4
    monkeypatch.setitem(sc.TRITON_CONFIG, "block_t", 16)  # several row blocks and tiles even at these sizes
    monkeypatch.setitem(sc.TRITON_CONFIG, "bwd_tiles", 2)
    gen = torch.Generator().manual_seed(T + C)
    N = B if cu is None else len(cu) - 1
    x = torch.randn(B, T, C, generator=gen)
    w = 0.5 * torch.randn(C, 1, W, generator=gen)
    state = torch.randn(N, C, W - 1, generator=gen) if with_state else None
    dy = torch.randn(B, T, C, generator=gen)
    cu_t = None if cu is None else torch.tensor(cu)

    xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y, new_state = sc.short_conv_silu(xs, ws, cu_t, state)
    (y * dy).sum().backward()
    xr, wr = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y_r, state_r = tk.short_conv(xr, wr, cu_t, None if state is None else state.double())
    (y_r * dy.double()).sum().backward()

    assert y.shape == (B, T, C) and y.dtype == x.dtype and new_state.shape == (N, C, W - 1)
    errs = {
        "y": rel(y, y_r),
        "state": rel(new_state, state_r),
        "dx": rel(xs.grad, xr.grad),
        "dw": rel(ws.grad, wr.grad),
    }
    assert ws.grad.shape == w.shape
    bad = {k: v for k, v in errs.items() if not v <= TOL[k]}
    assert not bad, f"{case}: {errs}"


@needs_interpreter
def test_bitwise_reproducible_and_bf16():
    """Two calls give identical bits (no atomics: the dw partial sums are reduced in torch); bf16 x keeps bf16 y."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 50, 40, generator=gen).bfloat16().requires_grad_(True)
    w = torch.randn(40, 4, generator=gen).requires_grad_(True)
    runs = []
    for _ in range(2):
        x.grad = w.grad = None
        y, _ = sc.short_conv_silu(x, w, torch.tensor([0, 20, 50]))
        y.float().sum().backward()
        runs.append((y, x.grad, w.grad))
    assert runs[0][0].dtype == torch.bfloat16
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    y_r, _ = tk.short_conv(x.detach(), w.detach(), torch.tensor([0, 20, 50]))
    assert rel(runs[0][0], y_r) <= 5e-3  # bf16 rounding of y


def test_argument_errors():
    """Everywhere (no kernel runs): the device, shapes, kernel width and a state that needs a gradient are named."""
    x = torch.randn(1, 5, 8)
    if not TRITON_CPU:
        with pytest.raises(RuntimeError, match="short convolution cannot run"):
            sc.short_conv_silu(x, torch.randn(8, 4))
        return
    with pytest.raises(ValueError, match="weight"):
        sc.short_conv_silu(x, torch.randn(7, 4))
    with pytest.raises(ValueError, match="W=3"):
        sc.short_conv_silu(x, torch.randn(8, 3))
    with pytest.raises(ValueError, match="conv_state"):
        sc.short_conv_silu(x, torch.randn(8, 4), None, torch.randn(1, 8, 2))
    with pytest.raises(RuntimeError, match="conv_state"):
        sc.short_conv_silu(x, torch.randn(8, 4), None, torch.randn(1, 8, 3, requires_grad=True))
    with pytest.raises(ValueError, match="cu_seqlens"):
        sc.short_conv_silu(x, torch.randn(8, 4), torch.tensor([0, 6]))
