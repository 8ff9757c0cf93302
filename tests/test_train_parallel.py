"""``kimi train`` under ``torchrun`` (2 gloo processes, FSDP2 + context parallelism, ``--cp 2``) equals one process:
the same losses, gradient norms and eval loss; its DCP ``step-N/`` folder resumes in one process (another world
size) and continues as the one-process run does; its safetensors export holds the same weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kimi_tools.cli import main
from kimi_tools.common import DEFAULT_TEXT

ROOT = Path(__file__).resolve().parents[1]
# weights: the export stores bf16, where fp32 differences of 1e-6 can flip a rounding (one bf16 step is 2^-8)
TOL = {"loss": 1e-5, "grad_norm": 1e-4, "eval_loss": 1e-5, "weights": 4e-3}
ARGV = (
    "--preset tiny --layers 4 --steps 3 --seq-len 40 --micro-batch-tokens 40 --batch-tokens 80 --eval-tokens 40 "
    "--eval-every 0 --warmup-steps 1 --lr 3e-3 --quiet --no-plot"
).split() + ["--data", str(DEFAULT_TEXT)]


def _records(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def _close(a, b, tol) -> bool:
    return abs(a - b) <= tol * abs(b)


@pytest.mark.distributed
@pytest.mark.slow
def test_torchrun_cp2_equals_one_process_and_resumes_on_one(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *ARGV, "--out", str(one)]) == 0
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "kimi_tools.cli", "train", *ARGV, "--cp", "2", "--stop-after", "2", "--out", str(two)]
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    want, got = _records(one), _records(two)
    for step in (1, 2):
        for key in ("loss", "grad_norm"):
            assert _close(got[step][key], want[step][key], TOL[key]), (step, key, got[step][key], want[step][key])
    assert _close(got[0]["eval_loss"], want[0]["eval_loss"], TOL["eval_loss"])
    a, b = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    assert a.keys() == b.keys()
    # the DCP folder of 2 ranks resumes in one process and reaches the one-process run's step 3
    assert main(["train", *ARGV, "--resume", "--out", str(two)]) == 0
    got = _records(two)
    assert _close(got[3]["loss"], want[3]["loss"], TOL["loss"]), (got[3], want[3])
    assert _close(got[3]["eval_loss"], want[3]["eval_loss"], TOL["eval_loss"])
    a, b = load_file(two / "model.safetensors"), load_file(one / "model.safetensors")
    for k in b:
        err = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-30))
        assert err <= TOL["weights"] or torch.equal(a[k], b[k]), (k, err)
