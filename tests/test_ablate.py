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
    assert [r["cell"] for r in rows] == ["index_topk=8", "index_topk=dense"]
    small, dense = rows
    assert dense["indexer_recall"] == pytest.approx(1.0)  # every visible key selected
    assert 0.0 < small["indexer_recall"] < 1.0
    # T = 48 <= the preset's top-64: the checkpoint is already dense, so 'dense' changes nothing anywhere ...
    assert all(dense[f"attn_rel.{i}"] == 0.0 for i in range(4)) and dense["logits_rel"] == 0.0
    # ... while top-8 changes the DSA layer's attention only (layer-local rows)
    assert small["attn_rel.3"] > 1e-3 and all(small[f"attn_rel.{i}"] == 0.0 for i in range(3))
    for name in ("ablate.csv", "ablate.json", "ablate.png"):
        assert (out / name).stat().st_size > 0
    assert (out / "ablate.csv").read_text().count("\n") == 3
    # a re-run with one more value computes only the new cell
    built = []
    orig = ab._build
    monkeypatch.setattr(ab, "_build", lambda cfg, *a: built.append(cfg.index_topk) or orig(cfg, *a))
    capsys.readouterr()
    rows = ab.run_grid(ckpt, ["index_topk=8,dense,16"], out, tokens=48, seq_len=48, quiet=False)
    assert built == [16] and len(rows) == 3
    assert "2 of 3 cells already in" in capsys.readouterr().err  # the user is told which cells were skipped
    assert json.loads((out / "ablate.json").read_text())[2]["cell"] == "index_topk=16"


def test_cli_errors_are_one_line(ckpt, tmp_path, capsys):
    assert main(["ablate", "--checkpoint", str(ckpt), "--out", str(tmp_path), "--set", "index_topk=0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kimi: error:") and "index_topk" in err[0]
    assert main(["ablate", "--checkpoint", str(ckpt), "--out", str(tmp_path)]) == 2
    assert "--set" in capsys.readouterr().err
