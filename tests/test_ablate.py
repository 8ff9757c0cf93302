"""``kimi ablate``: grid parsing, one small grid on a 4-layer tiny checkpoint (rows, recall, layer-local errors that
change exactly where the override acts), re-runs that skip finished cells, and one-line CLI errors."""

from __future__ import annotations

import json

import pytest

import kimi_tools.ablate as ab
from kimi.config import load_config
from kimi.init import init_checkpoint
from kimi_tools.cli import main
from kimi_tools.common import CliError
from kimi_tools.distill import DENSE_TOPK
from kimi_tools.plots import figure_facts

FIELDS = {"index_topk", "gate_lower_bound", "num_experts"}


def test_parse_grid():
    cells = ab.parse_grid(["index_topk=8,dense", "gate_lower_bound=-5,none"], FIELDS)
    assert [ab.cell_key(c) for c in cells] == [
        "index_topk=8,gate_lower_bound=-5",
        "index_topk=8,gate_lower_bound=none",
        "index_topk=dense,gate_lower_bound=-5",
        "index_topk=dense,gate_lower_bound=none",
    ]
    assert cells[3] == {"index_topk": ("dense", DENSE_TOPK), "gate_lower_bound": ("none", None)}
    for bad, msg in [
        (["index_topk"], "expected key=v1"),
        (["nope=1"], "config fields"),
        (["index_top_k=1"], r"did you mean index_topk\?.*valid keys: gate_lower_bound, index_topk, num_experts\)"),
        (["index_topk="], "at least one value"),
        (["gate_lower_bound=dense"], "index_topk only"),
        (["index_topk=1", "index_topk=2"], "twice"),
    ]:
        with pytest.raises(CliError, match=msg):
            ab.parse_grid(bad, FIELDS)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    init_checkpoint(d, load_config("tiny"), seed=0, layers=4)  # KKKD: layer 3 is the DSA layer
    return d


def test_grid_rows_errors_and_skip(ckpt, tmp_path, monkeypatch, capsys):
    out = tmp_path / "abl"
    rows = ab.run_grid(ckpt, ["index_topk=8,dense"], out, tokens=48, seq_len=48, quiet=True)
    assert [r["cell"] for r in rows] == ["(unchanged)", "index_topk=8", "index_topk=dense"]
    base, small, dense = rows
    assert all(base[f"attn_rel.{i}"] == 0.0 for i in range(4)) and base["logits_rel"] == 0.0
    assert dense["indexer_recall"] == pytest.approx(1.0)  # every visible key selected
    assert 0.0 < small["indexer_recall"] < 1.0
    # T = 48 <= the preset's top-64: the checkpoint is already dense, so 'dense' changes nothing anywhere ...
    assert all(dense[f"attn_rel.{i}"] == 0.0 for i in range(4)) and dense["logits_rel"] == 0.0
    # ... while top-8 changes the DSA layer's attention only (layer-local rows)
    assert small["attn_rel.3"] > 1e-3 and all(small[f"attn_rel.{i}"] == 0.0 for i in range(3))
    for name in ("ablate.csv", "ablate.json", "ablate.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "ablate.csv").read_text().count("\n") == 4
    # the PNG draws these rows: the loss panel's markers are the cells' eval losses, its dashed line the baseline
    loss_ax = figure_facts(ab.ablate_figure(rows))["axes"][0]
    assert loss_ax["lines"][0]["y"] == [small["eval_loss"], dense["eval_loss"]]
    assert loss_ax["lines"][1]["y"] == [base["eval_loss"], base["eval_loss"]]
    # a re-run with one more value computes only the new cell
    built = []
    orig = ab._build
    monkeypatch.setattr(ab, "_build", lambda cfg, *a: built.append(cfg.index_topk) or orig(cfg, *a))
    capsys.readouterr()
    rows = ab.run_grid(ckpt, ["index_topk=8,dense,16"], out, tokens=48, seq_len=48, quiet=False)
    assert built == [16] and len(rows) == 4
    assert "3 of 4 cells already in" in capsys.readouterr().err  # the user is told which cells were skipped
    assert json.loads((out / "ablate.json").read_text())[3]["cell"] == "index_topk=16"


def test_cli_errors_are_one_line(ckpt, tmp_path, capsys):
    assert main(["ablate", "--checkpoint", str(ckpt), "--out", str(tmp_path), "--set", "index_topk=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kimi: error:") and "index_topk" in err[0]
    assert main(["ablate", "--checkpoint", str(ckpt), "--out", str(tmp_path)]) == 2
    assert "--set" in capsys.readouterr().err


def _row(cell, loss, recall=None, attn=(), resid=(), logits=None):
    r = {
        "cell": cell,
        "mode": "eval",
        "text": "alice_ch1.txt",
        "tokens": 48,
        "eval_loss": loss,
        "indexer_recall": recall,
    }
    for i, (a, b) in enumerate(zip(attn, resid)):
        r[f"attn_rel.{i}"], r[f"residual_rel.{i}"] = a, b
    if logits is not None:
        r["logits_rel"] = logits
    return r


def test_ablate_figure_draws_the_grid_as_a_grid():
    """A 2 x 3 grid whose losses differ by 0.007 (as on a real checkpoint): one marker series per value of the first
    key (legend) over the second key's values (x), the loss axis zoomed to the data (not from 0) with the unchanged
    model as a dashed line, a value label per marker, and the per-layer errors as cells x layers with exact zeros
    drawn as '0' (masked on the log colour scale), not as a small number."""
    losses = {("8", "-5"): 2.5686, ("8", "none"): 2.5701, ("8", "-2"): 2.5756,
              ("dense", "-5"): 2.5690, ("dense", "none"): 2.5712, ("dense", "-2"): 2.5731}  # fmt: skip
    rows = [_row("(unchanged)", 2.5700, 0.9, (0.0, 0.0), (0.0, 0.0), 0.0)]
    for (k, g), loss in losses.items():
        rows.append(_row(f"index_topk={k},gate_lower_bound={g}", loss, 1.0 if k == "dense" else 0.5,
                         (0.0 if g == "-5" else 0.3, 0.02), (0.0, 0.01), 0.04))  # fmt: skip
    facts = figure_facts(ab.ablate_figure(rows))
    loss_ax, recall_ax, attn_ax, resid_ax = (a for a in facts["axes"] if a["ylabel"] != "relative error (log scale)")
    assert loss_ax["xlabel"] == "gate_lower_bound" and loss_ax["xticklabels"] == ["-5", "none", "-2"]
    assert loss_ax["legend"][:2] == ["index_topk=8", "index_topk=dense"]
    series = [ln for ln in loss_ax["lines"] if ln["label"].startswith("index_topk")]
    assert [ln["y"] for ln in series] == [[2.5686, 2.5701, 2.5756], [2.5690, 2.5712, 2.5731]]
    baseline = [ln for ln in loss_ax["lines"] if ln["label"].startswith("unchanged model")]
    assert len(baseline) == 1 and baseline[0]["y"] == [2.57, 2.57] and baseline[0]["linestyle"] == "--"
    lo, hi = loss_ax["ylim"]
    assert 2.55 < lo < 2.5686 and 2.5756 < hi < 2.59  # zoomed: the 0.007 spread fills the panel
    assert {"2.5686", "2.5756", "2.5712"} <= set(loss_ax["texts"])  # value labels
    assert recall_ax["ylim"][0] == 0.0 and [ln["y"] for ln in recall_ax["lines"][:2]] == [[0.5] * 3, [1.0] * 3]
    attn = attn_ax["images"][0]["values"]  # rows = the six cells, columns = layers 0, 1
    assert attn_ax["yticklabels"][0] == "index_topk=8,gate_lower_bound=-5" and attn_ax["xticklabels"] == ["0", "1"]
    assert attn[0] == [None, 0.02] and attn[1] == [0.3, 0.02]  # exact zero: masked (grey), not a 1e-9 value
    assert attn_ax["texts"][:4] == ["0", "2.0e-02", "3.0e-01", "2.0e-02"]
    assert resid_ax["xticklabels"] == ["0", "1", "logits"] and resid_ax["images"][0]["values"][0] == [None, 0.01, 0.04]


def test_run_grid_leaves_the_pyplot_backend_alone(ckpt, tmp_path):
    """The PNG is rendered without pyplot: a notebook's inline backend survives ``run_grid``."""
    import matplotlib

    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        ab.run_grid(ckpt, ["gate_lower_bound=-3"], tmp_path, tokens=16, seq_len=16, quiet=True)
        assert matplotlib.get_backend() == "svg" and (tmp_path / "ablate.png").stat().st_size > 0
    finally:
        matplotlib.use(before)


def test_rerun_refuses_rows_of_another_checkpoint_or_token_count(ckpt, tmp_path, capsys):
    """A folder's rows are keyed by everything that changes their numbers besides the cell's overrides: a re-run on
    another checkpoint (same shapes, other weights) or with another ``--tokens`` is refused in one line naming the
    field, instead of reporting the first checkpoint's losses as the second's or appending duplicate cells;
    ``--restart`` starts over."""
    other = tmp_path / "other"
    init_checkpoint(other, load_config("tiny"), seed=1, layers=4)
    out = tmp_path / "abl"
    first = ab.run_grid(ckpt, ["gate_lower_bound=-3"], out, tokens=16, seq_len=16, quiet=True)
    assert {r["tokens"] for r in first} == {16} and len({r["checkpoint"] for r in first}) == 1
    with pytest.raises(CliError, match=r"--out: .*another setting \(checkpoint \(abl: 'sha256:.*--restart"):
        ab.run_grid(other, ["gate_lower_bound=-3"], out, tokens=16, seq_len=16, quiet=True)
    with pytest.raises(CliError, match=r"another setting \(text_sha256 .*; tokens \(abl: 16, now: 24\)"):
        ab.run_grid(ckpt, ["gate_lower_bound=-3"], out, tokens=24, seq_len=16, quiet=True)
    assert json.loads((out / "ablate.json").read_text()) == first  # nothing appended
    # the same setting again: every cell skipped, the same rows
    assert ab.run_grid(ckpt, ["gate_lower_bound=-3"], out, tokens=16, seq_len=16, quiet=True) == first
    # --restart: the other checkpoint's own numbers, one row per cell
    rows = ab.run_grid(other, ["gate_lower_bound=-3"], out, tokens=16, seq_len=16, quiet=True, restart=True)
    assert [r["cell"] for r in rows] == [r["cell"] for r in first]
    assert rows[0]["checkpoint"] != first[0]["checkpoint"] and rows[0]["eval_loss"] != first[0]["eval_loss"]
    # the CLI: one line
    argv = ["ablate", "--checkpoint", str(ckpt), "--out", str(out), "--set", "gate_lower_bound=-3", "--tokens", "16"]
    assert main([*argv, "--seq-len", "16", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint (abl: 'sha256:" in err[0] and "--restart" in err[0]
