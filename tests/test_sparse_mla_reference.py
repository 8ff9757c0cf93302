"""CPU checks of ``sparse_mla_fwd_reference`` (the oracle) against a dense-mask softmax in fp64 (spec 4.3, cases 12-15)."""

from __future__ import annotations

import math

import pytest
import torch

from kernels_torch.ops.sparse_mla import sparse_mla_fwd, sparse_mla_fwd_reference

SM_SCALE = 192**-0.5  # spec 3.3: 192^-1/2 in both forms, not d_qk^-1/2
TOL_OUT = 1e-6  # relative, reference (fp32) vs dense fp64
TOL_LSE = 1e-6


def _dense(q, kv, indices, sm_scale, topk_length, d_v):
    """Dense-mask oracle in fp64: additive 0/-inf mask over all S keys built from the selected ids."""
    T, H, D = q.shape
    S, K = kv.shape[0], indices.shape[-1]
    idx = indices.reshape(T, K).long()
    keep = (idx >= 0) & (idx < S)
    if topk_length is not None:
        keep &= torch.arange(K)[None, :] < topk_length[:, None].long()
    mask = torch.zeros(T, S, dtype=torch.bool)
    rows = torch.arange(T)[:, None].expand(T, K)
    mask[rows[keep], idx[keep]] = True  # duplicate ids would count once here: tests draw distinct ids
    logits = torch.einsum("thd,sd->ths", q.double(), kv.reshape(S, D).double()) * sm_scale
    logits = logits.masked_fill(~mask[:, None, :], -math.inf)
    lse = torch.logsumexp(logits, -1)
    empty = torch.isneginf(lse)
    p = torch.exp(logits - lse.masked_fill(empty, math.inf)[..., None])
    out = torch.einsum("ths,sv->thv", p, kv.reshape(S, D)[:, :d_v].double())
    return out, logits.amax(-1), lse.masked_fill(empty, math.inf)


def _inputs(T, H, S, K, D, d_v, seed, dtype=torch.float32, topk=False, kv3=True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g, dtype=dtype)
    kv = torch.randn(S, 1, D, generator=g, dtype=dtype) if kv3 else torch.randn(S, D, generator=g, dtype=dtype)
    idx = (
        torch.stack([torch.randperm(S + 8, generator=g)[:K] for _ in range(T)]).to(torch.int32) - 4
    )  # ids in [-4, S+4)
    idx[torch.rand(T, K, generator=g) < 0.2] = -1  # -1 holes
    idx[0] = -1  # an empty row
    if T > 2:
        idx[1, : K // 2] = S + 3  # leading block all out of range, valid keys after it
    tlen = None
    if topk:
        tlen = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32)
        tlen[-1] = 0
    return q, kv, idx, tlen


@pytest.mark.parametrize(
    "T,H,S,K,D,d_v,topk",
    [(5, 3, 40, 16, 24, 16, False), (7, 4, 33, 20, 20, 12, True), (4, 2, 10, 10, 8, 8, False)],
    ids=["plain", "topk_length", "K_eq_S"],
)
def test_reference_matches_dense_mask(T, H, S, K, D, d_v, topk):
    q, kv, idx, tlen = _inputs(T, H, S, K, D, d_v, seed=T * 100 + K, topk=topk, kv3=(D != 20))
    out, mx, lse = sparse_mla_fwd_reference(q, kv, idx[:, None, :], SM_SCALE, topk_length=tlen, d_v=d_v)
    out_d, mx_d, lse_d = _dense(q, kv, idx, SM_SCALE, tlen, d_v)
    assert out.shape == (T, H, d_v) and lse.shape == (T, H) and mx.shape == (T, H)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any() and not torch.isnan(mx).any()
    rel = (out.double() - out_d).norm() / out_d.norm().clamp_min(1e-30)  # norm 0 when every row is empty
    assert rel <= TOL_OUT, f"out rel err {rel:.2e} > {TOL_OUT}"
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_d)) and torch.equal(torch.isinf(mx), torch.isinf(mx_d))
    fin = torch.isfinite(lse_d)
    assert torch.allclose(lse.double()[fin], lse_d[fin], rtol=TOL_LSE, atol=TOL_LSE)
    assert torch.allclose(mx.double()[fin], mx_d[fin], rtol=TOL_LSE, atol=TOL_LSE)


def test_reference_empty_rows_and_topk_length_zero():
    q, kv, idx, _ = _inputs(4, 2, 12, 6, 8, 8, seed=3)
    tlen = torch.tensor([6, 0, 6, 1], dtype=torch.int32)
    idx[2] = 12  # all out of range
    out, mx, lse = sparse_mla_fwd_reference(q, kv, idx, SM_SCALE, topk_length=tlen, d_v=8)
    for t in (0, 1, 2):  # row 0: all -1; row 1: topk_length 0; row 2: all ids >= S
        assert torch.equal(out[t], torch.zeros_like(out[t]))
        assert torch.isposinf(lse[t]).all() and torch.isneginf(mx[t]).all()


def test_reference_ignores_ids_past_topk_length_even_nan_rows():
    q, kv, idx, _ = _inputs(3, 2, 16, 8, 8, 8, seed=5)
    idx = torch.arange(8, dtype=torch.int32).repeat(3, 1)
    kv_nan = kv.clone()
    kv_nan[4:8] = float("nan")  # keys only reachable past topk_length
    tlen = torch.tensor([4, 4, 4], dtype=torch.int32)
    a = sparse_mla_fwd_reference(q, kv_nan, idx, SM_SCALE, topk_length=tlen, d_v=8)
    b = sparse_mla_fwd_reference(q, kv, idx[:, :4], SM_SCALE, d_v=8)
    for x, y in zip(a, b):
        assert torch.allclose(x, y)


def test_padded_heads_are_inert():
    """Case 14: zero query heads appended (96 -> 128 style) change no real head."""
    q, kv, idx, tlen = _inputs(4, 3, 20, 8, 16, 8, seed=7, topk=True)
    a = sparse_mla_fwd_reference(q, kv, idx, SM_SCALE, tlen, d_v=8)
    q_pad = torch.cat([q, torch.zeros(4, 5, 16)], dim=1)
    b = sparse_mla_fwd_reference(q_pad, kv, idx, SM_SCALE, tlen, d_v=8)
    for x, y in zip(a, b):
        assert torch.allclose(x, y[:, :3], rtol=1e-6, atol=1e-6)


def test_argument_errors_name_the_argument():
    q = torch.randn(2, 3, 576, dtype=torch.bfloat16)
    kv = torch.randn(5, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="kv"):
        sparse_mla_fwd_reference(q, torch.randn(5, 2, 576), idx, SM_SCALE)
    with pytest.raises(ValueError, match="indices"):
        sparse_mla_fwd_reference(q, kv, torch.zeros(3, 4, dtype=torch.int32), SM_SCALE)
    with pytest.raises(TypeError, match="indices"):
        sparse_mla_fwd_reference(q, kv, idx.float(), SM_SCALE)
    with pytest.raises(ValueError, match="topk_length"):
        sparse_mla_fwd_reference(q, kv, idx, SM_SCALE, topk_length=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(TypeError, match="q"):
        sparse_mla_fwd(q.float(), kv, idx, SM_SCALE)
    with pytest.raises(ValueError, match="CUDA"):
        sparse_mla_fwd(q, kv, idx, SM_SCALE, backend="triton")


@pytest.mark.parametrize("with_topk_length", [True, False], ids=["topk_length", "no-topk_length"])
@pytest.mark.parametrize("H,K", [(96, 100), (64, 128), (20, 2048)], ids=["H96-K100", "H64-K128", "H20-K2048"])
def test_flash_mla_wrapper_pads_heads_and_topk(monkeypatch, H, K, with_topk_length):
    """The FlashMLA branch (used when a ``flash_mla`` module imports; none does here): heads are padded to 64 or 128
    and the top-k axis to a multiple of 128 with skipped ids, in FlashMLA's argument layout, and the padding is sliced
    away. A torch stand-in for ``flash_mla_sparse_fwd`` checks the layout and computes the readable reference."""
    import kernels_torch.ops.sparse_mla as sm

    seen = {}

    def fake_flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, topk_length=None, use_legacy=False):
        assert q.ndim == 3 and q.shape[1] in (64, 128) and q.shape[2] == 576
        assert (q[:, H:] == 0).all()  # the pad heads are zero queries (inert), in every call of the reused buffer
        assert kv.ndim == 3 and kv.shape[1] == 1 and indices.ndim == 3 and indices.shape[1] == 1
        assert indices.shape[2] % 128 == 0 and d_v == 512 and use_legacy  # SM90: the legacy kernels
        if topk_length is not None:  # slots past topk_length are skipped ids (FlashMLA's NaN footnote)
            past = torch.arange(indices.shape[2])[None, :] >= topk_length[:, None]
            assert (indices[:, 0][past] == -1).all()
        seen.update(H_pad=q.shape[1], K_pad=indices.shape[2])
        out, mx, lse = sparse_mla_fwd_reference(q, kv, indices, sm_scale, topk_length, d_v=d_v)
        return out, mx, lse.masked_fill(torch.isposinf(lse), -math.inf)  # empty rows as some builds write them

    monkeypatch.setattr(sm, "_flash_mla_sparse_fwd", fake_flash_mla_sparse_fwd)
    monkeypatch.setattr(sm, "_flash_mla_arch", lambda device: "legacy")
    T, S = 9, 300
    g = torch.Generator().manual_seed(H + K)
    q = torch.randn(T, H, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(S, 576, generator=g, dtype=torch.float64)
    idx = torch.randint(-1, S + 3, (T, K), generator=g, dtype=torch.int32)  # -1 holes and out-of-range ids
    idx[0] = -1  # a row without a valid key: out 0, max_logits -inf, lse +inf
    tlen = torch.randint(0, K + 1, (T,), generator=g, dtype=torch.int32) if with_topk_length else None
    got = sm._sparse_mla_fwd_flash_mla(q, kv, idx, SM_SCALE, tlen, rows=4)  # 3 calls of <= 4 rows
    want = sparse_mla_fwd_reference(q, kv, idx, SM_SCALE, tlen)
    assert seen == {"H_pad": 64 if H <= 64 else 128, "K_pad": -(-K // 128) * 128}
    for name, a, b in zip(("out", "max_logits", "lse"), got, want):
        assert a.shape == b.shape, name
        assert torch.equal(torch.isposinf(a), torch.isposinf(b)), name  # empty rows: -inf max, +inf lse
        assert torch.equal(torch.isneginf(a), torch.isneginf(b)), name
        fin = torch.isfinite(b)
        assert torch.allclose(a[fin], b[fin], rtol=1e-12, atol=1e-12), name


def test_kernel_choice(monkeypatch):
    """sparse_mla_fwd_kernel: auto takes FlashMLA where it runs, else Triton; the argument beats $KIMI_SPARSE_KERNEL;
    a forced FlashMLA that cannot run and an unknown value raise, naming the cause."""
    import kernels_torch.ops.sparse_mla as sm

    q = torch.zeros(4, 96, 576)
    monkeypatch.delenv("KIMI_SPARSE_KERNEL", raising=False)
    monkeypatch.setattr(sm, "flash_mla_takes", lambda q: None)
    assert sm.sparse_mla_fwd_kernel(q) == "flash_mla" and sm.sparse_mla_fwd_kernel(q, "triton") == "triton"
    monkeypatch.setenv("KIMI_SPARSE_KERNEL", "triton")
    assert sm.sparse_mla_fwd_kernel(q) == "triton" and sm.sparse_mla_fwd_kernel(q, None) == "triton"
    assert sm.sparse_mla_fwd_kernel(q, "flash_mla") == "flash_mla"
    monkeypatch.setattr(sm, "flash_mla_takes", lambda q: "no module")
    monkeypatch.setenv("KIMI_SPARSE_KERNEL", "auto")
    assert sm.sparse_mla_fwd_kernel(q) == "triton"
    with pytest.raises(RuntimeError, match="no module"):
        sm.sparse_mla_fwd_kernel(q, "flash_mla")
    monkeypatch.setenv("KIMI_SPARSE_KERNEL", "cutlass")
    with pytest.raises(ValueError, match="KIMI_SPARSE_KERNEL.*cutlass"):
        sm.sparse_mla_fwd_kernel(q)


def test_flash_mla_reads_padded_q_in_place(monkeypatch):
    """A query built with ``padded_q`` reaches FlashMLA as its own buffer (no copy, one call whatever ``rows``), the
    outputs come back as ``[:, :H]`` views of FlashMLA's, and they equal the readable reference; pad heads holding NaN
    stay in the pad rows. Queries not in that layout (a strided head slice, heads 32: of a 128-head buffer, whose
    last row's pad would lie past the storage, or the first T rows of a taller dense tensor, whose row stride is H * D
    though the storage has room) go through the padded copy and give the same numbers; a single row goes in place
    whatever its row stride, with whatever follows it as pad heads."""
    import kernels_torch.ops.sparse_mla as sm

    calls = []

    def fake_flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, topk_length=None, use_legacy=False):
        calls.append((q.data_ptr(), q.shape[0]))
        assert q.is_contiguous() and q.shape[1] == 128
        return sparse_mla_fwd_reference(q, kv, indices, sm_scale, topk_length, d_v=d_v)

    monkeypatch.setattr(sm, "_flash_mla_sparse_fwd", fake_flash_mla_sparse_fwd)
    monkeypatch.setattr(sm, "_flash_mla_arch", lambda device: "legacy")
    T, H, S, K = 9, 96, 200, 128
    g = torch.Generator().manual_seed(11)
    dense = torch.randn(T, H, 576, generator=g, dtype=torch.float64)
    kv = torch.randn(S, 576, generator=g, dtype=torch.float64)
    idx = torch.randint(-1, S, (T, K), generator=g, dtype=torch.int32)
    want = sparse_mla_fwd_reference(dense, kv, idx, SM_SCALE)

    q = sm.padded_q(T, H, dtype=torch.float64, device="cpu")
    parent = q.as_strided((T, 128, 576), (128 * 576, 576, 1))
    assert q.shape == (T, H, 576) and (parent[:, H:] == 0).all()
    q.copy_(dense)
    parent[:, H:] = float("nan")  # inert: heads never mix
    got = sm._sparse_mla_fwd_flash_mla(q, kv, idx, SM_SCALE, None, rows=4)
    assert calls == [(q.data_ptr(), T)]  # the buffer itself, in one call
    assert got[0].shape == (T, H, 512) and not got[0].is_contiguous()  # a view of FlashMLA's 128-head output
    big = torch.randn(T, 128, 576, generator=g, dtype=torch.float64)
    for name, other in (
        ("strided heads", torch.randn(T, 2 * H, 576, dtype=torch.float64)[:, ::2]),
        ("tail", big[:, 32:]),
        ("rows of a taller dense tensor", torch.randn(2 * T, H, 576, dtype=torch.float64)[:T]),
    ):
        other.copy_(dense)
        calls.clear()
        again = sm._sparse_mla_fwd_flash_mla(other, kv, idx, SM_SCALE, None, rows=4)
        assert len(calls) == 3 and all(ptr != other.data_ptr() for ptr, _ in calls), name  # the padded copy
        for a, b in zip(again, got):
            assert same_fp64(a, b), name
    for name, a, b in zip(("out", "max_logits", "lse"), got, want):
        fin = torch.isfinite(b)
        assert torch.equal(torch.isposinf(a), torch.isposinf(b)), name
        assert torch.allclose(a[fin], b[fin], rtol=1e-12, atol=1e-12), name
    # T = 1: the row's stride is never used, so a dense row with room after it goes in place; the 32 "pad heads"
    # FlashMLA reads are the next row's first heads (NaN here), inert as the zeros of padded_q
    rows = torch.randn(3, H, 576, dtype=torch.float64)
    rows[2] = float("nan")
    one = rows[1:2]
    one.copy_(dense[4:5])
    calls.clear()
    single = sm._sparse_mla_fwd_flash_mla(one, kv, idx[4:5], SM_SCALE, None, rows=4)
    assert calls == [(one.data_ptr(), 1)]
    for a, b in zip(single, got):
        assert same_fp64(a, b[4:5])


def same_fp64(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The stand-in's fp64 einsum on calls of other row counts: the CPU BLAS's blocking (and so the last bits) may
    change with the row count and the CPU, so equal to 1e-12 with the infinities in place, not bitwise."""
    fin = torch.isfinite(b)
    return torch.equal(torch.isinf(a), torch.isinf(b)) and torch.allclose(a[fin], b[fin], rtol=1e-12, atol=1e-12)


def test_padded_q_refuses_head_counts_flash_mla_has_no_tiling_for():
    """``flash_mla_heads`` / ``padded_q`` take 0 <= H <= 128 (FlashMLA's 64- and 128-head tilings); more heads, or a
    negative count, is named, never a tensor of another head count."""
    import kernels_torch.ops.sparse_mla as sm

    assert [sm.flash_mla_heads(h) for h in (1, 63, 64, 65, 96, 128)] == [64, 64, 64, 128, 128, 128]
    assert sm.padded_q(3, 96, dtype=torch.float32).shape == (3, 96, 576)
    assert sm.padded_q(3, 0, dtype=torch.float32).shape == (3, 0, 576)
    for H in (129, 192, -3):
        with pytest.raises(ValueError, match=f"H: got {H} query heads, expected"):
            sm.flash_mla_heads(H)
        with pytest.raises(ValueError, match=f"H: got {H} query heads, expected"):
            sm.padded_q(3, H, dtype=torch.float32)


@pytest.mark.parametrize(
    "shape,dtype,sl",
    [
        ((7, 128, 576), torch.bfloat16, (slice(None), slice(0, 96))),  # the 96 useful heads of FlashMLA's layout
        ((3, 64, 512), torch.bfloat16, (slice(1, 3), slice(0, 20))),  # a row slice: storage offset
        ((4, 8, 5), torch.bfloat16, (slice(None), slice(0, 3))),  # last axis not a multiple of 4: plain copy
        ((4, 8, 6), torch.float32, (slice(None), slice(1, 3))),  # odd storage offset in words: plain copy
        ((2, 4, 8), torch.float64, (slice(None), slice(0, 2))),  # 8-byte elements: plain copy
    ],
)
def test_copy_rows_wide_is_the_plain_copy(shape, dtype, sl):
    """``copy_rows_wide`` (the FlashMLA wrapper's head-padding copies, moved as 8-byte words) writes exactly what
    ``copy_`` writes, into and out of padded views, and leaves every other element of the buffer alone."""
    from kernels_torch.ops.sparse_mla import copy_rows_wide

    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    buf = torch.randn(shape, generator=g).to(dtype)
    src = torch.randn(buf[sl].shape, generator=g).to(dtype)
    want = buf.clone()
    want[sl].copy_(src)
    copy_rows_wide(buf[sl], src)
    assert torch.equal(buf, want)
    out = torch.empty_like(src)
    copy_rows_wide(out, buf[sl])  # out of the padded view
    assert torch.equal(out, src)


def test_copy_rows_wide_keeps_autograd_and_takes_0d():
    """Under autograd it is ``copy_`` itself (the gradient reaches ``src``); a 0-d tensor copies too."""
    from kernels_torch.ops.sparse_mla import copy_rows_wide

    g = torch.Generator().manual_seed(2)
    src = torch.randn(4, 8, generator=g).bfloat16().requires_grad_(True)
    dst = torch.randn(4, 8, generator=g).bfloat16()
    copy_rows_wide(dst, src)
    dst.float().sum().backward()
    assert torch.equal(dst, src.detach()) and torch.equal(src.grad, torch.ones_like(src))
    d0, s0 = (torch.randn((), generator=g).bfloat16() for _ in range(2))
    copy_rows_wide(d0, s0)
    assert torch.equal(d0, s0)
