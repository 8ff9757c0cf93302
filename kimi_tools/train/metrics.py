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

__all__ = ["RECORD_KEYS", "MetricsLog", "plot_losses", "peak_mem_bytes"]

RECORD_KEYS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_bytes")


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
        self.history = []
        if self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(rec, dict) and isinstance(rec.get("step"), int) and rec["step"] <= step:
                    self.history.append(rec)
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
        return {r["step"]: r["eval_loss"] for r in self.history if r.get("eval_loss") is not None}


def plot_losses(path: str | Path, records: list[dict]) -> None:
    """``loss.png``: the train loss per step and the eval losses, written atomically (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=120)
    ax = fig.add_subplot()
    tr = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    ev = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if tr:
        ax.plot(*zip(*tr), label="train loss", lw=1)
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    write_atomic(Path(path), buf.getvalue())


def peak_mem_bytes(device: str) -> int:
    """Peak memory: ``torch.cuda.max_memory_allocated`` on CUDA, else the process's peak RSS (Linux ``ru_maxrss``)."""
    import torch

    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB; process-wide
