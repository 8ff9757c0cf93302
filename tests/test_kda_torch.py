"""KDA torch twin (kernels_torch/kda.py) against the JAX reference (reference_jax/kda.py): functions, module, packed
documents, decode, bf16, backends. Relative error with a named tolerance per tensor; seeded random inputs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from helpers import rel
from layer_weights import kda_params, layer_dtypes

import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
import reference_jax.kda as jk
from kimi.config import load_config
from kimi.layout import param_layout

TOL_FP32 = 1e-5  # torch vs JAX, fp32
TOL_FP64 = 1e-10  # torch vs JAX, fp64
TOL_BF16 = 3e-2  # bf16 torch module vs fp32 torch module
LB = -5.0
PREFIX = "model.layers.{i}.self_attn."


DTYPES = {"fp32": (torch.float32, np.float32, TOL_FP32), "fp64": (torch.float64, np.float64, TOL_FP64)}


def pair(a: np.ndarray, name: str):
    """The same values as a torch tensor and a jax array of the run dtype ``name``."""
    tdt, ndt, _ = DTYPES[name]
    return torch.tensor(a.astype(ndt)), jnp.asarray(a.astype(ndt))


def kda_inputs(seed, B, T, H, K, V, N=None):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q, k = unit(rng.standard_normal((B, T, H, K))), unit(rng.standard_normal((B, T, H, K)))
    v = rng.standard_normal((B, T, H, V))
    g = LB / (1 + np.exp(-3 * rng.standard_normal((B, T, H, K))))
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    S0 = rng.standard_normal((N or B, H, K, V))
    return q, k, v, g, beta, S0


# ------------------------------------------------------------------------------------------------ functions


@pytest.mark.parametrize("dt", ["fp32", "fp64"])
@pytest.mark.parametrize("lower_bound", [LB, None], ids=["lb_sigmoid", "softplus"])
def test_gate_l2norm_gated_norm_match_jax(lower_bound, dt):
    rng = np.random.default_rng(1)
    H, K = 3, 8
    f, A_log, dt_bias = rng.uniform(-30, 30, (2, 5, H, K)), np.log(rng.uniform(1, 16, H)), rng.standard_normal(H * K)
    o, gate, w = rng.standard_normal((2, 5, H, K)), rng.standard_normal((2, 5, H, K)), rng.standard_normal(K)
    tol = DTYPES[dt][2]
    with jax.enable_x64(dt == "fp64"):
        (ft, fj), (at, aj), (bt, bj) = pair(f, dt), pair(A_log, dt), pair(dt_bias, dt)
        gt, gj = tk.kda_gate(ft, at, bt, lower_bound), jk.kda_gate(fj, aj, bj, lower_bound)
        assert gt.dtype == DTYPES[dt][0] and rel(gt, gj) <= tol
        assert rel(tk.l2norm(ft), jk.l2norm(fj)) <= tol
        (ot, oj), (gat, gaj), (wt, wj) = pair(o, dt), pair(gate, dt), pair(w, dt)
        assert rel(tk.gated_rms_norm(ot, gat, wt, 1e-5), jk.gated_rms_norm(oj, gaj, wj, 1e-5)) <= tol
    assert (
        tk.kda_gate(torch.tensor(f, dtype=torch.bfloat16), torch.tensor(A_log), torch.tensor(dt_bias), LB).dtype
        == torch.float32
    )


@pytest.mark.parametrize("cu", [None, [0, 1, 9, 30]], ids=["batch", "packed"])
def test_short_conv_matches_jax(cu):
    rng = np.random.default_rng(2)
    B, N = (2, 2) if cu is None else (1, 3)
    T, C, W = 30, 6, 4
    x, w, st = rng.standard_normal((B, T, C)), rng.standard_normal((C, 1, W)), rng.standard_normal((N, C, W - 1))
    (xt, xj), (wt, wj), (stt, stj) = pair(x, "fp32"), pair(w, "fp32"), pair(st, "fp32")
    cut = None if cu is None else torch.tensor(cu)
    yt, nt = tk.short_conv(xt, wt, cut, stt)
    yj, nj = jk.short_conv(xj, wj, None if cu is None else np.array(cu), stj)
    assert rel(yt, yj) <= TOL_FP32 and rel(nt, nj) <= TOL_FP32
    yt2, _ = tk.short_conv(xt, wt[:, 0], cut, stt)  # [C, W] weight
    assert torch.equal(yt, yt2)


@pytest.mark.parametrize("dt", ["fp32", "fp64"])
@pytest.mark.parametrize(
    "T,cu", [(1, None), (65, None), (200, None), (200, [0, 1, 70, 200])], ids=["T1", "T65", "T200", "packed"]
)
def test_recurrence_matches_jax(T, cu, dt):
    B, N = (2, 2) if cu is None else (1, len(cu) - 1)
    arrays = kda_inputs(T, B, T, 2, 8, 12, N=N)  # K = 8 != V = 12
    tol = DTYPES[dt][2]
    with jax.enable_x64(dt == "fp64"):
        ts, js = zip(*(pair(a, dt) for a in arrays))
        cut, cuj = (None, None) if cu is None else (torch.tensor(cu), np.array(cu))
        o_j, S_j = jk.kda_recurrent(*js[:5], initial_state=js[5], cu_seqlens=cuj)
        for fn in (tk.kda_chunk, tk.kda_recurrent):
            o_t, S_t = fn(*ts[:5], initial_state=ts[5], cu_seqlens=cut)
            assert o_t.dtype == S_t.dtype == DTYPES[dt][0]
            assert rel(o_t, o_j) <= tol and rel(S_t, S_j) <= tol, (fn.__name__, rel(o_t, o_j), rel(S_t, S_j))
        o_t, S_t = tk.kda_chunk(*ts[:5], initial_state=ts[5], cu_seqlens=cut, chunk_size=16)
        assert rel(o_t, o_j) <= tol and rel(S_t, S_j) <= tol


def test_chunk_no_overflow_near_lower_bound():
    """Case 6 in torch: g close to -5 on full 64-token chunks stays finite and matches the recurrence."""
    q, k, v, _, beta, S0 = (torch.tensor(a, dtype=torch.float32) for a in kda_inputs(6, 1, 192, 2, 8, 4))
    g = LB + 0.05 * torch.rand(1, 192, 2, 8, generator=torch.Generator().manual_seed(6))
    o_c, S_c = tk.kda_chunk(q, k, v, g, beta, initial_state=S0)
    o_r, S_r = tk.kda_recurrent(q, k, v, g, beta, initial_state=S0)
    assert torch.isfinite(o_c).all() and torch.isfinite(S_c).all()
    assert rel(o_c, o_r) <= TOL_FP32 and rel(S_c, S_r) <= TOL_FP32


TOL_GRAD_FP64 = 1e-9  # gradients, chunk (recomputed per chunk) vs autograd through the recurrence, fp64


@pytest.mark.parametrize("cu", [None, [0, 1, 37, 70]], ids=["batch", "packed"])
def test_chunk_gradients_match_recurrence_and_keep_no_decay_tensors(cu):
    """Autograd through ``kda_chunk`` (each chunk recomputed in the backward) equals autograd through the
    recurrence for every input, K != V, T not a multiple of the chunk; and the backward keeps no ``[.., C, C, K]``
    decay tensor alive between forward and backward (what makes training at 8K tokens fit)."""
    B = 2 if cu is None else 1
    N = B if cu is None else len(cu) - 1
    C, K = 16, 6
    arrays = kda_inputs(31, B, 70, 2, K, 5, N=N)
    ins_c = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    ins_r = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in arrays]
    gen = torch.Generator().manual_seed(32)
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o_c, S_c = tk.kda_chunk(*ins_c[:5], initial_state=ins_c[5], cu_seqlens=cu, chunk_size=C)
    o_r, S_r = tk.kda_recurrent(*ins_r[:5], initial_state=ins_r[5], cu_seqlens=cu)
    do, dS = (
        torch.randn(o_r.shape, generator=gen, dtype=torch.float64),
        torch.randn(S_r.shape, generator=gen, dtype=torch.float64),
    )
    ((o_c * do).sum() + (S_c * dS).sum()).backward()
    ((o_r * do).sum() + (S_r * dS).sum()).backward()
    assert rel(o_c, o_r) <= TOL_FP64 and rel(S_c, S_r) <= TOL_FP64
    for name, a, b in zip(("q", "k", "v", "g", "beta", "S0"), ins_c, ins_r):
        assert rel(a.grad, b.grad) <= TOL_GRAD_FP64, (name, rel(a.grad, b.grad))
    assert shapes and not [s for s in shapes if len(s) >= 3 and s[-3:] == (C, C, K)], "decay tensors kept for backward"


def test_output_dtype_follows_v_in_both_forms():
    """o comes back in v's dtype (the state in the compute dtype), in the recurrent and the chunk form alike, as in
    the JAX twin: bf16 inputs give bf16 o and fp32 S."""
    q, k, v, g, beta, _ = (torch.tensor(a, dtype=torch.float32) for a in kda_inputs(8, 1, 20, 2, 4, 3))
    o_j, S_j = jk.kda_recurrent(
        *(jnp.asarray(t.numpy()).astype(jnp.bfloat16) for t in (q, k, v)),
        jnp.asarray(g.numpy()),
        jnp.asarray(beta.numpy()),
    )
    for fn in (tk.kda_recurrent, tk.kda_chunk):
        o, S = fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta)
        assert o.dtype == torch.bfloat16 and S.dtype == torch.float32, fn.__name__
        assert str(o_j.dtype) == "bfloat16" and str(S_j.dtype) == "float32"


def test_invalid_inputs_raise():
    q, k, v, g, beta, _ = (torch.tensor(a, dtype=torch.float32) for a in kda_inputs(3, 1, 10, 1, 4, 4))
    for bad in ([0, 5, 5, 10], [1, 10], [0, 9]):
        for fn in (tk.kda_chunk, tk.kda_recurrent):
            with pytest.raises(ValueError, match="cu_seqlens"):
                fn(q, k, v, g, beta, cu_seqlens=torch.tensor(bad))
        with pytest.raises(ValueError, match="cu_seqlens"):
            tk.short_conv(v[:, :, 0], torch.ones(4, 1, 4), cu_seqlens=torch.tensor(bad))
    with pytest.raises(ValueError, match="A_log"):
        tk.kda_gate(g, torch.zeros(8), torch.zeros(4), LB)


# ------------------------------------------------------------------------------------------------ the module


def configs():
    base = load_config("tiny")
    return {"k3": base, "kimi_linear_gates": base.replace(use_full_rank_gate=False, gate_lower_bound=None)}


def random_weights(cfg, i, seed) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Random canonical weights of KDA layer i (float64 numpy, names without the self_attn prefix) and their
    checkpoint dtypes."""
    return kda_params(cfg, i, np.random.default_rng(seed)), layer_dtypes(cfg, i, "self_attn.")


def jax_tree(flat, dtype):
    tree: dict = {}
    for name, a in flat.items():
        *path, leaf = name.split(".")
        node = tree
        for p in path:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(a, dtype)
    return {"params": tree}


def torch_module(cfg, flat, dtype=torch.float32, backend="eager"):
    m = tk.KimiDeltaAttention(cfg, 0, backend=backend).to(dtype)  # cast first: loading copies into the param dtype
    m.load_state_dict({k: torch.tensor(v) for k, v in flat.items()}, strict=True)
    return m


def jit_apply(model, cu=None):
    return jax.jit(
        lambda p, x, cache=None, mode="chunk": model.apply(p, x, cu_seqlens=cu, cache=cache, mode=mode),
        static_argnames="mode",
    )


@pytest.mark.parametrize("name", ["k3", "kimi_linear_gates"])
def test_state_dict_keys_are_canonical(name):
    cfg = configs()[name]
    i = cfg.kda_layers[-1]
    m = tk.KimiDeltaAttention(cfg, i)
    pre = PREFIX.format(i=i)
    want = {s.name[len(pre) :]: s.shape for s in param_layout(cfg, [i]) if s.name.startswith(pre)}
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == want
    with pytest.raises(ValueError, match="layer_idx"):
        tk.KimiDeltaAttention(cfg, cfg.mla_layers[0])


@pytest.mark.parametrize("dt", ["fp32", "fp64"])
@pytest.mark.parametrize("name,mode", [("k3", "chunk"), ("kimi_linear_gates", "recurrent"), ("k3", "recurrent")])
def test_module_matches_jax(name, mode, dt):
    cfg = configs()[name]
    flat, _ = random_weights(cfg, 0, seed=20)
    tdt, ndt, tol = DTYPES[dt]
    x = np.random.default_rng(21).standard_normal((2, 20, cfg.hidden_size))
    with jax.enable_x64(dt == "fp64"):
        out_j, cache_j = jit_apply(jk.KimiDeltaAttention(cfg, 0))(jax_tree(flat, ndt), jnp.asarray(x, ndt), mode=mode)
        with torch.no_grad():
            out_t, cache_t = torch_module(cfg, flat, tdt)(torch.tensor(x, dtype=tdt), mode=mode)
    assert out_t.dtype == tdt and rel(out_t, out_j) <= tol
    for a, b in zip(cache_t, cache_j):
        assert rel(a, b) <= tol


def test_module_packed_and_decode_match_jax():
    """Packed documents (a length-1 one inside) and prefill + single-token decode in torch equal the JAX one-shot
    prefill (case 3: beta's sigmoid once, also when decoding)."""
    cfg = configs()["k3"]
    flat, _ = random_weights(cfg, 0, seed=22)
    x = np.random.default_rng(23).standard_normal((1, 30, cfg.hidden_size)).astype(np.float32)
    cu = [0, 7, 8, 30]
    jm = jk.KimiDeltaAttention(cfg, 0)
    params = jax_tree(flat, jnp.float32)
    out_j, cache_j = jit_apply(jm, np.array(cu))(params, jnp.asarray(x))
    tm = torch_module(cfg, flat)
    with torch.no_grad():
        out_t, cache_t = tm(torch.tensor(x), cu_seqlens=torch.tensor(cu))
        assert rel(out_t, out_j) <= TOL_FP32
        for a, b in zip(cache_t, cache_j):
            assert rel(a, b) <= TOL_FP32
        # decode: the last document, prefill 18 tokens then 4 single-token steps in each mode
        out_jd, _ = jit_apply(jm)(params, jnp.asarray(x[:, 8:30]))
        for mode in ("chunk", "recurrent"):
            o, c = tm(torch.tensor(x[:, 8:26]), mode=mode)
            steps = []
            for t in range(26, 30):
                o_t, c = tm(torch.tensor(x[:, t : t + 1]), cache=c, mode=mode)
                steps.append(o_t)
            assert rel(torch.cat([o] + steps, dim=1), out_jd) <= TOL_FP32
            assert rel(c.S, cache_j.S[2:]) <= TOL_FP32 and rel(c.conv_v, cache_j.conv_v[2:]) <= TOL_FP32


def test_bf16_module_close_to_fp32():
    """bf16 projections and activations (checkpoint dtypes) with fp32 gates, beta and state stay close to fp32 (case 2
    in the torch path: g and beta are never narrowed)."""
    cfg = configs()["k3"]
    flat, dtypes = random_weights(cfg, 0, seed=24)
    m16 = torch_module(cfg, flat)
    for n, p in m16.named_parameters():
        if dtypes[n] == "bfloat16":
            p.data = p.data.to(torch.bfloat16)
    m32 = torch_module(
        cfg,
        {
            n: torch.tensor(a).to(torch.bfloat16 if dtypes[n] == "bfloat16" else torch.float32).float().numpy()
            for n, a in flat.items()
        },
    )
    x = torch.randn(2, 40, cfg.hidden_size, generator=torch.Generator().manual_seed(25))
    with torch.no_grad():
        out16, c16 = m16(x.to(torch.bfloat16))
        out32, c32 = m32(x.to(torch.bfloat16).float())
    assert out16.dtype == torch.bfloat16 and c16.S.dtype == torch.float32
    assert m16.q_conv1d.weight.dtype == torch.float32 and m16.A_log.dtype == torch.float32
    assert rel(out16, out32) <= TOL_BF16 and rel(c16.S, c32.S) <= TOL_BF16


def test_bf16_module_keeps_gates_fp32(monkeypatch):
    """Case 2: in the bf16 module the recurrence receives g and beta in fp32 (and L2-normalised q, k in fp32)."""
    cfg = configs()["k3"]
    flat, _ = random_weights(cfg, 0, seed=28)
    seen = {}

    def spy(q, k, v, g, beta, **kw):
        seen.update(q=q.dtype, k=k.dtype, g=g.dtype, beta=beta.dtype)
        return tk.kda_recurrent(q, k, v, g, beta, **kw)

    monkeypatch.setattr(tk, "kda_chunk", spy)
    m = torch_module(cfg, flat).to(torch.bfloat16)
    with torch.no_grad():
        m(torch.randn(1, 5, cfg.hidden_size, dtype=torch.bfloat16))
    assert seen == {"q": torch.float32, "k": torch.float32, "g": torch.float32, "beta": torch.float32}


def test_long_sequence_slow_decay_fp32_vs_fp64():
    """Case 2 in torch: T = 4096, g ~ -1e-3; the fp32 chunk form stays within 1e-5 of fp64, bf16-narrowed g does not."""
    rng = np.random.default_rng(29)
    q, k, v, _, beta, _ = kda_inputs(29, 1, 4096, 1, 4, 4)
    g = -1e-3 * rng.uniform(0.5, 1.5, (1, 4096, 1, 4))
    f32 = [torch.tensor(a, dtype=torch.float32) for a in (q, k, v, g, beta)]
    o_ref, S_ref = tk.kda_recurrent(*(t.double() for t in f32))
    o, S = tk.kda_chunk(*f32)
    assert rel(o, o_ref) <= 1e-5 and rel(S, S_ref) <= 1e-5
    _, S_bad = tk.kda_chunk(*f32[:3], f32[3].bfloat16().float(), f32[4].bfloat16().float())
    assert rel(S_bad, S_ref) > 1e-3


def test_backends():
    cfg = configs()["k3"]
    flat, _ = random_weights(cfg, 0, seed=26)
    x = torch.randn(1, 9, cfg.hidden_size, generator=torch.Generator().manual_seed(27))
    with torch.no_grad():
        out_e, _ = torch_module(cfg, flat)(x)
        out_s, _ = torch_module(cfg, flat, backend="sdpa")(x)
        assert torch.equal(out_e, out_s)
        with pytest.raises(ValueError, match="backend"):
            tk.KimiDeltaAttention(cfg, 0, backend="flash")
        with pytest.raises(
            RuntimeError, match="cudnn"
        ):  # no fla or no CUDA here: a clear error, never a silent fallback
            torch_module(cfg, flat, backend="cudnn")(x)
        with pytest.raises(ValueError, match="mode"):
            torch_module(cfg, flat)(x, mode="fused")


def test_cudnn_backend_names_what_is_missing():
    """backend='cudnn' needs the gpu extra (fla), CUDA tensors and bf16 activations; the error lists every missing one
    and nothing silently falls back to eager."""
    import importlib.util

    cfg = configs()["k3"]
    m = torch_module(cfg, random_weights(cfg, 0, seed=30)[0], backend="cudnn")
    x = torch.randn(1, 3, cfg.hidden_size)
    with pytest.raises(RuntimeError) as e:
        m(x)
    msg = str(e.value)
    assert "backend='cudnn'" in msg and "CUDA" in msg and "bfloat16" in msg
    assert ("gpu extra" in msg) == (importlib.util.find_spec("fla") is None)
    with pytest.raises(RuntimeError, match="CUDA") as e:
        m(x.bfloat16(), mode="recurrent")
    assert "bfloat16 activations" not in str(e.value)


def test_kda_recurrence_cudnn_layout_conversions(monkeypatch):
    """kda_recurrence_cudnn's boundary, with a torch stand-in for cuDNN's op (THD tensors, cu_seqlens int32, V-first
    states [N, H, V, K], default scale): B sequences become packed documents, states are transposed in and out, and the
    result equals kda_chunk on our layout, including the gradient of the initial state (to fp32 rounding: the op takes
    fp32 states). K != V catches a missing transpose."""
    seen = {}

    def fake_op(q, k, v, g, beta, cu_seqlens, scale, initial_state=None, output_final_state=False, plan_name=None):
        T, H, K = q.shape
        V = v.shape[-1]
        N = cu_seqlens.numel() - 1
        assert (
            k.shape == (T, H, K) and g.shape == (T, H, K) and beta.shape == (T, H) and cu_seqlens.dtype == torch.int32
        )
        assert initial_state is None or initial_state.shape == (N, H, V, K)
        assert scale == K**-0.5 and output_final_state
        seen.update(N=N, plan=plan_name)
        S0 = None if initial_state is None else initial_state.transpose(-1, -2)
        o, S = tk.kda_chunk(q[None], k[None], v[None], g[None], beta[None], scale, S0, cu_seqlens.tolist())
        return o[0], S.transpose(-1, -2), torch.empty(0)

    monkeypatch.setattr(kc, "_cudnn_kda_op", lambda: fake_op)
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 9, 2, 4, 6
    q, k = (tk.l2norm(torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    g = -torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    S0 = torch.randn(B, H, K, V, generator=gen, dtype=torch.float64, requires_grad=True)
    o, S = kc.kda_recurrence_cudnn(q, k, v, g, beta, S0, plan_name=None)
    o_r, S_r = tk.kda_chunk(q, k, v, g, beta, initial_state=S0)
    assert seen == {"N": B, "plan": None} and o.shape == (B, T, H, V) and S.shape == (B, H, K, V)
    torch.testing.assert_close(o, o_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, S_r, rtol=1e-5, atol=1e-6)
    (dS0,) = torch.autograd.grad(S.sum() + o.sum(), S0)
    (dS0_r,) = torch.autograd.grad(S_r.sum() + o_r.sum(), S0)
    torch.testing.assert_close(dS0, dS0_r, rtol=1e-5, atol=1e-6)
    # packed documents (B = 1) with a length-1 document
    cu = [0, 1, 5, 9]
    o, S = kc.kda_recurrence_cudnn(q[:1], k[:1], v[:1], g[:1], beta[:1], S0.detach()[:1].repeat(3, 1, 1, 1), cu, None)
    o_r, S_r = tk.kda_chunk(
        q[:1], k[:1], v[:1], g[:1], beta[:1], initial_state=S0.detach()[:1].repeat(3, 1, 1, 1), cu_seqlens=cu
    )
    torch.testing.assert_close(o, o_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(S, S_r, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="initial_state"):
        kc.kda_recurrence_cudnn(q, k, v, g, beta, S0[:1], plan_name=None)
