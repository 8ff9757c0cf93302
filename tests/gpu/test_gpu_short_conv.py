"""GPU checks of KDA's short convolution (depthwise causal conv1d, width 4, + SiLU) on both kernels of the ``cudnn``
backend: cuDNN Frontend's ``cudnn.ops.causal_conv1d`` (``kernels_torch.kda_cudnn.short_conv_cudnn``) and fla-core's
``causal_conv1d`` as the layer calls it, against the eager function ``kernels_torch.kda.short_conv`` in fp64 on the same
bf16 inputs: y, dx, dw and the new conv state, at T in {1, 63, 2049, 8192}, packed documents with length-1 documents,
non-zero conv states, and bitwise reproducible forwards (activation recomputation relies on them). Spec
``architecture.md`` 2.2 step 2; cases 4-5. Each error is printed as ``CONV_ERR <test> <tensor> <value>``.
"""

from __future__ import annotations

import pytest
import torch
from helpers import rel

import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
W = 4
TOL = {  # bf16 kernel (fp32 accumulation) against fp64 eager on the same bf16 values, ||a - b|| / ||b||
    "y": 8e-3,  # one bf16 rounding of the output (2^-9 relative, ~4e-3 in norm)
    "dx": 8e-3,  # bf16 dx: one rounding
    "dw": 2e-3,  # fp32 sums over T of bf16 products
    "state": 0.0,  # copies of inputs: exact
}
CASES = {  # name -> (B, T, C, cu_seqlens, with_state)
    "T1": (2, 1, 512, None, False),
    "T63": (2, 63, 512, None, True),
    "T2049": (1, 2049, 1536, None, False),
    "T8192_real_width": (1, 8192, 12288, None, False),
    "packed_len1": (1, 503, 512, [0, 1, 2, 3, 503], True),
    "packed_five": (1, 2000, 1536, [0, 15, 100, 300, 1200, 2000], False),
}


def fla_conv(x, weight, cu, state):
    """fla's ``causal_conv1d`` exactly as ``kernels_torch.kda_cudnn.kda_layer_forward`` calls it (our state as fla's
    W-wide window)."""
    from fla.modules.causal_conv1d import causal_conv1d

    y, final = causal_conv1d(
        x=x,
        weight=weight[:, 0, :],
        initial_state=kc._fla_conv_state(state),
        output_final_state=True,
        activation="silu",
        cu_seqlens=cu,
        cu_seqlens_cpu=None if cu is None else cu.cpu(),
    )
    return y, final[..., 1:]


@pytest.fixture(params=["cudnn", "fla"])
def conv(request):
    if request.param == "cudnn":
        why = kc.cudnn_short_conv_unavailable(torch.empty(1, device=DEVICE, dtype=torch.bfloat16), W)
        if why is not None:
            pytest.skip(f"cuDNN short conv: {why}")
        return lambda x, w, cu, state: kc.short_conv_cudnn(x, w, cu, state)
    return fla_conv


def case_inputs(case: str, seed: int):
    B, T, C, cu, with_state = CASES[case]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(B, T, C, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = 0.5 * torch.randn(C, 1, W, device=DEVICE, generator=gen)  # fp32, the checkpoint's dtype
    N = B if cu is None else len(cu) - 1
    state = torch.randn(N, C, W - 1, device=DEVICE, generator=gen).to(torch.bfloat16) if with_state else None
    dy = torch.randn(B, T, C, device=DEVICE, generator=gen).to(torch.bfloat16)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device=DEVICE)
    return x, w, state, dy, cu_t


@pytest.mark.parametrize("case", list(CASES))
def test_matches_eager(case, conv, request):
    x, w, state, dy, cu = case_inputs(case, seed=len(case))
    xd, wd = x.double().requires_grad_(True), w.double().requires_grad_(True)
    y_ref, new_ref = tk.short_conv(xd, wd, None if cu is None else cu.cpu(), None if state is None else state.double())
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xd, wd), dy.double())
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y, new = conv(xg, wg, cu, state)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape and new.shape == new_ref.shape
    dx, dw = torch.autograd.grad(y, (xg, wg), dy)
    assert dw.dtype == torch.float32 and dw.shape == w.shape
    test = request.node.name
    errs = {"y": rel(y, y_ref), "dx": rel(dx, dx_ref), "dw": rel(dw, dw_ref), "state": rel(new, new_ref)}
    for name, e in errs.items():
        print(f"CONV_ERR {test} {name} {e:.3e}")
    bad = {n: (e, TOL[n]) for n, e in errs.items() if not e <= TOL[n]}
    assert not bad, f"relative errors over tolerance: {bad}"


@pytest.mark.parametrize("case", ["T2049", "packed_len1"])
def test_forward_bitwise_reproducible(case, conv):
    x, w, state, _, cu = case_inputs(case, seed=3)
    with torch.no_grad():
        a, sa = conv(x, w, cu, state)
        b, sb = conv(x, w, cu, state)
    assert torch.equal(a, b) and torch.equal(sa, sb)


def test_documents_reset():
    """The packed call differs from the whole row run as one sequence exactly at the first W-1 tokens of every later
    document (cuDNN's kernel; the reset is real and no wider than the window)."""
    why = kc.cudnn_short_conv_unavailable(torch.empty(1, device=DEVICE, dtype=torch.bfloat16), W)
    if why is not None:
        pytest.skip(f"cuDNN short conv: {why}")
    x, w, _, _, cu = case_inputs("packed_five", seed=5)
    with torch.no_grad():
        packed, _ = kc.short_conv_cudnn(x, w, cu, None)
        whole, _ = kc.short_conv_cudnn(x, w, None, None)
    differs = (packed != whole).any(dim=-1)[0]
    starts = cu.tolist()[1:-1]
    expected = torch.zeros_like(differs)
    for s in starts:
        expected[s : s + W - 1] = True
    assert torch.equal(differs, expected)
