"""GPU checks of the fused SiTU-GLU (``kernels_torch.ops.situ``): the Triton kernels against the torch kernel (fp32
math on the same values), and the ``cudnn`` backend's DenseMLP / KimiMoE (fused activation) against the eager
modules with the same weights.

    python -m pytest -q -m gpu tests/gpu/test_gpu_situ.py
"""

from __future__ import annotations

import pytest
import torch
from _helpers import init_layer
from helpers import rel

from kernels_torch import kernel_choice
from kernels_torch.moe import DenseMLP, KimiMoE
from kernels_torch.ops import situ as S
from kimi.config import load_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not S.triton_available(), reason="needs triton"),
]

TOL_FP32 = 1e-5  # Triton vs torch kernel, fp32 out / da / db (||x - y|| / ||y||; GPU exp and our tanh: a few ulp)
TOL_BF16_ULP = 2.0**-7  # Triton bf16 values vs the fp32 math on the same inputs: within one bf16 ulp per element ...
TOL_BF16_CANCEL = 1e-6  # ... plus this times max|ref| (fp32 cancellation where d gate/da crosses 0)
TOL_MODULE_FP32 = 1e-5  # cudnn-backend module vs eager module, fp32: output and every weight gradient
TOL_MODULE_BF16 = 1e-2  # the same in bf16 (matmuls in bf16; the activation's rounding may differ by an ulp)

CASES = [("situ", 25.0), ("situ", None), ("silu", None)]
CASE_IDS = ["situ", "situ_nolinear", "silu"]


def _inputs(n, i, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    a = (torch.randn(n, i, device="cuda", generator=g) * 3).to(dtype)
    b = (torch.randn(n, i, device="cuda", generator=g) * 12).to(dtype)
    dout = torch.randn(n, i, device="cuda", generator=g).to(dtype)
    return a, b, dout


def _run(a, b, dout, act, lb, kernel):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    out = S.situ_glu(a, b, 4.0, lb, hidden_act=act, kernel=kernel)
    out.backward(dout)
    return out.detach(), a.grad, b.grad


def _within_one_bf16_ulp(x, ref):
    x, ref = x.double(), ref.double()
    return bool(((x - ref).abs() <= TOL_BF16_ULP * ref.abs() + TOL_BF16_CANCEL * ref.abs().max()).all())


@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,i", [(1, 3072), (63, 3072), (8193, 3072), (1, 33792), (63, 33792), (8193, 33792)])
def test_triton_matches_torch(n, i, dtype, act, lb):
    if n * i > 8193 * 3072 and act != "situ":  # the big shape once per dtype is enough (the K3 activation)
        pytest.skip("the 8193 x 33792 shape runs for hidden_act='situ' only")
    a, b, dout = _inputs(n, i, dtype, seed=n + i)
    got = _run(a, b, dout, act, lb, "triton")
    assert all(x.dtype == dtype for x in got)
    for name, x in zip(("out", "da", "db"), got, strict=True):
        assert torch.isfinite(x).all(), name
    if dtype == torch.float32:
        want = _run(a, b, dout, act, lb, "torch")
        for name, x, y in zip(("out", "da", "db"), got, want, strict=True):
            assert rel(x, y) <= TOL_FP32, (name, rel(x, y))
    else:
        want = _run(a.float(), b.float(), dout.float(), act, lb, "torch")
        for name, x, y in zip(("out", "da", "db"), got, want, strict=True):
            assert _within_one_bf16_ulp(x, y), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_extreme_inputs_finite(dtype):
    big = 1e4 if dtype == torch.float32 else torch.finfo(torch.bfloat16).max / 4
    vals = torch.tensor([-big, -100.0, -1e-3, 0.0, 1e-3, 100.0, big], device="cuda")
    a, b = vals.repeat_interleave(len(vals)).to(dtype), vals.repeat(len(vals)).to(dtype)
    for act, lb in CASES:
        bb = b.clamp(-1, 1) if act == "silu" else b
        got = _run(a, bb, torch.ones_like(a), act, lb, "triton")
        for name, x in zip(("out", "da", "db"), got, strict=True):
            assert torch.isfinite(x).all(), (act, lb, name)


def test_auto_picks_triton_on_cuda(monkeypatch):
    monkeypatch.delenv("KIMI_GLU_KERNEL", raising=False)
    kernel_choice.reset_used()
    a, b, _ = _inputs(4, 96, torch.bfloat16, seed=0)
    S.situ_glu(a, b)
    assert kernel_choice.used()["glu"] == {"triton": 1}


def _modules_agree(m_eager, m_cudnn, x, tol):
    m_cudnn.load_state_dict(m_eager.state_dict())
    y0, y1 = m_eager(x), m_cudnn(x)
    g = torch.randn_like(y0)
    y0.backward(g)
    y1.backward(g)
    assert rel(y1, y0) <= tol, ("out", rel(y1, y0))
    for (name, p0), p1 in zip(m_eager.named_parameters(), m_cudnn.parameters(), strict=True):
        if p0.grad is not None and p0.grad.norm() > 0:
            assert rel(p1.grad, p0.grad) <= tol, (name, rel(p1.grad, p0.grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cudnn_dense_mlp_matches_eager(dtype):
    cfg = load_config("tiny")
    m0, m1 = DenseMLP(cfg, 3072), DenseMLP(cfg, 3072, backend="cudnn")
    init_layer(m0, seed=1)
    m0, m1 = m0.to("cuda", dtype), m1.to("cuda", dtype)
    x = torch.randn(2, 257, cfg.hidden_size, device="cuda").to(dtype)
    kernel_choice.reset_used()
    _modules_agree(m0, m1, x, TOL_MODULE_FP32 if dtype == torch.float32 else TOL_MODULE_BF16)
    assert kernel_choice.used()["glu"] == {"triton": 1}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cudnn_kimi_moe_matches_eager(dtype):
    cfg = load_config("tiny")
    m0, m1 = KimiMoE(cfg), KimiMoE(cfg, backend="cudnn")
    init_layer(m0, seed=2)
    m0, m1 = m0.to("cuda"), m1.to("cuda")
    for m in (m0, m1):  # activations and matrices in dtype; the router's correction bias stays fp32
        for name, p in m.named_parameters():
            if name != "gate.e_score_correction_bias":
                p.data = p.data.to(dtype)
    x = torch.randn(2, 129, cfg.hidden_size, device="cuda").to(dtype)
    kernel_choice.reset_used()
    _modules_agree(m0, m1, x, TOL_MODULE_FP32 if dtype == torch.float32 else TOL_MODULE_BF16)
    assert kernel_choice.used()["glu"]["triton"] >= 2  # experts that got tokens, and the shared experts
