"""GPU checks of the KDA layer under ``backend='cudnn'`` (``kernels_torch.kda_cudnn.kda_layer_forward``) on both
recurrence kernels (``kda_kernel`` = ``cudnn``: cuDNN Frontend's KDA op; ``fla``: fla-core's ``chunk_kda``) against the pure-torch
eager layer: forward (out, final state, conv states), packed documents, decode, the gradients of every parameter and
of x, the recurrence alone with non-zero initial states (and its gradient), and bitwise reproducible forwards. The cuDNN
kernel runs in three variants (``kda_prep``): ``triton`` and ``outside`` (q/k L2 norm, gate and beta sigmoid computed
around the op by our Triton kernels, auto's choice, or by fla's; what training runs) and ``in_kernel`` (the op's own
fusions, forward only, opt-in: measured slower): all are checked against eager fp32 with the same tolerances. Spec ``architecture.md`` section 2; cases 1-7.

The cudnn layer runs in bf16 with the checkpoint dtypes (bf16 projections, fp32 conv / A_log / dt_bias / o_norm); the
eager reference runs in fp32 on the same bf16-rounded values, so the errors below are the bf16 pipeline's error
(the spec measured fla's ``chunk_kda`` at 4.4e-3 relative to an fp32 recurrence at T = 512, bf16 inputs).
H = 96, K = V = 128 (the real head layout, so the kernels autotune once for the benchmark too), small hidden size.
Every measured error is printed as ``KDA_ERR <test> <tensor> <value>``.
"""

from __future__ import annotations

import os

import pytest
import torch
from _helpers import rel_or_scaled  # tests/gpu is on pytest's path
from helpers import rel

import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
from kernels_torch import kernel_choice
from kimi.config import load_config
from kimi.layout import param_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL_OUT = 2e-2  # layer output, bf16 cudnn vs fp32 eager (||a - b|| / ||b||)
TOL_STATE = 2e-2  # final recurrent state S [N, H, K, V] (fp32 in both, from bf16 activations)
TOL_CU_DTYPE = 1e-2  # fla chunk_kda with int32 vs int64 cu_seqlens (bf16 rounding of other tile configs)
TOL_CONV = 1e-2  # conv states: the last W-1 pre-conv projections (bf16 rounding of a fp32 value only)
TOL_GRAD = {  # per tensor, bf16 cudnn vs fp32 eager
    "x": 5e-2,
    "linear": 5e-2,  # q/k/v/f_a/f_b/b/g/o projections (the bf16 eager layer itself is ~3e-2 off on dq_proj)
    "conv": 5e-2,  # q/k/v_conv1d.weight [P, 1, W]
    "A_log": 1e-1,  # [H]: a sum over all tokens and channels with cancellation (bf16 eager: up to 7.6e-2)
    "dt_bias": 5e-2,  # [H*K]
    "o_norm.weight": 3e-2,
}
TOL_ZERO_GRAD = 5e-2  # ||grad|| / ||the same gradient at T = 2|| where the eager one is exactly zero (T = 1's gate)
TOL_REC = {"o": 1e-2, "S": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dS0": 2e-2}
DEVICE = "cuda"
# KIMI_TEST_KDA_KERNELS narrows the kernels (e.g. "cudnn" when fla was checked in an earlier run: its autotuning is slow)
KERNELS = os.environ.get("KIMI_TEST_KDA_KERNELS", "cudnn,fla").split(",")


@pytest.fixture(params=KERNELS)
def kernel(request):
    """The recurrence kernel under test; cuDNN's is skipped (with the reason) where its op cannot run."""
    if request.param == "cudnn":
        why = kc.cudnn_kda_unavailable(torch.empty(1, device=DEVICE, dtype=torch.bfloat16), 128, 128)
        if why is not None:
            pytest.skip(f"cuDNN KDA: {why}")
    kernel_choice.reset_used()
    return request.param


def ran_on(kernel):
    """Every KDA call since the fixture ran on ``kernel`` (no silent fallback)."""
    got = kernel_choice.used().get("kda", {})
    assert set(got) == {kernel}, f"KDA calls ran on {got}, expected only {kernel!r}"


def configs():
    base = load_config("tiny").replace(hidden_size=256, kda_num_heads=96, kda_head_dim=128, kda_gate_rank=64)
    return {
        "k3_lb_sigmoid": base,  # gate_lower_bound = -5, full-rank output gate
        "kimi_linear_softplus": base.replace(gate_lower_bound=None, use_full_rank_gate=False),
    }


def report(test: str, name: str, value: float) -> float:
    print(f"KDA_ERR {test} {name} {value:.3e}")
    return value


def layer_pair(cfg, seed: int, kernel: str | None = None):
    """(cudnn layer with checkpoint dtypes, eager fp32 layer with the same bf16-rounded values), both on the GPU.
    Random weights: linear N(0, 1/in), conv 0.5 N(0,1), A_log log U(1, 16), dt_bias N(0,1), o_norm 1 + 0.1 N(0,1)."""
    i = cfg.kda_layers[0]
    pre = f"model.layers.{i}.self_attn."
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    vals, dtypes = {}, {}
    for s in param_layout(cfg, [i]):
        if not s.name.startswith(pre):
            continue
        name, shape = s.name[len(pre) :], tuple(s.shape)
        r = torch.randn(shape, device=DEVICE, generator=gen)
        if name == "A_log":
            r = torch.rand(shape, device=DEVICE, generator=gen).mul(15).add(1).log()
        elif name == "o_norm.weight":
            r = 1 + 0.1 * r
        elif "conv1d" in name:
            r = 0.5 * r
        elif name != "dt_bias":
            r = r * shape[-1] ** -0.5
        dt = torch.bfloat16 if s.dtype == "bfloat16" else torch.float32
        vals[name], dtypes[name] = r.to(dt), dt
    if kernel == "cudnn" and cfg.gate_lower_bound is None:
        pytest.skip("cuDNN's KDA engine declines the unbounded softplus gate: test_unbounded_gate_runs_on_fla")
    fast = tk.KimiDeltaAttention(cfg, i, backend="cudnn").to(DEVICE)
    fast.kda_kernel = kernel
    ref = tk.KimiDeltaAttention(cfg, i, backend="eager").to(DEVICE)
    for n, p in fast.named_parameters():
        p.data = vals[n].clone()
    ref.load_state_dict({n: v.float() for n, v in vals.items()}, strict=True)
    return fast, ref


def inputs(cfg, B, T, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(B, T, cfg.hidden_size, device=DEVICE, generator=gen).to(torch.bfloat16)
    return x, x.float()


def check_forward(test, fast, ref, x16, x32, cu=None, cache16=None, cache32=None):
    with torch.no_grad():
        out, c = fast(x16, cu_seqlens=cu, cache=cache16)
        out_r, c_r = ref(x32, cu_seqlens=cu, cache=cache32)
    assert out.dtype == torch.bfloat16 and out.shape == out_r.shape and c.S.dtype == torch.float32
    assert c.S.shape == c_r.S.shape and c.conv_q.shape == c_r.conv_q.shape
    assert torch.isfinite(out).all()
    errs = {"out": rel(out, out_r), "S": rel(c.S, c_r.S)}
    errs.update({n: rel(getattr(c, n), getattr(c_r, n)) for n in ("conv_q", "conv_k", "conv_v")})
    for n, e in errs.items():
        report(test, n, e)
    assert errs["out"] <= TOL_OUT and errs["S"] <= TOL_STATE
    assert all(errs[n] <= TOL_CONV for n in ("conv_q", "conv_k", "conv_v"))  # max() would drop a NaN
    return out, c


# ------------------------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("gate", list(configs()))
@pytest.mark.parametrize("T", [1, 63, 2049, 8192])
def test_forward_matches_eager(T, gate, kernel):
    cfg = configs()[gate]
    fast, ref = layer_pair(cfg, seed=T, kernel=kernel)
    x16, x32 = inputs(cfg, 2 if T < 4096 else 1, T, seed=T + 1)
    check_forward(f"fwd[{kernel}-{gate}-T{T}]", fast, ref, x16, x32)
    ran_on(kernel)


@pytest.mark.parametrize("gate", list(configs()))
def test_forward_bitwise_reproducible(gate, kernel):
    """Two forward calls on the same inputs give identical bits (activation recomputation relies on it)."""
    cfg = configs()[gate]
    fast, _ = layer_pair(cfg, seed=7, kernel=kernel)
    x16, _ = inputs(cfg, 1, 2049, seed=8)
    cu = torch.tensor([0, 1, 700, 2049])
    with torch.no_grad():
        a, ca = fast(x16, cu_seqlens=cu)
        b, cb = fast(x16, cu_seqlens=cu)
    assert torch.equal(a, b) and torch.equal(ca.S, cb.S)
    ran_on(kernel)


CU = {
    "len1_docs": [0, 1, 2, 3, 503],
    "three_docs": [0, 256, 500, 1000],
    "five_docs": [0, 15, 100, 300, 1200, 2000],
}


@pytest.mark.parametrize("gate", list(configs()))
@pytest.mark.parametrize("cu_name", list(CU))
def test_packed_documents_match_eager(cu_name, gate, kernel):
    """Cases 4-5: conv window and state reset at every document start (B = 1, contiguous documents)."""
    cfg = configs()[gate]
    cu = CU[cu_name]
    fast, ref = layer_pair(cfg, seed=len(cu), kernel=kernel)
    x16, x32 = inputs(cfg, 1, cu[-1], seed=cu[1])
    out, c = check_forward(
        f"packed[{kernel}-{gate}-{cu_name}]", fast, ref, x16, x32, cu=torch.tensor(cu, dtype=torch.int64)
    )
    # int32 on the GPU and a plain list give the same result
    with torch.no_grad():
        out32, c32 = fast(x16, cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEVICE))
        out_l, _ = fast(x16, cu_seqlens=cu)
    assert torch.equal(out32, out) and torch.equal(c32.S, c.S) and torch.equal(out_l, out)
    # the first tokens of every later document differ from running the row as one document (the reset is real)
    with torch.no_grad():
        whole, _ = fast(x16)
    starts = torch.tensor([s + j for s, e in zip(cu[1:-1], cu[2:]) for j in range(min(3, e - s))], device=DEVICE)
    assert torch.isfinite(whole).all()  # rel is inf on a NaN: the lower bound below would pass on one
    assert rel(whole[:, starts], out[:, starts]) > 10 * TOL_OUT
    ran_on(kernel)


def test_fla_chunk_kda_cu_seqlens_int32_and_int64():
    """fla's chunk_kda itself takes cu_seqlens as int64 (its annotation) and as int32: the same documents.

    Not bit-identical (H200, 2026-11-30): the index dtype is part of Triton's autotune key, so the two calls may run
    different tile configs; the results agree to bf16 rounding, while ignoring the boundaries changes them by O(1)."""
    from fla.ops.kda import chunk_kda

    gen = torch.Generator(device=DEVICE).manual_seed(5)
    T, H, K = 700, 96, 128  # H as in the layer tests: no extra autotuning
    q, k, v, f = (torch.randn(1, T, H, K, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(4))
    beta = torch.rand(1, T, H, device=DEVICE, generator=gen)
    A_log, dt_bias = torch.zeros(H, device=DEVICE), torch.randn(H * K, device=DEVICE, generator=gen)
    outs = {}
    for name, dt in (("int64", torch.int64), ("int32", torch.int32), ("one_doc", None)):
        cu = None if dt is None else torch.tensor([0, 1, 64, 300, 700], dtype=dt, device=DEVICE)
        o, S = chunk_kda(
            q,
            k,
            v,
            f,
            beta,
            initial_state=None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True,
            A_log=A_log,
            dt_bias=dt_bias,
            safe_gate=True,
            lower_bound=-5.0,
            cu_seqlens=cu,
        )
        outs[name] = (o, S)
    e_o = report("fla_cu_dtype", "out int32 vs int64", rel(outs["int32"][0], outs["int64"][0]))
    e_S = report("fla_cu_dtype", "S int32 vs int64", rel(outs["int32"][1], outs["int64"][1]))
    starts = [1, 2, 64, 65, 300, 301]  # first tokens of documents 2-4, where a reset state must change the output
    e_doc = report(
        "fla_cu_dtype",
        "out at document starts, one document vs int64",
        rel(outs["one_doc"][0][:, starts], outs["int64"][0][:, starts]),
    )
    assert e_o <= TOL_CU_DTYPE and e_S <= TOL_CU_DTYPE
    assert torch.isfinite(outs["one_doc"][0]).all()  # rel is inf on a NaN: the lower bound below would pass on one
    assert e_doc > 10 * TOL_CU_DTYPE  # the boundaries matter, so the comparison above can fail


@pytest.mark.parametrize("gate", list(configs()))
def test_prefill_then_decode_matches_full_prefill(gate, kernel):
    """Case 3 and the decode cache: prefill T-8 then 8 single-token steps (chunk mode through fla with a cache, and
    recurrent mode through the torch recurrence) equals one prefill of T, and both match eager fp32."""
    cfg = configs()[gate]
    fast, ref = layer_pair(cfg, seed=40, kernel=kernel)
    T = 72
    x16, x32 = inputs(cfg, 2, T, seed=41)
    with torch.no_grad():
        full_r, c_full_r = ref(x32)
        for mode in ("chunk", "recurrent"):
            o, c = fast(x16[:, : T - 8])
            steps = [o]
            for t in range(T - 8, T):
                o_t, c = fast(x16[:, t : t + 1], cache=c, mode=mode)
                steps.append(o_t)
            out = torch.cat(steps, dim=1)
            e_out, e_S = (
                report(f"decode[{kernel}-{gate}-{mode}]", "out", rel(out, full_r)),
                report(f"decode[{kernel}-{gate}-{mode}]", "S", rel(c.S, c_full_r.S)),
            )
            assert e_out <= TOL_OUT and e_S <= TOL_STATE
            assert rel(c.conv_v, c_full_r.conv_v) <= TOL_CONV


def test_needs_bf16_on_gpu():
    cfg = configs()["k3_lb_sigmoid"]
    fast, _ = layer_pair(cfg, seed=3)
    x16, x32 = inputs(cfg, 1, 8, seed=4)
    with pytest.raises(RuntimeError, match="bfloat16") as e:
        fast(x32)
    assert "CUDA" not in str(e.value) and "gpu extra" not in str(e.value)


# ------------------------------------------------------------------------------------------------ gradients


def _tol_for(name: str) -> tuple[str, float]:
    if name.endswith("proj.weight"):
        return "linear", TOL_GRAD["linear"]
    if "conv1d" in name:
        return "conv", TOL_GRAD["conv"]
    return name, TOL_GRAD[name]


_EAGER_GRADS: dict = {}


def _eager_grads(cfg, gate, B, T, cu):
    """Eager fp32 out and gradients of x and every parameter for loss <out, dout> (cached: both kernels share them)."""
    key = (gate, B, T, None if cu is None else tuple(cu))
    if key not in _EAGER_GRADS:
        _, ref = layer_pair(cfg, seed=50)
        _, x32 = inputs(cfg, B, T, seed=51)
        x32.requires_grad_(True)
        gen = torch.Generator(device=DEVICE).manual_seed(52)
        dout = torch.randn(B, T, cfg.hidden_size, device=DEVICE, generator=gen).to(torch.bfloat16)
        out_r, _ = ref(x32, cu_seqlens=cu)
        out_r.backward(dout.float())
        grads = {n: p.grad.detach() for n, p in ref.named_parameters()}
        _EAGER_GRADS.clear()  # keep one entry: the large ones are hundreds of MB
        _EAGER_GRADS[key] = (out_r.detach(), x32.grad.detach(), grads, dout)
    return _EAGER_GRADS[key]


ONE_DECAY_STEP = (2, 2, None)  # (B, T, cu_seqlens): the unit of a gradient that is exactly zero at T = 1
GRAD_CASES = {  # name -> (B, T, cu_seqlens)
    "T1": (2, 1, None),
    "T63": (2, 63, None),
    "T2049": (1, 2049, None),
    "T8192": (1, 8192, None),
    "packed_len1": (1, 400, [0, 1, 100, 130, 400]),
}


@pytest.mark.parametrize("gate", list(configs()))
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradients_match_eager(gate, case, kernel):
    """dx and the gradient of every parameter, cudnn backend (bf16) against eager (fp32 autograd through the
    pure-torch chunk form), loss = <out, dout> with random dout; T in {1, 63, 2049, 8192} and packed documents with a
    length-1 document."""
    _check_gradients(gate, case, kernel)


@pytest.mark.parametrize("case", ["T63", "T2049", "packed_len1"])
@pytest.mark.parametrize("conv", ["cudnn", "fla"])
def test_gradients_match_eager_per_short_conv_kernel(case, conv):
    """The same check with the layer's short convolutions forced to each kernel (``short_conv_kernel``; cuDNN FE's
    ``causal_conv1d`` or fla's), recurrence on cuDNN where it runs; every call ran on the forced conv kernel."""
    kernel = "cudnn" if "cudnn" in KERNELS and _cudnn_kda_why() is None else "fla"
    if conv == "cudnn":
        why = kc.cudnn_short_conv_unavailable(torch.empty(1, device=DEVICE, dtype=torch.bfloat16), 4)
        if why is not None:
            pytest.skip(f"cuDNN short conv: {why}")
    kernel_choice.reset_used()
    _check_gradients("k3_lb_sigmoid", case, kernel, conv)
    assert kernel_choice.used()["short_conv"] == {conv: 3}


def _cudnn_kda_why():
    return kc.cudnn_kda_unavailable(torch.empty(1, device=DEVICE, dtype=torch.bfloat16), 128, 128)


def _check_gradients(gate, case, kernel, conv=None):
    cfg = configs()[gate]
    B, T, cu = GRAD_CASES[case]
    out_r, dx_r, grads_r, dout = _eager_grads(cfg, gate, B, T, cu)
    fast, _ = layer_pair(cfg, seed=50, kernel=kernel)
    fast.short_conv_kernel = conv
    x16, _ = inputs(cfg, B, T, seed=51)
    x16.requires_grad_(True)
    out, _ = fast(x16, cu_seqlens=cu)
    out.backward(dout)
    test = f"grad[{kernel}-{gate}-{case}" + (f"-conv_{conv}]" if conv else "]")
    failures = []  # every check is "not e <= tol": a NaN error fails (``e > tol`` let one pass)
    errs = {"out": report(test, "out", rel(out, out_r)), "x": report(test, "dx", rel(x16.grad, dx_r))}
    if not errs["out"] <= TOL_OUT:
        failures.append(("out", errs["out"], TOL_OUT))
    if not errs["x"] <= TOL_GRAD["x"]:
        failures.append(("dx", errs["x"], TOL_GRAD["x"]))
    if kernel == "cudnn":  # training computes the L2 norm / gate / beta sigmoid outside the op (the SM90 backward
        # needs it); auto takes fla's functions (kda_prep='outside'; ours, 'triton': tests/gpu/test_gpu_kda_prep.py)
        assert set(kernel_choice.used().get("kda_prep", {})) == {"outside"}
    # At T = 1 from a zero state the gate's parameters (A_log, dt_bias, f_a/f_b_proj) get an exactly zero gradient:
    # the decay only multiplies that state. The eager reference gives 0; a kernel gives 0 (cuDNN) or rounding noise
    # (fla's dg = q*dq - k*dk cancels in exact arithmetic only). Such a gradient is measured in units of the same
    # gradient at T = 2 (same weights and seeds), where one token's decay acts on a non-zero state, against
    # TOL_ZERO_GRAD.
    zero_ref = {n for n, _ in fast.named_parameters() if not bool(grads_r[n].ne(0).any())}
    scale = _eager_grads(cfg, gate, *ONE_DECAY_STEP)[2] if zero_ref else None
    for n, p in fast.named_parameters():
        assert p.grad is not None, f"{n}: no gradient through the cudnn path"
        assert p.grad.dtype == p.dtype
        _, tol = _tol_for(n)
        if n in zero_ref:
            e, tol = rel_or_scaled(p.grad, grads_r[n], scale[n]), TOL_ZERO_GRAD
        else:
            e = rel(p.grad, grads_r[n])
        report(test, "d" + n, e)
        if not e <= tol:
            failures.append((n, e, tol))
    ran_on(kernel)
    assert not failures, f"relative errors over tolerance: {failures}"


# ------------------------------------------------------------------------------------------------ the recurrence alone


def _recurrence(kernel, q, k, v, g, beta, S0, cu):
    """o, S of one kernel on L2-normalised bf16 q/k, bf16 v, fp32 log-space g and beta, fp32 S0 [N, H, K, V]."""
    if kernel == "cudnn":
        return kc.kda_recurrence_cudnn(q, k, v, g, beta, S0, cu)
    from fla.ops.kda import chunk_kda

    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int64, device=DEVICE)
    return chunk_kda(
        q, k, v, g, beta, scale=q.shape[-1] ** -0.5, initial_state=S0, output_final_state=True, cu_seqlens=cu_t
    )


@pytest.mark.parametrize("case", ["T63", "T2049_init", "packed_len1_init"])
def test_recurrence_matches_eager(case, kernel):
    """The recurrence alone against ``kda_chunk`` in fp32: o, the final state and dq, dk, dv, dg, dbeta and the gradient
    of a non-zero initial state (K-first [N, H, K, V]; the cuDNN op's V-first layout is converted inside), K = V = 128."""
    T, cu, with_S0 = {"T63": (63, None, False), "T2049_init": (2049, None, True)}.get(
        case, (700, [0, 1, 300, 301, 700], True)
    )
    H, K = 8, 128
    gen = torch.Generator(device=DEVICE).manual_seed(T)
    N = 1 if cu is None else len(cu) - 1
    rn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    q = tk.l2norm(rn(1, T, H, K)).to(torch.bfloat16)
    k = tk.l2norm(rn(1, T, H, K)).to(torch.bfloat16)
    v = rn(1, T, H, K).to(torch.bfloat16)
    g = -5 * torch.sigmoid(rn(1, T, H, K))  # the K3 gate's range (-5, 0)
    beta = torch.sigmoid(rn(1, T, H))
    S0 = 0.5 * rn(N, H, K, K) if with_S0 else None
    do, dS = rn(1, T, H, K).to(torch.bfloat16), rn(N, H, K, K)
    leaves = {"q": q, "k": k, "v": v, "g": g, "beta": beta} | ({"S0": S0} if with_S0 else {})
    fast = {n: t.clone().requires_grad_(True) for n, t in leaves.items()}
    ref = {n: t.double().requires_grad_(True) for n, t in leaves.items()}
    o, S = _recurrence(kernel, *(fast[n] for n in ("q", "k", "v", "g", "beta")), fast.get("S0"), cu)
    ((o.float() * do.float()).sum() + (S * dS).sum()).backward()
    o_r, S_r = tk.kda_chunk(*(ref[n] for n in ("q", "k", "v", "g", "beta")), initial_state=ref.get("S0"), cu_seqlens=cu)
    ((o_r * do.double()).sum() + (S_r * dS.double()).sum()).backward()
    test = f"rec[{kernel}-{case}]"
    errs = {"o": rel(o, o_r), "S": rel(S, S_r)}
    errs |= {"d" + n: rel(fast[n].grad, ref[n].grad) for n in ("q", "k", "v", "g", "beta")}
    if with_S0:
        errs["dS0"] = rel(fast["S0"].grad, ref["S0"].grad)
    for n, e in errs.items():
        report(test, n, e)
    bad = {n: e for n, e in errs.items() if not e <= TOL_REC[n]}
    assert not bad, f"{test}: relative errors over tolerance {bad}"


def test_unbounded_gate_runs_on_fla():
    """The softplus gate (gate_lower_bound None): auto runs fla (cuDNN's engine gave NaN there on the H200), and a
    forced cuDNN kernel says why it cannot run."""
    cfg = configs()["kimi_linear_softplus"]
    if kc.cudnn_kda_unavailable(torch.empty(1, device=DEVICE), 128, 128) is not None:
        pytest.skip("no cuDNN KDA op here")
    fast, ref = layer_pair(cfg, seed=60, kernel="auto")
    x16, x32 = inputs(cfg, 1, 300, seed=61)
    kernel_choice.reset_used()
    check_forward("unbounded_gate[auto]", fast, ref, x16, x32)
    ran_on("fla")
    fast.kda_kernel = "cudnn"
    with pytest.raises(RuntimeError, match="gate_lower_bound=None"):
        fast(x16)


# ------------------------------------------------------------------------------------------------ kda_prep variants


def _cudnn_or_skip():
    why = kc.cudnn_kda_unavailable(torch.empty(1, device=DEVICE, dtype=torch.bfloat16), 128, 128)
    if why is not None:
        pytest.skip(f"cuDNN KDA: {why}")


PREP_CASES = {  # name -> (B, T, cu_seqlens, with a random non-zero cache: conv windows and initial state)
    "T1": (2, 1, None, False),
    "T63": (2, 63, None, True),
    "T2049": (1, 2049, None, False),
    "T8192": (1, 8192, None, False),
    "packed_len1_init": (1, 503, [0, 1, 2, 3, 503], True),
}


@pytest.mark.parametrize("prep", ["in_kernel", "outside", "triton"])
@pytest.mark.parametrize("case", list(PREP_CASES))
def test_cudnn_prep_variants_match_eager(case, prep):
    """The cuDNN kernel with the L2 norm / gate / beta sigmoid in the kernel and outside it (fla's or our Triton
    kernels): layer output, final
    state and conv states against eager fp32 (same tolerances as every forward test), with non-zero initial states
    and packed documents including length-1 ones; two calls give identical bits; the variant that ran is recorded."""
    _cudnn_or_skip()
    cfg = configs()["k3_lb_sigmoid"]
    B, T, cu, with_cache = PREP_CASES[case]
    fast, ref = layer_pair(cfg, seed=70 + T, kernel="cudnn")
    fast.kda_prep = prep
    x16, x32 = inputs(cfg, B, T, seed=71 + T)
    cache16 = cache32 = None
    if with_cache:
        N = B if cu is None else len(cu) - 1
        P, W, H, K = (
            cfg.kda_num_heads * cfg.kda_head_dim,
            cfg.short_conv_kernel_size,
            cfg.kda_num_heads,
            cfg.kda_head_dim,
        )
        gen = torch.Generator(device=DEVICE).manual_seed(72)
        conv = [torch.randn(N, P, W - 1, device=DEVICE, generator=gen).to(torch.bfloat16) for _ in range(3)]
        S0 = 0.5 * torch.randn(N, H, K, K, device=DEVICE, generator=gen)
        cache16 = tk.KDACache(*conv, S0)
        cache32 = tk.KDACache(*(c.float() for c in conv), S0)
    cu_t = None if cu is None else torch.tensor(cu)
    kernel_choice.reset_used()
    out, c = check_forward(f"prep[{prep}-{case}]", fast, ref, x16, x32, cu=cu_t, cache16=cache16, cache32=cache32)
    with torch.no_grad():
        out2, c2 = fast(x16, cu_seqlens=cu_t, cache=cache16)
    assert torch.equal(out, out2) and torch.equal(c.S, c2.S)
    used = kernel_choice.used()
    assert {op: used.get(op) for op in ("kda", "kda_prep", "kda_pieces")} == {
        "kda": {"cudnn": 2},
        "kda_prep": {prep: 2},
        "kda_pieces": {"one": 2},
    }
    assert sum(used["short_conv"].values()) == 6  # three convolutions a call, on whichever kernel auto took


def test_cudnn_prep_auto_and_forced():
    """auto: outside (fla's functions) under no_grad and under autograd (in_kernel and triton measured no faster); a
    forced triton (ours) runs; a forced in_kernel runs under no_grad and raises under autograd."""
    _cudnn_or_skip()
    cfg = configs()["k3_lb_sigmoid"]
    fast, _ = layer_pair(cfg, seed=80, kernel="cudnn")
    x16, _ = inputs(cfg, 1, 100, seed=81)
    kernel_choice.reset_used()
    with torch.no_grad():
        fast(x16)
    fast(x16)[0].float().sum().backward()
    assert kernel_choice.used()["kda_prep"] == {"outside": 2}
    fast.kda_prep = "triton"
    fast(x16)[0].float().sum().backward()
    fast.kda_prep = "in_kernel"
    with torch.no_grad():
        fast(x16)
    assert kernel_choice.used()["kda_prep"] == {"outside": 2, "triton": 1, "in_kernel": 1}
    with pytest.raises(RuntimeError, match="in_kernel"):
        fast(x16)


@pytest.mark.parametrize("case", ["T1", "T63", "T2049_init", "packed_len1_init"])
def test_recurrence_fused_matches_eager(case):
    """``kda_recurrence_cudnn_fused`` (raw q/k, raw gate input f with A_log / dt_bias / lower bound, beta logits) against
    ``kda_chunk`` in fp64 on ``l2norm``, ``kda_gate`` and ``sigmoid``: o and the final state (K-first), with one head's
    A_log past the cap A_LOG_MAX and non-zero initial states; and against the outside variant on the same inputs."""
    _cudnn_or_skip()
    T, cu, with_S0 = {"T1": (1, None, False), "T63": (63, None, False), "T2049_init": (2049, None, True)}.get(
        case, (700, [0, 1, 300, 301, 700], True)
    )
    H, K = 8, 128
    gen = torch.Generator(device=DEVICE).manual_seed(90 + T)
    N = 1 if cu is None else len(cu) - 1
    rn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    q, k, v, f = (rn(1, T, H, K).to(torch.bfloat16) for _ in range(4))
    b = rn(1, T, H).to(torch.bfloat16)
    A_log = torch.rand(H, device=DEVICE, generator=gen).mul(15).add(1).log()
    A_log[0] = 80.0  # past A_LOG_MAX (exp(80) overflows fp32): the cap must reach the kernel
    dt_bias = rn(H * K)
    S0 = 0.5 * rn(N, H, K, K) if with_S0 else None
    with torch.no_grad():
        o, S = kc.kda_recurrence_cudnn_fused(q, k, v, f, b, A_log, dt_bias, -5.0, S0, cu)
        g = tk.kda_gate(f.double(), A_log.double(), dt_bias.double(), -5.0)
        qn, kn, beta = tk.l2norm(q.double()), tk.l2norm(k.double()), torch.sigmoid(b.double())
        o_r, S_r = tk.kda_chunk(qn, kn, v.double(), g, beta, initial_state=S0, cu_seqlens=cu)
        o_out, S_out = kc.kda_recurrence_cudnn(
            tk.l2norm(q).to(torch.bfloat16), tk.l2norm(k).to(torch.bfloat16), v, g.float(), beta.float(), S0, cu
        )
    test = f"rec_fused[{case}]"
    errs = {"o": rel(o, o_r), "S": rel(S, S_r)}
    for n, e in errs.items():
        report(test, n, e)
    report(test, "o vs outside", rel(o, o_out))
    report(test, "S vs outside", rel(S, S_out))
    bad = {n: e for n, e in errs.items() if not e <= TOL_REC[n]}
    assert not bad, f"{test}: relative errors over tolerance {bad}"


@pytest.mark.parametrize("gate", ["layer", "uniform"])
def test_pieces_one_and_cudnn_split_match_eager(gate):
    """``kda_pieces``: one piece per sequence (auto) and cuDNN's split (here 33 pieces: 264 // 8 heads, with its
    walk-back) both match ``kda_chunk`` in fp64 (o and the final state), with a gate whose slowest channels hardly
    decay (the layer's kind, which stalls the walk-back bound) and with one uniform in (-5, 0); each is bitwise
    reproducible and the split that ran is recorded."""
    _cudnn_or_skip()
    T, H, K = 2049, 8, 128
    gen = torch.Generator(device=DEVICE).manual_seed(91)
    rn = lambda *s: torch.randn(*s, device=DEVICE, generator=gen)  # noqa: E731
    q, k = (tk.l2norm(rn(1, T, H, K)).to(torch.bfloat16) for _ in range(2))
    v = rn(1, T, H, K).to(torch.bfloat16)
    if gate == "layer":  # lb * sigmoid(rate * (f + dt_bias)) with dt_bias ~ N(0, 1): some channels barely decay
        g = tk.kda_gate(
            rn(1, T, H, K), torch.rand(H, device=DEVICE, generator=gen).mul(15).add(1).log(), rn(H * K), -5.0
        )
    else:
        g = -5 * torch.rand(1, T, H, K, device=DEVICE, generator=gen)
    beta = torch.sigmoid(rn(1, T, H))
    S0 = 0.5 * rn(1, H, K, K)
    o_r, S_r = tk.kda_chunk(q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=S0.double())
    kernel_choice.reset_used()
    for pieces in ("one", "cudnn"):
        o, S = kc.kda_recurrence_cudnn(q, k, v, g, beta, S0, pieces=pieces)
        o2, S2 = kc.kda_recurrence_cudnn(q, k, v, g, beta, S0, pieces=pieces)
        assert torch.equal(o, o2) and torch.equal(S, S2), f"{pieces}: two calls differ"
        errs = {"o": report(f"pieces[{pieces}-{gate}]", "o", rel(o, o_r)), "S": rel(S, S_r)}
        assert errs["o"] <= TOL_REC["o"] and errs["S"] <= TOL_REC["S"], f"{pieces}: {errs}"
    assert kernel_choice.used()["kda_pieces"] == {"one": 2, "cudnn": 2}
