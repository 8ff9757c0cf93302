"""GPU checks of the grouped routed experts (``kernels_torch.ops.moe_grouped``, ``moe_kernel="grouped_mm"``): equal to
the readable loop in bf16 at K3.1's expert shapes (experts with 0, 1 and many rows; T = 1, 63, 257), the Triton
gather-sums against their torch twins, and no host sync in a MoE layer's forward and backward nor in a whole model
training step (``torch.cuda.set_sync_debug_mode("error")``).

    python -m pytest -q -m gpu tests/gpu/test_gpu_moe_grouped.py
"""

from __future__ import annotations

import pytest
import torch
from _helpers import init_layer
from helpers import rel

from kernels_torch import kernel_choice
from kernels_torch.moe import KimiMoE
from kernels_torch.ops import moe_grouped as G
from kimi.config import load_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL_BF16 = 1e-2  # grouped vs loop, both bf16 (GEMM blocking, the fp32 sum's order): out, z.grad, expert grads
TOL_VS_FP32 = 2e-2  # grouped bf16 vs the loop in fp32 on the same bf16-exact weights and inputs
TOL_TRITON = 1e-6  # Triton gather-sums vs their torch twins (fp32 accumulation in the same order)
TOL_TRITON_BF16 = 2.0**-7  # ... their bf16 outputs (one rounding each)

K31 = load_config("k3.1-pro").truncated(2)


def _moe(cfg, dtype, seed=0):
    torch.manual_seed(seed)
    with torch.device("cuda"):
        m = KimiMoE(cfg, backend="cudnn")
    init_layer(m, seed)
    with torch.no_grad():
        for w in (m.experts.w1, m.experts.w3, m.experts.w2):
            w.normal_(0.0, w.shape[-1] ** -0.5)
        bias = 0.05 * torch.randn(cfg.num_experts, device="cuda")
        bias[[0, 5]] = -10.0  # no row
        bias[3] = 1.0  # many rows
        m.gate.e_score_correction_bias.copy_(bias)
    m = m.to(dtype)
    m.gate.e_score_correction_bias.data = m.gate.e_score_correction_bias.data.float()
    return m


def _routed(m, z, ids, w, kernel, dz):
    m.experts.moe_kernel = kernel
    m.zero_grad(set_to_none=True)
    z = z.detach().clone().requires_grad_()
    out = m.routed_experts(z, ids, w)
    out.backward(dz.to(out.dtype))
    return out.detach(), z.grad, {n: m.experts.get_parameter(n).grad for n in ("w1", "w3", "w2")}


@pytest.mark.parametrize("T", [1, 63, 257])
def test_grouped_equals_loop_bf16_at_k31_expert_shapes(T):
    cfg = K31.replace(num_experts=32)  # K3.1's widths and top-16; 32 experts keep the loop reference quick
    m = _moe(cfg, torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    with torch.no_grad():
        ids, w = m.gate(x)
        z = m.routed_expert_down_proj(x)
    dz = torch.randn(T, cfg.routed_expert_hidden_size, device="cuda", generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=cfg.num_experts)
    assert counts[0] == 0 and counts[5] == 0 and (T < 16 or int(counts[3]) == T)
    kernel_choice.reset_used()
    y1, dz1, g1 = _routed(m, z, ids, w, "grouped_mm", dz)
    assert kernel_choice.used()["moe"] == {"grouped_mm": 1}
    y0, dz0, g0 = _routed(m, z, ids, w, "loop", dz)
    assert not rel(y1, y0) > TOL_BF16 and not rel(dz1, dz0) > TOL_BF16  # NaN fails (rel is inf)
    for n in g0:
        assert not rel(g1[n], g0[n]) > TOL_BF16, n
        assert not g1[n][0].any() and not g1[n][5].any()  # starved experts: exactly zero gradient
    # and against fp32 arithmetic on the same bf16 values
    m32 = _moe(cfg, torch.float32)
    m32.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    y32, dz32, _ = _routed(m32, z.float(), ids, w, "loop", dz)
    assert not rel(y1, y32) > TOL_VS_FP32 and not rel(dz1, dz32) > TOL_VS_FP32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("align", [1, 16])
def test_triton_gather_sums_equal_torch(dtype, align):
    g = torch.Generator(device="cuda").manual_seed(7)
    N, k, E, D = 300, 16, 64, 3584
    ids = torch.randint(0, E, (N, k), device="cuda", generator=g)
    lay = G.expert_layout(ids, E, align)
    w0 = torch.rand(N, k, device="cuda", generator=g)
    z0 = torch.randn(N, D, device="cuda", generator=g).to(dtype)
    dr = torch.randn(N, D, device="cuda", generator=g)
    out = {}
    for kern in ("torch", "triton"):
        z, w = z0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = G.permute_rows(z, lay, kernel=kern) * 1.5
        r = G.combine_rows(y, w, lay, kernel=kern)
        (r * dr).sum().backward()
        out[kern] = (r.detach(), z.grad, w.grad)
    tol = TOL_TRITON if dtype == torch.float32 else TOL_TRITON_BF16
    for name, a, b in zip(("r", "z.grad", "w.grad"), out["triton"], out["torch"]):
        assert not rel(a, b) > tol, name


def test_moe_layer_has_no_host_sync():
    cfg = K31.replace(num_experts=64)
    m = _moe(cfg, torch.bfloat16)
    x = torch.randn(1, 512, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(1, 512, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    m(x).backward(dy)  # warm-up: Triton compilation, cuBLAS handles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m(x).backward(dy)
        ids_t = torch.randint(0, cfg.num_experts, (1, 16), device="cuda")  # decode-sized routing too
        m.routed_experts(
            torch.randn(1, 3584, device="cuda", dtype=torch.bfloat16), ids_t, torch.rand(1, 16, device="cuda")
        )
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_model_training_step_has_no_host_sync():
    """A whole training step of the cudnn backend (4 real-dimension layers: KDA x 3 and DSA, 16 experts top-8, the
    chunked LM loss) under the sync debug mode: any host sync in any layer's forward or backward raises."""
    from kernels_torch.model import KimiK3Model, cast_model

    cfg = load_config("k3.1-pro").truncated(4).replace(num_experts=16, num_experts_per_token=8)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = KimiK3Model(cfg, backend="cudnn")
    init_layer(model, 0)
    model = cast_model(model, torch.bfloat16)
    T = 1024
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    labels = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    model.loss(ids, labels).backward()  # warm-up (autotuning, compilation)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.loss(ids, labels).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
