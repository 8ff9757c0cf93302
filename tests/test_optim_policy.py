"""``kimi train --optimizer adamw-fp32|adamw-bf16`` and ``--offload none|cpu``: the optimizer and FSDP2 policies
that ``kimi plan`` picks, runnable.

- ``adamw-bf16`` (torchao's AdamW with bf16 stochastic rounding: bf16 weights, gradients and moments, no fp32
  masters) stays within a derived bound of fp32 AdamW over 20 steps on the tiny preset, and the same bound refuses
  torchao's AdamW with round-to-nearest (:func:`test_adamw_bf16_within_a_derived_bound_of_fp32_adamw`).
- ``--offload cpu`` (FSDP2's ``CPUOffloadPolicy``) at dp 2, several micro-batches per rank, gives the run without
  offload bit for bit, across a save and resume.
- ``adamw-bf16`` under torchrun with dp 2, ep 2, pp 2, cp 2 and LoRA (with and without offload) gives the
  one-process ``adamw-bf16`` run within bf16's tolerance; its resume state holds bf16 weights and moments (no fp32
  master) and resumes on another layout.
- Bad combinations are refused in one line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from test_train_parallel import BF16_TOL, _close, _records, _short_documents, _torchrun

from kimi_tools.cli import main
from kimi_tools.common import DEFAULT_TEXT

COMMON = (
    "--preset tiny --layers 4 --steps 3 --seq-len 40 --micro-batch-tokens 40 --batch-tokens 80 --eval-tokens 40 "
    "--eval-every 0 --warmup-steps 1 --lr 3e-3 --quiet --no-plot"
).split()
BF16 = ["--dtype", "bfloat16", "--optimizer", "adamw-bf16"]
# adamw-bf16 on another layout draws other rounding bits (each rank rounds its own shards): after the first update
# the runs are two draws. Three draws in one process (8 layers, lr 3e-3, step 3) spread the loss over 1.5% (5.693 to
# 5.778) and the eval loss over 0.2% (5.850 to 5.861; fp32 AdamW: 5.925); allowed: twice the spread
SR_TOL = 0.03


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _short_documents(tmp_path_factory.mktemp("data") / "docs.jsonl")


def _cli(argv, capsys):
    rc = main(["train", *argv])
    return rc, capsys.readouterr().err.strip().splitlines()


# ---------------------------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            ["--optimizer", "adamw-bf16"],
            "--optimizer adamw-bf16: got --dtype float32, expected --dtype bfloat16",
        ),
        (["--offload", "cpu"], "--offload cpu: given in one process, expected a launch under torchrun"),
    ],
    ids=["bf16-states-fp32-weights", "offload-one-process"],
)
def test_policies_refused_in_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "out"
    argv = ["--layers", "2", "--steps", "2", "--seq-len", "16", "--quiet", "--data", str(DEFAULT_TEXT)]
    rc, err = _cli([*argv, "--out", str(out), *extra], capsys)
    assert rc == 2 and len(err) == 1 and err[0].startswith("kimi: error: ") and message in err[0], err
    assert not out.exists()


def test_adamw_bf16_without_torchao_refused_before_the_model(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else find_spec(name, *a)
    )
    out = tmp_path / "out"
    argv = ["--layers", "2", "--steps", "2", "--seq-len", "16", "--quiet", "--data", str(DEFAULT_TEXT)]
    rc, err = _cli([*argv, "--dtype", "bfloat16", "--optimizer", "adamw-bf16", "--out", str(out)], capsys)
    assert rc == 2 and len(err) == 1 and "--optimizer adamw-bf16: needs torchao" in err[0], err
    assert not out.exists()


def test_fingerprint_keeps_runs_written_before_the_optimizer_flag():
    """The default ``adamw-fp32`` is left out of the fingerprint (a run written before the flag existed resumes);
    ``adamw-bf16`` is in it (other numbers); ``--offload`` is run control (a run resumes with or without it)."""
    from kimi.config import load_config
    from kimi_tools.train.args import TrainArgs, fingerprint, resolve, run_control_fields

    cfg = load_config("tiny")
    base = resolve(TrainArgs(out="x", data=["d"], dtype="bfloat16"))
    h0, body = fingerprint(base, cfg)
    assert "optimizer" not in body["args"] and "offload" not in body["args"]
    h1, body1 = fingerprint(resolve(TrainArgs(out="x", data=["d"], dtype="bfloat16", optimizer="adamw-bf16")), cfg)
    assert body1["args"]["optimizer"] == "adamw-bf16" and h1 != h0
    assert "offload" in run_control_fields()


def test_master_weights_and_optimizer_of_each_policy():
    """``adamw-bf16``: every trainable parameter is its own master (bf16 and the fp32 ones alike), but a parameter
    a layout keeps whole on every rank keeps an fp32 master; torchao's AdamW keeps bf16 moments for bf16 weights
    and fp32 ones for fp32 weights, steps every parameter, and its state round-trips through
    ``OptimizerState`` (DCP's flattened form). ``adamw-fp32``: fp32 masters of the bf16 parameters, torch's
    AdamW."""
    from kimi_tools.train.args import TrainArgs, resolve
    from kimi_tools.train.weights import MasterWeights, OptimizerState, build_optimizer, step_optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 8))
    model[0].to(torch.bfloat16)
    model[2].to(torch.bfloat16)  # the LayerNorm stays fp32, as A_log and dt_bias do in the checkpoint
    a = resolve(TrainArgs(out="x", data=["d"], dtype="bfloat16", optimizer="adamw-bf16", lr=1e-2))
    mw = MasterWeights(model, low_precision=True)
    assert mw.module is model and all(p is m for p, m in mw.pairs)
    whole = MasterWeights(model, low_precision=True, replicated=[model[2].weight])
    copied = [n for n, (p, m) in zip(whole.names, whole.pairs) if p is not m]
    assert copied == ["2.weight"] and whole.state_dict()["2.weight"].dtype == torch.float32
    opt = build_optimizer(mw, a)
    assert type(opt).__module__.startswith("torchao.optim")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(4, 16)
    model[2](model[1](model[0](x.bfloat16()).float()).bfloat16()).float().square().mean().backward()
    step_optimizer(opt, a, step=1)
    for n, p in model.named_parameters():
        s = opt.state[p]
        assert s["exp_avg"].dtype == s["exp_avg_sq"].dtype == p.dtype, n
        assert not torch.equal(p, before[n]), n  # every parameter moved
    state = OptimizerState(mw.module, opt)
    sd = state.state_dict()
    assert sd["state.0.weight.exp_avg"].dtype == torch.bfloat16
    assert sd["state.1.weight.exp_avg"].dtype == torch.float32
    state.load_state_dict(sd)
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # torchao's lr stays a tensor the schedule fills
    fp32 = resolve(TrainArgs(out="x", data=["d"], dtype="bfloat16"))
    masters = MasterWeights(model)
    assert masters.module is not model and all(m.dtype == torch.float32 for m in masters.masters)
    assert type(build_optimizer(masters, fp32)) is torch.optim.AdamW


def test_offload_materialise_moves_only_what_fsdp2_leaves():
    """Under ``--offload cpu`` on a device the model is materialised on the host (FSDP2 wants its shards there) and
    ``_plain_to`` then moves the tensors FSDP2 does not manage, the plain parameters and the buffers, to the device,
    each parameter keeping its object (the trainer holds references to them). ``meta`` stands in for the device."""
    from kimi_tools.train.weights import _plain_to

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    params = list(model.parameters())
    _plain_to(model, "meta")
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert all(p.is_meta for p in model.parameters()) and all(b.is_meta for b in model.buffers())


# ---------------------------------------------------------------------------------------------- the bound


def _bound_run(tmp_path: Path, name: str, optimizer: str, steps: int, lr: float):
    """A one-process run of the tiny preset (4 layers, bf16 compute, constant lr, no clipping): its eval losses
    at step 0 and ``steps``, and the trainer (its final model)."""
    from kimi_tools.train.args import TrainArgs
    from kimi_tools.train.trainer import Trainer

    a = TrainArgs(
        out=str(tmp_path / name), data=[str(DEFAULT_TEXT)], preset="tiny", layers=4, steps=steps, seq_len=64,
        eval_tokens=256, eval_every=0, lr=lr, warmup_steps=0, min_lr_ratio=1.0, grad_clip=0.0, dtype="bfloat16",
        optimizer=optimizer, save=False, plot=False, quiet=True,
    )  # fmt: skip
    trainer = Trainer(a)
    result = trainer.run()
    return result.eval_losses[0], result.eval_losses[steps], result.records, trainer


def _grad_times_spacing(trainer) -> float:
    """``||g * u||_2`` at the trainer's final weights: ``g`` the gradient of the eval loss (the mean over the eval
    targets), ``u`` each weight's spacing in its own dtype (bf16: ``2^(floor(log2|w|) - 7)``; fp32: ``- 23``)."""
    model, stage, evals = trainer.model, trainer.stage, trainer.evals
    model.zero_grad(set_to_none=True)
    n = sum(b.num_targets for b in evals)
    for b in evals:
        loss, _ = stage.loss(model, b)
        (loss * (b.num_targets / n)).backward()
    sq = 0.0
    for p in model.parameters():
        if p.grad is None:
            continue
        mant = 7 if p.dtype == torch.bfloat16 else 23
        w = p.detach().double()
        u = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(1e-30))) - mant)
        sq += float((p.grad.double() * u).square().sum())
    return math.sqrt(sq)


@pytest.mark.slow
def test_adamw_bf16_within_a_derived_bound_of_fp32_adamw(tmp_path, monkeypatch):
    """20 steps of the tiny preset (4 layers, 64-token rows, bf16 compute, lr 3e-4 constant, no clipping): the eval
    loss of ``adamw-bf16`` (B) against ``adamw-fp32`` (A: fp32 masters and moments, the model's bf16 weights the
    masters rounded to nearest) is within

        |E_B(n) - E_A(n)| <= z * sqrt((n + 1) / 4) * ||g * u||_2 + eps * |E_A(0) - E_A(n)|,   z = 4, n = 20,

    derived as follows. Both runs start from the same bf16 weights, see the same rows and compute in bf16, so step 1
    is the same step (its loss is checked equal); they differ only in how the optimizer stores what it computes.
    Let ``u`` be a weight's bf16 spacing (``u <= 2^-7 |w|``).

    1. Stochastic rounding (B): each step writes the fp32 result rounded up with probability equal to its fraction
       of ``u``, an error ``e`` with ``|e| < u``, ``E[e] = 0``, ``Var[e] <= u^2 / 4``; over n independent steps the
       weight's drift from exact arithmetic has variance at most ``n u^2 / 4`` (a random walk: ``sqrt(n) 2^-8 |w|``
       at most in standard deviation).
    2. A's bf16 weights are its masters rounded to nearest: ``|e| <= u / 2``, variance at most ``u^2 / 4``; at
       lr 3e-4 a step moves a weight of 0.02 by about 2.5 ``u``, so where a master lies between two bf16 values is
       spread over the interval and this error is taken as zero-mean too.
    3. To first order the eval loss moves by ``g . dw`` (``g`` its gradient at A's final weights): independent
       zero-mean ``dw_i`` give a standard deviation of at most ``sqrt((n + 1) / 4) ||g * u||_2``; z = 4 deviations.
    4. B rounds its moments to nearest in bf16 each step (relative error ``<= 2^-9``); an EMA with factor beta
       carries a stored error on with weight beta, so m's relative error is ``<= 2^-9 / (1 - beta1)`` and v's
       ``<= 2^-9 / (1 - beta2)``, the update ``m / sqrt(v)``'s ``<= eps = 2^-9 / (1 - beta1) + 2^-10 / (1 - beta2)``
       (0.039 at 0.9 and 0.95). Coherently, the loss change the updates made, ``|E_A(0) - E_A(n)|``, is off by at
       most that fraction of itself.

    Left out: second-order terms and the feedback of a changed weight on later gradients (small over 20 steps at
    this lr). Measured on the CPU: B - A = +0.016 against a bound of 0.091 (0.030 from 1-3, 0.061 from 4). The same
    bound refuses torchao's AdamW with round-to-nearest (C: updates below half a spacing are lost; +0.278, checked
    here) and a wrong lr (x1.25: -0.196, x0.8: +0.278, checked by hand)."""
    import kimi_tools.train.weights as weights

    n, lr, z = 20, 3e-4, 4.0
    e0, ea, rec_a, tr_a = _bound_run(tmp_path, "a", "adamw-fp32", n, lr)
    _, eb, rec_b, _ = _bound_run(tmp_path, "b", "adamw-bf16", n, lr)
    assert rec_b[1]["loss"] == rec_a[1]["loss"]  # the same first step
    gu = _grad_times_spacing(tr_a)
    eps = 2**-9 / (1 - 0.9) + 2**-10 / (1 - 0.95)  # --beta1 / --beta2 defaults
    bound = z * math.sqrt((n + 1) / 4) * gu + eps * abs(e0 - ea)
    assert abs(eb - ea) <= bound, (eb, ea, bound, gu)

    cls = weights._torchao_adamw()  # the wrong optimizer: the same class rounding to nearest
    monkeypatch.setattr(
        weights, "_torchao_adamw", lambda: lambda *a, **kw: cls(*a, **{**kw, "bf16_stochastic_round": False})
    )
    _, ec, _, _ = _bound_run(tmp_path, "c", "adamw-bf16", n, lr)
    assert abs(ec - ea) > bound, (ec, ea, bound)


# ---------------------------------------------------------------------------------------------- under torchrun


def _dcp_dtypes(step_dir: Path) -> dict[str, torch.dtype]:
    """The dtype of every tensor of a ``step-N/`` resume state, by its flat key."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return {k: v.properties.dtype for k, v in meta.items() if hasattr(v, "properties")}


def _policy_worker(rank: int, world: int, groups, out: str) -> None:
    """One rank of :func:`test_policies_reach_fsdp2`: the trainer built under a torchrun environment, each policy."""

    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    from kimi_tools.train.args import TrainArgs
    from kimi_tools.train.trainer import Trainer

    torch.set_num_threads(1)
    groups.open()
    try:
        for optimizer, offload, ep in (("adamw-bf16", "cpu", 2), ("adamw-fp32", "none", 1)):
            a = TrainArgs(
                out=f"{out}/{optimizer}", data=[str(DEFAULT_TEXT)], layers=2, seq_len=16, batch_tokens=32, dtype="bfloat16",
                optimizer=optimizer, offload=offload, ep=ep, quiet=True,
            )  # fmt: skip
            tr = Trainer(a)
            units = [m for m in tr.model.modules() if isinstance(m, FSDPModule)]
            assert len(units) >= 3 + (ep > 1), len(units)  # the layers, the root (and the experts)
            for m in units:
                policy = m._get_fsdp_state()._fsdp_param_group.offload_policy
                assert isinstance(policy, CPUOffloadPolicy) == (offload == "cpu"), (m, policy)
            sharded = [p for p in tr.model.parameters() if isinstance(p, DTensor) and p.requires_grad]
            whole = [p for p in tr.model.parameters() if not isinstance(p, DTensor) and p.requires_grad]
            assert sharded and whole  # the checkpoint's fp32 tensors stay whole (FSDP2 ignores them)
            want = torch.bfloat16 if optimizer == "adamw-bf16" else torch.float32  # no fp32 masters under bf16
            assert {p.dtype for p in sharded} == {want}, {p.dtype for p in sharded}
            assert {p.dtype for p in whole} == {torch.float32}
            assert tr.masters.module is tr.model  # every trainable parameter its own master
            is_ao = type(tr.optimizer).__module__.startswith("torchao.optim")
            assert is_ao == (optimizer == "adamw-bf16"), type(tr.optimizer)
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


@pytest.mark.distributed
@pytest.mark.slow
def test_policies_reach_fsdp2(tmp_path):
    """On 2 gloo ranks: ``--offload cpu`` puts FSDP2's ``CPUOffloadPolicy`` on every unit (the layers, the root, the
    expert-parallel experts); ``--optimizer adamw-bf16`` keeps the sharded trainable parameters bf16 (no fp32
    master) and builds torchao's AdamW, ``adamw-fp32`` upcasts them to fp32 masters (torch's AdamW); the checkpoint's
    fp32 tensors stay whole and fp32 either way."""
    from helpers import spawn

    spawn(_policy_worker, 2, str(tmp_path))


@pytest.mark.distributed
@pytest.mark.slow
def test_offload_cpu_at_dp2_equals_no_offload_and_resumes(tmp_path, data):
    """dp 2 with ``--offload cpu`` (the shards, gradients and AdamW state on the host; on gloo, a CPU run, the
    offload is a copy) gives the run without offload bit for bit: losses, gradient norms, eval losses and the
    export. A resume state saved without offload resumes into offloaded shards and reaches the same step 3. Three
    micro-batches per rank and step: under offload the trainer sums the host gradients outside ``.grad`` between
    them (``kernels_torch.parallel.fsdp.HostGradSums``), bit for bit FSDP2's own accumulation."""
    base = [*COMMON, "--batch-tokens", "240", "--data", str(data)]
    off, ref = tmp_path / "off", tmp_path / "ref"
    r = _torchrun(2, [*base, "--offload", "cpu", "--out", str(off)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(2, [*base, "--stop-after", "2", "--out", str(ref)])
    assert r.returncode == 0, r.stderr[-3000:]
    r = _torchrun(2, [*base, "--offload", "cpu", "--resume", "--out", str(ref)])
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _records(off), _records(ref)
    assert sorted(got) == sorted(want) == [0, 1, 2, 3]
    for step in got:
        for key in ("loss", "grad_norm", "eval_loss", "lr"):
            assert got[step][key] == want[step][key], (step, key, got[step][key], want[step][key])
    assert (off / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert json.loads((off / "run.json").read_text())["args"]["offload"] == "cpu"


# (the model's flags, shared with the one-process reference; the layout's flags)
VARIANTS = {
    "dp2": ([], []),
    "ep2_offload": ([], ["--ep", "2", "--offload", "cpu"]),
    "lora_cp2_offload": (["--lora-rank", "4"], ["--cp", "2", "--offload", "cpu"]),
    "pp2_offload": (["--layers", "8"], ["--pp", "2", "--offload", "cpu"]),  # two AttnRes blocks of 4: one a stage
    "one_rank": ([], []),  # torchrun with one process: no FSDP2 (it would only copy), the model as in one process
}
NPROC = {"one_rank": 1}  # processes per variant (default 2)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_adamw_bf16_under_torchrun(tmp_path, data, variant):
    """``--optimizer adamw-bf16`` on 2 ranks (dp 2; ep 2; LoRA at cp 2; pp 2; the last three with ``--offload
    cpu``) and on one rank (torchrun, no FSDP2: ``run.json``'s ``layout.fsdp2``) against the one-process
    ``adamw-bf16`` run: step 1 (before any rounding draw) within bf16's tolerance
    (``BF16_TOL``), the later losses and the eval loss within the spread of the draws (``SR_TOL``). The resume state holds
    the sharded trainable weights in bf16 (no fp32 master: FSDP2 kept them bf16) with bf16 moments, the checkpoint's
    fp32 tensors in fp32 with fp32 moments; ``run.json`` records the policies. dp 2 and one rank: stopped at step 2,
    each resumes in one process (another layout) and reaches the one-process step 3."""
    model_flags, layout = VARIANTS[variant]
    model_flags = [*COMMON, *BF16, *model_flags, "--data", str(data)]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *model_flags, "--out", str(one)]) == 0
    stop = ["--stop-after", "2"] if variant in ("dp2", "one_rank") else []
    r = _torchrun(NPROC.get(variant, 2), [*model_flags, *layout, *stop, "--out", str(two)])
    assert r.returncode == 0, r.stderr[-3000:]
    saved = two / ("step-2" if stop else "step-3")
    dtypes = _dcp_dtypes(saved)
    weights = {k.removeprefix("weights."): d for k, d in dtypes.items() if k.startswith("weights.")}
    bf16_weights = [n for n, d in weights.items() if d == torch.bfloat16]
    fp32_weights = [n for n, d in weights.items() if d == torch.float32]
    assert len(bf16_weights) > 20 and len(bf16_weights) + len(fp32_weights) == len(weights), weights
    if "--lora-rank" in model_flags:  # the adapters alone train
        assert all(".lora_" in n for n in weights), weights
    for names, dtype in ((bf16_weights, torch.bfloat16), (fp32_weights, torch.float32)):
        for n in names:
            for moment in ("exp_avg", "exp_avg_sq"):
                key = f"optimizer.state.{n}.{moment}"
                assert dtypes.get(key, dtype) == dtype, (key, dtypes.get(key))
    run = json.loads((two / "run.json").read_text())
    args = run["args"]
    assert (args["optimizer"], args["offload"]) == ("adamw-bf16", "cpu" if "--offload" in layout else "none")
    assert run["layout"]["fsdp2"] == (variant != "one_rank"), run["layout"]
    if stop:  # the dp 2 resume state in one process
        assert main(["train", *model_flags, "--resume", "--out", str(two)]) == 0
    want, got = _records(one), _records(two)
    # step 1 is before any rounding draw: bf16's tolerance of another layout
    assert _close(got[1]["loss"], want[1]["loss"], BF16_TOL["loss"]), (got[1], want[1])
    assert _close(got[1]["grad_norm"], want[1]["grad_norm"], BF16_TOL["grad_norm"]), (got[1], want[1])
    for step in (2, 3):  # the gradient norm moves with the draws (step 3, 4 layers: 5.76 to 6.33), so not compared
        assert _close(got[step]["loss"], want[step]["loss"], SR_TOL), (step, got[step], want[step])
        assert math.isfinite(got[step]["grad_norm"])
    assert _close(got[3]["eval_loss"], want[3]["eval_loss"], SR_TOL), (got[3], want[3])
    assert got[3]["loss"] < got[1]["loss"]  # it trains
