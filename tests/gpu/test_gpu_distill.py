"""GPU: the chunked warm-up KL at 32K tokens with the real head count and absorbed widths fits (no [T, S, H]
tensor: that would be 96 x 32K x 32K x 4 B = 412 GB), and its rows and gradient match a dense computation of the
same rows; the gathered sparse-stage KL matches the dense one and takes the sparse forward's lse."""

from __future__ import annotations

import pytest
import torch

from kernels_torch import distill as kd

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCALE = 192**-0.5
TOL_KL = 1e-4  # chunked rows vs a dense recomputation of the same rows, fp32
TOL_GRAD = 1e-4


def test_warmup_chunked_32k_fits_and_matches_dense_rows():
    T, H, D = 32768, 96, 576  # absorbed MLA: one shared 576-wide key per token
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (torch.randn(1, T, H, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    k = (torch.randn(1, T, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    scores = torch.randn(1, T, T, device="cuda", generator=g).requires_grad_(True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kl, _ = kd.warmup_kl_chunked(q, k, scores, SCALE)
    kl.sum().backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 12 * 2**30, extra / 2**30  # the [T, S] gradient (4 GiB) plus chunks; never [T, S, H]
    rows = torch.arange(T - 48, T, device="cuda")
    logits = torch.einsum("thd,sd->hts", q[0, rows].float(), k[0].float()) * SCALE  # [H, 48, S]
    vis = torch.arange(T, device="cuda")[None, :] <= rows[:, None]
    p = torch.softmax(logits.masked_fill(~vis, float("-inf")), -1).sum(0)
    p = p / p.sum(-1, keepdim=True)
    s = scores[0, rows].detach().masked_fill(~vis, float("-inf"))
    log_q = torch.log_softmax(s, -1)
    kl_ref = torch.where(p > 0, p * (torch.log(p.clamp_min(1e-38)) - log_q), 0.0).sum(-1)
    assert float((kl[0, rows] - kl_ref).norm() / kl_ref.norm()) < TOL_KL
    grad_ref = torch.exp(log_q) - p  # d sum_t KL / d I
    assert float((scores.grad[0, rows] - grad_ref).norm() / grad_ref.norm()) < TOL_GRAD


def test_sparse_gathered_takes_the_sparse_forward_lse():
    from kernels_torch.ops.sparse_mla import sparse_mla_fwd

    T, H, D, K = 4096, 64, 576, 2048
    g = torch.Generator(device="cuda").manual_seed(1)
    q = (torch.randn(T, H, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    kv = (torch.randn(T, D, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
    t = torch.arange(T, device="cuda")[:, None]
    idx = torch.randint(0, T, (T, K), device="cuda", generator=g)
    idx = torch.where(idx <= t, idx, -1).to(torch.int32)
    tlen = torch.full((T,), K, device="cuda", dtype=torch.int32)
    _, _, lse = sparse_mla_fwd(q, kv[:, None], idx, SCALE, tlen)  # natural-log lse over exactly the selected slots
    at = torch.randn(T, K, device="cuda", generator=g)
    kl_lse = kd.sparse_kl_gathered(q, kv, idx, at, SCALE, lse=lse.reshape(T, H).float())
    kl = kd.sparse_kl_gathered(q, kv, idx, at, SCALE)
    assert float((kl_lse - kl).norm() / kl.norm()) < 1e-3
