"""Every notebook runs top to bottom in a real kernel (nbclient, python3), and the numbered ones are checked on what
they computed: each ends by printing ``RESULTS {json}``, which the assertions below read back from the executed
notebook (written to pytest's tmp_path; nothing is written beside the notebooks). ``RESULTS["figure"]`` is the
notebook's figure read back (``kimi_tools.plots.figure_facts``): the checks assert on what a reader sees (the
plotted values, legends, axis labels and limits, blank pixels where nothing was measured), and every numbered
notebook must show its figure inline and leave no ``kimi-*`` folder in the kernel's temporary folder.

Each notebook runs in a child process under a hard time limit. A CI run once hung inside the Jupyter stack (no cell
finished, no error, and nbclient's own cell timeout never fired) until the whole run was killed; now a hang costs
``HANG_LIMIT_S`` and is retried once, while a notebook that fails (an error in a cell) fails at once."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("nbclient")  # the child process runs it
nbformat = pytest.importorskip("nbformat")
pytest.importorskip("ipykernel")

NB_DIR = Path(__file__).parent.parent / "notebooks"


def notebooks(folder: Path) -> list[Path]:
    """The project's notebooks, without the ``*.nbconvert.ipynb`` copies ``jupyter nbconvert --execute`` leaves."""
    return sorted(p for p in folder.glob("*.ipynb") if not p.name.endswith(".nbconvert.ipynb"))


NOTEBOOKS = notebooks(NB_DIR)


def test_nbconvert_outputs_are_not_collected(tmp_path):
    (tmp_path / "explore.ipynb").write_text("{}")
    (tmp_path / "explore.nbconvert.ipynb").write_text("{}")
    assert [p.name for p in notebooks(tmp_path)] == ["explore.ipynb"]


CELL_TIMEOUT_S = 240  # nbclient's limit per cell; the slowest cell takes ~20 s on a 2-core CPU
HANG_LIMIT_S = 420  # the child's limit for the whole notebook; the slowest notebook takes ~26 s there
ATTEMPTS = 2

# The child: execute ``src`` with the notebooks folder as working directory and write the result to ``dst``. The
# kernel it starts watches its parent (ipykernel's parent poller), so killing the child also ends the kernel.
RUN_NOTEBOOK = """
import sys
import nbclient, nbformat
src, dst, cwd, cell_timeout = sys.argv[1:]
nb = nbformat.read(src, as_version=4)
nbclient.NotebookClient(
    nb, timeout=int(cell_timeout), kernel_name="python3", resources={"metadata": {"path": cwd}}
).execute()
nbformat.write(nb, dst)
"""


def execute(path: Path, out_dir: Path, tmp_dir: Path | None = None):
    """The executed notebook. Raises AssertionError with the child's stderr when a cell fails, and fails the test
    when every attempt hung. ``tmp_dir``: the child's (and so the kernel's) ``TMPDIR``."""
    env = dict(os.environ, **({"TMPDIR": str(tmp_dir)} if tmp_dir is not None else {}))
    for attempt in range(ATTEMPTS):
        dst = out_dir / f"{path.stem}.attempt{attempt}.ipynb"
        log = out_dir / f"{path.stem}.attempt{attempt}.log"
        argv = [sys.executable, "-c", RUN_NOTEBOOK, str(path), str(dst), str(NB_DIR), str(CELL_TIMEOUT_S)]
        # The child's output goes to a file, not a pipe: the kernel inherits it, and a pipe would keep the wait open
        # for as long as the kernel lives.
        with log.open("w") as out:
            try:
                proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=HANG_LIMIT_S, env=env)
            except subprocess.TimeoutExpired:
                warnings.warn(f"{path.name}: attempt {attempt + 1} hung past {HANG_LIMIT_S} s; killed", stacklevel=1)
                continue
        if proc.returncode != 0:
            raise AssertionError(f"{path.name} failed (exit {proc.returncode}):\n{log.read_text()[-6000:]}")
        return nbformat.read(dst, as_version=4)
    pytest.fail(f"{path.name} hung in all {ATTEMPTS} attempts ({HANG_LIMIT_S} s each)")


def results(nb) -> dict:
    for cell in reversed(nb.cells):
        for out in cell.get("outputs", []):
            text = out.get("text", "")
            for line in text.splitlines():
                if line.startswith("RESULTS "):
                    return json.loads(line[len("RESULTS ") :])
    raise AssertionError("the notebook printed no RESULTS line")


def panel(r, title: str) -> dict:
    """The axes of the notebook's figure (``RESULTS["figure"]``, ``kimi_tools.plots.figure_facts``) titled ``title``."""
    found = [a for a in r["figure"]["axes"] if a["title"].startswith(title)]
    assert len(found) == 1, (title, [a["title"] for a in r["figure"]["axes"]])
    return found[0]


def labelled(r) -> None:
    """Every axes of the figure (colorbars included) says what its y axis is."""
    for a in r["figure"]["axes"]:
        assert a["ylabel"].strip(), a["title"] or "a colorbar"


def same(got, want, rel=1e-6) -> bool:
    return len(got) == len(want) and all(g == pytest.approx(w, rel=rel, abs=1e-12) for g, w in zip(got, want))


def check_01_kda(r):
    assert r["chunk_vs_recurrent_rel"] < 1e-5 and r["state_rel"] < 1e-5  # the two forms agree in fp32
    lo, hi = r["decay_range"]
    assert 0 < lo <= hi <= 1  # exp(g) with the lower-bound gate: in (e^-5, 1]
    assert lo >= math.exp(-5) - 1e-6
    assert 0 < r["beta_range"][0] <= r["beta_range"][1] < 1
    assert len(r["state_norms"]) == 12 and all(all(math.isfinite(v) and v > 0 for v in row) for row in r["state_norms"])
    # the figure: beta one row per head (no spaghetti of overlapping lines), the state norms one line per head with
    # a legend, every axis labelled
    labelled(r)
    beta = panel(r, "write strength beta")["images"][0]
    assert beta["shape"] == [4, 192] and beta["masked"] == 0
    assert [beta["min"], beta["max"]] == pytest.approx(r["beta_range"])
    decay = panel(r, "decay exp(g)")["images"][0]
    assert decay["shape"] == [16, 192] and lo <= decay["min"] <= decay["max"] <= hi
    norms = panel(r, "state norm")
    assert norms["legend"] == [f"head {h}" for h in range(4)]
    cols = [list(col) for col in zip(*r["state_norms"])]  # [head][step]
    assert len(norms["lines"]) == 4 and all(same(ln["y"], col) for ln, col in zip(norms["lines"], cols))


def check_02_dsa(r):
    assert r["T"] > r["index_topk"]
    assert r["recall_first_rows_min"] == pytest.approx(1.0)  # rows with <= k visible keys select them all
    assert 0.2 < r["recall_beyond_topk"] < 1.0 and r["recall_beyond_topk"] < r["recall_mean"] <= 1.0
    assert r["selected_per_row_max"] == r["index_topk"] and r["causal_ok"]
    # the figure: future keys are blank in the score and attention maps (not drawn as a floor value such as
    # log10(1e-6)); the recall curve is the recall, with the top-k boundary in the legend
    labelled(r)
    T = r["T"]
    for title in ("indexer scores", "dense attention p"):
        img = panel(r, title)["images"][0]
        assert img["shape"] == [T, T] and img["masked"] == T * (T - 1) // 2, title
    rec = panel(r, "recall per query")
    assert same(rec["lines"][0]["y"], r["recall"]) and f"t = index_topk = {r['index_topk']}" in rec["legend"]


def check_03_equivalence(r):
    reports = {b: rep for b, rep in r.items() if b != "figure"}
    assert {"eager", "sdpa"} <= set(reports)
    for backend, rep in reports.items():
        assert rep["passed"], backend
        assert [row["layer"] for row in rep["layers"]] == list(range(4)), backend  # a row for every layer
        if backend != "cudnn":
            assert all(row["attn_rel"] < 1e-4 for row in rep["layers"]), backend
    # the figure: each backend's measured errors (an exact 0 left out of the log axis and named in the legend,
    # never a floor), in line styles that keep agreeing backends visible
    labelled(r)
    for title, key in (("attention output", "attn_rel"), ("residual stream", "residual_rel")):
        ax = panel(r, title)
        assert [ln["label"].split(" ")[0] for ln in ax["lines"]] == list(reports), title
        for ln, rep in zip(ax["lines"], reports.values()):
            assert ln["y"] == pytest.approx([row[key] if row[key] > 0 else None for row in rep["layers"]]), title
        assert len({(ln["linestyle"], ln["marker"]) for ln in ax["lines"]}) == len(ax["lines"]), title


def check_04_ablation(r):
    rows = r["rows"]
    assert [row["cell"] for row in rows] == ["(unchanged)"] + [
        f"index_topk={k}" for k in ("8", "16", "32", "64", "dense")
    ]
    base, cells = rows[0], rows[1:]
    recalls = [row["indexer_recall"] for row in cells]
    assert all(a <= b + 1e-9 for a, b in zip(recalls, recalls[1:]))  # more keys, more of the attention mass
    assert recalls[0] < 0.9 and recalls[-1] == pytest.approx(1.0)
    assert cells[3]["attn_rel.3"] == 0.0  # top-64 is the checkpoint's own budget: the unchanged model
    assert cells[3]["eval_loss"] == base["eval_loss"]
    assert all(math.isfinite(row["eval_loss"]) for row in rows)
    # the figure (kimi ablate's own): one marker per budget at its eval loss, the unchanged model as the dashed
    # baseline, the loss axis zoomed to the data (not from 0), value labels; the DSA layer's error per budget with
    # the exact zero of top-64 blank on the log colour scale (drawn as "0")
    labelled(r)
    loss = panel(r, "held-out loss")
    assert loss["xticklabels"] == ["8", "16", "32", "64", "dense"]
    assert same(loss["lines"][0]["y"], [c["eval_loss"] for c in cells])
    assert loss["lines"][1]["label"].startswith("unchanged model") and same(
        loss["lines"][1]["y"], [base["eval_loss"]] * 2
    )
    lo, hi = loss["ylim"]
    spread = max(c["eval_loss"] for c in cells) - min(c["eval_loss"] for c in cells)
    assert min(c["eval_loss"] for c in cells) - spread < lo and hi < max(c["eval_loss"] for c in cells) + spread
    assert f"{cells[0]['eval_loss']:.4f}" in loss["texts"]
    attn = panel(r, "attention output")["images"][0]["values"]  # [budget, layer]
    assert [row[3] for row in attn] == pytest.approx([c["attn_rel.3"] or None for c in cells])
    assert all(row[:3] == [None, None, None] for row in attn)  # layers 0-2 are KDA: exactly unchanged


def check_05_training(r):
    runs = {name: recs for name, recs in r.items() if name not in ("figure", "has_lora")}
    assert ("LoRA r=8" in runs) == r["has_lora"]
    for name, recs in runs.items():
        steps = [x for x in recs if x["loss"] is not None]
        assert [x["step"] for x in steps] == list(range(1, 9)), name
        assert all(math.isfinite(x["loss"]) for x in steps), name
    wu = [x for x in runs["indexer warm-up"] if x["loss"] is not None]
    assert wu[-1]["kl"] < wu[0]["kl"]  # the warm-up distils the indexer towards the attention
    sp = [x for x in runs["sparse stage"] if x["loss"] is not None]
    assert all(0 < x["indexer_recall"] <= 1 for x in sp)
    ft = [x for x in runs["full fine-tuning"] if x["loss"] is not None]
    assert ft[-1]["loss"] < ft[0]["loss"]
    # the figure: each run's curves are its records, and no two lines of a panel share line style and marker (the
    # sparse stage's LM loss lies on full fine-tuning's: both must stay visible)
    runs = {name: [x for x in recs if x["loss"] is not None] for name, recs in runs.items()}
    labelled(r)
    for title, key in (("LM loss", None), ("indexer KL", "kl"), ("indexer recall", "indexer_recall")):
        ax = panel(r, title)
        assert ax["legend"] == [ln["label"] for ln in ax["lines"]] and ax["lines"], title
        for ln in ax["lines"]:
            recs = runs[ln["label"]]
            k = key or ("lm_loss" if recs[0].get("lm_loss") is not None else "loss")
            assert same(ln["y"], [x[k] for x in recs]), (title, ln["label"])
        assert len({(ln["linestyle"], ln["marker"]) for ln in ax["lines"]}) == len(ax["lines"]), title


CHECKS = {name[len("check_") :]: f for name, f in globals().items() if name.startswith("check_")}


def test_every_numbered_notebook_has_a_check():
    numbered = [p.stem for p in NOTEBOOKS if p.stem[:2].isdigit()]
    assert sorted(numbered) == sorted(CHECKS)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook(path, tmp_path):
    kernel_tmp = tmp_path / "kernel_tmp"  # the kernel's TMPDIR: what a notebook leaves in /tmp shows here
    kernel_tmp.mkdir()
    nb = execute(path, tmp_path, kernel_tmp)
    left = sorted(p.name for p in kernel_tmp.glob("kimi-*"))
    assert not left, f"{path.name} left {left} in the temporary folder"
    if path.stem in CHECKS:
        CHECKS[path.stem](results(nb))
        shown = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
        assert shown, f"{path.name} shows no figure inline"


def _write_notebook(folder: Path, source: str) -> Path:
    path = folder / "probe.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_hung_notebook_is_killed_and_retried(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "HANG_LIMIT_S", 10)
    path = _write_notebook(tmp_path, "import os, time\nprint('KERNEL', os.getpid(), flush=True)\ntime.sleep(600)")
    with (
        pytest.warns(UserWarning, match="hung past 10 s") as record,
        pytest.raises(pytest.fail.Exception, match="hung"),
    ):
        execute(path, tmp_path)
    assert len(record) == ATTEMPTS


@pytest.mark.slow
def test_failing_notebook_fails_at_once_with_the_cell_error(tmp_path):
    path = _write_notebook(tmp_path, "raise ValueError('the probe cell fails')")
    with pytest.raises(AssertionError, match="the probe cell fails"):
        execute(path, tmp_path)
