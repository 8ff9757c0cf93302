"""``kimi_tools.train.metrics``: reading ``metrics.jsonl`` back (torn lines skipped), several runs' eval losses side by
side (the FP8-against-bf16 check of ``benchmarks/plot_train_runs.py``), and their curves in one PNG."""

from __future__ import annotations

import json

import pytest

from kimi_tools.plots import figure_facts
from kimi_tools.train.metrics import compare_eval_losses, plot_runs, read_records, runs_figure


def _records(evals: dict[int, float], steps: int = 8, seed: float = 0.0) -> list[dict]:
    out = [{"step": 0, "loss": None, "eval_loss": evals.get(0)}]
    for s in range(1, steps + 1):
        out.append({"step": s, "loss": 5.0 - 0.3 * s + seed, "eval_loss": evals.get(s)})
    return out


def test_read_records_skips_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    recs = _records({0: 5.0, 4: 4.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 9, "loss"')
    assert read_records(path) == recs


def test_compare_eval_losses_relative_to_the_first_run():
    got = compare_eval_losses({"bf16": _records({0: 5.0, 8: 2.0}), "fp8": _records({0: 5.0, 4: 3.3, 8: 2.02})})
    assert got["baseline"] == "bf16" and got["shared_eval_steps"] == [0, 8]
    assert got["rel_diff_from_baseline"]["fp8"][0] == 0.0
    assert got["rel_diff_from_baseline"]["fp8"][8] == pytest.approx(0.01)
    assert got["eval_loss"]["fp8"] == {0: 5.0, 4: 3.3, 8: 2.02}


def test_compare_eval_losses_refuses_empty_input():
    with pytest.raises(ValueError, match="runs: got none"):
        compare_eval_losses({})
    with pytest.raises(ValueError, match=r"\['fp8'\] have no eval_loss"):
        compare_eval_losses({"bf16": _records({0: 5.0}), "fp8": _records({})})


def test_plot_runs_writes_one_png(tmp_path):
    out = tmp_path / "both.png"
    plot_runs(out, {"bf16": _records({0: 5.0, 8: 2.0}), "fp8": _records({0: 5.0, 8: 2.1}, seed=0.05)})
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["both.png"]  # written atomically: no temporary left
    with pytest.raises(ValueError, match="runs: got none"):
        plot_runs(tmp_path / "none.png", {})


def test_compare_eval_losses_with_a_zero_baseline():
    got = compare_eval_losses({"a": _records({0: 0.0, 8: 0.0}), "b": _records({0: 0.0, 8: 1.0})})
    assert got["rel_diff_from_baseline"]["b"] == {0: 0.0, 8: float("inf")}


def test_runs_figure_draws_every_run():
    bf16, fp8 = _records({0: 5.0, 4: 3.0, 8: 2.0}), _records({0: 5.0, 4: 3.1, 8: 2.1}, seed=0.05)
    (ax,) = figure_facts(runs_figure({"bf16": bf16, "fp8": fp8}))["axes"]
    lines = {line["label"]: line for line in ax["lines"]}
    assert ax["legend"] == ["bf16: train loss", "bf16: eval loss", "fp8: train loss", "fp8: eval loss"]
    assert lines["fp8: eval loss"]["x"] == [0, 4, 8] and lines["fp8: eval loss"]["y"] == [5.0, 3.1, 2.1]
    assert lines["bf16: train loss"]["y"] == [r["loss"] for r in bf16 if r["loss"] is not None]
