"""LoRA built on ``meta`` under torchrun: the adapters start where one process starts them.

* :func:`kimi_tools.lora.initial_adapters` of a model on ``meta`` equals, bit for bit, what ``apply_lora`` gives the
  one-process model from the same RNG state (fp32 and bf16 bases), and leaves the RNG where ``apply_lora`` on
  ``meta`` then leaves it: the state one process has after ``apply_lora`` (LoRA dropout draws from it next);
* ``load_sharded`` of a LoRA-wrapped meta model (base layers under their checkpoint names, adapters from ``extra``)
  equals ``load_model`` + ``apply_lora``; a missing, misshaped or foreign ``extra`` tensor is refused, named;
* ``kimi train --lora-rank`` on two gloo ranks (spawned processes with torchrun's environment, running the trainer
  as ``torchrun`` would: meta build, sharding, ``load_sharded`` of the checkpoint with the adapters' initial values)
  gives the one-process run's losses, gradient norms, eval loss and adapter, also when stopped and resumed: with
  ``--ep 2`` (dp 2) and with ``--cp 2``. A wrong initial A changes the first step's gradient norm (B is zero, so
  B's gradient is A's image).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import spawn
from safetensors.torch import load_file

from kimi.config import load_config
from kimi_tools.common import DEFAULT_TEXT

# fp32 sums in another order (sharded reductions), as tests/test_train_parallel.py: the loss, the gradient norm (the
# most sensitive), the eval loss, and the adapters written after 3 steps
TOL = {"loss": 1e-5, "grad_norm": 3e-4, "eval_loss": 1e-5, "adapter": 1e-4}
RUN = dict(
    data=[str(DEFAULT_TEXT)],
    steps=3,
    seq_len=32,
    micro_batch_tokens=32,
    batch_tokens=64,
    eval_tokens=64,
    eval_every=0,
    warmup_steps=1,
    lr=1e-2,
    lora_rank=4,
    lora_alpha=8.0,
    quiet=True,
    plot=False,
)


def _meta_model(cfg, dtype):
    from kernels_torch.model import KimiK3Model, cast_model

    with torch.device("meta"):
        return cast_model(KimiK3Model(cfg), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_initial_adapters_on_meta_equal_one_process(dtype):
    from kernels_torch.model import model_from_params
    from kimi.init import init_params
    from kimi_tools import lora

    cfg = load_config("tiny").truncated(4)
    settings = lora.LoraSettings(rank=4, alpha=8.0, targets=lora.DEFAULT_TARGETS + ("g_proj",))
    torch.manual_seed(11)
    one = model_from_params(cfg, init_params(cfg, seed=2, layers=4), "eager", dtype)
    lora.apply_lora(one, settings)
    rng_one = torch.get_rng_state()
    want = {n: p.detach() for n, p in one.named_parameters() if ".lora_" in n}

    torch.manual_seed(11)
    meta = _meta_model(cfg, dtype)
    got = lora.initial_adapters(meta, settings)
    assert not lora.lora_modules(meta)  # the model is not touched
    lora.apply_lora(meta, settings)
    assert torch.equal(torch.get_rng_state(), rng_one)  # the draws after it (LoRA dropout) are one process's
    assert got.keys() == want.keys() and len(want) > 20
    assert set(got) == {n for n in meta.state_dict() if ".lora_" in n}  # the wrapped model's names
    for n, w in want.items():
        assert got[n].dtype == w.dtype and got[n].device.type == "cpu", n
        assert torch.equal(got[n], w), n  # bit for bit: peft's own draws and cast
    assert any(".lora_A." in n and got[n].abs().sum() > 0 for n in got)
    assert all(not got[n].any() for n in got if ".lora_B." in n)  # B starts at zero


def test_load_sharded_fills_a_lora_model_as_one_process(tmp_path):
    """One process, no sharding: a LoRA-wrapped meta model filled by ``load_sharded`` (base layers under their
    checkpoint names, adapters from ``extra``) equals ``load_model`` + ``apply_lora`` bit for bit; an adapter left out
    of ``extra``, one of another shape, or a name the model lacks is refused, named."""
    from kernels_torch.model import load_model
    from kernels_torch.parallel.load import load_sharded, to_empty
    from kimi.init import init_checkpoint
    from kimi_tools import lora

    cfg = load_config("tiny").truncated(4)
    init_checkpoint(tmp_path / "k", load_config("tiny"), seed=3, layers=4)
    settings = lora.LoraSettings(rank=2, alpha=4.0)
    torch.manual_seed(7)
    one = load_model(tmp_path / "k")
    lora.apply_lora(one, settings)

    def wrapped():
        torch.manual_seed(7)
        meta = _meta_model(cfg, torch.float32)
        init = lora.initial_adapters(meta, settings)
        lora.apply_lora(meta, settings)
        return to_empty(meta, "cpu"), init

    model, init = wrapped()
    load_sharded(model, tmp_path / "k", extra=init)
    want, got = one.state_dict(), model.state_dict()
    assert want.keys() == got.keys() and any(".base_layer." in k for k in got)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    a_name = next(n for n in init if ".lora_A." in n)
    for extra, match in (
        ({n: t for n, t in init.items() if n != a_name}, f"not in the checkpoint's layout: {a_name}"),
        ({**init, a_name: init[a_name][:1]}, rf"wrong shape: {a_name} \(extra \[1, "),
        ({**init, "model.layers.0.nope.lora_A.default.weight": init[a_name]}, "extra: model.layers.0.nope.lora_A"),
    ):
        model, _ = wrapped()
        with pytest.raises(ValueError, match=match):
            load_sharded(model, tmp_path / "k", extra=extra)


def _train_worker(rank: int, world: int, groups, kw: dict, phases: list[dict]) -> None:
    """Run the trainer once per phase (its extra arguments) as torchrun's rank ``rank`` of ``world``, each run in a
    group of its own (``groups.open()``; the trainer ends each run with a barrier and destroys its group, as a torchrun
    launch exits)."""
    torch.set_num_threads(1)
    from kimi_tools.train import TrainArgs, train

    for phase in phases:
        groups.open()
        train(TrainArgs(**kw, **phase))


def _records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.fixture(scope="module")
def lora_one(tmp_path_factory):
    """A 2-layer checkpoint and the one-process LoRA run on it (3 steps): the reference of every layout."""
    from kimi.init import init_checkpoint
    from kimi_tools.train import TrainArgs, train

    root = tmp_path_factory.mktemp("lora_one")
    init_checkpoint(root / "base", load_config("tiny"), seed=0, layers=2)
    train(TrainArgs(checkpoint=str(root / "base"), out=str(root / "one"), **RUN))
    return root / "base", root / "one"


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [{"ep": 2}, {"cp": 2}], ids=["dp2-ep2", "cp2"])
def test_sharded_lora_run_equals_one_process_and_resumes(tmp_path, lora_one, layout):
    base, one = lora_one
    out = tmp_path / "two"
    kw = dict(checkpoint=str(base), out=str(out), **RUN, **layout)
    spawn(_train_worker, 2, kw, [{"stop_after": 2}, {"resume": True}])
    want, got = _records(one), _records(out)
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            err = abs(got[step][key] - want[step][key]) / abs(want[step][key])
            assert err <= TOL[key], (step, key, got[step][key], want[step][key])
    for step in (0, 3):
        err = abs(got[step]["eval_loss"] - want[step]["eval_loss"]) / want[step]["eval_loss"]
        assert err <= TOL["eval_loss"], (step, got[step]["eval_loss"], want[step]["eval_loss"])
    a, b = load_file(out / "adapter_model.safetensors"), load_file(one / "adapter_model.safetensors")
    assert a.keys() == b.keys() and len(b) > 10
    for k in b:
        assert _rel(a[k], b[k]) <= TOL["adapter"], (k, _rel(a[k], b[k]))
    # the writer alone read the base for its fingerprint; the adapter records it as one process's does
    meta_a = json.loads((out / "adapter_config.json").read_text())
    assert meta_a["base_model_name_or_path"] == str(base)
    from kimi_tools import lora

    assert lora.adapter_base_fingerprint(out) == lora.adapter_base_fingerprint(one) == lora.base_fingerprint(base)
