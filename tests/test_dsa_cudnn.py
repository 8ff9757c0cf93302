"""CPU checks of the ``cudnn`` backend's pieces that need no GPU (``kernels_torch.dsa_cudnn``): the errors when CUDA,
bf16 or the gpu extra are missing, the refusal of masks with holes, the frozen indexer, and the torch twins (chunked
indexer scores, sparse MLA) against the readable references. The kernels themselves: ``tests/gpu/test_gpu_dsa_cudnn.py``.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import rel

import kernels_torch.dsa_cudnn as dc
import kernels_torch.indexer as ti
import kernels_torch.mla as tm
from kernels_torch.common import causal_document_mask
from kernels_torch.model import KimiK3Model
from kernels_torch.ops.sparse_mla import sparse_mla_fwd_reference
from kimi.config import load_config

DSA = 3  # a DSA layer of the tiny preset
TOL_FP64 = 1e-12  # torch twins vs references, fp64


def _has_cuda_and_extra() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("cudnn") is not None


@pytest.mark.skipif(_has_cuda_and_extra(), reason="checks the errors of a machine without CUDA / the gpu extra")
def test_cudnn_backend_names_what_is_missing():
    cfg = load_config("tiny")
    layer = tm.GatedMLA(cfg, DSA, backend="cudnn")  # construction works anywhere; the refusal is at forward time
    x = torch.randn(1, 5, cfg.hidden_size)
    with pytest.raises(RuntimeError) as e:
        layer(x)
    msg = str(e.value)
    assert "backend='cudnn'" in msg and "sdpa" in msg
    assert "CUDA" in msg and "bfloat16 activations" in msg
    assert ("gpu extra" in msg) == (importlib.util.find_spec("cudnn") is None)
    with pytest.raises(RuntimeError) as e:  # bf16 given: bf16 is no longer named
        layer.to(torch.bfloat16)(x.bfloat16())
    assert "CUDA" in str(e.value) and "bfloat16 activations" not in str(e.value)


def test_missing_gpu_extra_is_named(monkeypatch):
    def no_cudnn(name):
        if name.startswith("cudnn") or name == "cutlass":
            raise ModuleNotFoundError(f"No module named {name!r}")
        return importlib.import_module(name)

    import importlib

    monkeypatch.setattr(dc, "_import", no_cudnn)
    with pytest.raises(RuntimeError, match=r"gpu extra: cuDNN Frontend.*kimi-k3\[gpu\]") as e:
        dc.require_cudnn(torch.zeros(2, dtype=torch.bfloat16))
    assert "the CUTLASS DSL" in str(e.value)  # every missing module is named, not only the first

    def only_cutlass_missing(name):  # cuDNN Frontend installed without its CUTLASS DSL
        if name == "cutlass":
            raise ModuleNotFoundError("No module named 'cutlass'")
        return object()

    monkeypatch.setattr(dc, "_import", only_cutlass_missing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    x = torch.zeros(2, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError) as e:
        dc.require_cudnn(x)
    assert "CUDA tensors" in str(e.value) and "the CUTLASS DSL (module cutlass: nvidia-cutlass-dsl" in str(e.value)
    assert "cuDNN Frontend >= 1.30" not in str(e.value)


def test_indexer_frozen_under_cudnn():
    cfg = load_config("tiny")
    for backend in ("eager", "sdpa", "cudnn"):
        layer = tm.GatedMLA(cfg, DSA, backend=backend)
        frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}
        expected = {n for n, _ in layer.named_parameters() if n.startswith("indexer.")} if backend == "cudnn" else set()
        assert frozen == expected and (backend != "cudnn" or frozen), backend
    model = KimiK3Model(cfg, backend="cudnn")  # the whole model builds on CPU too
    names = [n for n, p in model.named_parameters() if not p.requires_grad and ".self_attn." in n]
    assert names and all(".self_attn.indexer." in n for n in names)  # (the MoE bias buffers are frozen anyway)
    assert len(names) == 5 * len(cfg.dsa_layers)  # wq_b, wk, k_norm.{weight,bias}, weights_proj


@pytest.mark.parametrize("cu", [[0, 1], [0, 7], [0, 1, 2, 3, 50], [0, 15, 100, 130]], ids=str)
def test_mask_of_contiguous_documents_gives_cu_seqlens(cu):
    T = cu[-1]
    cu_t = torch.tensor(cu)
    assert torch.equal(dc.cu_seqlens_from_mask(causal_document_mask(T, cu_t)), cu_t)
    assert torch.equal(dc.cu_seqlens_from_mask(causal_document_mask(T, cu_t)[None]), cu_t)


def test_mask_with_a_hole_is_refused():
    T = 40
    m = causal_document_mask(T, torch.tensor([0, 10, 40]))
    holed = m.clone()
    holed[30, 20] = False  # a key inside the row's own document, before the query
    with pytest.raises(ValueError, match=r"row 30.*hole.*sdpa"):
        dc.cu_seqlens_from_mask(holed)
    future = m.clone()
    future[5, 6] = True  # not causal
    with pytest.raises(ValueError, match=r"row 5.*sdpa"):
        dc.cu_seqlens_from_mask(future)
    empty_row = m.clone()
    empty_row[12] = False
    with pytest.raises(ValueError, match="sdpa"):
        dc.cu_seqlens_from_mask(empty_row)
    with pytest.raises(ValueError, match=r"\[T, T\].*sdpa"):
        dc.cu_seqlens_from_mask(torch.ones(2, T, T, dtype=torch.bool))


@pytest.mark.parametrize(
    "T,cu,chunk", [(1, None, 7), (63, None, 10), (300, [0, 1, 129, 300], 50)], ids=["T1", "T63", "T300-packed"]
)
def test_chunked_scores_twin_matches_indexer_scores(T, cu, chunk):
    """The row-chunk driver (torch twin of the cuDNN score kernel: H_I = 4, D_I = 16) gives the masked
    ``indexer_scores``, in chunks of at most ``chunk`` rows and one document's keys."""
    g = torch.Generator().manual_seed(T)
    HI, KI = 4, 16
    q = torch.randn(T, HI, KI, generator=g, dtype=torch.float64)
    k = torch.randn(T, KI, generator=g, dtype=torch.float64)
    w = torch.randn(T, HI, generator=g, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    got = torch.full((T, T), float("-inf"), dtype=torch.float64)
    shapes = []

    def on_chunk(r0, r1, a, cols, scores):
        shapes.append(tuple(scores.shape))
        n = min(cols, T - a)
        got[r0:r1, a : a + n] = scores[:, :n].double()

    dc._indexer_chunks(q, k, w, 8, cu_t, chunk, dc.CHUNK_BYTES, on_chunk)
    mask = causal_document_mask(T, cu_t)
    ref = ti.indexer_scores(q[None], k[None], w[None])[0].masked_fill(~mask, float("-inf"))
    got = got.masked_fill(~mask, float("-inf"))
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    fin = torch.isfinite(ref)
    assert rel(got[fin], ref[fin]) < 1e-6  # the twin scores in fp32
    assert all(r <= chunk for r, _ in shapes)


@pytest.mark.parametrize("T,H,K,S", [(1, 3, 4, 5), (63, 4, 37, 50), (70, 2, 16, 20)], ids=lambda v: str(v))
def test_sparse_mla_torch_twin_matches_reference(T, H, K, S):
    """The differentiable torch twin used for shapes the kernels do not take (d_qk 40, d_v 32, K != V)."""
    g = torch.Generator().manual_seed(T + K)
    D, V = 40, 32
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64)
    idx = torch.randint(-3, S + 3, (T, K), generator=g).to(torch.int32)
    idx[0] = -1  # a row with no valid key: 0, never NaN
    tlen = torch.randint(0, K + 1, (T,), generator=g).to(torch.int32)
    out = dc._sparse_mla_torch(q, kv, idx, tlen, 0.3, V, rows_per_chunk=16)
    ref, _, _ = sparse_mla_fwd_reference(q, kv, idx, 0.3, tlen, d_v=V)
    assert not torch.isnan(out).any() and bool((out[0] == 0).all())
    assert rel(out, ref) < TOL_FP64


def _indexer_topk_torch(q_I, k_I, weights, topk, cu_seqlens=None, chunk_rows=None, **_):
    """Torch stand-in for :func:`dc.indexer_topk_cudnn` (same arguments and returns): fp64 scores, canonical top-k."""
    T = q_I.shape[0]
    cu = None if cu_seqlens is None else torch.as_tensor(cu_seqlens)
    mask = causal_document_mask(T, cu)
    idx = ti.topk_indices(ti.indexer_scores(q_I[None], k_I[None], weights[None]), mask, topk)[0]
    idx = torch.nn.functional.pad(idx, (0, topk - idx.shape[1]), value=-1)
    return idx.int(), mask.sum(-1).clamp(max=topk).int()


class _TorchTopK:
    """Torch stand-in for cuDNN FE's ``indexer_top_k_wrapper`` (``tie_break=2``): per row the ``k`` largest of the
    first ``seq_lens[r]`` columns, equal scores by the larger column, ``-1`` past the visible columns."""

    @staticmethod
    def indexer_top_k_wrapper(scores, seq_lens, k, return_val=False, tie_break=2):
        assert tie_break == 2 and not return_val
        cols = torch.arange(scores.shape[1])
        s = scores.masked_fill(cols[None, :] >= seq_lens[:, None].long(), float("-inf")).flip(-1)
        order = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]  # stable: larger column first
        idx = scores.shape[1] - 1 - order
        return {"indices": torch.where(torch.arange(k)[None, :] < seq_lens[:, None].long(), idx, -1).int()}


@pytest.mark.parametrize(
    "cu,chunk_rows",
    [(None, 128), ([0, 100, 450, 700], 128), ([0, 300, 700], None)],
    ids=["one-doc-chunks", "packed-short-doc", "packed-one-chunk-per-doc"],
)
def test_indexer_topk_chunk_driver(monkeypatch, cu, chunk_rows):
    """``indexer_topk_cudnn``'s own row-chunk driver (document offsets, local -> global ids, -1 slots of a document
    shorter than topk, ``topk_length``) against the canonical top-k of the dense reference scores. The two cuDNN
    kernels are replaced: the scores by ``_ScoreChunks``' torch twin (H_I = 4 is not a cuDNN shape), the top-k by a
    torch sort with the same tie rule."""
    monkeypatch.setattr(dc, "require_cudnn", lambda x, what="x": None)
    monkeypatch.setattr(dc, "_dsa", lambda: _TorchTopK)
    T, HI, KI, topk = 700, 4, 32, 200  # the 100-token document has 128 score columns < topk
    g = torch.Generator().manual_seed(7)
    q_I = torch.randn(T, HI, KI, generator=g).bfloat16()
    k_I = torch.randn(T, KI, generator=g).bfloat16()
    w = torch.randn(T, HI, generator=g)
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    idx, length = dc.indexer_topk_cudnn(q_I, k_I, w, topk, cu_t, chunk_rows)
    ref_idx, ref_len = _indexer_topk_torch(q_I, k_I, w, topk, cu_t)
    assert idx.shape == (T, topk) and idx.dtype == torch.int32
    assert torch.equal(length, ref_len)
    assert torch.equal(torch.sort(idx.long(), -1).values, torch.sort(ref_idx.long(), -1).values)
    valid = torch.arange(topk)[None, :] < length[:, None]  # the valid ids come first, then -1
    assert bool((idx[valid] >= 0).all()) and bool((idx[~valid] == -1).all())


def test_sort_topk_slots_orders_ids_and_keeps_sets():
    """Each row's ids ascending, its -1 slots last, the set unchanged (what makes the cudnn DSA forward reproducible)."""
    g = torch.Generator().manual_seed(3)
    T, k = 50, 16
    ids = torch.stack([torch.randperm(1000, generator=g)[:k] for _ in range(T)]).int()
    n_valid = torch.randint(0, k + 1, (T,), generator=g)
    ids = torch.where(torch.arange(k)[None, :] < n_valid[:, None], ids, -1)
    ids = ids[:, torch.randperm(k, generator=g)]  # -1 anywhere, as an unsorted kernel result could hold them
    out = dc.sort_topk_slots(ids)
    assert out.dtype == torch.int32 and out.shape == ids.shape
    for r in range(T):
        valid = out[r, : n_valid[r]]
        assert bool((valid[1:] > valid[:-1]).all()) and bool((out[r, n_valid[r] :] == -1).all())
        assert set(valid.tolist()) == set(ids[r][ids[r] >= 0].tolist())


TOL_WIRING = 1e-10  # fp64, cudnn layer code with torch stand-ins for the two kernels vs the eager layer


@pytest.mark.parametrize(
    "B,T,cu",
    [(1, 1, None), (2, 100, None), (1, 130, [0, 15, 100, 130]), (1, 63, None)],
    ids=["T1", "B2-T100", "packed", "T63"],
)
def test_cudnn_layer_code_matches_eager_with_torch_kernels(monkeypatch, B, T, cu):
    """``gated_mla_forward``'s own code (projections, the absorbed query and latent rows, W_UV, the gate, o_proj,
    B > 1 as packed documents) against the eager layer in fp64 on the CPU. The two GPU kernels are replaced by their
    torch twins: the indexer by fp64 scores + the canonical top-k, the sparse attention by ``_sparse_mla_torch``
    (what ``sparse_mla`` picks below the real 576/512 dims). T > index_topk = 64 makes the selection real."""
    monkeypatch.setattr(dc, "require_cudnn", lambda x, what="x": None)
    monkeypatch.setattr(dc, "indexer_topk_cudnn", _indexer_topk_torch)
    cfg = load_config("tiny")
    torch.manual_seed(T + B)
    eager = tm.GatedMLA(cfg, DSA, backend="eager").double()
    fast = tm.GatedMLA(cfg, DSA, backend="cudnn").double()
    with torch.no_grad():  # fresh random weights (the default init leaves some norms at exactly 1)
        for p in eager.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5 + (1.0 if p.ndim == 1 else 0.0))
    fast.load_state_dict(eager.state_dict())
    x = torch.randn(B, T, cfg.hidden_size, dtype=torch.float64)
    cu_t = None if cu is None else torch.tensor(cu)
    out, aux = fast(x, cu_seqlens=cu_t, return_aux=True)
    out_e, aux_e = eager(x, cu_seqlens=cu_t, return_aux=True)
    k = min(T, cfg.index_topk)
    assert torch.equal(
        torch.sort(aux["topk_indices"].long(), -1).values, torch.sort(aux_e["topk_indices"].long(), -1).values
    )
    assert aux["topk_indices"].shape == (B, T, k)
    ids = aux["topk_indices"].long()  # slots ascending, -1 last (sort_topk_slots: a reproducible sparse forward)
    keyed = torch.where(ids < 0, torch.iinfo(torch.int64).max, ids)
    assert bool((keyed[..., 1:] >= keyed[..., :-1]).all())
    err = rel(out.detach(), out_e.detach())
    assert err <= TOL_WIRING, err


def test_padded_query_layout_only_when_nothing_needs_the_sparse_backward(monkeypatch):
    """``gated_mla_forward`` writes its absorbed queries into FlashMLA's padded layout (``padded_q``, a strided view)
    only when no gradient flows through the sparse attention: with grad mode off, but not when only the latent KV rows
    need one (here only ``kv_a_*`` trains: q needs no gradient, yet the cuDNN backward runs and reads q), nor in full
    training. The outputs are the same either way (real 576/512 dims, fp64, FlashMLA stood in by the torch twin)."""
    monkeypatch.setattr(dc, "require_cudnn", lambda x, what="x": None)
    monkeypatch.setattr(dc, "indexer_topk_cudnn", _indexer_topk_torch)
    monkeypatch.setattr(dc, "wants_padded_q", lambda H, device, kernel=None: True)  # as on an H200 with FlashMLA
    layouts, sparse_mla = [], dc.sparse_mla

    def spy(q, kv, *args, **kwargs):
        layouts.append("contiguous" if q.is_contiguous() else "padded")
        return sparse_mla(q, kv, *args, **kwargs)

    monkeypatch.setattr(dc, "sparse_mla", spy)
    cfg = load_config("tiny").replace(kv_lora_rank=dc.SPARSE_D_V, qk_rope_head_dim=dc.SPARSE_D_QK - dc.SPARSE_D_V)
    torch.manual_seed(5)
    layer = tm.GatedMLA(cfg, DSA, backend="cudnn").double()
    x = torch.randn(1, 9, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        out_inf = layer(x)
    for name, p in layer.named_parameters():
        p.requires_grad_(name.startswith("kv_a_"))
    out_kv = layer(x)
    out_kv.sum().backward()
    assert layer.kv_a_proj_with_mqa.weight.grad is not None
    layer.requires_grad_(True)
    out_all = layer(x)
    assert layouts == ["padded", "contiguous", "contiguous"]
    assert rel(out_kv.detach(), out_inf) <= TOL_FP64 and rel(out_all.detach(), out_inf) <= TOL_FP64
