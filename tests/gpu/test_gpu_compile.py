"""Decoder blocks compiled with inductor on CUDA (``kernels_torch.compile``): the CPU tests (``tests/test_compile.py``)
trace with ``aot_eager``; here inductor generates the kernels and the grouped experts run ``torch._grouped_mm`` in
bf16 through the ``kimi::`` layout ops. Each layer kind of the tiny model on the ``sdpa`` backend in bf16: 0 graph
breaks, 1 compilation for two micro-batches of one shape, the output and every gradient within bf16 rounding of
eager; and ``compile_blocks`` on a whole model, loss and gradients against eager.

    python -m pytest -q -m gpu tests/gpu/test_gpu_compile.py
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from helpers import check_rel
from torch._dynamo.testing import CompileCounterWithBackend

from kernels_torch.compile import compile_blocks
from kernels_torch.model import KimiK3Model, cast_model
from kimi.config import load_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# inductor vs eager, both bf16: fused elementwise chains round once instead of at every op (a few bf16 ulps),
# GEMMs may pick other tiles; the gradients go through one more such chain than the outputs
TOL = {"out": 2e-2, "grad": 3e-2, "loss": 1e-2}
TOL_FP32 = {
    "loss": 1e-4,
    "grad": 1e-2,
}  # the whole model in fp32: reordered sums (1e-5 seen with inductor on the CPU), TF32 convs


def _breaks() -> int:
    return sum(torch._dynamo.utils.counters["graph_break"].values())


def _model(cfg, seed: int, dtype=torch.bfloat16) -> KimiK3Model:
    """The tiny model on CUDA, sdpa backend, in ``dtype`` (the checkpoint's fp32 tensors kept fp32); in bf16 the
    routed experts on the grouped kernel (``torch._grouped_mm`` takes bf16 only)."""
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = cast_model(KimiK3Model(cfg, backend="sdpa"), dtype)
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None and dtype == torch.bfloat16:
            moe.experts.moe_kernel = "grouped_mm"
    return model


@pytest.mark.parametrize("idx", [0, 1, 3], ids=["kda-dense", "kda-moe", "dsa-moe"])
def test_layer_compiled_by_inductor_matches_eager(idx):
    cfg = load_config("tiny")
    model = _model(cfg, idx)
    layer = model.model.layers[idx]
    T, D = 64, cfg.hidden_size
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    for cu in ([0, 17, 64], [0, 40, 64]):
        p = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
        blocks = [torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)] if idx else []
        w = torch.randn(1, T, D, device="cuda", dtype=torch.bfloat16)
        runs = []
        for call in (layer, compiled):
            layer.zero_grad(set_to_none=True)
            x = p.clone().requires_grad_(True)
            _, out, _ = call([b.clone() for b in blocks], x, torch.tensor(cu, device="cuda"))
            (out.float() * w.float()).sum().backward()
            grads = {n: q.grad.float() for n, q in layer.named_parameters() if q.grad is not None and q.grad.any()}
            runs.append((out.float(), x.grad.float(), grads))
        (out0, dp0, g0), (out1, dp1, g1) = runs
        check_rel("out", out1, out0, TOL["out"])
        check_rel("d p", dp1, dp0, TOL["grad"])
        assert set(g0) <= set(g1)
        for name in g0:
            check_rel(f"d {name}", g1[name], g0[name], TOL["grad"])
    assert _breaks() == 0, dict(torch._dynamo.utils.counters["graph_break"])
    assert counter.frame_count == 1


def test_compile_blocks_inductor_model_loss_and_grads():
    """The whole tiny model in fp32 (in bf16, inductor's fused fp32 arithmetic moves the random model's router and
    top-k picks, and nine layers of such flips are no comparison: the per-layer test above covers bf16)."""
    cfg = load_config("tiny")
    eager, model = _model(cfg, 0, torch.float32), _model(cfg, 0, torch.float32)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compile_blocks(model, backend="inductor")
    T = 96
    ids = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    labels = torch.randint(0, cfg.vocab_size, (1, T), device="cuda")
    cu = torch.tensor([0, 31, 96], device="cuda")
    losses = []
    for m in (eager, model):
        loss = m.loss(ids, labels, cu)
        loss.backward()
        losses.append(loss.detach().float())
    check_rel("loss", losses[1], losses[0], TOL_FP32["loss"])
    worst = max(
        (float((b.grad.float() - a.grad.float()).norm() / a.grad.float().norm().clamp_min(1e-30)), name)
        for (name, a), b in zip(eager.named_parameters(), model.parameters())
        if a.grad is not None and a.grad.any()
    )
    assert worst[0] <= TOL_FP32["grad"], worst
    assert _breaks() == 0
