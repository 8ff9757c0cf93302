"""Issue 13 faults on the GPU paths (``backend='cudnn'``).

* Fault 1: a head whose ``A_log`` overflows fp32 (89 > 88.7) gives a finite output and finite gradients through fla's
  in-kernel gate, in both gate forms, as the eager layer does. fla computes ``exp(A_log)`` inside ``chunk_kda``; the
  layer passes ``A_log`` capped at ``A_LOG_MAX`` (mutation: pass it uncapped, and the output or gradients are NaN).
* Fault 2: signed zeros in the cuDNN indexer's scores tie with +0.0 (canonical rule, spec 9).
"""

from __future__ import annotations

import pytest
import torch
from test_gpu_kda_cudnn import DEVICE, configs, inputs, layer_pair, rel

import kernels_torch.indexer as ti
from kernels_torch.common import causal_document_mask

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL_OUT = 2e-2  # bf16 cudnn vs fp32 eager, as test_gpu_kda_cudnn


@pytest.mark.parametrize("gate", list(configs()))
def test_overflowing_A_log_finite_on_fla(gate):
    cfg = configs()[gate]
    fast, ref = layer_pair(cfg, seed=70)
    with torch.no_grad():
        for layer in (fast, ref):
            layer.A_log[0] = 89.0  # exp overflows fp32
            layer.A_log[1] = 70.0  # finite but huge rate
    x16, x32 = inputs(cfg, 2, 130, seed=71)
    x16.requires_grad_(True)
    x32.requires_grad_(True)
    out, c = fast(x16)
    out_r, c_r = ref(x32)
    assert torch.isfinite(out).all() and torch.isfinite(c.S).all()
    assert torch.isfinite(out_r).all()
    assert rel(out, out_r) <= TOL_OUT
    dout = torch.randn_like(out)
    out.backward(dout)
    out_r.backward(dout.float())
    for n, p in fast.named_parameters():
        assert torch.isfinite(p.grad).all(), n
    assert torch.isfinite(x16.grad).all()
    assert fast.A_log.grad[0] == 0  # past the cap: no gradient reaches A_log


def test_cudnn_indexer_signed_zero_ties():
    """Weights of both signs: every key with q.k <= 0 for all heads scores 0 with the sign of the row's weights
    (-0.0 for negative weights). The cutoff falls inside those zeros, where the canonical rule keeps the larger key
    indices whatever the sign bit; the sets must equal the torch twin's (mutation: drop the add_(0.0) in
    _ScoreChunks, if cuDNN's top-k orders -0.0 below +0.0)."""
    import kernels_torch.dsa_cudnn as dc

    T, HI, KI, TOPK = 1500, 32, 128, 256
    g = torch.Generator(device=DEVICE).manual_seed(12)
    q = torch.rand(T, HI, KI, device=DEVICE, generator=g).bfloat16()  # q >= 0
    k = torch.rand(T, KI, device=DEVICE, generator=g)
    neg = torch.rand(T, device=DEVICE, generator=g) < 0.8
    k = torch.where(neg[:, None], -k, k).bfloat16()  # q.k <= 0: ReLU gives exactly 0
    sign = torch.where(torch.rand(T, 1, device=DEVICE, generator=g) < 0.5, -1.0, 1.0)
    w = sign * (torch.rand(T, HI, device=DEVICE, generator=g) + 0.1)  # rows of negative weights: zeros are -0.0
    idx, _ = dc.indexer_topk_cudnn(q, k, w, TOPK, chunk_rows=512)
    canon = ti.topk_indices(ti.indexer_scores(q[None], k[None], w[None]), causal_document_mask(T, device=DEVICE), TOPK)
    canon = torch.nn.functional.pad(canon[0], (0, TOPK - canon.shape[-1]), value=-1)
    same = (torch.sort(idx, -1).values == torch.sort(canon, -1).values).all(-1)
    assert bool(same.all()), f"{int((~same).sum())} rows differ from the canonical tie rule"


@pytest.mark.parametrize("style", ["half", "interleaved"])
@pytest.mark.parametrize("cu", [None, [0, 700, 3000]], ids=["one", "packed"])
def test_cudnn_dsa_layer_with_indexer_rope_matches_eager(style, cu):
    """Fault 7 on the cudnn path: Indexer.projections rotates q_I and k_I (positions restarting per document) before
    the cuDNN indexer, so its selected sets match the eager twin's beyond near-ties, and the outputs agree. Mutation:
    call projections without cu_seqlens in gated_mla_forward (positions do not restart: the packed case fails)."""
    from _helpers import init_layer
    from test_gpu_dsa_cudnn import SELECTION_DISAGREE_MAX, TOL_LAYER_OUT, _layer_config

    import kernels_torch.mla as tm
    from kimi_tools.compare import selection_agreement

    cfg = _layer_config().replace(indexer_rope=style)
    T = 3000
    ref_layer = tm.GatedMLA(cfg, 3, backend="eager")
    init_layer(ref_layer, seed=5)
    layer = tm.GatedMLA(cfg, 3, backend="cudnn")
    layer.load_state_dict(ref_layer.state_dict())
    layer = layer.to(DEVICE, torch.bfloat16)
    ref_layer = ref_layer.to(DEVICE, torch.bfloat16).float()
    cu_t = None if cu is None else torch.tensor(cu)
    g = torch.Generator(device=DEVICE).manual_seed(6)
    x = torch.randn(1, T, cfg.hidden_size, device=DEVICE, generator=g).bfloat16()
    with torch.no_grad():
        out, aux = layer(x, cu_seqlens=cu_t, return_aux=True)
        out_r, aux_r = ref_layer(x.float(), cu_seqlens=cu_t, return_aux=True)
    sel, _ = selection_agreement(
        aux_r["topk_indices"][0].cpu().numpy(),
        aux_r["index_scores"][0].cpu().numpy(),
        aux["topk_indices"][0].cpu().numpy(),
        2e-2,
        causal=True,
    )
    assert sel["disagree"] / sel["rows"] <= SELECTION_DISAGREE_MAX, sel
    assert rel(out, out_r) <= TOL_LAYER_OUT
