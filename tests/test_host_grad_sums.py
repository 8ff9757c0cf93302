"""``kernels_torch.parallel.fsdp.HostGradSums``: under FSDP2's ``CPUOffloadPolicy`` the host gradients of a step's
micro-batches are summed outside ``.grad`` (so that FSDP2 copies every one the fast way, non-blocking into pinned
memory, instead of its blocking copy and host add when ``.grad`` exists), and the step's gradient is bit for bit
FSDP2's own accumulation. Two gloo ranks spawned by the test, a small MLP in fp32, one FSDP2 unit per layer."""

from __future__ import annotations

import functools

import pytest
import torch
from dist_helpers import run_workers
from torch import nn

N_MICRO = 4  # micro-batches per step: the first held, two added in between, the last given back
SCALES = (1.0, 7.0, 0.3, 3.0)  # each micro-batch's input scale: sums of unlike magnitudes, so the order shows


def _mlp(mesh, offload: bool) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 96), nn.Tanh(), nn.Linear(96, 96), nn.Tanh(), nn.Linear(96, 8))
    kw = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)  # the root: no parameter of its own
    return model


def _backward(model: nn.Module, x: torch.Tensor) -> None:
    (model(x) ** 2).sum().backward()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.to_local().clone() for p in model.parameters()]


def _worker(rank: int, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from kernels_torch.parallel.fsdp import HostGradSums, offloaded_params

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own micro-batches
    xs = [torch.randn(5, 24, generator=g) * s for s in SCALES]

    plain = _mlp(mesh, offload=False)  # each micro-batch's gradient alone
    per = []
    for x in xs:
        _backward(plain, x)
        per.append(_grads(plain))
        plain.zero_grad(set_to_none=True)
    want = [functools.reduce(torch.add, gs) for gs in zip(*per)]  # ((g0 + g1) + g2) + g3
    other = [functools.reduce(torch.add, gs[::-1]) for gs in zip(*per)]  # g3 + g2 + g1 + g0
    assert any(not torch.equal(a, b) for a, b in zip(want, other))  # the order shows in the bits

    own = _mlp(mesh, offload=False)  # FSDP2's own accumulation in .grad: the reference order
    for x in xs:
        _backward(own, x)
    assert all(torch.equal(a, b) for a, b in zip(_grads(own), want))
    assert offloaded_params(own) == []  # no CPUOffloadPolicy: nothing to hold

    off = _mlp(mesh, offload=True)
    params = offloaded_params(off)
    assert params == list(off.parameters())  # every layer's weight and bias, once, in module order
    sums = HostGradSums(params)
    for i, x in enumerate(xs):
        _backward(off, x)
        if i < N_MICRO - 1:
            assert all(p.grad is not None for p in params)
            sums.take()
            assert all(p.grad is None for p in params)  # the next backward copies the fast way (no .grad)
    assert len(sums.held) == len(params)
    sums.give_back()
    assert sums.held == {}
    got = _grads(off)
    assert all(p.grad.device.type == "cpu" for p in params)
    bad = [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]  # bit for bit: tolerance 0
    assert not bad, [(i, (got[i] - want[i]).abs().max().item()) for i in bad]

    sums.give_back()  # nothing held: .grad stays as it is
    assert all(torch.equal(a, b) for a, b in zip(_grads(off), want))


@pytest.mark.distributed
def test_host_grad_sums_match_fsdp2_accumulation_bit_for_bit():
    """On 2 gloo ranks, 4 micro-batches of unlike scales: between micro-batches the offloaded parameters' ``.grad``
    is None (taken into the held sums); after the last, ``.grad`` equals FSDP2's own accumulation without offload and
    the plain sum ``((g0 + g1) + g2) + g3`` of the micro-batches' gradients bit for bit, while the reversed order
    differs (so the test tells the order); ``offloaded_params`` lists only the units under ``CPUOffloadPolicy``."""
    run_workers(_worker, 2)
