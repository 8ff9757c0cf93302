"""GPU checks of the ``cudnn`` backend (``kernels_torch.dsa_cudnn``) on SM90: indexer scores and selected sets against
the eager indexer, the canonical tie rule, the sparse MLA autograd Function against fp32 autograd, and one DSA layer
(real attention dims, hidden 1024) against the eager backend, forward and backward. Cases 8, 9, 12, 13, 15.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from _helpers import init_layer  # noqa: E402
from helpers import rel  # noqa: E402

import kernels_torch.indexer as ti  # noqa: E402
import kernels_torch.mla as tm  # noqa: E402
from kernels_torch.common import causal_document_mask  # noqa: E402
from kimi.config import load_config  # noqa: E402
from kimi_tools.compare import selection_agreement  # noqa: E402

HI, KI, TOPK = 32, 128, 2048  # K3.1 indexer
H = 96
SM_SCALE = 192**-0.5  # spec 3.3: NOT 576^-1/2
TOL_SCORES = 1e-5  # cuDNN fp32 scores vs torch fp32 einsum, ||diff|| / ||ref|| over visible keys
TOL_TIE = 1e-5  # selection ties: relative to the row's max |score|
TOL_SPARSE_OUT = 1e-2  # bf16 Function vs fp32 autograd of the torch twin
TOL_SPARSE_GRAD = 3e-2  # dq, dkv
TOL_LAYER_OUT = 2e-2  # bf16 layer (cudnn) vs fp32 eager layer, same bf16-rounded weights
TOL_LAYER_GRAD = 3e-2  # parameter and input gradients, same comparison
SELECTION_DISAGREE_MAX = 0.02  # bf16 vs fp32 indexer inputs: rows whose sets differ beyond ties (tie_rel 2e-2)


def dc():
    import kernels_torch.dsa_cudnn as m

    return m


def _indexer_inputs(T, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(T, HI, KI, device="cuda", generator=g).bfloat16()
    k = torch.randn(T, KI, device="cuda", generator=g).bfloat16()
    w = torch.randn(T, HI, device="cuda", generator=g)
    return q, k, w


def _check_structure(idx, tlen, T, cu):
    """-1 only after the valid prefix, valid ids causal and inside the row's document, no duplicates (cases 8, 9)."""
    mask = causal_document_mask(T, cu, device="cuda")
    visible = mask.sum(-1)
    assert torch.equal(tlen.long(), visible.clamp(max=idx.shape[1])), "topk_length != min(k, visible keys)"
    pos = torch.arange(idx.shape[1], device="cuda")[None]
    valid = idx >= 0
    assert torch.equal(valid, pos < tlen[:, None]), "-1 padding is not exactly the tail past topk_length"
    rows = torch.arange(T, device="cuda")[:, None].expand_as(idx)
    assert bool(mask[rows[valid], idx[valid].long()].all()), "a selected key is in the future or another document"
    s = torch.sort(torch.where(valid, idx, -2 - pos), dim=-1).values  # padding made distinct
    assert not bool((s[:, 1:] == s[:, :-1]).any()), "duplicate key in a row"


def _same_sets(a, b):
    """Rows where the two index lists hold the same set (-1 ignored)."""
    return (torch.sort(a, -1).values == torch.sort(b, -1).values).all(-1)


INDEXER_CASES = [(1, None), (63, None), (2049, None), (4500, None), (4500, [0, 15, 2100, 4500])]


@pytest.mark.parametrize("T,cu", INDEXER_CASES, ids=["T1", "T63", "T2049", "T4500", "T4500-packed"])
def test_indexer_scores_and_sets_match_eager(T, cu):
    q, k, w = _indexer_inputs(T, seed=T + (7 if cu else 0))
    cu_t = None if cu is None else torch.tensor(cu)
    mask = causal_document_mask(T, cu_t, device="cuda")
    ref = ti.indexer_scores(q[None], k[None], w[None])[0]  # fp32 einsum from the same bf16 inputs
    got = dc().indexer_scores_cudnn(q, k, w, cu_t, chunk_rows=1024)
    assert torch.equal(torch.isneginf(got), ~mask), "masked pattern differs (case 8)"
    err = rel(got[mask], ref[mask])
    print(f"T={T} cu={cu}: score rel err {err:.2e}")
    assert err <= TOL_SCORES, f"scores rel err {err:.2e} > {TOL_SCORES}"

    idx, tlen = dc().indexer_topk_cudnn(q, k, w, TOPK, cu_t, chunk_rows=1024)
    assert idx.shape == (T, TOPK) and idx.dtype == torch.int32 and tlen.dtype == torch.int32
    _check_structure(idx, tlen, T, cu_t)
    canon = ti.topk_indices(ref[None], mask, TOPK)[0]  # [T, min(k, T)]
    canon = torch.nn.functional.pad(canon, (0, TOPK - canon.shape[1]), value=-1)
    same = _same_sets(idx, canon)
    rows = torch.nonzero(~same).flatten().tolist()
    # rows is a subset, so the causal check (key <= row) is _check_structure's job above, not selection_agreement's
    sel = (
        selection_agreement(
            canon[rows].cpu().numpy(),
            ref.masked_fill(~mask, float("-inf"))[rows].cpu().numpy(),
            idx[rows].cpu().numpy(),
            TOL_TIE,
        )[0]
        if rows
        else {"disagree": 0, "tie_only": 0}
    )
    print(f"  sets: {T - len(rows)} identical, {sel['tie_only']} differ by ties, {sel['disagree']} disagree")
    assert sel["disagree"] == 0


def test_indexer_ties_follow_canonical_rule():
    """Exact ReLU ties: 80% of keys score exactly +0 for every query, so past k visible keys the cutoff falls inside
    the zeros, where the canonical rule keeps the larger key indices (spec 9). The sets must match exactly."""
    T = 3000
    g = torch.Generator(device="cuda").manual_seed(11)
    q = torch.rand(T, HI, KI, device="cuda", generator=g).bfloat16()  # q >= 0
    k = torch.rand(T, KI, device="cuda", generator=g)
    neg = torch.rand(T, device="cuda", generator=g) < 0.8
    k = torch.where(neg[:, None], -k, k).bfloat16()  # q.k <= 0 for these keys: ReLU gives exactly 0
    w = torch.rand(T, HI, device="cuda", generator=g) + 0.1  # positive weights: zero scores are +0
    idx, _ = dc().indexer_topk_cudnn(q, k, w, TOPK, chunk_rows=512)
    mask = causal_document_mask(T, device="cuda")
    canon = ti.topk_indices(ti.indexer_scores(q[None], k[None], w[None]), mask, TOPK)[0]
    canon = torch.nn.functional.pad(canon, (0, TOPK - canon.shape[1]), value=-1)
    same = _same_sets(idx, canon)
    assert bool(same.all()), (
        f"{int((~same).sum())} rows differ from the canonical tie rule, first {int((~same).nonzero()[0])}"
    )


def _random_selection(T, S, K, seed):
    """Causal-like random index sets over S >= T keys (query t sits at position S - T + t): min(visible, K) distinct
    keys, -1 after, in random order."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    visible = torch.arange(S, device="cuda")[None] <= torch.arange(S - T, S, device="cuda")[:, None]
    r = torch.rand(T, S, device="cuda", generator=g).masked_fill(~visible, -1.0)
    vals, idx = r.topk(min(K, S), dim=-1)
    idx = torch.where(vals >= 0, idx, -1).to(torch.int32)
    idx = torch.nn.functional.pad(idx, (0, K - idx.shape[1]), value=-1)
    tlen = (idx >= 0).sum(-1).to(torch.int32)
    return idx, tlen


# (S_q, S_kv): a single query row needs several keys, or its softmax is constant and dq is exactly 0 (no relative error)
@pytest.mark.parametrize(
    "T,S", [(1, 3000), (2, 2), (17, 17), (63, 63), (2049, 2049), (4096, 4096)], ids=lambda v: str(v)
)
def test_sparse_mla_function_matches_fp32_autograd(T, S):
    m = dc()
    g = torch.Generator(device="cuda").manual_seed(100 + T)
    q = torch.randn(T, H, 576, device="cuda", generator=g).bfloat16().requires_grad_()
    kv = torch.randn(S, 576, device="cuda", generator=g).bfloat16().requires_grad_()
    idx, tlen = _random_selection(T, S, TOPK, 200 + T)
    dout = torch.randn(T, H, 512, device="cuda", generator=g).bfloat16()
    out = m.SparseMLAFunction.apply(q, kv, idx, tlen, SM_SCALE)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    q32, kv32 = q.detach().float().requires_grad_(), kv.detach().float().requires_grad_()
    ref = m._sparse_mla_torch(q32, kv32, idx, tlen, SM_SCALE, 512)
    dq_r, dkv_r = torch.autograd.grad(ref, (q32, kv32), dout.float())
    errs = {"out": rel(out, ref), "dq": rel(dq, dq_r), "dkv": rel(dkv, dkv_r)}
    print(f"T={T}: " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert errs["out"] <= TOL_SPARSE_OUT and errs["dq"] <= TOL_SPARSE_GRAD and errs["dkv"] <= TOL_SPARSE_GRAD, errs


def _layer_config():
    """K3.1's attention dims (H 96, q_lora 1536, kv_lora 512, rope 64, nope 128, v 128, indexer 32 x 128, k 2048)
    with a smaller hidden size; layer 3 is a DSA layer."""
    return load_config("k3.1-pro").replace(hidden_size=1024)


LAYER_CASES = [(1, None), (63, None), (2049, None), (4096, [0, 100, 2200, 4096])]


@pytest.mark.parametrize("T,cu", LAYER_CASES, ids=["T1", "T63", "T2049", "T4096-packed"])
def test_dsa_layer_cudnn_matches_eager(T, cu):
    cfg = _layer_config()
    torch.manual_seed(T)
    ref_layer = tm.GatedMLA(cfg, 3, backend="eager")
    init_layer(ref_layer, seed=T)
    layer = tm.GatedMLA(cfg, 3, backend="cudnn")
    layer.load_state_dict(ref_layer.state_dict())
    layer = layer.to("cuda", torch.bfloat16)
    ref_layer = ref_layer.to("cuda", torch.bfloat16).float()  # the same bf16-rounded weights, computed in fp32
    assert all(not p.requires_grad for p in layer.indexer.parameters())
    cu_t = None if cu is None else torch.tensor(cu)

    g = torch.Generator(device="cuda").manual_seed(300 + T)
    x = torch.randn(1, T, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    dy = torch.randn(1, T, cfg.hidden_size, device="cuda", generator=g)
    x1 = x.clone().requires_grad_()
    out, aux = layer(x1, cu_seqlens=cu_t, return_aux=True)
    (out.float() * dy).sum().backward()
    x2 = x.float().requires_grad_()
    out_r, aux_r = ref_layer(x2, cu_seqlens=cu_t, return_aux=True)
    (out_r * dy).sum().backward()

    assert out.dtype == torch.bfloat16 and aux["index_scores"] is None
    idx, idx_r = aux["topk_indices"][0], aux_r["topk_indices"][0]
    assert idx.shape == idx_r.shape == (T, min(T, cfg.index_topk))
    sel, _ = selection_agreement(
        idx_r.cpu().numpy(), aux_r["index_scores"][0].detach().cpu().numpy(), idx.cpu().numpy(), 2e-2, causal=True
    )
    errs = {"out": rel(out, out_r), "x.grad": rel(x1.grad, x2.grad)}
    # T = 1: one visible key, so the softmax is constant and the query path has exactly zero gradient; a relative
    # error is undefined there. Check those gradients are tiny next to the value path's instead.
    q_path = ("q_a_proj.", "q_a_layernorm.", "q_b_proj.") if T == 1 else ()
    for (name, p), (_, p_r) in zip(layer.named_parameters(), ref_layer.named_parameters()):
        if name.startswith("indexer."):
            assert p.grad is None, f"{name}: the frozen indexer got a gradient"
        elif name.startswith(q_path):
            ratio = float(p.grad.float().norm() / layer.kv_b_proj.weight.grad.float().norm())
            assert torch.isfinite(p.grad).all() and ratio <= 1e-3, f"{name}: {ratio:.2e} x |kv_b_proj grad|"
        else:
            errs[name] = rel(p.grad, p_r.grad)
    print(f"T={T} cu={cu}: selection {sel}; " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
    assert sel["disagree"] / sel["rows"] <= SELECTION_DISAGREE_MAX, sel
    if T <= cfg.index_topk:  # every causal key is selected: DSA is dense MLA (spec 4.3)
        assert sel["identical"] == T
    assert errs["out"] <= TOL_LAYER_OUT, errs
    bad = {k: v for k, v in errs.items() if k != "out" and not v <= TOL_LAYER_GRAD}
    assert not bad, bad


@pytest.mark.parametrize("T", [63, 2049])
def test_dsa_layer_inference_layout_is_bitwise_the_training_layout(T):
    """Without autograd the DSA layer writes its absorbed queries into FlashMLA's padded layout (``padded_q``); with
    autograd it builds them contiguous. The outputs are bitwise equal, and the kernel that ran is recorded."""
    from kernels_torch import kernel_choice
    from kernels_torch.ops import sparse_mla as sm

    cfg = _layer_config()
    layer = tm.GatedMLA(cfg, 3, backend="cudnn")
    init_layer(layer, seed=T + 5)
    layer = layer.to("cuda", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(400 + T)
    x = torch.randn(1, T, cfg.hidden_size, device="cuda", generator=g).bfloat16()
    if not sm.wants_padded_q(cfg.num_attention_heads, x.device, layer.sparse_kernel):
        pytest.skip("FlashMLA does not run here (no padded layout)")
    kernel_choice.reset_used()
    with torch.no_grad():
        out_inf = layer(x)
    out_train = layer(x.clone().requires_grad_())
    assert torch.equal(out_inf, out_train.detach())
    assert kernel_choice.used()["sparse_mla_fwd"] == {"flash_mla": 2}
