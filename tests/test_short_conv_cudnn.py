"""CPU checks of the ``cudnn`` KDA layer's short convolution on cuDNN Frontend's ``causal_conv1d``
(``kernels_torch.kda_cudnn.short_conv_cudnn``): the new conv state we gather ourselves (:func:`conv_final_state`)
against the eager function, the call's wiring (layout, dtypes, states) through a torch stand-in for the op, and the
layer's choice between fla's kernel and cuDNN's (``short_conv`` in ``kernels_torch.kernel_choice``). The kernel itself is checked
against the eager function in ``tests/gpu/test_gpu_kda_cudnn.py``."""

from __future__ import annotations

import pytest
import torch
from test_kda_cudnn_prep import rel, stub_layer

import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
from kernels_torch import kernel_choice

TOL = 1e-12  # fp64 throughout: the stand-in and the eager function compute the same sums


def fake_cudnn_conv(seen: list):
    """A torch stand-in for ``cudnn.ops.causal_conv1d`` (its documented contract: x ``[B, C, T]``, weight ``[C, W]``,
    int32 ``cu_seqlens``, ``initial_states`` ``[N, C, W-1]``, output in x's layout); records each call's arguments."""

    def op(x, weight, activation=None, *, cu_seqlens=None, initial_states=None):
        seen.append(dict(x=x, weight=weight, activation=activation, cu_seqlens=cu_seqlens, state=initial_states))
        y, _ = tk.short_conv(
            x.transpose(1, 2), weight, None if cu_seqlens is None else cu_seqlens.cpu(), initial_states
        )
        return y.transpose(1, 2)

    return op


@pytest.mark.parametrize(
    "B,T,cu,with_state",
    [
        (2, 9, None, False),
        (2, 9, None, True),
        (1, 12, [0, 1, 3, 10, 12], False),  # documents of 1 and 2 tokens: shorter than the W - 1 = 3 state columns
        (1, 12, [0, 1, 3, 10, 12], True),
        (1, 1, None, True),
    ],
)
def test_final_state_equals_eager(B, T, cu, with_state):
    C, W = 5, 4
    x = torch.randn(B, T, C, dtype=torch.float64)
    N = B if cu is None else len(cu) - 1
    state = torch.randn(N, C, W - 1, dtype=torch.float64) if with_state else None
    cu_t = None if cu is None else torch.tensor(cu)
    _, want = tk.short_conv(x, torch.randn(C, 1, W, dtype=torch.float64), cu_t, state)
    got = kc.conv_final_state(x, state, cu_t, W)
    assert got.shape == (N, C, W - 1)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cu,with_state", [(None, False), ([0, 1, 6, 13], True), ([0, 13], False)])
def test_short_conv_cudnn_wiring(monkeypatch, cu, with_state):
    """y, dx, dw and the new state equal the eager function's; the op gets the channel-last transpose, a contiguous
    ``[C, W]`` filter, int32 ``cu_seqlens`` and the state as given."""
    seen = []
    monkeypatch.setattr(kc, "_cudnn_causal_conv1d", lambda: fake_cudnn_conv(seen))
    B = 2 if cu is None else 1
    T, C, W = 13, 6, 4
    N = B if cu is None else len(cu) - 1
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    w = torch.randn(C, 1, W, dtype=torch.float64, requires_grad=True)
    state = torch.randn(N, C, W - 1, dtype=torch.float64) if with_state else None
    cu_t = None if cu is None else torch.tensor(cu)
    y, new = kc.short_conv_cudnn(x, w, cu_t, state)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    y_ref, new_ref = tk.short_conv(x, w, cu_t, state)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w), dy)
    for name, got, want in (("y", y, y_ref), ("state", new, new_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)):
        assert rel(got, want) < TOL, name
    (call,) = seen
    assert call["activation"] == "silu" and call["x"].shape == (B, C, T) and call["x"].stride(1) == 1
    assert call["weight"].shape == (C, W) and call["weight"].is_contiguous()
    assert (call["cu_seqlens"] is None) == (cu is None)
    if cu is not None:
        assert call["cu_seqlens"].dtype == torch.int32 and call["cu_seqlens"].tolist() == cu
    assert (call["state"] is None) == (not with_state)
    with pytest.raises(ValueError, match=r"conv_state: got shape \(1, 6, 2\)"):
        kc.short_conv_cudnn(x, w, cu_t, torch.zeros(1, C, 2, dtype=torch.float64))


def test_unavailable_reasons():
    x = torch.randn(1, 4, 8)
    why = kc.cudnn_short_conv_unavailable(x, 4)
    assert why is not None  # CPU (or no cuDNN FE): a reason, never None
    assert "cpu" in why or "cudnn" in why.lower()


def test_layer_choice(monkeypatch):
    """Auto takes ``SHORT_CONV_AUTO`` where cuDNN's kernel can run, else fla; a forced ``cudnn`` that cannot run, or
    whose route declines at the call, raises naming it; under auto a decline runs fla with one warning. Both kernels
    give the same layer output (the stand-in computes the eager function)."""
    seen = []
    layer, x = stub_layer(monkeypatch, T=7)
    monkeypatch.setattr(kc, "_cudnn_causal_conv1d", lambda: fake_cudnn_conv(seen))
    monkeypatch.setattr(kc, "cudnn_short_conv_unavailable", lambda x, W: None)

    def run():
        kernel_choice.reset_used()
        with torch.no_grad():
            out = layer(x)[0]
        return out, kernel_choice.used()["short_conv"]

    monkeypatch.setattr(kernel_choice, "SHORT_CONV_AUTO", "fla")
    out_fla, used = run()
    assert used == {"fla": 3} and not seen
    monkeypatch.setattr(kernel_choice, "SHORT_CONV_AUTO", "cudnn")
    out_cudnn, used = run()
    assert used == {"cudnn": 3} and len(seen) == 3
    assert rel(out_cudnn, out_fla) < 1e-6  # fp32 layer
    P, W = layer.q_conv1d.weight.shape[0], layer.q_conv1d.weight.shape[-1]
    H, K = layer.config.kda_num_heads, layer.config.kda_head_dim
    cache = tk.KDACache(*(torch.randn(1, P, W - 1) for _ in range(3)), torch.randn(1, H, K, K) * 0.1)
    with torch.no_grad():  # with conv states (chunked prefill): the states reach cuDNN's call, and both kernels agree
        got = layer(x, cache=cache)
        layer.short_conv_kernel = "fla"
        want = layer(x, cache=cache)
    assert rel(got[0], want[0]) < 1e-6 and all(torch.equal(a, b) for a, b in zip(got[1][:3], want[1][:3]))
    assert seen[-1]["state"] is not None
    assert run()[1] == {"fla": 3}
    layer.short_conv_kernel = None
    monkeypatch.setenv("KIMI_SHORT_CONV_KERNEL", "fla")
    assert run()[1] == {"fla": 3}
    monkeypatch.setenv("KIMI_SHORT_CONV_KERNEL", "triton")
    with pytest.raises(ValueError, match=r"\$KIMI_SHORT_CONV_KERNEL: got 'triton'"):
        run()
    monkeypatch.delenv("KIMI_SHORT_CONV_KERNEL")

    monkeypatch.setattr(kc, "cudnn_short_conv_unavailable", lambda x, W: "x is on cpu")
    assert run()[1] == {"fla": 3}  # auto: the other kernel
    layer.short_conv_kernel = "cudnn"
    with pytest.raises(RuntimeError, match="short_conv_kernel: got 'cudnn'.*x is on cpu"):
        run()

    def declining(*args, **kwargs):
        raise NotImplementedError("the current backend cannot execute this call")

    monkeypatch.setattr(kc, "cudnn_short_conv_unavailable", lambda x, W: None)
    monkeypatch.setattr(kc, "_cudnn_causal_conv1d", lambda: declining)
    with pytest.raises(RuntimeError, match="declined: the current backend"):
        run()
    layer.short_conv_kernel = None
    kc._FALLBACK_WARNED.clear()
    with pytest.warns(UserWarning, match="cuDNN short conv declined"):
        out, used = run()
    assert used == {"fla": 3} and rel(out, out_fla) < 1e-6

    def missing_dsl(*args, **kwargs):  # what the route raises where nvidia-cutlass-dsl is not installed
        raise ModuleNotFoundError("No module named 'cutlass'")

    monkeypatch.setattr(kc, "_cudnn_causal_conv1d", lambda: missing_dsl)
    kc._FALLBACK_WARNED.clear()
    with pytest.warns(UserWarning, match="No module named 'cutlass'"):
        out, used = run()
    assert used == {"fla": 3} and rel(out, out_fla) < 1e-6
    layer.short_conv_kernel = "cudnn"
    with pytest.raises(RuntimeError, match="declined: No module named 'cutlass'"):
        run()


def test_missing_cutlass_dsl_is_a_reason(monkeypatch):
    """Without the CUTLASS DSL cuDNN's causal_conv1d cannot run: auto picks fla before any call."""
    monkeypatch.setattr(kc.importlib.util, "find_spec", lambda name: None if name == "cutlass" else object())
    why = kc.cudnn_short_conv_unavailable(torch.randn(1, 4, 8), 4)
    assert why is not None and "CUTLASS DSL" in why, why


def test_state_needing_a_gradient_stays_on_fla(monkeypatch):
    layer, x = stub_layer(monkeypatch, T=4)
    monkeypatch.setattr(kc, "cudnn_short_conv_unavailable", lambda x, W: None)
    monkeypatch.setattr(kernel_choice, "SHORT_CONV_AUTO", "cudnn")
    state = torch.randn(1, 8, 3)
    assert kc._short_conv_choice(layer, x, (state, None, None), 4) == ("cudnn", False)
    state.requires_grad_(True)
    assert kc._short_conv_choice(layer, x, (state, None, None), 4) == ("fla", False)
    with torch.no_grad():  # no gradient to compute: cuDNN's runs
        assert kc._short_conv_choice(layer, x, (state, None, None), 4) == ("cudnn", False)
    layer.short_conv_kernel = "cudnn"
    with pytest.raises(RuntimeError, match="requires a gradient"):
        kc._short_conv_choice(layer, x, (None, state, None), 4)


def test_set_model_kernels_and_load_model_take_short_conv():
    m = torch.nn.Module()
    m.short_conv_kernel = None
    kernel_choice.set_model_kernels(m, short_conv_kernel="cudnn")
    assert m.short_conv_kernel == "cudnn"
    with pytest.raises(ValueError, match="got 'triton' for short_conv"):
        kernel_choice.set_model_kernels(m, short_conv_kernel="triton")
