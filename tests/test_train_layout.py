"""What a run's layout may and may not change, and what ``kimi train`` says about it.

* The tokens per step default to one micro-batch per data-parallel group and pipeline stage, so the one-process
  command runs under any layout; an explicit ``--batch-tokens`` that does not deal is refused naming the world
  (``--pp`` included) and a value that works.
* A resume keeps the run's tokens per step (and, unless told, its micro-batch); the layout, ``--micro-batch-tokens``,
  ``--compile`` and ``--recompute`` may change. A one-process run resumes under a 2-rank gloo torchrun with another
  micro-batch and continues as the uninterrupted run; a ``--compile`` (aot_eager) run resumes without it.
* The stage-count refusals are true (the layout they offer runs), ``--pp-schedule`` / ``--pp-layout`` without ``--pp``
  are refused, ``run.json`` records each launch's layout, the header prints it under torchrun, a compiling run says
  so before its first step, and a resumed run's summary counts only its own tokens.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from test_train_parallel import TOL, _assert_same, _close, _records, _short_documents, _torchrun

from kimi.config import load_config
from kimi_tools.cli import main
from kimi_tools.common import DEFAULT_TEXT
from kimi_tools.train import TrainArgs
from kimi_tools.train.args import resolve

# aot_eager generates no code: the compiled blocks compute what eager does, bit for bit on the CPU
# (tests/test_compile.py); a resumed run's losses against the uninterrupted one's, same process kind
COMPILE_TOL = 1e-6


def _par(dp=1, cp=1, pp=1, schedule="1F1B", spr=1):
    """A :class:`TrainParallel` of one process with the sizes of a torchrun layout (no process group: the checks of
    the step's micro-batches and stages are pure arithmetic)."""
    from kimi_tools.train.parallel import TrainParallel

    par = TrainParallel(1, "cpu")
    par.dp_size, par.cp_size, par.pp_size, par.pp_schedule, par.stages_per_rank = dp, cp, pp, schedule, spr
    return par


@pytest.mark.parametrize(
    "dp, cp, pp, schedule, spr",
    [(1, 1, 1, "1F1B", 1), (2, 1, 1, "1F1B", 1), (2, 2, 1, "1F1B", 1), (1, 1, 2, "1F1B", 1), (2, 1, 2, "1F1B", 1),
     (1, 2, 2, "GPipe", 1), (1, 1, 2, "Interleaved1F1B", 2), (2, 1, 4, "Interleaved1F1B", 3)],
)  # fmt: skip
def test_the_default_tokens_per_step_deal_under_every_layout(dp, cp, pp, schedule, spr):
    """Without --batch-tokens a step is one micro-batch per dp group and per stage the schedule needs, which deals
    under any layout (before: one micro-batch, refused by every --dp > 1 and --pp > 1)."""
    from kimi_tools.train.args import default_batch_tokens

    par = _par(dp, cp, pp, schedule, spr)
    need = pp * spr if pp > 1 and schedule != "GPipe" else 1
    assert par.min_microbatches == dp * need
    batch = default_batch_tokens(64, par.min_microbatches)
    par.check_accum(batch // 64, 64, 64)  # no refusal
    assert par.n_microbatches == need


def test_a_step_that_cannot_be_dealt_names_the_world_and_a_way_that_works():
    """Under --pp the refusal names the whole world (pp x dp x cp; before: 'world 2' on 4 ranks) and each value it
    offers deals."""
    par = _par(dp=2, pp=2)
    with pytest.raises(ValueError) as e:
        par.check_accum(2, 64, 64)  # --batch-tokens 128 on pp 2 x dp 2: one micro-batch per group, 1F1B needs 2
    msg = str(e.value)
    assert msg.startswith(
        "--batch-tokens: 128 tokens per step = 2 micro-batches of --micro-batch-tokens 64, which cannot be dealt to "
        "the 2 data-parallel groups (--dp 2 of world 4 = --pp 2 x --dp 2 x --cp 1; --pp 2 --pp-schedule 1F1B runs 2 "
        "stages) at 2 or more each; expected "
    ), msg
    assert "no --batch-tokens (the default: 256)" in msg, msg
    # a resumed run keeps its tokens per step: the refusal offers a micro-batch, and that micro-batch deals
    with pytest.raises(ValueError) as e:
        par.check_accum(1, 512, 64, resumed=True)  # the run's 512 tokens in one micro-batch of 8 rows
    msg = str(e.value)
    assert "(the run's, kept on --resume)" in msg and "--batch-tokens 5" not in msg, msg
    micro = int(re.search(r"--micro-batch-tokens ([0-9,]+) \(the same tokens per step\)", msg)[1].replace(",", ""))
    assert micro == 128, msg  # the largest that deals: 4 micro-batches of 2 rows
    par.check_accum(512 // micro, micro, 64, resumed=True)
    with pytest.raises(ValueError, match=r"expected a layout that deals the step's 1 row\(s\) of 64 tokens"):
        _par(dp=2).check_accum(1, 64, 64, resumed=True)  # no micro-batch deals one row to 2 groups
    with pytest.raises(ValueError, match=r"under Interleaved1F1B: a multiple of n // 2 each\); expected --batch"):
        _par(pp=2, schedule="Interleaved1F1B", spr=2).check_accum(5, 64, 64)  # torch's rounds rule


def test_stage_count_refusals_are_true():
    """More stages than the default layout cuts: the refusal names --pp as typed (Interleaved1F1B: --pp 2 is 4
    stages, said so), and the --pp-layout it offers is one the model takes (before: 'expected at most 3 stages',
    though 0,4,4,1 runs; 'got 4' for a typed --pp 2)."""
    from kernels_torch.parallel.pipeline import parse_stage_layout, stage_layout

    tiny = load_config("tiny")  # 9 layers: AttnRes blocks of 4 -> 3 blocks
    cases = [
        (tiny, _par(pp=4), "--pp 4: 4 pipeline stages, but the model's 9 layers are 3 AttnRes blocks of 4 layers"),
        (tiny.truncated(3), _par(pp=2), "--pp 2: 2 pipeline stages, but the model's 3 layers are 1 AttnRes blocks"),
        (
            tiny.truncated(8),
            _par(pp=2, schedule="Interleaved1F1B", spr=2),
            "--pp 2: 4 pipeline stages (2 per rank under --pp-schedule Interleaved1F1B), but the model's 8 layers",
        ),
    ]
    messages = []
    for config, par, said in cases:
        par.pp_counts = None
        with pytest.raises(ValueError) as e:
            par._check_stage_count(config)
        msg = str(e.value)
        messages.append(msg)
        assert msg.startswith(said), msg
        offered = re.search(r"--pp-layout ([0-9,]+)", msg)
        assert offered, msg
        counts = parse_stage_layout(offered[1])
        assert len(counts) == par.pp_size * par.stages_per_rank
        stage_layout(config, len(counts), counts)  # the model takes it
    assert messages[0].endswith("expected --pp at most 3 or --pp-layout 0,4,4,1 (the embedding and / or the head "
                                "alone on a stage)"), messages[0]  # fmt: skip
    with pytest.raises(ValueError, match=r"expected at most 3 stages, or up to 5 with layer_counts putting 0 layers"):
        stage_layout(tiny, 4)  # the library's own message says what else fits


@pytest.mark.parametrize("flag, value", [("pp_schedule", "GPipe"), ("pp_layout", "4,5")])
def test_pipeline_flags_without_pp_are_refused(flag, value):
    """--pp-schedule / --pp-layout without --pp would be ignored (and recorded in run.json): refused in one line."""
    a = TrainArgs(out="o", data=[str(DEFAULT_TEXT)], **{flag: value})
    name = "--" + flag.replace("_", "-")
    with pytest.raises(ValueError, match=rf"^{name}: got '{value}' without --pp, expected --pp N > 1 too"):
        resolve(a)
    assert resolve(dataclasses.replace(a, pp=2)).pp_schedule == ("GPipe" if flag == "pp_schedule" else "1F1B")


def test_an_older_run_json_whose_fingerprint_counted_run_control_still_resumes(tmp_path):
    """A run.json written when --micro-batch-tokens and --compile were part of the fingerprint: its settings, less
    what is run control now, are today's, so the check passes; a real difference is still refused, with the way out
    for --batch-tokens."""
    from kimi_tools.train.args import fingerprint
    from kimi_tools.train.checkpoint import check_out

    a = resolve(TrainArgs(out=str(tmp_path), data=[str(DEFAULT_TEXT)], layers=1, batch_tokens=512, resume=True))
    cfg = load_config("tiny").truncated(1)
    fp, body = fingerprint(a, cfg)
    old_args = {**body["args"], "micro_batch_tokens": 256, "compile": True, "compile_backend": "aot_eager"}
    old = {"fingerprint": "sha-of-the-old-body", "fingerprint_of": {**body, "args": old_args}, "args": old_args}
    (tmp_path / "run.json").write_text(json.dumps(old))
    (tmp_path / "step-1").mkdir()
    (tmp_path / "step-1" / ".metadata").write_bytes(b"")
    check_out(a, fp, body)  # no refusal
    b = dataclasses.replace(a, batch_tokens=1024)
    with pytest.raises(ValueError) as e:
        check_out(b, *fingerprint(b, cfg))
    assert "--batch-tokens (run: 512, now: 1024)" in str(e.value), e.value
    assert str(e.value).endswith(
        "--batch-tokens is the run's tokens per step, which a resume keeps: leave it out (the run's value is taken) "
        "and deal it to another layout with --micro-batch-tokens"
    ), e.value


def test_a_compiled_run_resumes_without_compile_and_says_it_compiles(tmp_path, capsys):
    """--compile (aot_eager) for 2 steps, then --resume without it: the run continues as the uninterrupted eager run
    (losses within COMPILE_TOL); the compiling run said so before its first step; the resumed summary counts its
    own step's tokens (before: the whole run's over this launch's time); run.json records each launch."""
    argv = (
        "--preset tiny --layers 1 --steps 3 --seq-len 32 --eval-tokens 32 --eval-every 0 --warmup-steps 1 "
        "--lr 3e-3 --no-plot"
    ).split() + ["--data", str(DEFAULT_TEXT)]
    ref, run = tmp_path / "ref", tmp_path / "run"
    assert main(["train", *argv, "--quiet", "--out", str(ref)]) == 0
    capsys.readouterr()
    assert main(["train", *argv, "--out", str(run), "--stop-after", "2", "--compile", "--compile-backend",
                 "aot_eager"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "\n  compiling the decoder blocks (aot_eager) on their first forward" in out, out
    assert main(["train", *argv, "--out", str(run), "--resume"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"; 32 tokens in [0-9]+ s \(step 3; 96 in all\)\n", out), out
    want, got = _records(ref), _records(run)
    for step in (1, 2, 3):
        assert _close(got[step]["loss"], want[step]["loss"], COMPILE_TOL), (step, got[step], want[step])
    rec = json.loads((run / "run.json").read_text())
    assert rec["args"]["compile"] is False and [x["start_step"] for x in rec["launches"]] == [0, 2]
    assert rec["layout"] == {"world": 1, "dp": 1, "cp": 1, "ep": 1, "pp": 1, "pp_schedule": None, "pp_layout": None,
                             "microbatches_per_dp_group": 1, "backend": None, "fsdp2": False}  # fmt: skip


COMMON = (
    "--preset tiny --layers 2 --steps 3 --seq-len 40 --eval-tokens 40 --eval-every 0 --warmup-steps 1 --lr 3e-3 "
    "--no-plot"
).split()


@pytest.mark.distributed
def test_a_one_process_run_resumes_under_torchrun_on_another_layout(tmp_path):
    """A one-process run of 2 rows per step in one micro-batch stops at step 2 and resumes under a 2-rank gloo
    torchrun with --dp 2 (its tokens per step kept, dealt as one row per rank with --micro-batch-tokens 40): step 3
    equals the uninterrupted one-process run's (loss, gradient norm, eval loss), run.json records the new layout and
    both launches, and the header prints the layout (before: the refusal sent the user to --batch-tokens, which
    --resume then refused)."""
    data = _short_documents(tmp_path / "docs.jsonl")
    one, run = tmp_path / "one", tmp_path / "run"
    base = [*COMMON, "--micro-batch-tokens", "80", "--data", str(data)]
    assert main(["train", *base, "--quiet", "--out", str(one)]) == 0
    assert main(["train", *base, "--quiet", "--out", str(run), "--stop-after", "2"]) == 0
    r = _torchrun(2, [*COMMON, "--data", str(data), "--dp", "2", "--micro-batch-tokens", "40", "--resume", "--out",
                      str(run)])  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "\n  parallel: world 2 = dp 2 x cp 1 (gloo); 1 micro-batch per data-parallel group and step\n" in (
        r.stdout
    ), r.stdout
    want, got = _records(one), _records(run)
    _assert_same(got, want, (1, 2, 3))
    assert _close(got[3]["eval_loss"], want[3]["eval_loss"], TOL["eval_loss"])
    rec = json.loads((run / "run.json").read_text())
    assert rec["args"]["batch_tokens"] == 80 and rec["args"]["micro_batch_tokens"] == 40 and rec["args"]["dp"] == 2
    assert rec["layout"]["world"] == 2 and rec["layout"]["dp"] == 2 and rec["layout"]["backend"] == "gloo"
    assert [(x["start_step"], x["layout"]["dp"]) for x in rec["launches"]] == [(0, 1), (2, 2)]
    assert Path(run / "model.safetensors").is_file()
