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
from kernels_torch.moe import MoEGate, selection_scores


@pytest.fixture(scope="module")
def tmodel(tiny_ckpt):
    return load_torch(tiny_ckpt, layers=4, backend="eager")


@torch.no_grad()
def _logits(model, ids, tape):
    with tape:
        return model(ids)


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


def test_rows_gaps_and_done(tmodel):
    """``rows`` replays one row of a batch's recording onto that row run alone; ``gap`` is the k-th minus the
    (k+1)-th selection score of the gate's input; ``done()`` is false until every recorded call was used."""
    ids = _ids(4)
    seen = []
    gate = next(m for m in tmodel.modules() if isinstance(m, MoEGate))
    hook = gate.register_forward_hook(lambda mod, args, out: seen.append(args[0].reshape(-1, args[0].shape[-1])))
    rec = RouterTape(tmodel)
    want = _logits(tmodel, ids, rec)
    hook.remove()
    rec.remove()
    s = selection_scores(seen[0], gate.weight, gate.e_score_correction_bias, gate.config).float()
    k = gate.config.num_experts_per_token
    top = s.topk(k + 1, dim=-1).values
    assert torch.equal(rec.calls[0][2], top[:, k - 1] - top[:, k])
    other = _perturbed(tmodel, 5)
    replay = RouterTape(other, replay=rec.calls, rows=slice(63, 126))  # row 1 of [2, 63], flattened to N = 126
    got = _logits(other, ids[1:], replay)
    replay.remove()
    assert replay.done() and rel(got[0], want[1]) <= 1e-5
    partial = RouterTape(tmodel, replay=rec.calls + rec.calls)
    _logits(tmodel, ids, partial)
    partial.remove()
    assert not partial.done()
