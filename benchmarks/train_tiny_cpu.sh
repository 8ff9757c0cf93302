#!/usr/bin/env bash
# Training and exact resume on a CPU: the tiny preset, 100 steps on tiny Shakespeare, then the same run resumed from its
# step-50 checkpoint, which must reproduce steps 51-100 exactly (CPU, fp32).
#
#   DATA=/path/to/tinyshakespeare.txt benchmarks/train_tiny_cpu.sh [full|lora] [RUN_DIR]
#
# full: full fine-tuning of the random-init tiny preset. lora: LoRA rank 8 (dropout 0.05) on a random-init tiny
# checkpoint written by `kimi init`. Writes benchmarks/results/train_tiny_cpu[_lora]/: metrics.jsonl and loss.png of
# the uninterrupted run, metrics_resumed.jsonl, stdout.txt, command.txt and summary.json (eval loss at steps 0, 25, ..
# 100, tokens/s, whether the resumed steps and the final weights match bitwise). On a shared machine run it with
# OMP_NUM_THREADS=1 (two intra-op threads per process oversubscribe a busy 2-core CPU: 25x slower here).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODE="${1:-full}"
DATA="${DATA:-$ROOT/../shared/data/tinyshakespeare.txt}"
RUN="${2:-$(mktemp -d /tmp/kimi-train-tiny.XXXXXX)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--data "$DATA" --steps 100 --seq-len 128 --micro-batch-tokens 128 --batch-tokens 128 --warmup-steps 10
      --eval-every 25 --eval-tokens 512 --backend sdpa --seed 0 --save-every 50 --keep 2)
case "$MODE" in
  full) RES="$ROOT/benchmarks/results/train_tiny_cpu"; WEIGHTS=model.safetensors
        ARGS+=(--preset tiny --lr 3e-3) ;;
  lora) RES="$ROOT/benchmarks/results/train_tiny_cpu_lora"; WEIGHTS=adapter_model.safetensors
        mkdir -p "$RUN" && python -m kimi_tools.cli init --preset tiny --out "$RUN/base" --seed 0 --force
        ARGS+=(--checkpoint "$RUN/base" --lora-rank 8 --lora-dropout 0.05 --lr 1e-2) ;;
  *) echo "usage: $0 [full|lora] [RUN_DIR]" >&2; exit 2 ;;
esac
mkdir -p "$RES"
echo "python -m kimi_tools.cli train ${ARGS[*]} --out $RUN/run" > "$RES/command.txt"
python -m kimi_tools.cli train "${ARGS[@]}" --out "$RUN/run" | tee "$RES/stdout.txt"
# the interrupted twin: the same folder as it was after step 50, resumed
rm -rf "$RUN/resumed" && cp -r "$RUN/run" "$RUN/resumed" && rm -rf "$RUN/resumed/step-100"
echo "python -m kimi_tools.cli train ${ARGS[*]} --out $RUN/resumed --resume" >> "$RES/command.txt"
python -m kimi_tools.cli train "${ARGS[@]}" --out "$RUN/resumed" --resume | tee -a "$RES/stdout.txt"
cp "$RUN/run/metrics.jsonl" "$RUN/run/loss.png" "$RES/"
cp "$RUN/resumed/metrics.jsonl" "$RES/metrics_resumed.jsonl"
python - "$RUN" "$RES" "$WEIGHTS" <<'PY'
import json, os, sys
from pathlib import Path

import torch
from safetensors.torch import load_file

run, res, weights = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
read = lambda p: [json.loads(line) for line in p.read_text().splitlines() if line]
full, resumed = read(run / "run" / "metrics.jsonl"), read(run / "resumed" / "metrics.jsonl")
keys = ("step", "loss", "eval_loss", "lr", "grad_norm")
a = [{k: r[k] for k in keys} for r in full if r["step"] > 50]
b = [{k: r[k] for k in keys} for r in resumed if r["step"] > 50]
wa, wb = load_file(run / "run" / weights), load_file(run / "resumed" / weights)
ev = {r["step"]: r["eval_loss"] for r in full if r["eval_loss"] is not None}
tps = sorted(r["tokens_per_s"] for r in full if r["tokens_per_s"])
summary = {
    "eval_loss": ev,
    "eval_loss_drop": ev[0] - ev[100],
    "final_train_loss": full[-1]["loss"],
    "median_tokens_per_s": tps[len(tps) // 2],
    "peak_mem_bytes": max(r["peak_mem_bytes"] or 0 for r in full),
    "resumed_steps_51_100_identical": a == b and len(a) == 50,
    f"resumed_{weights.split('.')[0]}_identical": wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa),
    "torch": torch.__version__,
    "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
}
(res / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
sys.exit(0 if all(v for k, v in summary.items() if k.endswith("_identical")) and ev[100] < ev[0] - 1.0 else 1)
PY
