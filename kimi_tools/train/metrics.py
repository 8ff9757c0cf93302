"""``metrics.jsonl``: one record per optimizer step (keys :data:`RECORD_KEYS` plus the stage's metrics; a ``step`` 0
record holds the first eval loss), read back on resume, and ``loss.png`` drawn from it.

MFU: ``kimi.flops.estimate_flops(cfg, seq_len, backward=True)["flops_per_token"] * tokens/s`` over ``--peak-tflops``
(no default: ``mfu`` is null without it).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from kimi.checkpoint import write_atomic

__all__ = [
    "RECORD_KEYS",
    "MetricsLog",
    "plot_losses",
    "plot_runs",
    "runs_figure",
    "read_records",
    "eval_losses",
    "compare_eval_losses",
    "peak_mem_bytes",
]

RECORD_KEYS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes")


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` (a line torn by a crash is skipped).

    Raises:
        FileNotFoundError: no file at ``path``.
    """
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            out.append(rec)
    return out


def eval_losses(records: list[dict]) -> dict[int, float]:
    """step -> eval loss of the records that hold one."""
    return {r["step"]: r["eval_loss"] for r in records if r.get("eval_loss") is not None}


class MetricsLog:
    """The records of a run: :attr:`history` (every step so far, read back on resume) and :attr:`records` (this
    process's). Only the ``writer`` (rank 0) writes the file; every record is one appended JSON line."""

    def __init__(self, path: str | Path, writer: bool = True):
        self.path, self.writer = Path(path), writer
        self.history: list[dict[str, Any]] = []
        self.records: list[dict[str, Any]] = []

    def start(self) -> None:
        """A new run: an empty file."""
        if self.writer:
            write_atomic(self.path, b"")

    def resume(self, step: int) -> None:
        """Read back the records up to ``step`` (a line torn by a crash is skipped: the resume state says where to
        restart) and rewrite the file with exactly those, so the records after ``step`` are not repeated."""
        records = read_records(self.path) if self.path.is_file() else []
        self.history = [r for r in records if r["step"] <= step]
        if self.writer:
            write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in self.history).encode())

    def append(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)
        self.history.append(rec)
        if self.writer:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec) + "\n")

    def eval_losses(self) -> dict[int, float]:
        """step -> eval loss over the whole run."""
        return eval_losses(self.history)


def plot_losses(path: str | Path, records: list[dict]) -> None:
    """``loss.png``: the train loss per step and the eval losses, written atomically (matplotlib, Agg)."""
    plot_runs(path, {"": records})


def plot_runs(path: str | Path, runs: dict[str, list[dict]]) -> None:
    """One PNG of several runs' curves (``{label: metrics.jsonl records}``, :func:`runs_figure`), written atomically.

    Raises:
        ValueError: ``runs`` is empty.
    """
    fig = runs_figure(runs)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(Path(path), buf.getvalue())


def runs_figure(runs: dict[str, list[dict]]):
    """The ``matplotlib.figure.Figure`` of :func:`plot_runs` (matplotlib, Agg, no pyplot): each run's train loss per
    step (a thin line) and its eval losses (markers), one colour per run, the legend naming the run.

    Raises:
        ValueError: ``runs`` is empty.
    """
    if not runs:
        raise ValueError("runs: got none, expected {label: records} for at least one run")
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.add_subplot()
    for i, (label, records) in enumerate(runs.items()):
        colour = f"C{i}"
        prefix = f"{label}: " if label else ""
        tr = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
        ev = list(eval_losses(records).items())
        if tr:
            ax.plot(*zip(*tr), color=colour, label=f"{prefix}train loss", lw=1, alpha=0.7 if label else 1.0)
        if ev:
            ax.plot(*zip(*ev), "o-" if i == 0 else "s--", color=colour, label=f"{prefix}eval loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def compare_eval_losses(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Runs' eval losses side by side (``{label: metrics.jsonl records}``, the first is the baseline): ``eval_loss``
    ``{label: {step: loss}}``, ``shared_eval_steps`` (the steps every run evaluated), and ``rel_diff_from_baseline``
    ``{label: {step: |loss - baseline| / baseline}}`` for the other runs at those steps.

    Raises:
        ValueError: ``runs`` is empty, or a run has no eval loss.
    """
    if not runs:
        raise ValueError("runs: got none, expected {label: records} for at least one run")
    evals = {label: eval_losses(recs) for label, recs in runs.items()}
    empty = [label for label, e in evals.items() if not e]
    if empty:
        raise ValueError(f"runs: {empty} have no eval_loss record, expected at least one each")
    base, *others = evals
    shared = sorted(set.intersection(*(set(e) for e in evals.values())))

    def rel(a: float, b: float) -> float:  # |a - b| / |b|; a zero baseline gives inf unless a equals it
        return abs(a - b) / abs(b) if b else (0.0 if a == b else float("inf"))

    rel_diff = {o: {s: rel(evals[o][s], evals[base][s]) for s in shared} for o in others}
    return {"eval_loss": evals, "baseline": base, "shared_eval_steps": shared, "rel_diff_from_baseline": rel_diff}


def peak_mem_bytes(device: str) -> int:
    """Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak RSS (Linux ``ru_maxrss``)."""
    import torch

    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB; process-wide
