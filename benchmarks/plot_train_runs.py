"""Two or more ``kimi train`` runs in one picture, and their eval losses side by side: what
``benchmarks/train_4layers_h200.sh`` writes for ``full`` (bf16) and ``fp8`` from the same start.

    python benchmarks/plot_train_runs.py bf16=runs/h200/train_full fp8=runs/h200/train_fp8 \\
        --out benchmarks/results/train_4layers_bf16_vs_fp8.png

Each ``LABEL=DIR`` names a run folder holding ``metrics.jsonl`` (or the file itself). Writes the PNG
(``kimi_tools.train.metrics.plot_runs``: train loss per step, eval loss markers, one colour per run) and, beside it, a
JSON of every run's eval losses by step and, at each eval step the runs share, each run's relative difference from
the first run (``|loss - loss_first| / loss_first``); prints the same as a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kimi_tools.train.metrics import compare_eval_losses, plot_runs, read_records


def _parse_run(text: str) -> tuple[str, Path]:
    label, sep, where = text.partition("=")
    if not sep or not label or not where:
        raise argparse.ArgumentTypeError(f"run: got {text!r}, expected LABEL=DIR (a run folder or its metrics.jsonl)")
    path = Path(where)
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"run {label!r}: no metrics.jsonl at {path}")
    return label, path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=_parse_run, help="LABEL=DIR, the first is the baseline")
    ap.add_argument("--out", required=True, type=Path, help="the PNG; the JSON goes beside it (.json)")
    args = ap.parse_args(argv)
    labels = [label for label, _ in args.runs]
    if len(set(labels)) != len(labels):
        ap.error(f"runs: labels must differ, got {labels}")
    if args.out.suffix.lower() != ".png":
        ap.error(f"--out: got {str(args.out)!r}, expected a .png path (the JSON goes beside it)")
    runs = {label: read_records(path) for label, path in args.runs}
    try:
        summary = compare_eval_losses(runs)  # before anything is written: a run without eval losses is refused
    except ValueError as e:
        ap.error(str(e))
    if not summary["shared_eval_steps"]:
        print(f"plot_train_runs: the runs share no eval step ({labels}); the table is empty", file=sys.stderr)
    plot_runs(args.out, runs)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    columns = ["step", *labels, *(f"{o} vs {labels[0]}" for o in labels[1:])]
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    for s in summary["shared_eval_steps"]:
        vals = " | ".join(f"{summary['eval_loss'][lab][s]:.4f}" for lab in labels)
        diffs = " | ".join(f"{100 * summary['rel_diff_from_baseline'][o][s]:.2f}%" for o in labels[1:])
        print(f"| {s} | {vals} |" + (f" {diffs} |" if diffs else ""))
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
