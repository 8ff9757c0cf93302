"""Activation offload on CUDA (``kernels_torch.activation_memory.save_on_host``): the saved tensors go to pinned host
memory on a side stream and come back for the backward. The tiny model on the ``sdpa`` backend in fp32, each offload
mode alone and around a recomputed block: the loss and every gradient equal no offload's bit for bit (the same
kernels on the same values; a copy read before its side-stream copy finished, or a device tensor reused before it
was copied, would change them), and the offloaded tensors live in pinned host memory until the backward.

    python -m pytest -q -m gpu tests/gpu/test_gpu_offload.py
"""

from __future__ import annotations

import pytest
import torch

from kernels_torch.activation_memory import offload_activations, recompute_layers, save_on_host
from kernels_torch.model import KimiK3Model
from kimi.config import load_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _run(policy):
    cfg = load_config("tiny")
    torch.manual_seed(0)
    model = KimiK3Model(cfg, backend="sdpa").cuda()
    mode, off = policy
    if mode:
        recompute_layers(model, mode)
    offload_activations(model, off)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda", generator=g)
    labels = torch.randint(0, cfg.vocab_size, (1, 512), device="cuda", generator=g)
    cu = torch.tensor([0, 200, 512], device="cuda")
    loss = model.loss(ids, labels, cu) / 512
    loss.backward()
    torch.cuda.synchronize()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("policy", [(None, "all"), (None, "attn"), ("mlp", "attn"), ("layer", "all"), ("attn", "attn")])
def test_offload_on_cuda_equals_no_offload(policy):
    l0, g0 = _run((None, "none"))
    l1, g1 = _run(policy)
    assert torch.equal(l0, l1)
    assert g0.keys() == g1.keys() and len(g0) > 50
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


def test_saved_tensors_live_in_pinned_host_memory():
    """The pack hook returns a pinned host copy (strides kept) and the copy's event; the unpack hook gives the
    values back on the device; a parameter and a small tensor stay as they are."""
    t = torch.randn(64, 4096, device="cuda").t()  # non-contiguous: its strides are kept
    stats = {}
    hooks = save_on_host(stats)
    device, host, done = hooks.pack_hook(t)
    assert host.device.type == "cpu" and host.is_pinned() and host.stride() == t.stride()
    assert stats == {"tensors": 1, "bytes": 64 * 4096 * 4}
    back = hooks.unpack_hook((device, host, done))
    assert back.device == t.device and torch.equal(back, t)
    w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    small = torch.randn(8, device="cuda")
    wt = w.t()
    assert hooks.pack_hook(w) is w and hooks.pack_hook(wt) is wt and hooks.pack_hook(small) is small
    assert stats["tensors"] == 1
