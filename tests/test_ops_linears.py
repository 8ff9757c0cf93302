"""``kernels_torch.ops.linears``: ``shared_input_linears`` (the KDA layer's six projections of x in one autograd node)
against one ``F.linear`` per weight under autograd (outputs, the summed input gradient, every weight gradient), and
``headwise_matmul`` (the DSA layer's absorbed W_UK / W_UV) against ``torch.einsum``."""

import pytest
import torch
import torch.nn.functional as F
from test_kda_cudnn_prep import rel, stub_layer

import kernels_torch.kda as tk
from kernels_torch.ops.linears import headwise_matmul, shared_input_linears

TOL_FP64 = 1e-12  # same products and sums in fp64: only the summation order may differ
TOL_BF16 = 2e-2  # bf16 outputs and bf16 running sums of dx (rounded after each GEMM, as autograd's adds)


def run(fn, x, weights, dys):
    x = x.detach().requires_grad_(True)
    ws = [w.detach().requires_grad_(True) for w in weights]
    ys = fn(x, ws)
    torch.autograd.backward(ys, dys)
    return ys, x.grad, [w.grad for w in ws]


def separate(x, ws):
    return tuple(F.linear(x, w.to(x.dtype)) for w in ws)


@pytest.mark.parametrize("T", [1, 63, 2049])
def test_matches_separate_linears_fp64(T):
    """Random fp64 x ``[2, T, 16]``, weights with 8, 1 and 24 outputs (one of them fp32): every output and gradient
    matches the one-linear-per-weight autograd graph to 1e-12."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(2, T, 16, generator=g, dtype=torch.float64)
    weights = [torch.randn(n, 16, generator=g, dtype=torch.float64) for n in (8, 1)]
    weights.append(torch.randn(24, 16, generator=g))  # fp32: cast to x's dtype, its gradient comes back in fp32
    dys = [torch.randn(2, T, w.shape[0], generator=g, dtype=torch.float64) for w in weights]
    ys, dx, dws = run(shared_input_linears, x, weights, dys)
    ys_ref, dx_ref, dws_ref = run(separate, x, weights, dys)
    for i, (y, y_ref) in enumerate(zip(ys, ys_ref)):
        assert rel(y, y_ref) < TOL_FP64, f"y[{i}]"
    assert rel(dx, dx_ref) < TOL_FP64, "dx"
    for i, (dw, dw_ref) in enumerate(zip(dws, dws_ref)):
        assert dw.dtype == weights[i].dtype, f"dW[{i}] dtype"
        assert rel(dw, dw_ref) < TOL_FP64, f"dW[{i}]"


def test_bf16_activations_fp32_weights():
    """The layer's dtypes: bf16 x, fp32 weights (K != V-like uneven widths): outputs bf16, gradients at bf16 level."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 63, 32, generator=g).bfloat16()
    weights = [torch.randn(n, 32, generator=g) / 6 for n in (48, 12, 5)]
    dys = [torch.randn(1, 63, w.shape[0], generator=g).bfloat16() for w in weights]
    ys, dx, dws = run(shared_input_linears, x, weights, dys)
    ys_ref, dx_ref, dws_ref = run(separate, x, weights, dys)
    assert all(y.dtype == torch.bfloat16 for y in ys)
    assert rel(dx, dx_ref) < TOL_BF16, "dx"
    for i, (dw, dw_ref) in enumerate(zip(dws, dws_ref)):
        assert dw.dtype == torch.float32 and rel(dw, dw_ref) < TOL_BF16, f"dW[{i}]"


def test_frozen_inputs_get_no_gradient():
    """x without grad and a frozen weight: no gradient is computed for them, the others are exact."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64)
    w0 = torch.randn(4, 16, generator=g, dtype=torch.float64)
    w1 = torch.randn(6, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    y0, y1 = shared_input_linears(x, [w0, w1])
    (y0.sum() + (y1 * 2).sum()).backward()
    assert w0.grad is None and x.grad is None
    assert rel(w1.grad, 2 * x.sum(0).expand(6, 16)) < TOL_FP64


def test_bad_weights_raise():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="empty"):
        shared_input_linears(x, [])
    with pytest.raises(ValueError, match=r"weights\[1\].*\[N, 16\]"):
        shared_input_linears(x, [torch.randn(4, 16), torch.randn(4, 15)])


def test_cudnn_layer_wires_each_projection_to_its_use(monkeypatch):
    """The ``cudnn`` KDA layer (run on the CPU through the stand-ins of ``test_kda_cudnn_prep.stub_layer``) takes its
    six projections of x from one ``shared_input_linears`` node: its output equals the eager layer's on the same
    weights (a projection wired to the wrong use, e.g. k's output as v, fails this)."""
    layer, x = stub_layer(monkeypatch, T=9)
    eager = tk.KimiDeltaAttention(layer.config, layer.layer_idx, backend="eager")
    eager.load_state_dict(layer.state_dict())
    with torch.no_grad():
        for p in layer.parameters():  # fresh random weights everywhere (gate parameters included), never zeros
            p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
        eager.load_state_dict(layer.state_dict())
        out = layer(x)[0]
        ref = eager(x)[0]
    assert rel(out, ref) < 1e-5


@pytest.mark.parametrize("N", [1, 63, 2049])
def test_headwise_matmul_matches_einsum_on_strided_views(N):
    """fp64, the layer's views: x a slice of a wider tensor (q_nope of [N, H, Kn + R]), w a transposed slice (W_UV^T
    of kv_b_proj's [H, Kn + V, L]), I != O; output, dx and dw against einsum to 1e-12, and the output contiguous."""
    g = torch.Generator().manual_seed(N)
    H, Kn, R, V, L = 3, 8, 4, 6, 10
    x_wide = torch.randn(N, H, Kn + R, generator=g, dtype=torch.float64)
    w_full = torch.randn(H, Kn + V, L, generator=g, dtype=torch.float64)
    dy = torch.randn(N, H, L, generator=g, dtype=torch.float64)
    do = torch.randn(N, H, V, generator=g, dtype=torch.float64)
    grads = []
    for fn in (headwise_matmul, None):
        xw = x_wide.clone().requires_grad_(True)
        w = w_full.clone().requires_grad_(True)
        x = xw[..., :Kn]  # [N, H, Kn], row stride H * (Kn + R)
        if fn is None:
            q_lat = torch.einsum("nhk,hkl->nhl", x, w[:, :Kn])
            o = torch.einsum("nhl,hvl->nhv", q_lat, w[:, Kn:])
        else:
            q_lat = fn(x, w[:, :Kn])
            o = fn(q_lat, w[:, Kn:].transpose(1, 2))
            assert q_lat.is_contiguous() and o.is_contiguous()
        torch.autograd.backward([q_lat, o], [dy, do])
        grads.append((q_lat.detach(), o.detach(), xw.grad, w.grad))
    for name, a, b in zip(("q_lat", "o", "dx", "dw"), *grads):
        assert rel(a, b) < TOL_FP64, name


def test_headwise_matmul_bf16_fp32_weight_and_errors():
    """bf16 x with an fp32 w (cast for the product, its gradient fp32) at bf16 level; bad shapes and a strided last
    axis raise, naming the shapes / the stride."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(63, 4, 16, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(4, 16, 8, generator=g) / 4).requires_grad_(True)
    y = headwise_matmul(x, w)
    dy = torch.randn(y.shape, generator=g).bfloat16()
    y.backward(dy)
    x2, w2 = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    y2 = torch.einsum("nhi,hio->nho", x2, w2)
    y2.backward(dy.double())
    assert y.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert rel(y, y2) < TOL_BF16 and rel(x.grad, x2.grad) < TOL_BF16 and rel(w.grad, w2.grad) < TOL_BF16
    with pytest.raises(ValueError, match=r"x \(63, 4, 16\) and w \(4, 15, 8\)"):
        headwise_matmul(x, torch.randn(4, 15, 8))
    with pytest.raises(ValueError, match="stride 2"):
        headwise_matmul(torch.randn(5, 4, 32)[..., ::2], torch.randn(4, 16, 8))


def test_edges_unused_outputs_empty_widths_and_second_derivatives():
    """An output outside the loss leaves its weight without a gradient (None, as ``F.linear``: an optimizer's weight
    decay must not see a zero gradient there); 0-row weights and D = 0 work; a second derivative raises (the saved
    weights are casts made without autograd), in both functions, instead of returning wrong numbers."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 16, generator=g).requires_grad_(True)
    ws = [torch.randn(n, 16, generator=g).requires_grad_(True) for n in (3, 4, 0)]
    ys = shared_input_linears(x, ws)
    (ys[1].sum() + ys[2].sum()).backward()
    assert ws[0].grad is None and ws[2].grad.shape == (0, 16)
    assert rel(x.grad, ws[1].detach().sum(0).expand(5, 16)) < 1e-6
    x0, w0 = torch.randn(7, 0).requires_grad_(True), torch.randn(3, 0).requires_grad_(True)
    shared_input_linears(x0, [w0])[0].sum().backward()
    assert x0.grad.shape == (7, 0) and w0.grad.shape == (3, 0)
    x = torch.randn(4, 16, generator=g, dtype=torch.float64).requires_grad_(True)
    w = torch.randn(3, 16, generator=g).requires_grad_(True)  # fp32 weight, fp64 x
    for y in (shared_input_linears(x, [w])[0], headwise_matmul(x.view(4, 1, 16), w.t()[None])):
        (gx,) = torch.autograd.grad((y**2).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match="once_differentiable"):
            gx.pow(2).sum().backward()
