"""``benchmarks/rank_rehearsal.py`` on the CPU: the rank of a planned layout, built by the trainer's code
(``TrainParallel.setup``) on torch's fake process group from the plan row's own ``kimi train`` command, runs its
stage's micro-batches and one optimizer step; its shards and optimizer states match the planner's bytes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kimi.config import load_config
from kimi_tools import plan as P

ROOT = Path(__file__).resolve().parent.parent
STATE_BYTES_RTOL = 0.0  # exact: the planner counts every shard and moment the rank holds (tiny preset, CPU)


def _bench():
    spec = importlib.util.spec_from_file_location("rank_rehearsal", ROOT / "benchmarks" / "rank_rehearsal.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rank_rehearsal_full_and_lora(tmp_path):
    """``main`` on the tiny preset at 4 planned GPUs (dp 4 x ep 4): full fine-tuning and LoRA each build the rank,
    run and step; the JSON holds the command it ran and the rank's shard bytes within
    :data:`STATE_BYTES_RTOL` of the planner's (no peak memory on the CPU)."""
    out = tmp_path / "r.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--clusters", "4", "--lora-gpus", "4", "--gpu-memory", "1"]
    mod = _bench()
    assert mod.available_host_gb() > 0  # the default --host-memory: 90% of it
    assert mod.main([*argv, "--host-memory", "250", "--seq-len", "64", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    for name, run in runs.items():
        assert run["status"] == "ok" and run["layout"]["world"] == 4, name
        assert ("--lora-rank" in run["command"]) == (name == "lora")
        assert run["experts_per_rank"] * run["layout"]["ep"] == load_config("tiny").num_experts
        for kind in ("params", "optimizer"):
            got, want = run["rank_bytes"][kind], run["predicted"][kind]
            assert abs(got - want) <= STATE_BYTES_RTOL * want, (name, kind, got, want)
        assert run["measured"]["peak_bytes"] is None and run["measured"]["ms_per_microbatch"] > 0


def _tiny_pp3_row() -> dict:
    """``kimi plan``'s row of the tiny preset on a pp 3 layout (whole layers recomputed, 64-token sequences, 4
    micro-batches), with its ``kimi train`` command."""
    row = P.evaluate(
        load_config("tiny"), P.Layout(pp=3, dp=1, cp=1, ep=1), P.Policy(recompute="full"), P.Hardware(),
        P.load_calibration(), seq_len=64, global_batch=256,
    )  # fmt: skip
    row["command"] = " ".join(P.train_command(row, preset="tiny", seq_len=64))
    return row


def test_rank_rehearsal_each_stage_of_a_pipeline():
    """``rehearse`` on every stage of a pp 3 tiny layout (the fake group's rank in that stage): the first stage takes
    token ids, the later ones a received state, the last ends with the loss; each compares its own stage's predicted
    compute (not the slowest stage's)."""
    mod = _bench()
    row = _tiny_pp3_row()
    per_stage = row["time"]["stage_compute_per_microbatch"]
    assert len(set(per_stage)) == 3  # the stages differ: a wrong stage's prediction shows
    for s in range(3):
        res = mod.rehearse("tiny", {**row, "worst_stage": s}, "cpu")
        assert res["stage"] == s and res["stage_layers"] == row["stages"][s]
        assert res["microbatches_in_flight"] == min(3 - s, row["microbatches"])
        assert res["predicted"]["compute_ms_per_microbatch"] == per_stage[s] * 1e3
        assert res["measured"]["ms_per_microbatch"] > 0


def test_rank_rehearsal_refuses_context_parallelism():
    """A layout with cp > 1 is refused in one line (its exchanges carry values the fake group cannot stand in for)."""
    row = {"layout": {"pp": 1, "dp": 2, "cp": 2, "ep": 1, "world": 4}}
    with pytest.raises(ValueError, match="cp 2: context parallelism is not rehearsed"):
        _bench().rehearse("tiny", row, "cpu")


def test_rank_rehearsal_refuses_two_stages_per_rank():
    """A V schedule's row (each rank holds two stages) is refused in one line: rehearsing one of them would
    understate the rank."""
    row = {"layout": {"pp": 2, "dp": 1, "cp": 1, "ep": 1, "world": 2}, "schedule": "DualPipeV"}
    with pytest.raises(ValueError, match=r"schedule DualPipeV: the rank holds stages \[0, 3\]"):
        _bench().rehearse("tiny", {**row, "worst_rank_stages": [0, 3], "worst_stage": 0}, "cpu")


def test_live_by_place_charges_blocks_to_the_projects_frames():
    """An out-of-memory row's breakdown: live blocks grouped by their innermost frame in the project's packages
    (else the innermost frame, else "unrecorded"), largest first; freed and inactive blocks left out."""
    mod = _bench()
    torch_frame = {"filename": "/venv/torch/nn/functional.py", "line": 7, "name": "linear"}
    moe = {"filename": "/root/repo/kernels_torch/moe.py", "line": 120, "name": "forward"}
    snap = {
        "segments": [
            {
                "blocks": [
                    {"size": 3_000_000_000, "state": "active_allocated", "frames": [torch_frame, moe]},
                    {"size": 1_000_000_000, "state": "active_allocated", "frames": [moe]},
                    {"size": 9_000_000_000, "state": "inactive", "frames": [moe]},
                ]
            },  # fmt: skip
            {
                "blocks": [
                    {"size": 2_000_000_000, "state": "active_allocated", "frames": [torch_frame]},
                    {"size": 500_000_000, "state": "active_allocated"},
                ]
            },  # fmt: skip
        ]
    }
    got = mod.live_by_place(snap)
    assert got == [
        {"place": "kernels_torch/moe.py:120 forward", "gb": 4.0, "blocks": 2},
        {"place": "/venv/torch/nn/functional.py:7 linear", "gb": 2.0, "blocks": 1},
        {"place": "unrecorded", "gb": 0.5, "blocks": 1},
    ]
    assert mod.live_by_place(snap, top=1) == got[:1]


def test_rank_rehearsal_names_each_layer_phase():
    """``progress["phase"]`` names the decoder layer as the rehearsal goes (an out-of-memory error then says where it
    came): each layer's forward and its backward, and the head, within the step that runs them."""
    mod = _bench()
    row = _tiny_pp3_row()

    class Log(dict):
        def __setitem__(self, key, value):
            if key == "phase":
                self.setdefault("seen", []).append(value)
            super().__setitem__(key, value)

    s = 2  # the last stage: its layers and the head
    progress = Log()
    mod.rehearse("tiny", {**row, "worst_stage": s}, "cpu", progress=progress)
    layers = range(*row["stages"][s])
    seen = progress["seen"]
    for i in layers:
        for phase in (f"forward 0 layer {i}", f"backward 0 backward layer {i}", f"timed backward layer {i}"):
            assert phase in seen, (phase, seen)
    assert "forward 0 head" in seen and seen.index("forward 0 head") > seen.index(f"forward 0 layer {layers[-1]}")
    assert seen[-1] == "optimizer"


def test_profile_tables_rank_operators_by_self_time():
    """The rehearsal's ``--profile`` tables: operators of a profiled run, the heaviest first, with their totals."""
    from torch.profiler import ProfilerActivity, profile

    mod = _bench()
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            (a @ b).relu()
    got = mod.profile_tables(prof, top=2)
    assert len(got["by_cpu"]) == 2 and got["by_cpu"][0]["self_cpu_ms"] >= got["by_cpu"][1]["self_cpu_ms"]
    assert {r["name"] for r in got["by_cpu"]} & {"aten::mm", "aten::matmul", "aten::relu", "aten::clamp_min"}
    assert got["self_cpu_ms_total"] >= sum(r["self_cpu_ms"] for r in got["by_cpu"])
    assert got["self_cuda_ms_total"] == 0.0


def test_choose_skips_rows_the_rehearsal_refuses(monkeypatch):
    """``choose`` takes the plan's best fitting row that ``rehearse`` runs: a row with context parallelism or a V
    schedule's (two stages per rank) is passed over for the next fitting one, not chosen and then refused."""
    mod = _bench()

    def row(name: str, cp: int, stages: list[int], fits: bool = True) -> dict:
        return {"name": name, "fits": fits, "layout": {"cp": cp}, "worst_rank_stages": stages}

    rows = [row("unfit", 1, [0], fits=False), row("cp2", 2, [0]), row("v", 1, [0, 3]), row("1f1b", 1, [1])]
    monkeypatch.setattr(mod.P, "run_plan", lambda args: (rows, []))
    assert mod.choose("tiny", 4, 64, None, 1.0)["name"] == "1f1b"
    monkeypatch.setattr(mod.P, "run_plan", lambda args: (rows[:3], []))
    assert mod.choose("tiny", 4, 64, None, 1.0) is None


def test_rank_rehearsal_holds_host_gradients_as_the_trainer_does(monkeypatch):
    """Under ``--offload cpu`` without a pipeline the trainer takes the host gradients out of ``.grad`` after each
    micro-batch's backward but the last (``kernels_torch.parallel.fsdp.HostGradSums``), so that FSDP2 copies each
    one the fast way: the rehearsal does so too (its timed micro-batch, a later one of the step, is compared with the
    planner's cost of that path), taking the in-flight and the timed micro-batch's gradients and giving them back
    before the optimizer step."""
    from kernels_torch.parallel import fsdp

    calls = []

    class Recording(fsdp.HostGradSums):
        def take(self):
            calls.append(("take", sum(p.grad is not None for p in self.params)))
            super().take()

        def give_back(self):
            calls.append(("give_back", len(self.held)))
            super().give_back()

    monkeypatch.setattr(fsdp, "HostGradSums", Recording)
    row = P.evaluate(
        load_config("tiny"), P.Layout(pp=1, dp=2, cp=1, ep=1), P.Policy(offload="cpu"), P.Hardware(),
        P.load_calibration(), seq_len=64, global_batch=256,
    )  # fmt: skip
    assert row["microbatches"] > 1
    row["command"] = " ".join(P.train_command(row, preset="tiny", seq_len=64))
    assert "--offload cpu" in row["command"]
    res = _bench().rehearse("tiny", row, "cpu")
    assert res["measured"]["ms_per_microbatch"] > 0
    assert [c[0] for c in calls] == ["take", "take", "give_back"], calls
    assert all(n > 0 for _, n in calls), calls  # gradients were there to take, and held
