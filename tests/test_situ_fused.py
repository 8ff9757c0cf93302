"""The fused SiTU-GLU (``kernels_torch.ops.situ``): the torch kernel against the plain ops of ``kernels_torch.moe``,
gradcheck, extreme inputs, the memory it saves, the wiring into the ``cudnn`` backend's modules, and (under
``TRITON_INTERPRET=1`` with Triton importable) the Triton kernels on CPU tensors.

Run the Triton tests with: ``TRITON_INTERPRET=1 PYTHONPATH=.:/path/to/triton python -m pytest tests/test_situ_fused.py``.
"""

import os

import pytest
import torch
from helpers import rel

from kernels_torch import kernel_choice
from kernels_torch.moe import DenseMLP, KimiMoE, glu_act, situ
from kernels_torch.ops import situ as S
from kimi.config import load_config

TOL_OUT_FP32 = 0.0  # torch kernel forward: the same fp32 ops as the plain path, so bitwise equal
TOL_GRAD_FP32 = 2e-6  # torch kernel da/db vs autograd of the plain ops (rel. error; same math, other op order)
TOL_GRAD_BF16 = 1e-2  # bf16 da/db: one bf16 rounding each (2^-8), rarely a different rounding than the plain path
TOL_TRITON_OUT_FP32 = 2e-6  # Triton (Cephes tanh, exp-based sigmoid) vs torch fp32 forward (rel. error)
TOL_TRITON_GRAD_FP32 = 4e-6  # Triton vs torch fp32 da, db
TOL_BF16_ULP = 2.0**-7  # Triton bf16 out / da / db vs fp32 math: one bf16 ulp (relative) per element ...
TOL_BF16_CANCEL = 1e-6  # ... plus this times max|ref|: fp32 cancellation where d gate/da crosses 0 (a ~ -1.28)
TOL_MODULE = 1e-5  # a fused (torch kernel) fp32 module vs the plain module: output and weight gradients

SIZES = [(1, 5), (63, 48), (7, 100)]  # N = 1, 63; I not a power of 2
IDS = [f"N{n}_I{i}" for n, i in SIZES]


def inputs(n, i, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, i, generator=g, dtype=torch.float64) * scale).to(dtype)
    b = (torch.randn(n, i, generator=g, dtype=torch.float64) * scale * 4).to(dtype)  # reaches the linear_beta cap
    dout = torch.randn(n, i, generator=g, dtype=torch.float64).to(dtype)
    return a, b, dout


def plain(a, b, dout, act="situ", linear_beta=25.0):
    """The plain path's output and autograd gradients."""
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    if act == "situ":
        out = situ(a, b, 4.0, linear_beta)
    else:
        out = glu_act(a, b, load_config("tiny").replace(hidden_act="silu"))
    out.backward(dout)
    return out.detach(), a.grad, b.grad


def fused(a, b, dout, act="situ", linear_beta=25.0, kernel="torch"):
    a, b = a.clone().requires_grad_(), b.clone().requires_grad_()
    lb = None if act == "silu" else linear_beta
    out = S.situ_glu(a, b, 4.0, lb, hidden_act=act, kernel=kernel)
    out.backward(dout)
    return out.detach(), a.grad, b.grad


CASES = [("situ", 25.0), ("situ", None), ("silu", None)]
CASE_IDS = ["situ", "situ_nolinear", "silu"]


# ------------------------------------------------------------------------------------------------ torch kernel


@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n,i", SIZES, ids=IDS)
def test_torch_kernel_matches_plain_fp32(act, lb, n, i):
    a, b, dout = inputs(n, i)
    out0, da0, db0 = plain(a, b, dout, act, lb)
    out1, da1, db1 = fused(a, b, dout, act, lb)
    assert out1.dtype == da1.dtype == db1.dtype == torch.float32
    assert rel(out1, out0) <= TOL_OUT_FP32
    assert rel(da1, da0) <= TOL_GRAD_FP32, "da"
    assert rel(db1, db0) <= TOL_GRAD_FP32, "db"


@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
def test_torch_kernel_matches_plain_bf16(act, lb):
    a, b, dout = inputs(63, 100, torch.bfloat16, seed=1)
    out0, da0, db0 = plain(a, b, dout, act, lb)
    out1, da1, db1 = fused(a, b, dout, act, lb)
    assert out1.dtype == da1.dtype == db1.dtype == torch.bfloat16
    assert torch.equal(out1, out0)  # same fp32 ops, one rounding: bitwise
    assert rel(da1, da0) <= TOL_GRAD_BF16, "da"
    assert rel(db1, db0) <= TOL_GRAD_BF16, "db"


def test_glu_act_fused_matches_glu_act_with_config():
    cfg = load_config("tiny")
    a, b, dout = inputs(9, 33, seed=2)
    for c in (cfg, cfg.replace(hidden_act="silu")):
        torch.testing.assert_close(S.glu_act_fused(a, b, c, kernel="torch"), glu_act(a, b, c), rtol=0, atol=0)
    with pytest.raises(ValueError, match="hidden_act: got 'gelu'"):
        S.glu_act_fused(a, b, cfg.replace(hidden_act="gelu"))


@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
def test_gradcheck_fp64(act, lb):
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(3, 7, generator=g, dtype=torch.float64) * 3).requires_grad_()
    b = (torch.randn(3, 7, generator=g, dtype=torch.float64) * 30).requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: S.situ_glu(a, b, 4.0, lb, hidden_act=act, kernel="torch"), (a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
def test_extreme_inputs_stay_finite(act, lb, dtype):
    big = 1e4 if dtype == torch.float32 else torch.finfo(torch.bfloat16).max / 4  # silu's a*b must not overflow
    vals = torch.tensor([-big, -100.0, -1e-3, 0.0, 1e-3, 100.0, big], dtype=torch.float64)
    a = vals.repeat_interleave(len(vals)).to(dtype)
    b = vals.repeat(len(vals)).to(dtype)
    if act == "silu":  # plain up branch: keep the product a*b in range, the extremes are in a
        b = b.clamp(-1.0, 1.0)
    out, da, db = fused(a, b, torch.ones_like(a), act, lb)
    for name, x in (("out", out), ("da", da), ("db", db)):
        assert torch.isfinite(x).all(), f"{name} not finite: {x}"
    if act == "situ" and lb is not None and dtype == torch.float32:  # the caps: |out| <= 4 * 25, zero slope at +-1e4
        assert out.abs().max() <= 100.0
        assert da[a.abs() == 1e4].abs().max() == 0 and db[b.abs() == 1e4].abs().max() == 0


def saved_bytes(fn, *args) -> int:
    """Bytes of the distinct tensors autograd saves while running ``fn(*args)``."""
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.dtype, tuple(t.shape))] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_saves_only_its_inputs(dtype):
    a, b, _ = inputs(64, 96, dtype)
    a.requires_grad_(), b.requires_grad_()
    one = a.numel() * a.element_size()
    got = saved_bytes(lambda: S.situ_glu(a, b, kernel="torch"))
    want = saved_bytes(lambda: situ(a, b))
    assert got == 2 * one, f"fused saved {got} bytes, expected a and b ({2 * one})"
    assert want >= 5 * a.numel() * 4, f"plain path saved only {want} bytes; the comparison is moot"


def test_backward_only_for_inputs_that_need_it():
    a, b, dout = inputs(5, 11)
    a.requires_grad_()
    S.situ_glu(a, b, kernel="torch").backward(dout)
    assert a.grad is not None and b.grad is None
    _, da0, _ = plain(a.detach(), b, dout)
    assert rel(a.grad, da0) <= TOL_GRAD_FP32


def test_bad_input_errors():
    a = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"a has shape \(3, 4\) and b \(3, 5\)"):
        S.situ_glu(a, torch.randn(3, 5))
    with pytest.raises(ValueError, match="beta got 0.0, expected a positive number"):
        S.situ_glu(a, a, beta=0.0)
    with pytest.raises(ValueError, match="linear_beta got -1.0"):
        S.situ_glu(a, a, linear_beta=-1.0)
    with pytest.raises(ValueError, match="b has dtype torch.int64"):
        S.situ_glu(a, torch.ones(3, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="hidden_act: got 'relu'"):
        S.situ_glu(a, a, hidden_act="relu")
    with pytest.raises(ValueError, match="got 'cuda' for glu"):
        S.situ_glu(a, a, kernel="cuda")
    if not os.environ.get("TRITON_INTERPRET") == "1":  # CPU tensors and no interpreter: Triton cannot take them
        with pytest.raises(ValueError, match="kernel='triton' cannot run"):
            S.situ_glu(a, a, kernel="triton")


def test_auto_on_cpu_runs_torch_and_records_it(monkeypatch):
    monkeypatch.delenv("KIMI_GLU_KERNEL", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernel_choice.reset_used()
    a, b, _ = inputs(4, 6)
    torch.testing.assert_close(S.situ_glu(a, b), situ(a, b), rtol=0, atol=0)
    assert kernel_choice.used()["glu"] == {"torch": 1}
    monkeypatch.setenv("KIMI_GLU_KERNEL", "torch")
    S.situ_glu(a.double(), b.double())  # fp64: the torch kernel, fp64 math
    assert kernel_choice.used()["glu"] == {"torch": 2}


# ------------------------------------------------------------------------------------------------ wiring


def test_cudnn_backend_modules_use_fused_and_keep_keys():
    cfg = load_config("tiny")
    torch.manual_seed(0)
    plain_mlp, fused_mlp = DenseMLP(cfg, 40), DenseMLP(cfg, 40, backend="cudnn")
    plain_moe, fused_moe = KimiMoE(cfg), KimiMoE(cfg, backend="cudnn")
    assert list(plain_mlp.state_dict()) == list(fused_mlp.state_dict())
    assert list(plain_moe.state_dict()) == list(fused_moe.state_dict())
    assert not plain_mlp.fused_glu and fused_mlp.fused_glu
    assert all(m.fused_glu for m in fused_moe.modules() if hasattr(m, "fused_glu"))
    assert not any(m.fused_glu for m in plain_moe.modules() if hasattr(m, "fused_glu"))
    fused_mlp.load_state_dict(plain_mlp.state_dict())
    fused_moe.load_state_dict(plain_moe.state_dict())
    x = torch.randn(2, 7, cfg.hidden_size)
    kernel_choice.reset_used()
    for m0, m1 in ((plain_mlp, fused_mlp), (plain_moe, fused_moe)):
        y0, y1 = m0(x), m1(x)
        g = torch.randn_like(y0)
        y0.backward(g), y1.backward(g)
        assert rel(y1, y0) <= TOL_MODULE
        for (name, p0), p1 in zip(m0.named_parameters(), m1.parameters(), strict=True):
            if p0.grad is not None and p0.grad.norm() > 0:
                assert rel(p1.grad, p0.grad) <= TOL_MODULE, name
    assert sum(kernel_choice.used()["glu"].values()) > 1  # the fused path ran (torch on CPU; Triton if interpreting)


# ------------------------------------------------------------------------------------------------ Triton (interpreter)

needs_interpreter = pytest.mark.skipif(
    not (S.triton_available() and os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton kernel tests on CPU need triton importable and TRITON_INTERPRET=1 (GPU: tests/gpu/test_gpu_situ.py)",
)


@needs_interpreter
@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("n,i", [(1, 5), (63, 100), (3, 1500)], ids=["N1_I5", "N63_I100", "N3_I1500_2blocks"])
def test_triton_interpreter_matches_torch_fp32(act, lb, n, i):
    a, b, dout = inputs(n, i, seed=4)
    out0, da0, db0 = fused(a, b, dout, act, lb, kernel="torch")
    out1, da1, db1 = fused(a, b, dout, act, lb, kernel="triton")
    assert rel(out1, out0) <= TOL_TRITON_OUT_FP32
    assert rel(da1, da0) <= TOL_TRITON_GRAD_FP32, "da"
    assert rel(db1, db0) <= TOL_TRITON_GRAD_FP32, "db"


def within_one_bf16_ulp(x: torch.Tensor, ref: torch.Tensor) -> bool:
    """Every bf16 ``x`` within one bf16 ulp (2^-7 relative, bf16 keeps 8 significant bits) of the fp32 ``ref``,
    plus an fp32-sized slack (``TOL_BF16_CANCEL · max|ref|``) for values near a zero crossing.

    Why not a relative-norm tolerance: the Triton interpreter's fp32 -> bf16 cast truncates (even with
    ``fp_downcast_rounding='rtne'``; seen with triton 3.6.0), so about half its bf16 values sit one ulp from torch's
    round-to-nearest (rel. error ~4e-3 overall). A GPU rounds to nearest (half an ulp); both pass this check."""
    x, ref = x.double(), ref.double()
    return bool(((x - ref).abs() <= TOL_BF16_ULP * ref.abs() + TOL_BF16_CANCEL * ref.abs().max()).all())


@needs_interpreter
@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("scale", [0.05, 3.0], ids=["small", "wide"])  # small: every |x| < 0.625, tanh's polynomial
def test_triton_interpreter_bf16(act, lb, scale):
    a, b, dout = inputs(63, 100, torch.bfloat16, seed=5, scale=scale)
    out1, da1, db1 = fused(a, b, dout, act, lb, kernel="triton")
    assert out1.dtype == da1.dtype == db1.dtype == torch.bfloat16
    ref = fused(a.float(), b.float(), dout.float(), act, lb, kernel="torch")  # fp32 math on the same bf16 values
    for name, x, y in zip(("out", "da", "db"), (out1, da1, db1), ref, strict=True):
        assert within_one_bf16_ulp(x, y), name


@needs_interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy's exp(1e4) = inf: intended, see _tanh
@pytest.mark.parametrize("act,lb", CASES, ids=CASE_IDS)
def test_triton_interpreter_extreme_inputs(act, lb):
    vals = torch.tensor([-1e4, -100.0, -1e-3, 0.0, 1e-3, 100.0, 1e4])
    a, b = vals.repeat_interleave(len(vals)), vals.repeat(len(vals))
    if act == "silu":
        b = b.clamp(-1.0, 1.0)
    out0, da0, db0 = fused(a, b, torch.ones_like(a), act, lb, kernel="torch")
    out1, da1, db1 = fused(a, b, torch.ones_like(a), act, lb, kernel="triton")
    for name, x, y in (("out", out1, out0), ("da", da1, da0), ("db", db1, db0)):
        assert torch.isfinite(x).all(), name
        assert rel(x, y) <= TOL_TRITON_GRAD_FP32, name


@needs_interpreter
def test_triton_interpreter_non_contiguous_and_records(monkeypatch):
    monkeypatch.delenv("KIMI_GLU_KERNEL", raising=False)
    kernel_choice.reset_used()
    a, b, dout = inputs(10, 30, seed=6)
    at, bt = a.t(), b.t()  # non-contiguous views
    out0, da0, db0 = fused(at, bt, dout.t(), kernel="torch")
    out1, da1, db1 = fused(at, bt, dout.t(), kernel="auto")  # auto under the interpreter: Triton
    assert kernel_choice.used()["glu"] == {"torch": 1, "triton": 1}
    for name, x, y in (("out", out1, out0), ("da", da1, da0), ("db", db1, db0)):
        assert x.shape == y.shape and rel(x, y) <= TOL_TRITON_GRAD_FP32, name
    with pytest.raises(ValueError, match="expected one dtype"):
        S.situ_glu(a, b.double(), kernel="triton")
