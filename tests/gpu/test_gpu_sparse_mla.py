"""GPU checks of the sparse MLA forward kernels (Triton; FlashMLA where the ``flash_mla`` module imports) against
``sparse_mla_fwd_reference`` (fp32), spec cases 12-15."""

from __future__ import annotations

import pytest
import torch

from kernels_torch.ops import sparse_mla as sm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SM_SCALE = 192**-0.5  # spec 3.3: NOT 576^-1/2
TOL_OUT = 1e-2  # ||out - ref|| / ||ref||, bf16 output and bf16 P in the PV product
TOL_LSE = 1e-4  # |lse - ref| / max(1, |ref|), fp32 statistics
TOL_MAX = 1e-4  # same for max_logits
TOPK_LENGTHS = (0, 1, 63, 64, 65)  # plus K, per row at random


def _inputs(T, H, S, K, seed, topk_length):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, H, sm.D_QK, device="cuda", generator=g).to(torch.bfloat16)
    kv = torch.randn(S, 1, sm.D_QK, device="cuda", generator=g).to(torch.bfloat16)
    idx = torch.randint(-8, S + 8, (T, K), device="cuda", generator=g, dtype=torch.int32)  # some < 0, some >= S
    idx[torch.rand(T, K, device="cuda", generator=g) < 0.15] = -1  # -1 holes
    idx[0] = -1  # a row with no valid key
    if T > 1:
        idx[1, : min(K, 64)] = S + 1  # the leading block all invalid, valid keys after it
    if T > 2:
        idx[2, : min(K, 64)] = -1
    tlen = None
    if topk_length:
        choices = torch.tensor([x for x in TOPK_LENGTHS if x <= K] + [K], device="cuda", dtype=torch.int32)
        tlen = choices[torch.randint(0, len(choices), (T,), device="cuda", generator=g)]
        # a valid-looking id with NaN data past topk_length must stay unread
        kv[S - 1] = float("nan")
        past = torch.arange(K, device="cuda")[None, :] >= tlen[:, None].long()
        idx = torch.where(past, torch.full_like(idx, S - 1), idx)
        idx = torch.where(~past & (idx == S - 1), torch.full_like(idx, -1), idx)
    return q, kv, idx[:, None, :], tlen


def _poisoned(T, H):
    nan = float("nan")
    return (
        torch.full((T, H, sm.D_V), nan, device="cuda", dtype=torch.bfloat16),
        torch.full((T, H), nan, device="cuda"),
        torch.full((T, H), nan, device="cuda"),
    )


def _check(got, ref, what):
    out, mx, lse = got
    out_r, mx_r, lse_r = ref
    assert not torch.isnan(out).any(), f"{what}: NaN (or unwritten) in out"
    assert not torch.isnan(lse).any() and not torch.isnan(mx).any(), f"{what}: NaN (or unwritten) in lse/max_logits"
    rel = (out.float() - out_r).norm() / out_r.norm().clamp_min(1e-30)
    assert rel <= TOL_OUT, f"{what}: out rel err {rel:.3e} > {TOL_OUT}"
    empty = torch.isposinf(lse_r)
    assert torch.equal(torch.isposinf(lse), empty), f"{what}: rows with no valid key differ"
    assert torch.isneginf(mx[empty]).all() and (out[empty] == 0).all(), f"{what}: empty rows not (0, -inf, +inf)"
    fin = ~empty
    err_lse = ((lse - lse_r).abs() / lse_r.abs().clamp_min(1.0))[fin].max().item() if fin.any() else 0.0
    err_mx = ((mx - mx_r).abs() / mx_r.abs().clamp_min(1.0))[fin].max().item() if fin.any() else 0.0
    assert err_lse <= TOL_LSE, f"{what}: lse err {err_lse:.3e} > {TOL_LSE}"
    assert err_mx <= TOL_MAX, f"{what}: max_logits err {err_mx:.3e} > {TOL_MAX}"


CASES = [  # (S_q, H, K, S_kv, topk_length)
    (1, 96, 2048, 3000, False),
    (63, 96, 2048, 2500, True),
    (63, 128, 100, 300, True),
    (2049, 96, 2048, 4096, True),
    (2049, 128, 2048, 2100, False),
    (63, 96, 37, 50, False),
]


CASE_IDS = [f"Sq{c[0]}-H{c[1]}-K{c[2]}-Skv{c[3]}{'-topklen' if c[4] else ''}" for c in CASES]


@pytest.mark.parametrize("layout", ["hk", "kh"])
@pytest.mark.parametrize("T,H,K,S,topk", CASES, ids=CASE_IDS)
def test_triton_matches_reference(T, H, K, S, topk, layout):
    q, kv, idx, tlen = _inputs(T, H, S, K, seed=T * 7 + K + H, topk_length=topk)
    ref = sm.sparse_mla_fwd_reference(q, kv, idx, SM_SCALE, topk_length=tlen)
    cfg = dict(layout=layout) if layout == "hk" else dict(layout="kh", block_k=128, num_stages=1)
    got = sm._sparse_mla_fwd_triton(q, kv[:, 0], idx[:, 0], SM_SCALE, tlen, _out=_poisoned(T, H), **cfg)
    _check(got, ref, f"{layout} T={T} H={H} K={K}")


def test_public_api_shapes_and_head_splits():
    T, H, K, S = 129, 96, 256, 700
    q, kv, idx, tlen = _inputs(T, H, S, K, seed=11, topk_length=True)
    ref = sm.sparse_mla_fwd_reference(q, kv, idx, SM_SCALE, topk_length=tlen)
    out = sm.sparse_mla_fwd(q, kv, idx, SM_SCALE, topk_length=tlen, backend="triton")  # [S,1,576] / [T,1,K]
    _check(out, ref, "3-D shapes")
    out2 = sm.sparse_mla_fwd(q, kv[:, 0], idx[:, 0], SM_SCALE, topk_length=tlen, backend="triton")  # 2-D forms
    assert all(torch.equal(a, b) for a, b in zip(out, out2))
    split = sm._sparse_mla_fwd_triton(
        q,
        kv[:, 0],
        idx[:, 0],
        SM_SCALE,
        tlen,
        head_splits=[(0, 64, 64), (64, 32, 32)],
        layout="kh",
        block_k=128,
        num_stages=1,
        _out=_poisoned(T, H),
    )
    _check(split, ref, "head splits 64+32")


def test_padded_heads_inert():
    """Case 14: appending zero query heads (96 -> 128) leaves the real heads' outputs unchanged."""
    T, H, K, S = 65, 96, 256, 500
    q, kv, idx, tlen = _inputs(T, H, S, K, seed=5, topk_length=True)
    a = sm.sparse_mla_fwd(q, kv, idx, SM_SCALE, topk_length=tlen, backend="triton")
    q_pad = torch.cat([q, torch.zeros(T, 128 - H, sm.D_QK, device="cuda", dtype=q.dtype)], dim=1)
    b = sm.sparse_mla_fwd(q_pad, kv, idx, SM_SCALE, topk_length=tlen, backend="triton")
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y[:, :H], rtol=1e-5, atol=1e-5)


def test_errors_name_the_argument():
    q = torch.randn(4, 96, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(10, 1, 576, device="cuda", dtype=torch.bfloat16)
    idx = torch.zeros(4, 1, 64, device="cuda", dtype=torch.int32)
    with pytest.raises(TypeError, match="indices"):
        sm.sparse_mla_fwd(q, kv, idx.long(), SM_SCALE)
    with pytest.raises(TypeError, match="kv"):
        sm.sparse_mla_fwd(q, kv.float(), idx, SM_SCALE)
    with pytest.raises(ValueError, match="q"):
        sm.sparse_mla_fwd(q[..., :512], kv[..., :512], idx, SM_SCALE)
    with pytest.raises(ValueError, match="device"):
        sm.sparse_mla_fwd(q, kv.cpu(), idx, SM_SCALE)


# ------------------------------------------------------------------------------------------------ both kernels
# The public sparse_mla_fwd on each kernel (FlashMLA where the flash_mla module imports and the device is SM90/SM100):
# the same contract as the Triton kernel, checked against the fp32 reference.

KERNELS = ["triton", "flash_mla"]


def _skip_unless(kernel, q):
    if kernel == "flash_mla":
        why = sm.flash_mla_takes(q)
        if why is not None:
            pytest.skip(f"FlashMLA: {why}")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("T,H,K,S,topk", CASES, ids=CASE_IDS)
def test_kernel_matches_reference_and_is_bitwise_reproducible(T, H, K, S, topk, kernel):
    """lse in natural-log units and max_logits (to 1e-4), out (to 1e-2), rows with no valid key, ids < 0 and >= S, K
    not a multiple of 128 (100, 37), topk_length; two calls give bitwise identical outputs (recomputation)."""
    from kernels_torch import kernel_choice

    q, kv, idx, tlen = _inputs(T, H, S, K, seed=T * 7 + K + H, topk_length=topk)
    _skip_unless(kernel, q)
    ref = sm.sparse_mla_fwd_reference(q, kv, idx, SM_SCALE, topk_length=tlen)
    kernel_choice.reset_used()
    got = sm.sparse_mla_fwd(q, kv, idx, SM_SCALE, topk_length=tlen, backend=kernel)
    assert kernel_choice.used() == {"sparse_mla_fwd": {kernel: 1}}
    _check(got, ref, f"{kernel} T={T} H={H} K={K}")
    again = sm.sparse_mla_fwd(q, kv, idx, SM_SCALE, topk_length=tlen, backend=kernel)
    for name, a, b in zip(("out", "max_logits", "lse"), got, again):
        assert torch.equal(a, b), f"{kernel}: {name} differs between two calls on the same inputs"


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_topk_length(kernel):
    """topk_length in {0, 1, 63, 64, 65, K} on rows whose slots past it hold valid-looking ids (of NaN key rows)."""
    T, H, K, S = 48, 96, 256, 600
    q, kv, idx, _ = _inputs(T, H, S, K, seed=3, topk_length=False)
    _skip_unless(kernel, q)
    lengths = torch.tensor([0, 1, 63, 64, 65, K], device="cuda", dtype=torch.int32)
    tlen = lengths[torch.arange(T, device="cuda") % len(lengths)]
    kv[S - 1] = float("nan")
    past = torch.arange(K, device="cuda")[None, :] >= tlen[:, None].long()
    idx2 = torch.where(past, torch.full_like(idx[:, 0], S - 1), torch.where(idx[:, 0] == S - 1, -1, idx[:, 0]))
    ref = sm.sparse_mla_fwd_reference(q, kv, idx2, SM_SCALE, topk_length=tlen)
    got = sm.sparse_mla_fwd(q, kv, idx2, SM_SCALE, topk_length=tlen, backend=kernel)
    _check(got, ref, f"{kernel} topk_length sweep")
    assert torch.isposinf(got[2][tlen == 0]).all()


def test_flash_mla_raw_contract():
    """The real module, called directly (SM90: use_legacy=True) at h_q = 128: lse is natural-log, max_logits is the
    scaled max, and what it writes on a row without a valid key (printed; our wrapper normalises it)."""
    if sm._flash_mla_sparse_fwd is None:
        pytest.skip("no flash_mla module")
    T, H, K, S = 64, 128, 256, 1000
    q, kv, idx, _ = _inputs(T, H, S, K, seed=9, topk_length=False)
    _skip_unless("flash_mla", q)
    kwargs = {"use_legacy": True} if sm._flash_mla_arch(q.device) == "legacy" else {}
    out, mx, lse = sm._flash_mla_sparse_fwd(q, kv, idx, SM_SCALE, 512, **kwargs)
    out_r, mx_r, lse_r = sm.sparse_mla_fwd_reference(q, kv, idx, SM_SCALE)
    print(
        f"FLASH_MLA_EMPTY_ROW out_absmax={out[0].abs().max().item()} lse={lse[0, :4].tolist()} max={mx[0, :4].tolist()}"
    )
    fin = torch.isfinite(lse_r)
    err_ln = ((lse - lse_r).abs() / lse_r.abs().clamp_min(1.0))[fin].max().item()
    err_mx = ((mx - mx_r).abs() / mx_r.abs().clamp_min(1.0))[fin].max().item()
    print(f"FLASH_MLA_RAW lse_err_natural_log={err_ln:.2e} max_logits_err={err_mx:.2e}")
    assert err_ln <= TOL_LSE and err_mx <= TOL_MAX
    assert (out[0] == 0).all() and not torch.isnan(out).any()


@pytest.mark.parametrize("T,H,K,S,topk", CASES, ids=CASE_IDS)
def test_flash_mla_padded_q_in_place(T, H, K, S, topk):
    """FlashMLA on a query built with ``padded_q`` (read in place, outputs returned as views): bitwise the same as on
    a contiguous query (same kernel, same numbers in the heads that count), with the pad heads poisoned to NaN."""
    q, kv, idx, tlen = _inputs(T, H, S, K, seed=T * 3 + K + H, topk_length=topk)
    _skip_unless("flash_mla", q)
    want = sm.sparse_mla_fwd(q, kv, idx, SM_SCALE, topk_length=tlen, backend="flash_mla")
    qp = sm.padded_q(T, H, device="cuda")
    qp.copy_(q)
    H_pad = sm.flash_mla_heads(H)
    if H_pad != H:
        qp.as_strided((T, H_pad, sm.D_QK), (H_pad * sm.D_QK, sm.D_QK, 1))[:, H:] = float("nan")
    got = sm.sparse_mla_fwd(qp, kv, idx, SM_SCALE, topk_length=tlen, backend="flash_mla")
    for name, a, b in zip(("out", "max_logits", "lse"), got, want):
        assert a.shape == b.shape and torch.equal(a, b), f"padded q: {name} differs from the contiguous query's"
    assert sm.wants_padded_q(96, q.device, "flash_mla") and not sm.wants_padded_q(128, q.device, "flash_mla")
    assert not sm.wants_padded_q(96, q.device, "triton")
