"""GPU checks of the Triton KDA input preparation (``kernels_torch.ops.kda_prep``, issue 15) on CUDA: ``l2norm_qk`` and
``kda_gate_lb`` against the eager ``kernels_torch.kda.l2norm`` / ``kda_gate`` in fp64 with autograd (outputs and dq,
dk, df, dA_log, ddt_bias), at the layer's head layout (H = 96, K = 128) and an odd H, T in {1, 63, 2049, 8192}, a head
past A_LOG_MAX and extreme f; beside fla's ``l2norm`` / ``fused_kda_gate`` (the ``outside`` preparation) on the same
inputs; and the cudnn KDA layer with ``kda_prep='triton'`` and ``'outside'`` against the eager fp32 layer (output, x
and every parameter gradient, with ``test_gpu_kda_cudnn``'s tolerances). Same checks on the CPU through Triton's
interpreter: ``tests/test_kda_prep_triton.py``. Errors are printed as ``KDA_ERR <test> <tensor> <value>``.
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_kda_cudnn import (
    TOL_GRAD,
    TOL_OUT,
    _eager_grads,
    _tol_for,
    configs,
    inputs,
    layer_pair,
    rel,
    report,
)

import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
from kernels_torch import kernel_choice
from kernels_torch.ops import kda_prep as kp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DEVICE = "cuda"
LB = -5.0
TOL = {  # ||a - b|| / ||b|| against fp64 eager autograd, per input dtype and tensor. CPU interpreter measured (T 63 /
    # 2049): fp32 l2 5e-8, g 3e-8, df 3.5e-7, ddt_bias 3.7e-7, dA_log 5e-6 (a cancelling sum of B*T*K terms per head);
    # here 10x more room for the compiled approximate sqrt / division / exp and the 4x longer sums at T = 8192
    torch.float32: {
        "qn": 2e-6,
        "kn": 2e-6,
        "dq": 2e-6,
        "dk": 2e-6,
        "g": 2e-6,
        "df": 5e-6,
        "dA_log": 1e-4,
        "ddt_bias": 5e-6,
    },
    # bf16: y and df stored in bf16 (2^-9 relative, measured 3.3e-3); the L2 backward uses the stored y
    torch.bfloat16: {
        "qn": 5e-3,
        "kn": 5e-3,
        "dq": 1e-2,
        "dk": 1e-2,
        "g": 2e-6,
        "df": 5e-3,
        "dA_log": 1e-4,
        "ddt_bias": 5e-6,
    },
}
TOL_VS_FLA = {"qn": 1e-2, "kn": 1e-2, "dq": 2e-2, "dk": 2e-2, "g": 1e-5, "df": 1e-2, "dA_log": 1e-3, "ddt_bias": 1e-3}


def _triton_or_skip():
    why = kp.triton_prep_unavailable(torch.empty(1, device=DEVICE))
    if why is not None:
        pytest.skip(f"Triton KDA preparation: {why}")


def _fla_prep():
    """fla's functions (``kda_prep='outside'``) or None where fla does not import."""
    try:
        from fla.modules.norm.l2norm import l2norm as fla_l2norm
        from fla.ops.kda.gate import fused_kda_gate
    except Exception:  # noqa: BLE001
        return None
    return fla_l2norm, fused_kda_gate


SHAPES = {  # (B, T, H, K)
    "T1": (2, 1, 96, 128),
    "T63_H5": (2, 63, 5, 128),
    "T2049": (1, 2049, 96, 128),
    "T8192": (1, 8192, 96, 128),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_l2norm_qk_matches_eager_and_fla(shape, dtype):
    _triton_or_skip()
    B, T, H, K = SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(T + H)
    rn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    scale = torch.tensor([1.0, 1e-3, 30.0], device=DEVICE)[
        torch.randint(0, 3, (B, T, H, 1), device=DEVICE, generator=gen)
    ]
    q, k = (rn(B, T, H, K) * scale).to(dtype), (rn(B, T, H, K) * scale.flip(0)).to(dtype)
    dqn, dkn = rn(B, T, H, K).to(dtype), rn(B, T, H, K).to(dtype)
    qf, kf = (t.clone().requires_grad_(True) for t in (q, k))
    qn, kn = kp.l2norm_qk(qf, kf)
    torch.autograd.backward([qn, kn], [dqn, dkn])
    qr, kr = (t.double().requires_grad_(True) for t in (q, k))
    torch.autograd.backward([tk.l2norm(qr), tk.l2norm(kr)], [dqn.double(), dkn.double()])
    test = f"prep_l2[{shape}-{dtype}]"
    errs = {"qn": rel(qn, tk.l2norm(q.double())), "kn": rel(kn, tk.l2norm(k.double()))}
    errs |= {"dq": rel(qf.grad, qr.grad), "dk": rel(kf.grad, kr.grad)}
    bad = {n: e for n, e in errs.items() if not report(test, n, e) <= TOL[dtype][n]}
    fla = _fla_prep()
    if fla is not None and dtype == torch.bfloat16:
        ql, kl = (t.clone().requires_grad_(True) for t in (q, k))
        qn_f, kn_f = fla[0](ql), fla[0](kl)
        torch.autograd.backward([qn_f, kn_f], [dqn, dkn])
        vs = {"qn": rel(qn, qn_f), "kn": rel(kn, kn_f), "dq": rel(qf.grad, ql.grad), "dk": rel(kf.grad, kl.grad)}
        bad |= {f"{n} vs fla": e for n, e in vs.items() if not report(test, f"{n} vs fla", e) <= TOL_VS_FLA[n]}
    assert not bad, f"{test}: over tolerance {bad}"


@pytest.mark.parametrize("extreme", [False, True], ids=["normal_f", "extreme_f"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_gate_matches_eager_and_fla(shape, dtype, extreme):
    _triton_or_skip()
    B, T, H, K = SHAPES[shape]
    gen = torch.Generator(device=DEVICE).manual_seed(T + 2 * H)
    rn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    f = 4 * rn(B, T, H, K)
    if extreme:  # +-1e4 and +-1e30 entries: saturated sigmoid, still finite values and gradients
        pick = torch.rand(f.shape, device=DEVICE, generator=gen)
        f = torch.where(pick < 0.05, 1e4 * torch.sign(f), f)
        f = torch.where(pick > 0.97, 1e30 * torch.sign(f), f)
    f = f.to(dtype)
    A_log = torch.rand(H, device=DEVICE, generator=gen).mul(15).add(1).log()
    A_log[0] = 80.0  # past A_LOG_MAX: capped, zero gradient
    dt_bias, dg = rn(H * K), rn(B, T, H, K)
    ours = {"f": f.clone(), "A_log": A_log.clone(), "dt_bias": dt_bias.clone()}
    ours = {n: t.requires_grad_(True) for n, t in ours.items()}
    g = kp.kda_gate_lb(ours["f"], ours["A_log"], ours["dt_bias"], LB)
    g.backward(dg)
    ref = {n: t.double().requires_grad_(True) for n, t in (("f", f), ("A_log", A_log), ("dt_bias", dt_bias))}
    g_r = tk.kda_gate(ref["f"], ref["A_log"], ref["dt_bias"], LB)
    g_r.backward(dg.double())
    assert g.dtype == torch.float32 and ours["f"].grad.dtype == dtype
    assert all(torch.isfinite(t.grad).all() for t in ours.values()) and torch.isfinite(g).all()
    assert ours["A_log"].grad[0] == 0
    test = f"prep_gate[{shape}-{dtype}-{'extreme' if extreme else 'normal'}]"
    errs = {"g": rel(g, g_r)} | {"d" + n: rel(ours[n].grad, ref[n].grad) for n in ours}  # df, dA_log, ddt_bias
    bad = {n: e for n, e in errs.items() if not report(test, n, e) <= TOL[dtype][n]}
    fla = _fla_prep()
    if fla is not None and dtype == torch.bfloat16 and not extreme:
        fl = {n: t.detach().clone().requires_grad_(True) for n, t in ours.items()}
        A_cap = fl["A_log"].clamp(max=tk.A_LOG_MAX)
        g_f = fla[1](fl["f"], A_cap, fl["dt_bias"], lower_bound=LB, output_dtype=torch.float32)
        g_f.backward(dg)
        vs = {"g": rel(g, g_f), "df": rel(ours["f"].grad, fl["f"].grad)}
        vs |= {
            "dA_log": rel(ours["A_log"].grad, fl["A_log"].grad),
            "ddt_bias": rel(ours["dt_bias"].grad, fl["dt_bias"].grad),
        }
        bad |= {f"{n} vs fla": e for n, e in vs.items() if not report(test, f"{n} vs fla", e) <= TOL_VS_FLA[n]}
    assert not bad, f"{test}: over tolerance {bad}"


GRAD_CASES = {"T63": (2, 63, None), "T2049": (1, 2049, None), "packed_len1": (1, 400, [0, 1, 100, 130, 400])}


@pytest.mark.parametrize("prep", ["triton", "outside"])
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_cudnn_layer_with_prep_matches_eager(case, prep):
    """The cudnn KDA layer (cuDNN's op) with our Triton preparation and with fla's: output, dx and every parameter
    gradient against eager fp32 (loss <out, dout>), with the tolerances of ``test_gpu_kda_cudnn``."""
    _triton_or_skip()
    why = kc.cudnn_kda_unavailable(torch.empty(1, device=DEVICE, dtype=torch.bfloat16), 128, 128)
    if why is not None:
        pytest.skip(f"cuDNN KDA: {why}")
    cfg = configs()["k3_lb_sigmoid"]
    B, T, cu = GRAD_CASES[case]
    out_r, dx_r, grads_r, dout = _eager_grads(cfg, "k3_lb_sigmoid", B, T, cu)
    fast, _ = layer_pair(cfg, seed=50, kernel="cudnn")
    fast.kda_prep = prep
    x16, _ = inputs(cfg, B, T, seed=51)
    x16.requires_grad_(True)
    kernel_choice.reset_used()
    out, _ = fast(x16, cu_seqlens=cu)
    out.backward(dout)
    used = kernel_choice.used()
    assert used["kda"] == {"cudnn": 1} and used["kda_prep"] == {prep: 1}
    test = f"prep_layer[{prep}-{case}]"
    failures = []
    for name, e, tol in (
        ("out", report(test, "out", rel(out, out_r)), TOL_OUT),
        ("dx", report(test, "dx", rel(x16.grad, dx_r)), TOL_GRAD["x"]),
    ):
        if not e <= tol:
            failures.append((name, e, tol))
    for n, p in fast.named_parameters():
        e = report(test, "d" + n, rel(p.grad, grads_r[n]))
        if not e <= _tol_for(n)[1]:
            failures.append((n, e, _tol_for(n)[1]))
    assert not failures, f"{test}: relative errors over tolerance {failures}"
