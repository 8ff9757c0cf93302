"""GPU checks of ``kernels_torch.fp8`` (torchao FP8 training matmuls) on SM90 / SM100:

* the device check passes on the GPU, grouped experts included;
* one converted projection (the real ``torch._scaled_mm``) against torchao's own emulation of the same casts, and
  against the fp64 product, output and both gradients, at T = 1, 63 and 2049 tokens, both recipes;
* the ``cudnn`` KDA layer (96 heads of 128, the real head layout) converted: its six projections run their
  Float8Linear forwards (never the fused ``shared_input_linears`` node), and output and gradients stay within the FP8
  bounds of the bf16 layer's;
* ``kernels_torch.moe.GroupedExperts`` converted (torchao's rowwise ``torch._scaled_grouped_mm``): the module's
  ``grouped_mm`` kernel with ``align`` 16, experts routed 0, 1 and many rows; output and gradients against the bf16
  module, and no host sync in its forward and backward (``torch.cuda.set_sync_debug_mode("error")``);
* the tiny model on the ``cudnn`` backend converted end to end, compared layer by layer against bf16 under routing
  and top-k replay (``tests/layer_local.py``): every Float8Linear is called, each layer's outputs and parameter
  gradients are within FP8 rounding of bf16's, and the same bounds reject a bf16 model whose ``o_proj`` weights are
  tripled and a conversion whose FP8 scales are dropped.

Needs torchao (``benchmarks/fp8_wheels.sh`` carries it to the H200). Every measured error is printed as
``FP8_ERR <test> <tensor> <value>``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import rel
from torch import nn

import kernels_torch.fp8 as fp8
import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
from kernels_torch import kernel_choice
from kimi.config import load_config


def _fp8_gpu() -> str | None:
    if not torch.cuda.is_available():
        return "needs CUDA"
    try:
        fp8.check_fp8_supported("cuda", grouped=True)
        fp8.import_torchao()
    except fp8.FP8UnsupportedError as e:
        return str(e)
    return None


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_fp8_gpu() is not None, reason=str(_fp8_gpu()))]

TOL_FP8_OUT = 6e-2  # one FP8 GEMM's output against fp64 (e4m3 x and W: 3.7% under emulation)
TOL_FP8_GRAD = {"rowwise": 6e-2, "tensorwise": 1e-1}  # e4m3 / e5m2 gradients
TOL_VS_EMULATION = 2e-2  # the real GEMM against torchao's emulation of the same casts (accumulation order, fast accum)
MIN_FP8_EFFECT = 1e-2  # FP8 rounding shows
TOL_LAYER = 0.25  # a converted layer against the bf16 layer (kimi_tools.compare.TOLERANCES_FP8's per-layer bound)
TOL_EXPERTS = {"out": 8e-2, "grad": 1.2e-1}  # three rowwise FP8 GEMMs and the activation, against bf16


def report(test: str, name: str, value: float) -> float:
    print(f"FP8_ERR {test} {name} {value:.3e}")
    return value


def test_device_check_on_this_gpu():
    cap = fp8.check_fp8_supported("cuda", grouped=True)
    assert cap in fp8.FP8_GROUPED_CAPABILITIES


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("T", [1, 63, 2049])
def test_projection_matches_emulation_and_fp64(recipe, T):
    from kernels_torch.moe import DenseMLP

    mlp = DenseMLP(load_config("tiny").replace(hidden_size=1024), 3072).cuda().bfloat16()
    emu = DenseMLP(load_config("tiny").replace(hidden_size=1024), 3072).cuda().bfloat16()
    g = torch.Generator(device="cuda").manual_seed(T)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(torch.randn(1024, 3072, device="cuda", generator=g) / 3072**0.5)
    emu.load_state_dict(mlp.state_dict())
    fp8.convert_model_to_fp8(mlp, recipe)
    fp8.convert_model_to_fp8(emu, recipe, emulate=True)
    x = torch.randn(T, 3072, device="cuda", generator=g).bfloat16()
    dy = torch.randn(T, 1024, device="cuda", generator=g).bfloat16()
    got = []
    for m in (mlp, emu):
        xi = x.clone().requires_grad_(True)
        y = m.down_proj(xi)
        y.backward(dy)
        got.append((y, xi.grad, m.down_proj.weight.grad))
    x64, w64 = x.double().requires_grad_(True), mlp.down_proj.weight.detach().double().requires_grad_(True)
    y64 = x64 @ w64.T
    y64.backward(dy.double())
    test = f"projection[{recipe}-T{T}]"
    for name, a, e, b, tol in zip(
        ("out", "dx", "dw"), got[0], got[1], (y64, x64.grad, w64.grad), (TOL_FP8_OUT, *[TOL_FP8_GRAD[recipe]] * 2)
    ):
        assert report(test, f"{name}_vs_emulation", rel(a, e)) <= TOL_VS_EMULATION, name
        err = report(test, f"{name}_vs_fp64", rel(a, b))
        assert MIN_FP8_EFFECT < err <= tol, name


def _kda_layer(seed: int):
    cfg = load_config("tiny").replace(hidden_size=1024, kda_num_heads=96, kda_head_dim=128, kda_gate_rank=64)
    g = torch.Generator(device="cuda").manual_seed(seed)
    layer = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="cudnn").cuda()
    with torch.no_grad():
        for p in layer.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, device="cuda", generator=g) / p.shape[1] ** 0.5)
    for p in layer.parameters():
        if p.ndim == 2:  # projections bf16, the rest (A_log, dt_bias, conv, o_norm) fp32 as in the checkpoint
            p.data = p.data.bfloat16()
    return cfg, layer


@pytest.mark.parametrize("T", [63, 2049])
def test_cudnn_kda_layer_in_fp8(monkeypatch, T):
    cfg, plain = _kda_layer(T)
    layer = copy.deepcopy(plain)
    rec = fp8.convert_model_to_fp8(layer, "rowwise")
    # exactly these: the gate's f_a / f_b and beta's b_proj stay bf16 in a layer converted on its own too (with them
    # in FP8, the H200 measured dt_bias's gradient 0.32-0.33 off bf16 here, 2026-12-03)
    assert set(rec.linears) == {"q_proj", "k_proj", "v_proj", "g_proj", "o_proj"}
    calls = dict.fromkeys(rec.linears, 0)
    for n in rec.linears:
        layer.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: calls.__setitem__(n, calls[n] + 1))
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, T, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    dy = torch.randn(1, T, cfg.hidden_size, device="cuda", generator=g).bfloat16()

    def run(m):
        xi = x.clone().requires_grad_(True)
        y, _ = m(xi)
        y.backward(dy)
        return y, xi.grad, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    want = run(plain)  # bf16, through the fused projections node

    def fused(*a, **k):
        raise AssertionError("the fused projections node ran on FP8 projections")

    monkeypatch.setattr(kc, "shared_input_linears", fused)
    got = run(layer)
    assert all(c == 1 for c in calls.values()), calls
    test = f"kda_layer[T{T}]"
    assert report(test, "out", rel(got[0], want[0])) <= TOL_LAYER
    assert report(test, "dx", rel(got[1], want[1])) <= TOL_LAYER
    assert set(got[2]) == set(want[2])
    errs = {n: report(test, f"d{n}", rel(got[2][n], gp)) for n, gp in want[2].items()}  # all printed, then checked
    assert not [n for n, e in errs.items() if not e <= TOL_LAYER], errs


def _experts(seed: int, E: int = 8, I: int = 256, Dl: int = 512):
    from kernels_torch.moe import GroupedExperts

    cfg = load_config("tiny").replace(quant_method=None, moe_intermediate_size=I)
    torch.manual_seed(seed)
    ex = GroupedExperts(cfg, Dl, backend="cudnn", num_experts=E).cuda().bfloat16()
    return nn.ModuleDict({"experts": ex})


def _routing(N: int, E: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(2, E, (N, k), device="cuda", generator=g)  # experts 0 and 1: none yet
    ids[0, 0] = 1  # expert 1: one row
    weights = torch.rand(N, k, device="cuda", generator=g)
    return ids, weights


@pytest.mark.parametrize("N", [1, 63, 2049])
def test_grouped_experts_in_fp8(N):
    k = 4
    ref = _experts(N)
    model = copy.deepcopy(ref)
    rec = fp8.convert_model_to_fp8(model, "rowwise")
    assert rec.grouped_experts == ("experts",) and model["experts"].align % 16 == 0
    ids, weights = _routing(N, 8, k, seed=N)
    g = torch.Generator(device="cuda").manual_seed(7)
    z = torch.randn(N, 512, device="cuda", generator=g).bfloat16()
    dr = torch.randn(N, 512, device="cuda", generator=g)
    got = []
    for m in (model, ref):
        kernel_choice.reset_used()
        zi = z.clone().requires_grad_(True)
        r = m["experts"](zi, ids, weights)
        r.backward(dr)
        assert kernel_choice.used()["moe"] == {"grouped_mm": 1}
        got.append((r, zi.grad, {n: p.grad for n, p in m.named_parameters()}))
    test = f"grouped_experts[N{N}]"
    assert report(test, "out", rel(got[0][0], got[1][0])) <= TOL_EXPERTS["out"]
    assert report(test, "dz", rel(got[0][1], got[1][1])) <= TOL_EXPERTS["grad"]
    for n, gp in got[1][2].items():
        assert report(test, f"d{n}", rel(got[0][2][n][1:], gp[1:])) <= TOL_EXPERTS["grad"], n
        # expert 0 has no row: its gradient is exactly zero in bf16, and must be in FP8 (an empty group's weight
        # gradient left unwritten by the grouped GEMM would be garbage the optimizer applies)
        assert float(gp[0].abs().max()) == 0.0 and float(got[0][2][n][0].abs().max()) == 0.0, n


def test_grouped_experts_fp8_has_no_host_sync():
    model = _experts(3)
    fp8.convert_model_to_fp8(model, "rowwise")
    ids, weights = _routing(512, 8, 4, seed=3)
    z = torch.randn(512, 512, device="cuda").bfloat16().requires_grad_(True)
    dr = torch.randn(512, 512, device="cuda")
    model["experts"](z, ids, weights).backward(dr)  # warm-up: Triton compiles, autotunes
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model["experts"](z, ids, weights).backward(dr)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _tiny_model(seed: int = 0):
    """The tiny model (cudnn backend: KDA on its kernels, the DSA indexer's top-k, grouped experts on grouped_mm),
    matrices N(0, 1/in) as tests/test_fp8.py's, cast to bf16 (the checkpoint's fp32 tensors stay fp32)."""
    from kernels_torch.model import KimiK3Model, cast_model

    cfg = load_config("tiny").replace(quant_method=None)
    torch.manual_seed(seed)
    model = KimiK3Model(cfg, backend="cudnn")
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return cast_model(model.cuda(), torch.bfloat16)


LAYER_LOCAL_TOKENS = 512  # above index_topk = 64: the DSA top-k chooses
LAYER_LOCAL_GRAD_SCALE = 1.0 / 8192  # a mean-token loss's output gradient over an 8K-token batch


def test_tiny_model_fp8_layer_by_layer_under_replay():
    """Each decoder layer of the tiny model converted (rowwise dense projections, the grouped experts wrapped: real
    FP8 GEMMs) against the same bf16 layer, both on the bf16 model's recorded inputs (AttnRes blocks and p) with its
    MoE routing and DSA top-k replayed (``tests/layer_local.py``, the comparison ``tests/test_fp8.py`` runs on the CPU
    under emulation): attn_out, mlp_out and each layer's parameter gradients within ``FP8_LAYER_TOL`` (every error
    printed as ``FP8_ERR``), every Float8Linear called. A whole-model comparison is no check on this random-init
    model (its error compounds through 9 layers and the router and top-k flips it causes: 9.0e-2 at layer 0 to
    9.6e-1 at layer 8 on the H200, 2026-12-04), nor is the loss (tripling every ``o_proj`` moved it 0.4%): the same
    layer-local bounds must reject the bf16 model with every ``o_proj`` tripled, and the converted one with its dense
    FP8 casts' scales dropped."""
    from layer_local import (
        FP8_LAYER_TOL,
        assert_wrong_models_fail,
        compare_models,
        failures,
        output_grads,
        record_layer_inputs,
        report,
    )

    ref = _tiny_model()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, ref.config.vocab_size, (1, LAYER_LOCAL_TOKENS), generator=g).cuda()
    inputs = record_layer_inputs(ref, ids)
    dys = output_grads(inputs, seed=2, scale=LAYER_LOCAL_GRAD_SCALE)
    model = copy.deepcopy(ref)
    rec = fp8.convert_model_to_fp8(model, "rowwise")
    assert rec.linears and rec.grouped_experts, rec.skipped
    calls = dict.fromkeys(rec.linears, 0)
    for n in rec.linears:
        model.get_submodule(n).register_forward_hook(lambda m, i, o, n=n: calls.__setitem__(n, calls[n] + 1))
    errs = compare_models(ref, model, inputs, dys)
    report("tiny_model_layer_local", errs)
    assert [n for n, c in calls.items() if c == 0] == []  # every Float8Linear ran
    assert failures(errs, FP8_LAYER_TOL) == []
    assert min(min(e.outputs.values()) for e in errs) > MIN_FP8_EFFECT

    assert_wrong_models_fail(ref, model, inputs, dys)
