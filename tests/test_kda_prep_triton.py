"""The Triton KDA input preparation (``kernels_torch.ops.kda_prep``: ``l2norm_qk``, ``kda_gate_lb``) against the eager
``kernels_torch.kda.l2norm`` / ``kda_gate`` in fp64 with autograd: outputs and every gradient (dq, dk, df, dA_log,
ddt_bias), on the CPU through Triton's interpreter.

The kernel tests run only where Triton imports and ``TRITON_INTERPRET=1`` was set before it was imported (CI has no
Triton; they skip with the reason). To run them here::

    TRITON_INTERPRET=1 PYTHONPATH=.:/path/to/triton python -m pytest -q tests/test_kda_prep_triton.py

The same kernels on CUDA and inside the cuDNN KDA layer: ``tests/gpu/test_gpu_kda_prep.py``. The argument checks and
the ``kda_prep`` choice run everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import rel

import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
from kernels_torch.ops import kda_prep as kp
from kimi.config import load_config

TRITON_CPU = kp.triton is not None and os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_interpreter = pytest.mark.skipif(
    not TRITON_CPU,
    reason="needs Triton with TRITON_INTERPRET=1 set before import (CPU interpreter); CUDA: tests/gpu/test_gpu_kda_prep.py",
)

# ||a - b|| / ||b|| against fp64 eager autograd, per tensor and input dtype.
TOL = {
    torch.float32: {
        "qn": 1e-6,
        "kn": 1e-6,
        "dq": 1e-6,
        "dk": 1e-6,
        "g": 1e-6,
        "df": 1e-6,
        "dA_log": 2e-5,
        "ddt_bias": 1e-6,
    },
    # bf16: y and df are stored in bf16 (2^-9 relative rounding); the L2 backward uses the stored bf16 y
    torch.bfloat16: {
        "qn": 5e-3,
        "kn": 5e-3,
        "dq": 1e-2,
        "dk": 1e-2,
        "g": 1e-6,
        "df": 5e-3,
        "dA_log": 2e-5,
        "ddt_bias": 1e-6,
    },
}
TOL_LAYER = 1e-5  # the whole layer in fp32 (measured <= 1.2e-6, on dA_log)
LB = -5.0
# The interpreter evaluates exp(-a * x) in numpy: at saturation it overflows to inf on purpose (sigmoid -> 0)
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def qk_inputs(B, T, H, K, dtype, seed):
    """Random q, k with a spread of row norms: some rows scaled to 1e-3 (where eps = 1e-6 matters at 1 %), some to 30."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(B, T, H, K, generator=gen) for _ in range(2))
    scale = torch.tensor([1.0, 1e-3, 30.0])[torch.randint(0, 3, (B, T, H, 1), generator=gen)]
    return (q * scale).to(dtype), (k * scale.flip(0)).to(dtype), gen


def check_l2(B, T, H, K, dtype, seed=0):
    q, k, gen = qk_inputs(B, T, H, K, dtype, seed)
    dqn, dkn = (torch.randn(B, T, H, K, generator=gen).to(dtype) for _ in range(2))
    qf, kf = (t.clone().requires_grad_(True) for t in (q, k))
    qn, kn = kp.l2norm_qk(qf, kf)
    assert qn.dtype == dtype and qn.shape == q.shape and kn.shape == k.shape
    torch.autograd.backward([qn, kn], [dqn, dkn])
    qr, kr = (t.double().requires_grad_(True) for t in (q, k))
    qn_r, kn_r = tk.l2norm(qr), tk.l2norm(kr)
    torch.autograd.backward([qn_r, kn_r], [dqn.double(), dkn.double()])
    assert qf.grad.dtype == dtype
    errs = {"qn": rel(qn, qn_r), "kn": rel(kn, kn_r), "dq": rel(qf.grad, qr.grad), "dk": rel(kf.grad, kr.grad)}
    bad = {n: e for n, e in errs.items() if not e <= TOL[dtype][n]}
    assert not bad, f"l2norm_qk {dtype} B={B} T={T} H={H} K={K}: over tolerance {bad}"


def gate_inputs(B, T, H, K, dtype, seed, extreme=False, past_cap_live=False):
    """f ~ 4 N(0, 1) (some entries +-1e4 and +-1e30 when ``extreme``), A_log with head 0 past A_LOG_MAX (80) and the
    rest log U(1, 16), dt_bias N(0, 1). ``past_cap_live``: head 0 gets dt_bias 0 and f ~ 1e-28 N(0, 1), so that its
    capped rate exp(64) = 6e27 gives an unsaturated sigmoid there, and only the cap's mask zeroes its dA_log."""
    gen = torch.Generator().manual_seed(seed)
    f = 4 * torch.randn(B, T, H, K, generator=gen)
    if extreme:
        pick = torch.rand(f.shape, generator=gen)
        f = torch.where(pick < 0.05, 1e4 * torch.sign(f), f)
        f = torch.where(pick > 0.97, 1e30 * torch.sign(f), f)
        f = f.clamp(-3e38, 3e38)  # in range for bf16 too
    A_log = torch.rand(H, generator=gen).mul(15).add(1).log()
    A_log[0] = 80.0  # exp(80) overflows fp32: capped at A_LOG_MAX, zero gradient
    dt_bias = torch.randn(H * K, generator=gen)
    if past_cap_live:
        f[..., 0, :] *= 2.5e-29
        dt_bias[:K] = 0.0
    dg = torch.randn(B, T, H, K, generator=gen)
    return f.to(dtype), A_log, dt_bias, dg


def check_gate(B, T, H, K, dtype, seed=0, extreme=False, past_cap_live=False):
    f, A_log, dt_bias, dg = gate_inputs(B, T, H, K, dtype, seed, extreme, past_cap_live)
    ours = {"f": f.clone().requires_grad_(True), "A_log": A_log.clone().requires_grad_(True)}
    ours["dt_bias"] = dt_bias.clone().requires_grad_(True)
    g = kp.kda_gate_lb(ours["f"], ours["A_log"], ours["dt_bias"], LB)
    assert g.dtype == torch.float32 and g.shape == f.shape
    g.backward(dg)
    ref = {"f": f.double().requires_grad_(True), "A_log": A_log.double().requires_grad_(True)}
    ref["dt_bias"] = dt_bias.double().requires_grad_(True)
    g_r = tk.kda_gate(ref["f"], ref["A_log"], ref["dt_bias"], LB)
    g_r.backward(dg.double())
    assert ours["f"].grad.dtype == dtype and ours["A_log"].grad.dtype == torch.float32
    for n, t in ours.items():
        assert torch.isfinite(t.grad).all(), f"d{n} not finite"
    assert torch.isfinite(g).all()
    assert ours["A_log"].grad[0] == 0  # past the cap: clamp's zero gradient
    errs = {"g": rel(g, g_r), "df": rel(ours["f"].grad, ref["f"].grad)}
    errs |= {
        "dA_log": rel(ours["A_log"].grad, ref["A_log"].grad),
        "ddt_bias": rel(ours["dt_bias"].grad, ref["dt_bias"].grad),
    }
    bad = {n: e for n, e in errs.items() if not e <= TOL[dtype][n]}
    assert not bad, f"kda_gate_lb {dtype} B={B} T={T} H={H} K={K} extreme={extreme}: over tolerance {bad}"


# (B, T, H, K): T = 1, 63, 2049; odd H; K = 128 and one K that is not a power of two (masked columns)
SHAPES = {"T1": (2, 1, 3, 128), "T63": (2, 63, 5, 128), "T2049": (1, 2049, 3, 128), "T63_K48": (1, 63, 3, 48)}


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_l2norm_qk_matches_eager(shape, dtype):
    check_l2(*SHAPES[shape], dtype, seed=len(shape))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gate_matches_eager(shape, dtype):
    check_gate(*SHAPES[shape], dtype, seed=len(shape))


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_extreme_f(dtype):
    """f at +-1e4 and +-1e30: saturated sigmoid, finite values and gradients, still the eager gate's."""
    check_gate(1, 300, 3, 128, dtype, seed=3, extreme=True)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gate_past_cap_unsaturated(dtype):
    """A head past A_LOG_MAX whose sigmoid is not saturated: its dA_log is still exactly 0 (clamp's gradient)."""
    check_gate(1, 63, 3, 128, dtype, seed=4, past_cap_live=True)


@needs_interpreter
def test_thd_views_and_reproducible():
    """``[B*T, H, K]`` views give the same bits as ``[B, T, H, K]``; two calls give identical bits (no atomics)."""
    q, k, _ = qk_inputs(2, 40, 3, 128, torch.bfloat16, seed=9)
    f, A_log, dt_bias, _ = gate_inputs(2, 40, 3, 128, torch.bfloat16, seed=9)
    a = kp.l2norm_qk(q, k)
    b = kp.l2norm_qk(q.view(80, 3, 128), k.view(80, 3, 128))
    assert torch.equal(a[0].view(80, 3, 128), b[0]) and torch.equal(a[1].view(80, 3, 128), b[1])
    g1, g2 = kp.kda_gate_lb(f, A_log, dt_bias, LB), kp.kda_gate_lb(f.view(80, 3, 128), A_log, dt_bias, LB)
    assert torch.equal(g1.view(80, 3, 128), g2)
    grads = []
    for _ in range(2):
        fl, Al, dl = (t.clone().requires_grad_(True) for t in (f, A_log, dt_bias))
        kp.kda_gate_lb(fl, Al, dl, LB).sum().backward()
        grads.append((fl.grad, Al.grad, dl.grad))
    assert all(torch.equal(x, y) for x, y in zip(*grads))


def test_argument_errors():
    """Checked before anything runs (also without Triton)."""
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="q, k"):
        kp.l2norm_qk(q, q[..., :4])
    with pytest.raises(ValueError, match="q, k"):
        kp.l2norm_qk(q, q.double())
    f, A_log, dt_bias = torch.randn(1, 4, 2, 8), torch.zeros(2), torch.zeros(16)
    with pytest.raises(ValueError, match="A_log"):
        kp.kda_gate_lb(f, A_log[:1], dt_bias, LB)
    with pytest.raises(ValueError, match="dt_bias"):
        kp.kda_gate_lb(f, A_log, dt_bias[:8], LB)
    for lb in (None, 0.0, 1.0, float("-inf")):
        with pytest.raises(ValueError, match="lower_bound"):
            kp.kda_gate_lb(f, A_log, dt_bias, lb)
    if not TRITON_CPU:  # CPU tensors outside the interpreter: a clear refusal, not a crash inside Triton
        with pytest.raises(RuntimeError, match="Triton KDA preparation cannot run"):
            kp.kda_gate_lb(f, A_log, dt_bias, LB)


def test_prep_choice_triton(monkeypatch):
    """``kda_prep='triton'`` is a valid, opt-in choice; ``auto`` takes fla's ``outside`` (ours measured no faster on
    the H200); forced where it cannot run, it raises with the reason."""
    monkeypatch.delenv("KIMI_KDA_PREP", raising=False)
    cfg = load_config("tiny")
    layer = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="cudnn")
    x = torch.randn(1, 2, cfg.hidden_size)
    assert kc._kda_prep_choice(layer, x) == "outside"  # CPU x
    layer.kda_prep = "triton"
    with pytest.raises(RuntimeError, match="'triton'.*cannot run"):
        kc._kda_prep_choice(layer, x)
    layer.kda_prep = None
    monkeypatch.setenv("KIMI_KDA_PREP", "triton")
    with pytest.raises(RuntimeError, match="'triton'"):
        kc._kda_prep_choice(layer, x)


@needs_interpreter
def test_cudnn_layer_wiring_with_triton_prep(monkeypatch):
    """``kernels_torch.kda_cudnn.kda_layer_forward`` with ``kda_prep='triton'`` on the CPU: fla's conv / gated norm
    replaced by the eager twins, cuDNN's op by ``test_kda_cudnn_prep``'s torch stand-in, so that only our kernels and the layer's wiring run
    (fp32 x, packed documents with a length-1 one, a head past A_LOG_MAX). Output, final state, dx and every parameter
    gradient equal the eager layer's to fp32 rounding."""
    import sys
    import types

    import torch.nn.functional as F
    from test_kda_cudnn_prep import fake_op

    from kernels_torch import kernel_choice

    def causal_conv1d(x, weight, initial_state, output_final_state, activation, cu_seqlens, cu_seqlens_cpu):
        state = None if initial_state is None else initial_state[..., 1:]
        y, new = tk.short_conv(x, weight, cu_seqlens_cpu, state)
        return y, F.pad(new, (1, 0))  # fla's [N, C, W] window

    def rms_norm_gated(o, gate, weight, bias, activation, eps):
        return tk.gated_rms_norm(o, gate, weight, eps).to(o.dtype)

    stubs = {n: types.ModuleType(n) for n in ("fla", "fla.modules", "fla.modules.norm")}
    stubs["fla.modules.causal_conv1d"] = types.SimpleNamespace(causal_conv1d=causal_conv1d)
    stubs["fla.modules.norm.fused_norm_gate"] = types.SimpleNamespace(rms_norm_gated=rms_norm_gated)
    for name, mod in stubs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    seen = {}
    monkeypatch.setattr(kc, "_cudnn_kda_op", lambda: fake_op(seen))
    monkeypatch.setattr(kc, "_cudnn_missing", lambda x: [])
    monkeypatch.setattr(kc, "cudnn_kda_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(kc, "_cudnn_plan_name", lambda device: None)
    monkeypatch.setattr(kc, "_kda_prep_choice", lambda layer, x: "triton")  # CPU x: auto would take fla's
    monkeypatch.setitem(sys.modules, kc._CUDNN_KDA_SM90_HOST, None)  # no SM90 launcher: cuDNN's own split, recorded
    monkeypatch.delenv("KIMI_KDA_PIECES", raising=False)

    cfg = load_config("tiny").replace(kda_num_heads=3, kda_head_dim=128)
    torch.manual_seed(0)
    fast = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="cudnn")
    fast.kda_kernel = "cudnn"
    ref = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="eager")
    with torch.no_grad():
        fast.A_log[0] = 80.0
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(1, 37, cfg.hidden_size)
    xf, xr = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    cu = [0, 1, 20, 37]
    kernel_choice.reset_used()
    (out, c), (out_r, c_r) = fast(xf, cu_seqlens=cu), ref(xr, cu_seqlens=cu)
    dout = torch.randn_like(out)
    out.backward(dout)
    out_r.backward(dout)
    used = kernel_choice.used()
    assert {op: used.get(op) for op in ("kda", "kda_prep", "kda_pieces")} == {
        "kda": {"cudnn": 1},
        "kda_prep": {"triton": 1},
        "kda_pieces": {"cudnn": 1},
    }
    assert seen["l2"] is False and seen["safe"] is False  # the op got prepared inputs
    errs = {"out": rel(out, out_r), "S": rel(c.S, c_r.S), "dx": rel(xf.grad, xr.grad)}
    ref_grads = dict(ref.named_parameters())
    errs |= {"d" + n: rel(p.grad, ref_grads[n].grad) for n, p in fast.named_parameters()}
    assert fast.A_log.grad[0] == 0
    bad = {n: e for n, e in errs.items() if not e <= TOL_LAYER}
    assert not bad, f"cudnn layer with kda_prep='triton' vs eager: over tolerance {bad}"
