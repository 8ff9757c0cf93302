"""CPU checks of the cuDNN KDA path's argument preparation (``kernels_torch.kda``): the forward-only variant that lets
cuDNN's op compute the q/k L2 norm, the lower-bound gate and the beta sigmoid (``kda_recurrence_cudnn_fused``) against
the variant that computes them outside (``kda_recurrence_cudnn``) and against the eager functions, and the layer's
choice between them (``kda_prep``). cuDNN's op is replaced by a torch stand-in that implements its documented options
(cuDNN FE 1.32 ``kimi_delta_attention`` docstring: ``x * rsqrt(sum(x^2) + 1e-6)``, ``gate_lower_bound *
sigmoid(exp(a_log) * (g + dt_bias))`` with ``dt_bias [H, K]``, ``sigmoid(beta)``; THD tensors, V-first states), so
these tests check our wiring, not the kernel (the GPU tests in ``tests/gpu/test_gpu_kda_cudnn.py`` do that)."""

from __future__ import annotations

import pytest
import torch
from helpers import rel

import kernels_torch.kda as tk
import kernels_torch.kda_cudnn as kc
from kernels_torch import kernel_choice
from kimi.config import load_config

TOL = 1e-6  # fp64 inputs; f and beta reach the op as fp32 (what the kernel reads), so ~1e-7 relative differences
LB = -5.0


def fake_op(seen: dict):
    """A torch stand-in for ``torch.ops.cudnn.kimi_delta_attention_fwd`` with the fusion options (fp64 math)."""

    def op(
        q,
        k,
        v,
        g,
        beta,
        cu_seqlens,
        scale,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        safe_gate=False,
        gate_lower_bound=None,
        a_log=None,
        dt_bias=None,
        plan_name=None,
    ):
        T, H, K = q.shape
        V = v.shape[-1]
        N = cu_seqlens.numel() - 1
        assert k.shape == (T, H, K) and g.shape == (T, H, K) and beta.shape == (T, H) and v.shape == (T, H, V)
        assert cu_seqlens.dtype == torch.int32 and scale == K**-0.5 and output_final_state
        assert initial_state is None or (initial_state.shape == (N, H, V, K) and initial_state.dtype == torch.float32)
        seen.update(l2=use_qk_l2norm_in_kernel, sig=use_beta_sigmoid_in_kernel, safe=safe_gate, plan=plan_name)
        if safe_gate:
            # the kernel's g and beta are fp32; a_log [H] capped by us, dt_bias [H, K]
            assert g.dtype == torch.float32 and beta.dtype == torch.float32
            assert a_log.shape == (H,) and dt_bias.shape == (H, K) and float(a_log.max()) <= tk.A_LOG_MAX
            g = gate_lower_bound * torch.sigmoid(a_log.double().exp()[:, None] * (g.double() + dt_bias.double()))
        else:
            assert a_log is None and dt_bias is None
        if use_qk_l2norm_in_kernel:
            q, k = (x.double() * torch.rsqrt(x.double().pow(2).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
        if use_beta_sigmoid_in_kernel:
            beta = torch.sigmoid(beta.double())
        S0 = None if initial_state is None else initial_state.transpose(-1, -2)
        o, S = tk.kda_chunk(q[None], k[None], v[None], g[None], beta[None], scale, S0, cu_seqlens.tolist())
        return o[0], S.transpose(-1, -2), torch.empty(0)

    return op


def inputs(seed: int, B: int, T: int, H: int, K: int, V: int, N: int):
    """Raw (un-normalised) q, k, v, f, beta logits in fp64, A_log [H] with one head past the cap, dt_bias [H*K],
    S0 [N, H, K, V]."""
    gen = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k, f = (2 * rn(B, T, H, K) for _ in range(3))
    v, b = rn(B, T, H, V), rn(B, T, H)
    A_log = torch.empty(H, dtype=torch.float64).uniform_(0.0, 2.8, generator=gen)
    A_log[0] = 80.0  # past A_LOG_MAX: the cap must reach the op (exp(80) overflows fp32)
    dt_bias = rn(H * K)
    return q, k, v, f, b, A_log, dt_bias, 0.5 * rn(N, H, K, V)


@pytest.mark.parametrize(
    "case",
    [
        # (B, T, cu_seqlens, with S0): K != V catches a missing transpose; T = 1; packed with a length-1 document
        (2, 9, None, True),
        (1, 1, None, False),
        (1, 63, [0, 1, 20, 63], True),
    ],
)
def test_fused_matches_outside_and_eager(monkeypatch, case):
    B, T, cu, with_S0 = case
    H, K, V = 3, 4, 6
    N = B if cu is None else len(cu) - 1
    seen = {}
    monkeypatch.setattr(kc, "_cudnn_kda_op", lambda: fake_op(seen))
    q, k, v, f, b, A_log, dt_bias, S0 = inputs(T, B, T, H, K, V, N)
    S0 = S0 if with_S0 else None
    with torch.no_grad():
        o, S = kc.kda_recurrence_cudnn_fused(q, k, v, f, b, A_log, dt_bias, LB, S0, cu, plan_name=None)
    assert seen == {"l2": True, "sig": True, "safe": True, "plan": None}
    assert o.shape == (B, T, H, V) and S.shape == (N, H, K, V) and S.is_contiguous()
    # the same function with the maps computed outside (what training runs)
    g = tk.kda_gate(f, A_log, dt_bias, LB)
    o_out, S_out = kc.kda_recurrence_cudnn(tk.l2norm(q), tk.l2norm(k), v, g, torch.sigmoid(b), S0, cu, plan_name=None)
    assert seen == {"l2": False, "sig": False, "safe": False, "plan": None}
    # and the eager chunk form on our layout
    o_r, S_r = tk.kda_chunk(tk.l2norm(q), tk.l2norm(k), v, g, torch.sigmoid(b), initial_state=S0, cu_seqlens=cu)
    for name, a, ref in (("o", o, o_r), ("S", S, S_r), ("o_outside", o_out, o_r), ("S_outside", S_out, S_r)):
        assert rel(a, ref) <= TOL, f"{name}: {rel(a, ref):.2e}"


def test_fused_refuses_gradients_and_bad_arguments(monkeypatch):
    monkeypatch.setattr(kc, "_cudnn_kda_op", lambda: fake_op({}))
    q, k, v, f, b, A_log, dt_bias, S0 = inputs(0, 1, 5, 2, 4, 4, 1)
    with pytest.raises(RuntimeError, match="forward only"):
        kc.kda_recurrence_cudnn_fused(q, k, v, f, b, A_log.requires_grad_(True), dt_bias, LB, plan_name=None)
    A_log = A_log.detach()
    with torch.no_grad():
        with pytest.raises(ValueError, match="lower_bound"):
            kc.kda_recurrence_cudnn_fused(q, k, v, f, b, A_log, dt_bias, None, plan_name=None)
        with pytest.raises(ValueError, match="dt_bias"):
            kc.kda_recurrence_cudnn_fused(q, k, v, f, b, A_log, dt_bias[:-1], LB, plan_name=None)
        with pytest.raises(ValueError, match="beta_logits"):
            kc.kda_recurrence_cudnn_fused(q, k, v, f, b[..., :1], A_log, dt_bias, LB, plan_name=None)
        with pytest.raises(ValueError, match="initial_state"):
            kc.kda_recurrence_cudnn_fused(q, k, v, f, b, A_log, dt_bias, LB, S0[..., :2], plan_name=None)


def test_prep_choice(monkeypatch):
    """``kda_prep``: auto = outside, with or without gradients (in_kernel measured slower); the attribute beats
    $KIMI_KDA_PREP; a forced in_kernel under autograd raises."""
    monkeypatch.delenv("KIMI_KDA_PREP", raising=False)
    cfg = load_config("tiny")
    layer = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="cudnn")
    x = torch.randn(1, 2, cfg.hidden_size)
    assert layer.kda_prep is None
    assert kc._kda_prep_choice(layer, x) == "outside"  # parameters require grad
    with torch.no_grad():
        assert kc._kda_prep_choice(layer, x) == "outside"
    layer.requires_grad_(False)
    assert kc._kda_prep_choice(layer, x) == "outside"
    monkeypatch.setenv("KIMI_KDA_PREP", "in_kernel")
    assert kc._kda_prep_choice(layer, x) == "in_kernel"  # no gradient needed: the forced choice holds
    with pytest.raises(RuntimeError, match="in_kernel"):
        kc._kda_prep_choice(layer, x.requires_grad_(True))
    x = x.detach()
    monkeypatch.setenv("KIMI_KDA_PREP", "outside")
    with torch.no_grad():
        assert kc._kda_prep_choice(layer, x) == "outside"
        layer.kda_prep = "in_kernel"
        assert kc._kda_prep_choice(layer, x) == "in_kernel"
    with pytest.raises(RuntimeError, match="in_kernel"):
        kc._kda_prep_choice(layer, x.requires_grad_(True))
    layer.kda_prep = "fused"
    with pytest.raises(ValueError, match="kda_prep"):
        kc._kda_prep_choice(layer, x)
    assert kernel_choice.resolve("kda_prep", "auto") == "auto"


def fake_cuda_host(monkeypatch, launches: list):
    """A stand-in for cuDNN FE 1.32's SM90 forward launcher module (``cudnn.linear_attention.hopper.cuda_host``):
    its ``pieces_per_sequence`` is cuDNN's heuristic, and an op stand-in that reads it at call time (as the real
    ``launch`` does) records the P of each call."""
    import sys
    import types

    host = types.ModuleType(kc._CUDNN_KDA_SM90_HOST)
    host.pieces_per_sequence = lambda total, n_seqs, n_heads: max(1, min(264 // (n_seqs * n_heads), -(-total // 16)))
    for name in ("cudnn", "cudnn.linear_attention", "cudnn.linear_attention.hopper"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    monkeypatch.setitem(sys.modules, kc._CUDNN_KDA_SM90_HOST, host)
    op = fake_op({})

    def launching_op(q, *args, **kwargs):
        launches.append(host.pieces_per_sequence(q.shape[0], args[4].numel() - 1, q.shape[1]))
        return op(q, *args, **kwargs)

    monkeypatch.setattr(kc, "_cudnn_kda_op", lambda: launching_op)
    return host


def pieces_case(monkeypatch, seed: int):
    """The fake launcher (:func:`fake_cuda_host`) with no ``$KIMI_KDA_PIECES``, fresh raw inputs (T = 63, H = 3, K = 4,
    V = 6, with S0) and the recurrence's arguments made from them; the record is reset. Returns ``(launches, host,
    raw inputs, args)``."""
    monkeypatch.delenv("KIMI_KDA_PIECES", raising=False)
    launches = []
    host = fake_cuda_host(monkeypatch, launches)
    raw = inputs(seed, 1, 63, 3, 4, 6, 1)
    q, k, v, f, b, A_log, dt_bias, S0 = raw
    args = (tk.l2norm(q), tk.l2norm(k), v, tk.kda_gate(f, A_log, dt_bias, LB), torch.sigmoid(b), S0)
    kernel_choice.reset_used()
    return launches, host, raw, args


def test_pieces_choice_patches_the_launcher_only_inside_the_call(monkeypatch):
    """``kda_pieces``: auto and ``one`` launch with P = 1, ``cudnn`` with cuDNN's heuristic (here 264 // 3 heads,
    capped by the 16-token chunks: 4 at T = 63); the launcher's function is restored after each call, also after an
    error; the same outputs either way (both are the recurrence); each call is recorded; the layer attribute and
    ``$KIMI_KDA_PIECES`` are honoured and a bad value is named."""
    launches, host, raw, args = pieces_case(monkeypatch, seed=5)
    heuristic = host.pieces_per_sequence
    q, k, v, f, b, A_log, dt_bias, S0 = raw
    outs = {p: kc.kda_recurrence_cudnn(*args, plan_name=None, pieces=p) for p in ("auto", "one", "cudnn", None)}
    assert launches == [1, 1, 4, 1] and host.pieces_per_sequence is heuristic
    assert kernel_choice.used()["kda_pieces"] == {"one": 3, "cudnn": 1}
    for p, (o, S) in outs.items():
        assert torch.equal(o, outs["cudnn"][0]) and torch.equal(S, outs["cudnn"][1]), p
    monkeypatch.setenv("KIMI_KDA_PIECES", "cudnn")
    kc.kda_recurrence_cudnn(*args, plan_name=None)
    assert launches[-1] == 4
    with torch.no_grad():  # the forward-only fused variant takes the same switch
        kc.kda_recurrence_cudnn_fused(q, k, v, f, b, A_log, dt_bias, LB, S0, plan_name=None, pieces="one")
    assert launches[-1] == 1 and host.pieces_per_sequence is heuristic
    with pytest.raises(ValueError, match="initial_state"):  # an error inside the call: the launcher is restored
        with kc.cudnn_kda_pieces("one"):
            assert host.pieces_per_sequence(10_000, 1, 3) == 1
            kc.kda_recurrence_cudnn(*args[:5], S0[..., :2], plan_name=None)
    assert host.pieces_per_sequence is heuristic
    monkeypatch.setenv("KIMI_KDA_PIECES", "two")
    with pytest.raises(ValueError, match=r"\$KIMI_KDA_PIECES: got 'two'"):
        kc.kda_recurrence_cudnn(*args, plan_name=None)


def test_pieces_without_the_launcher(monkeypatch):
    """A cuDNN FE without the 1.32 launcher function: auto runs cuDNN's own split (recorded as ``cudnn``); a forced
    ``one`` says why it cannot apply."""
    import sys

    monkeypatch.delenv("KIMI_KDA_PIECES", raising=False)
    monkeypatch.setitem(sys.modules, kc._CUDNN_KDA_SM90_HOST, None)  # import raises ImportError
    monkeypatch.setattr(kc, "_cudnn_kda_op", lambda: fake_op({}))
    q, k, v, f, b, A_log, dt_bias, S0 = inputs(6, 1, 9, 2, 4, 4, 1)
    args = (tk.l2norm(q), tk.l2norm(k), v, tk.kda_gate(f, A_log, dt_bias, LB), torch.sigmoid(b))
    kernel_choice.reset_used()
    kc.kda_recurrence_cudnn(*args, plan_name=None)
    assert kernel_choice.used()["kda_pieces"] == {"cudnn": 1}
    with pytest.raises(RuntimeError, match="kda_pieces: got 'one'.*use 'cudnn'"):
        kc.kda_recurrence_cudnn(*args, plan_name=None, pieces="one")


def test_pieces_nested_cudnn_inside_one(monkeypatch):
    """A ``cudnn`` call inside a ``cudnn_kda_pieces("one")`` block launches with cuDNN's heuristic, which is what it
    records, and the outer block's patch is back after it."""
    launches, host, _, args = pieces_case(monkeypatch, seed=7)
    heuristic = host.pieces_per_sequence
    with kc.cudnn_kda_pieces("one"):
        kc.kda_recurrence_cudnn(*args, plan_name=None, pieces="cudnn")
        assert host.pieces_per_sequence(10_000, 1, 3) == 1  # the outer block's patch is back
        kc.kda_recurrence_cudnn(*args, plan_name=None, pieces="one")
    assert launches == [4, 1] and kernel_choice.used()["kda_pieces"] == {"cudnn": 1, "one": 1}
    assert host.pieces_per_sequence is heuristic


def test_pieces_threads_restore_the_launcher(monkeypatch):
    """A second thread that asks for ``one`` while the first holds the patch waits, and leaves cuDNN's function
    restored once both are done: it must not take the first thread's patch for cuDNN's own function."""
    import threading

    launches = []
    host = fake_cuda_host(monkeypatch, launches)
    heuristic = host.pieces_per_sequence
    real_lock, waiting = kc._PIECES_LOCK, threading.Event()

    class SignallingLock:  # the real lock; says when the second thread is about to wait on it
        def __enter__(self):
            if threading.current_thread().name == "second":
                waiting.set()
            return real_lock.__enter__()

        def __exit__(self, *exc):
            return real_lock.__exit__(*exc)

    monkeypatch.setattr(kc, "_PIECES_LOCK", SignallingLock())
    errors = []

    def second():
        try:
            with kc.cudnn_kda_pieces("one"):
                assert host.pieces_per_sequence(10_000, 1, 3) == 1
        except Exception as e:  # noqa: BLE001  (reported by the assertion below)
            errors.append(e)

    with kc.cudnn_kda_pieces("one"):
        t = threading.Thread(target=second, name="second")
        t.start()
        assert waiting.wait(10)
    t.join(10)
    assert not t.is_alive() and not errors, errors
    assert host.pieces_per_sequence is heuristic, "cuDNN's pieces_per_sequence left patched"


def stub_layer(monkeypatch, T: int = 5):
    """A tiny ``cudnn`` KDA layer (2 heads of 16; kernels on auto) that runs on the CPU: fla's short conv and gated
    norm replaced by the eager functions (fla's calling convention), cuDNN's KDA op by :func:`fake_op` with the
    in-kernel preparation, no SM90 launcher module. Returns ``(layer, x [1, T, D])``; fla's conv stub records its
    calls in ``layer.fla_conv_calls``."""
    import sys
    import types

    calls = []

    def causal_conv1d(x, weight, initial_state, output_final_state, activation, cu_seqlens, cu_seqlens_cpu):
        calls.append(x.shape)
        y, new = tk.short_conv(x, weight, cu_seqlens_cpu, None if initial_state is None else initial_state[..., 1:])
        return y, torch.nn.functional.pad(new, (1, 0))  # fla's [N, C, W] window

    def rms_norm_gated(o, gate, weight, bias, activation, eps):
        return tk.gated_rms_norm(o, gate, weight, eps).to(o.dtype)

    stubs = {n: types.ModuleType(n) for n in ("fla", "fla.modules", "fla.modules.norm", "fla.ops", "fla.ops.kda")}
    stubs["fla.modules.causal_conv1d"] = types.SimpleNamespace(causal_conv1d=causal_conv1d)
    stubs["fla.modules.norm.fused_norm_gate"] = types.SimpleNamespace(rms_norm_gated=rms_norm_gated)
    for name, mod in stubs.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(kc, "_cudnn_kda_op", lambda: fake_op({}))
    monkeypatch.setattr(kc, "_cudnn_missing", lambda x: [])
    monkeypatch.setattr(kc, "cudnn_kda_unavailable", lambda *a, **k: None)
    monkeypatch.setattr(kc, "_cudnn_plan_name", lambda device: None)
    monkeypatch.setattr(kc, "_kda_prep_choice", lambda layer, x: "in_kernel")
    monkeypatch.setitem(sys.modules, kc._CUDNN_KDA_SM90_HOST, None)  # no launcher function
    for var in ("KIMI_KDA_PIECES", "KIMI_SHORT_CONV_KERNEL"):
        monkeypatch.delenv(var, raising=False)
    cfg = load_config("tiny").replace(kda_num_heads=2, kda_head_dim=16)
    layer = tk.KimiDeltaAttention(cfg, cfg.kda_layers[0], backend="cudnn")  # kda_kernel None: auto
    layer.fla_conv_calls = calls
    return layer, torch.randn(1, T, cfg.hidden_size)


def test_layer_refuses_a_bad_pieces_choice_instead_of_falling_back(monkeypatch):
    """The cudnn layer with its kernel on auto: a ``kda_pieces`` outside the choices (attribute or
    ``$KIMI_KDA_PIECES``), or a forced ``one`` where cuDNN FE has no launcher function, raises naming it; it is not
    taken for a cuDNN decline (which falls back to fla's kernel with a warning). A good value runs the op."""
    layer, x = stub_layer(monkeypatch)
    with torch.no_grad():
        kernel_choice.reset_used()
        layer(x)
        assert kernel_choice.used()["kda"] == {"cudnn": 1} and kernel_choice.used()["kda_pieces"] == {"cudnn": 1}
        layer.kda_pieces = "two"
        with pytest.raises(ValueError, match="got 'two' for kda_pieces"):
            layer(x)
        layer.kda_pieces = "one"
        with pytest.raises(RuntimeError, match="kda_pieces: got 'one'"):
            layer(x)
        layer.kda_pieces = None
        monkeypatch.setenv("KIMI_KDA_PIECES", "two")
        with pytest.raises(ValueError, match=r"\$KIMI_KDA_PIECES: got 'two'"):
            layer(x)
