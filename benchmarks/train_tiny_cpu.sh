#!/usr/bin/env bash
# Part 4 of issue 10 on a CPU: the tiny preset (random init), 100 steps of full fine-tuning on tiny Shakespeare,
# then the same run resumed from its step-50 checkpoint, which must reproduce steps 51-100 exactly (CPU, fp32).
#
#   DATA=/path/to/tinyshakespeare.txt benchmarks/train_tiny_cpu.sh [RUN_DIR]
#
# Writes benchmarks/results/train_tiny_cpu/: metrics.jsonl and loss.png of the full run, metrics_resumed.jsonl,
# summary.json (eval loss at step 0 and 100, tokens/s, whether the resumed steps match bitwise) and command.txt.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
DATA="${DATA:-$ROOT/../shared/data/tinyshakespeare.txt}"
RUN="${1:-$(mktemp -d /tmp/kimi-train-tiny.XXXXXX)}"
RES="$ROOT/benchmarks/results/train_tiny_cpu"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--preset tiny --data "$DATA" --steps 100 --seq-len 128 --micro-batch-tokens 128 --batch-tokens 128
      --lr 3e-3 --warmup-steps 10 --eval-every 25 --eval-tokens 512 --backend sdpa --seed 0)
mkdir -p "$RES"
echo "python -m kimi_tools.cli train ${ARGS[*]} --out $RUN/full --save-every 50 --keep 2" > "$RES/command.txt"
python -m kimi_tools.cli train "${ARGS[@]}" --out "$RUN/full" --save-every 50 --keep 2 | tee "$RES/stdout.txt"
# the interrupted twin: the same folder as it was after step 50, resumed
rm -rf "$RUN/resumed" && cp -r "$RUN/full" "$RUN/resumed" && rm -rf "$RUN/resumed/step-100"
echo "python -m kimi_tools.cli train ${ARGS[*]} --out $RUN/resumed --save-every 50 --keep 2 --resume" >> "$RES/command.txt"
python -m kimi_tools.cli train "${ARGS[@]}" --out "$RUN/resumed" --save-every 50 --keep 2 --resume \
    | tee -a "$RES/stdout.txt"
cp "$RUN/full/metrics.jsonl" "$RUN/full/loss.png" "$RES/"
cp "$RUN/resumed/metrics.jsonl" "$RES/metrics_resumed.jsonl"
python - "$RUN" "$RES" <<'PY'
import json, sys
from pathlib import Path

import torch
from safetensors.torch import load_file

run, res = Path(sys.argv[1]), Path(sys.argv[2])
read = lambda p: [json.loads(line) for line in p.read_text().splitlines() if line]
full, resumed = read(run / "full" / "metrics.jsonl"), read(run / "resumed" / "metrics.jsonl")
keys = ("step", "loss", "eval_loss", "lr", "grad_norm")
a = [{k: r[k] for k in keys} for r in full if r["step"] > 50]
b = [{k: r[k] for k in keys} for r in resumed if r["step"] > 50]
wa, wb = load_file(run / "full" / "model.safetensors"), load_file(run / "resumed" / "model.safetensors")
ev = {r["step"]: r["eval_loss"] for r in full if r["eval_loss"] is not None}
tps = [r["tokens_per_s"] for r in full if r["tokens_per_s"]]
summary = {
    "eval_loss": ev,
    "eval_loss_drop": ev[0] - ev[100],
    "final_train_loss": full[-1]["loss"],
    "median_tokens_per_s": sorted(tps)[len(tps) // 2],
    "peak_mem_bytes": max(r["peak_mem_bytes"] or 0 for r in full),
    "resumed_steps_51_100_identical": a == b and len(a) == 50,
    "resumed_weights_identical": wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa),
    "torch": torch.__version__,
    "omp_num_threads": __import__("os").environ.get("OMP_NUM_THREADS"),
}
(res / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
ok = summary["resumed_steps_51_100_identical"] and summary["resumed_weights_identical"] and ev[100] < ev[0] - 1.0
sys.exit(0 if ok else 1)
PY
