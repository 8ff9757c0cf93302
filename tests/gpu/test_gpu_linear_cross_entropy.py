"""GPU checks of ``kernels_torch.loss.linear_cross_entropy`` in bf16 at the real vocabulary (163,840) and a 1024-wide
hidden state: value and both gradients against the full-logits path, and the peak memory it saves.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import rel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

from kernels_torch.loss import default_chunk_size, linear_cross_entropy  # noqa: E402

TOL = {"loss": 1e-4, "dhidden": 1e-2, "dweight": 1e-2}  # bf16: one rounding of dlogits / of each chunk's dW apart
N, D, V = 4096, 1024, 163840


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(N, D, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(V, D, device="cuda", generator=g) * 2 / D**0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device="cuda", generator=g)
    labels[::7] = -100
    return hidden, weight, labels


def _peak(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**30


@pytest.mark.parametrize("chunk", [1000, None], ids=["chunk1000", "default"])
def test_bf16_real_vocab_matches_full_logits_and_saves_memory(chunk):
    hidden, weight, labels = _inputs()

    def full():
        loss = F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=-100, reduction="sum")
        return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))

    def chunked():
        loss = linear_cross_entropy(hidden, weight, labels, chunk_size=chunk)
        return (loss.detach(), *torch.autograd.grad(loss, (hidden, weight)))

    (l0, dh0, dw0), full_gib = _peak(full)
    (l1, dh1, dw1), chunk_gib = _peak(chunked)
    assert torch.isfinite(l1) and rel(l1, l0) <= TOL["loss"], (float(l1), float(l0))
    assert rel(dh1, dh0) <= TOL["dhidden"], rel(dh1, dh0)
    assert rel(dw1, dw0) <= TOL["dweight"], rel(dw1, dw0)
    # chunked, beyond the inputs: one chunk's bf16 logits, fp32 copy and bf16 dlogits (<= 8 bytes per entry), dW
    # (fp32 accumulator, the per-chunk bf16 product, the kept and the scaled bf16 copies: <= 8 bytes per entry) and
    # dhidden; the full path holds [N, V] bf16 + fp32 + fp32 grad + bf16 grad (~6.9 GiB here)
    C = chunk or default_chunk_size(V)
    bound = (C * V * 8 + V * D * 8 + 2 * N * D * 2) / 2**30
    print(f"peak beyond inputs: full {full_gib:.2f} GiB, chunked {chunk_gib:.2f} GiB (bound {bound:.2f})")
    assert chunk_gib <= bound and chunk_gib < 0.75 * full_gib, (chunk_gib, bound, full_gib)
