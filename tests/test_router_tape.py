"""``helpers.RouterTape``, the routing replay the GPU decode tests compare two paths under, on the tiny preset's
first 4 layers (``KKKD``, fp32, eager, CPU): a recording replayed onto the model it came from changes nothing; replayed
onto a copy whose router weights were perturbed, it restores the original output exactly (the experts and their
weights come from the recording) and reports where the perturbed router would have picked otherwise."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import RouterTape, rel

from kernels_torch.model import load_model as load_torch
from kernels_torch.moe import MoEGate


@pytest.fixture(scope="module")
def tmodel(tiny_ckpt):
    return load_torch(tiny_ckpt, layers=4, backend="eager")


def _logits(model, ids, tape=None):
    if tape is not None:
        tape.on = True
    try:
        with torch.no_grad():
            return model(ids)
    finally:
        if tape is not None:
            tape.on = False


def _ids(seed, B=2, T=63):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def _perturbed(model, seed):
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in other.modules():
            if isinstance(m, MoEGate):
                m.weight.add_(torch.randn(m.weight.shape, generator=g) * m.weight.std())
    return other


def test_replay_onto_the_recorded_model_changes_nothing(tmodel):
    ids = _ids(0)
    rec = RouterTape(tmodel)
    want = _logits(tmodel, ids, rec)
    rec.remove()
    assert len(rec.calls) == sum(isinstance(m, MoEGate) for m in tmodel.modules()) >= 2
    replay = RouterTape(tmodel, replay=rec.calls)
    got = _logits(tmodel, ids, replay)
    replay.remove()
    assert replay.done() and torch.equal(got, want)
    assert all(bool(torch.isinf(s).all()) for s in replay.splits)  # its own picks are the recorded ones
    assert all(bool((gap >= 0).all()) for _, _, gap in rec.calls)


def test_replay_restores_the_output_under_a_perturbed_router(tmodel):
    ids = _ids(1)
    rec = RouterTape(tmodel)
    want = _logits(tmodel, ids, rec)
    rec.remove()
    other = _perturbed(tmodel, 2)
    own = RouterTape(other)
    free = _logits(other, ids, own)  # routed by its own (perturbed) router
    own.remove()
    assert rel(free, want) > 1e-3
    replay = RouterTape(other, replay=rec.calls)
    got = _logits(other, ids, replay)
    replay.remove()
    assert replay.done() and torch.equal(got, want)
    # the first MoE layer sees the same input in both runs: its splits are exactly where the two routers disagree
    first = (own.calls[0][0].sort(-1).values != rec.calls[0][0].sort(-1).values).any(-1)
    assert first.any() and torch.equal(torch.isfinite(replay.splits[0]), first)
    assert torch.equal(replay.splits[0][first], own.calls[0][2][first])


def test_replay_past_the_recording_is_refused(tmodel):
    rec = RouterTape(tmodel)
    _logits(tmodel, _ids(3), rec)
    rec.remove()
    replay = RouterTape(tmodel, replay=rec.calls[:1])
    with pytest.raises(IndexError, match="recording holds 1"):
        _logits(tmodel, _ids(3), replay)
    replay.remove()
