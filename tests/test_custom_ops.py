"""The ``cudnn`` backend's kernels as ``kimi::`` custom ops (``kernels_torch.compile``): ``torch.library.opcheck`` on
each op through its CPU twin (schema, fake tensors, autograd registration, AOT dispatch with dynamic shapes), the
ops' gradients against autograd over the readable torch functions in fp64 (opcheck alone would pass an op whose
backward returned zeros), and the fake implementations' shapes and dtypes at the real dimensions against the
kernels' documented outputs (fake tensors only: no kernel runs). The device runs (the kernels themselves under
``opcheck``) are in ``tests/gpu/test_gpu_compile.py``.

Fake CUDA tensors do not work on a CPU-only torch build (a view or an autograd edge of one asks for the CUDA device
guard, "PyTorch is not linked with support for cuda devices", and autograd aborts the process), so the fakes here
are CPU fakes of the real dimensions and dtypes: the fake implementations read only shapes and dtypes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_rel
from torch._subclasses.fake_tensor import FakeTensorMode

from kernels_torch import dsa_cudnn as dc
from kernels_torch import kda
from kernels_torch import kda_cudnn as kc
from kernels_torch.ops import situ as S

TOL = {"grad": 1e-10, "out": 1e-12}  # op vs the readable function, fp64 (the same arithmetic up to reordering)


def _f64(*shape, requires_grad=True):
    return torch.randn(*shape, dtype=torch.float64, requires_grad=requires_grad)


def _sparse_case(T=9, H=3, D=24, d_v=16, K=5):
    """Absorbed sparse MLA inputs at small dims: causal random ids with ``-1`` slots and ids past ``topk_length``;
    row 0 selects nothing (an empty row: out 0, lse +inf, no NaN in the gradients)."""
    torch.manual_seed(3)
    q, kv = _f64(T, H, D), _f64(T, D)
    idx = torch.stack([torch.randint(-1, t + 1, (K,)) for t in range(T)]).to(torch.int32)
    tlen = torch.randint(1, K + 1, (T,), dtype=torch.int32)
    tlen[0] = 0
    return q, kv, idx, tlen, 0.3, d_v


def _kda_case(B=1, T=21, H=2, K=8, V=4):
    torch.manual_seed(4)
    q, k = (torch.nn.functional.normalize(_f64(B, T, H, K), dim=-1).detach().requires_grad_() for _ in range(2))
    g = (-torch.rand(B, T, H, K, dtype=torch.float64) * 2).requires_grad_()
    beta = torch.rand(B, T, H, dtype=torch.float64).requires_grad_()
    return q, k, _f64(B, T, H, V), g, beta, _f64(2, H, K, V), torch.tensor([0, 8, T])


def _op_cases():
    """(name, op, args, readable function of the same args or None)."""
    a, b = _f64(5, 7), _f64(5, 7)
    q, kv, idx, tlen, scale, d_v = _sparse_case()
    kq, kk, kv_, kg, kb, s0, cu = _kda_case()
    x, cw, cs = _f64(1, 21, 6), _f64(6, 1, 4), _f64(2, 6, 3)
    torch.manual_seed(5)
    qi, ki, wi = torch.randn(11, 4, 8), torch.randn(11, 8), torch.randn(11, 4)

    def situ_eager(a, b, act, beta, lb, kernel):
        return S.situ_glu(a, b, beta, lb, hidden_act=act, kernel=kernel)

    def sparse_eager(q, kv, idx, tlen, scale, d_v, kernel):
        out, lse = dc._sparse_mla_torch(q, kv, idx, tlen, scale, d_v, return_lse=True)
        return out, lse

    def kda_eager(q, k, v, g, beta, s0, cu, *rest):
        return kda.kda_chunk(q, k, v, g, beta, None, s0, cu)

    def conv_eager(x, w, cu, st, *rest):
        return kda.short_conv(x, w, cu, st)

    def nograd(*args):  # the backward ops are called on saved tensors: no autograd of their own
        return tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in args)

    return [
        ("situ_glu", S._situ_glu_op, (a, b, "situ", 4.0, 25.0, "torch"), situ_eager),
        ("silu_glu", S._situ_glu_op, (a, b, "silu", 1.0, None, "torch"), situ_eager),
        ("situ_glu_backward", S._situ_glu_backward_op, nograd(_f64(5, 7), a, b, "situ", 4.0, 25.0, "torch"), None),
        ("sparse_mla", dc._sparse_mla_op, (q, kv, idx, tlen, scale, d_v, None), sparse_eager),
        (
            "sparse_mla_backward",
            dc._sparse_mla_backward_op,
            nograd(_f64(9, 3, d_v), q, kv, _f64(9, 3, d_v), _f64(9, 3), idx, tlen, scale),
            None,
        ),
        ("indexer_topk", dc._indexer_topk_op, (qi, ki, wi, 4, torch.tensor([0, 6, 11])), None),
        ("indexer_topk_one_doc", dc._indexer_topk_op, (qi, ki, wi, 16, None), None),
        ("kda_cudnn", kc._kda_cudnn_op, (kq, kk, kv_, kg, kb, s0, cu, None), kda_eager),
        ("kda_cudnn_no_state", kc._kda_cudnn_op, (kq, kk, kv_, kg, kb, None, None, None), kda_eager),
        (
            "kda_cudnn_backward",
            kc._kda_cudnn_backward_op,
            nograd(_f64(1, 21, 2, 4), _f64(2, 2, 8, 4), kq, kk, kv_, kg, kb, s0, cu),
            None,
        ),
        ("kda_fla", kc._kda_fla_op, (kq, kk, kv_, kg, kb, s0, cu), kda_eager),
        ("kda_short_conv", kc._short_conv_gpu_op, (x, cw, torch.tensor([0, 8, 21]), cs, "fla", False), conv_eager),
    ]


CASES = _op_cases()


@pytest.mark.parametrize("name, op, args, eager", CASES, ids=[c[0] for c in CASES])
def test_cudnn_ops_opcheck_and_gradients(name, op, args, eager):
    """opcheck on every op of the cudnn backend; the outputs and gradients of the ops with one equal those of the
    readable function (autograd over the same math)."""
    torch.library.opcheck(op, args)
    if eager is None:
        return
    inputs = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]
    got, want = op(*args), eager(*args)
    got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
    for i, (o, e) in enumerate(zip(got, want)):
        check_rel(f"{name} out {i}", o.masked_fill(torch.isinf(e), 0), e.masked_fill(torch.isinf(e), 0), TOL["out"])
    grads = []
    for outs in (got, want):
        torch.manual_seed(1)
        seeds = [torch.randn(o.shape, dtype=o.dtype) for o in outs]  # randn_like would follow the strides
        diff = [(o, s) for o, s in zip(outs, seeds) if o.requires_grad]
        grads.append(torch.autograd.grad([o for o, _ in diff], inputs, [s for _, s in diff], allow_unused=True))
    for i, (g1, g2) in enumerate(zip(*grads)):
        assert g1 is not None and g2 is not None, (name, i)
        assert torch.isfinite(g1).all(), (name, i)
        check_rel(f"{name} d input {i}", g1, g2, TOL["grad"])


def test_sparse_mla_backward_twin_is_the_softmax_backward():
    """The CPU twin of cuDNN's sparse backward (from ``out`` and the natural-log ``lse``, no recomputation of the
    softmax normaliser) equals autograd over the gathered sparse attention, including on an empty row."""
    q, kv, idx, tlen, scale, d_v = _sparse_case()
    out, lse = dc._sparse_mla_torch(q, kv, idx, tlen, scale, d_v, return_lse=True)
    dout = torch.randn_like(out)
    want = torch.autograd.grad(out, (q, kv), dout)
    got = dc._sparse_mla_backward_torch(dout, q.detach(), kv.detach(), out.detach(), lse, idx, tlen, scale)
    check_rel("dq", got[0], want[0], TOL["grad"])
    check_rel("dkv", got[1], want[1], TOL["grad"])
    assert not got[0][0].any()  # the empty row: no key, no gradient


def test_indexer_topk_twin_selects_the_canonical_set():
    """The CPU twin of the cuDNN indexer top-k: per row, the ``min(k, visible)`` keys of its document prefix with
    the highest scores (ties to the larger key index), ids ascending then ``-1``; ``topk_length`` = that count."""
    torch.manual_seed(6)
    T, HI, DI, k = 13, 4, 8, 5
    q_I, k_I, w = torch.randn(T, HI, DI), torch.randn(T, DI), torch.randn(T, HI)
    k_I[7] = k_I[6]  # equal keys: equal scores, a tie the larger index wins
    cu = torch.tensor([0, 4, T])
    idx, tlen = dc._indexer_topk_op(q_I, k_I, w, k, cu)
    scores = torch.einsum("thd,sd->ths", q_I, k_I).relu().mul(DI**-0.5)
    scores = (scores * w[..., None] * HI**-0.5).sum(1)  # [T, T]
    for t in range(T):
        start = 0 if t < 4 else 4
        keys = sorted(range(start, t + 1), key=lambda s: (-float(scores[t, s]), -s))[:k]
        want = sorted(keys) + [-1] * (k - len(keys))
        assert idx[t].tolist() == want, (t, idx[t].tolist(), want)
        assert int(tlen[t]) == len(keys)
    assert idx.dtype == tlen.dtype == torch.int32


def _fake(mode, *shape, dtype=torch.bfloat16):
    with mode:
        return torch.empty(*shape, dtype=dtype)


def test_fake_shapes_at_the_real_dimensions():
    """Each op's fake implementation at K3's dimensions gives the shapes and dtypes the kernels document: FlashMLA's
    ``out [T, H, 512]`` bf16 and ``lse [T, H]`` fp32 (docs/kernels.md), cuDNN's sparse backward ``dq`` / ``dkv`` as
    q and kv, the indexer top-k ``[T, k]`` and ``[T]`` int32, cuDNN FE's KDA ``o`` as v and the state ``[N, H, K,
    V]`` fp32 with gradients shaped as the inputs (``dg`` and ``dbeta`` fp32), the short conv's ``[B, T, C]`` and
    ``[N, C, W-1]``, SiTU-GLU's output and gradients as its inputs."""
    mode = FakeTensorMode()
    T, H, k, N = 4096, 96, 2048, 3
    q, kv = _fake(mode, T, H, 576), _fake(mode, T, 576)
    idx, tlen = _fake(mode, T, k, dtype=torch.int32), _fake(mode, T, dtype=torch.int32)
    with mode:
        out, lse = dc._sparse_mla_op(q, kv, idx, tlen, 192**-0.5, 512, None)
        dq, dkv = dc._sparse_mla_backward_op(out, q, kv, out, lse, idx, tlen, 192**-0.5)
        ids, lens = dc._indexer_topk_op(_fake(mode, T, 32, 128), _fake(mode, T, 128), _fake(mode, T, 32), k, None)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == ((T, H, 512), torch.bfloat16, (T, H), torch.float32)
    assert (dq.shape, dq.dtype, dkv.shape, dkv.dtype) == (q.shape, q.dtype, kv.shape, kv.dtype)
    assert (ids.shape, ids.dtype, lens.shape, lens.dtype) == ((T, k), torch.int32, (T,), torch.int32)
    assert dq.is_contiguous() and out.is_contiguous()

    Hk, K = 96, 128
    qk = [_fake(mode, 1, T, Hk, K) for _ in range(3)]
    g, beta = _fake(mode, 1, T, Hk, K, dtype=torch.float32), _fake(mode, 1, T, Hk, dtype=torch.float32)
    s0, cu = _fake(mode, N, Hk, K, K, dtype=torch.float32), _fake(mode, N + 1, dtype=torch.int32)
    with mode:
        o, st = kc._kda_cudnn_op(*qk, g, beta, s0, cu, None)
        grads = kc._kda_cudnn_backward_op(o, st, *qk, g, beta, s0, cu)
        o2, st2 = kc._kda_fla_op(*qk, g, beta, None, cu)
        y, cs = kc._short_conv_gpu_op(_fake(mode, 1, T, Hk * K), _fake(mode, Hk * K, 1, 4, dtype=torch.float32), cu,
                                      None, "cudnn", False)  # fmt: skip
        a = _fake(mode, T, 3584)
        act = S._situ_glu_op(a, a, "situ", 4.0, 25.0, "triton")
        da, db = S._situ_glu_backward_op(act, a, a, "situ", 4.0, 25.0, "triton")
    for o_ in (o, o2):
        assert (o_.shape, o_.dtype) == ((1, T, Hk, K), torch.bfloat16)
    for s_ in (st, st2):
        assert (s_.shape, s_.dtype) == ((N, Hk, K, K), torch.float32)
    want = [(t.shape, t.dtype) for t in (*qk, g, beta, s0)]
    assert [(t.shape, t.dtype) for t in grads] == want
    assert (y.shape, y.dtype, cs.shape, cs.dtype) == ((1, T, Hk * K), torch.bfloat16, (N, Hk * K, 3), torch.bfloat16)
    assert all((t.shape, t.dtype) == (a.shape, a.dtype) for t in (act, da, db))
