#!/usr/bin/env bash
# On the H200: `kimi train` of the real-dimension 4-layer K3.1 model (KKKD: three KDA layers and
# one DSA layer, 16 routed experts of which 8 active, every other dimension real; 6.78 B parameters) on the cudnn
# backend, 100 steps of 8,192 tokens of Tiny Shakespeare, bf16 with fp32 masters, activation recomputation per layer.
#
#   DATA=/path/to/tinyshakespeare.txt CKPT=/tmp/k31-4layers benchmarks/train_4layers_h200.sh [full|lora|fp8] [OUT_DIR]
#
# CKPT must hold the checkpoint (run_h200.sh's `init` step writes it: kimi init --preset k3.1-pro --layers 4
# --set num_experts=16 --set num_experts_per_token=8).
#
# full: every layer weight trains (4.43 B parameters); the input embedding and lm_head (2 x 1.17 B) stay frozen,
#   because their fp32 masters, gradients and AdamW moments (18 B per parameter) would add 42 GB to the 93 GB the
#   layers' optimizer state already takes on a 141 GB GPU. `--no-save`: the 53 GB of fp32 masters and AdamW state
#   would not fit the machine's disk beside the checkpoint; the run writes metrics.jsonl and loss.png only.
# lora: rank 16 adapters on the default targets (MLA and KDA projections, kv_b_proj in absorbed form), saved in peft's
#   format with the resume state.
# fp8: as full, with --fp8 rowwise (kernels_torch.fp8: torchao's rowwise recipe on the projections, shared and routed
#   experts; needs torchao), from the same checkpoint and seed, so that its curve sits beside full's.
# LR (default 1e-4, full and fp8) and WARMUP (default 10 steps) set the schedule. At 1e-4 the early steps are
# unstable: the gradient norm reaches ~500 at step 2, after which a run may sit near loss 12.5 for a few steps
# (escaping at step 6 on 2026-12-01) or for twenty (2026-12-03), so two runs that differ only in rounding
# can end far apart; the bf16-against-FP8 comparison uses LR=3e-5 WARMUP=20.
# MFU: model FLOPs (kimi.flops.estimate_flops, no recomputation counted) over the bf16 matmul ceiling measured at
# the start of this script (8192^3), as in benchmark 5. Writes OUT_DIR/{metrics.jsonl, loss.png, stdout.txt,
# command.txt, summary.json}.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MODE="${1:-full}"
OUT="${2:-$ROOT/benchmarks/results/train_4layers_h200_$MODE}"
DATA="${DATA:-$ROOT/../shared/data/tinyshakespeare.txt}"
CKPT="${CKPT:-/tmp/k31-4layers}"
RUN="${RUN:-/tmp/kimi-train-4layers-$MODE}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
mkdir -p "$OUT"
rm -rf "$RUN"
PEAK=$(python3 - <<'PY'
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ a
torch.cuda.synchronize()
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
s.record()
for _ in range(20):
    a @ a
e.record()
torch.cuda.synchronize()
print(f"{2 * 8192**3 * 20 / (s.elapsed_time(e) * 1e-3) / 1e12:.1f}")
PY
)
LR=${LR:-1e-4}  # full and fp8 (LoRA: 1e-3)
ARGS=(--checkpoint "$CKPT" --data "$DATA" --steps 100 --seq-len 8192 --warmup-steps "${WARMUP:-10}" --eval-every 25
      --eval-tokens 32768 --backend cudnn --recompute --seed 0 --peak-tflops "$PEAK")
case "$MODE" in
  full) ARGS+=(--lr "$LR" --freeze "model.embed_tokens.*" "lm_head.*" --no-save) ;;
  fp8) ARGS+=(--lr "$LR" --freeze "model.embed_tokens.*" "lm_head.*" --no-save --fp8 rowwise) ;;
  lora) ARGS+=(--lora-rank 16 --lr 1e-3) ;;
  *) echo "usage: $0 [full|lora|fp8] [OUT_DIR]" >&2; exit 2 ;;
esac
echo "python3 -m kimi_tools.cli train ${ARGS[*]} --out $RUN" > "$OUT/command.txt"
python3 -m kimi_tools.cli train "${ARGS[@]}" --out "$RUN" 2>&1 | tr '\r' '\n' | grep -v '^train: *[0-9]*%' \
  | tee "$OUT/stdout.txt"
cp "$RUN/metrics.jsonl" "$RUN/loss.png" "$OUT/"
[ "$MODE" = lora ] && ls -la "$RUN" >> "$OUT/stdout.txt"
python3 - "$OUT" "$PEAK" "$MODE" <<'PY'
import json, sys
from pathlib import Path

import torch

out, peak, mode = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
steps = [r for r in recs if r["step"] > 0]
timed = sorted(steps[5:], key=lambda r: r["tokens_per_s"])  # after the first 5 (compilation, autotuning)
mid = timed[len(timed) // 2]
ev = {r["step"]: r["eval_loss"] for r in recs if r.get("eval_loss") is not None}
summary = {
    "mode": mode,
    "device": torch.cuda.get_device_name(),
    "torch": torch.__version__,
    "matmul_ceiling_tflops": peak,
    "eval_loss": ev,
    "train_loss_first_last": [steps[0]["loss"], steps[-1]["loss"]],
    "median_tokens_per_s": mid["tokens_per_s"],
    "median_mfu": mid["mfu"],
    "peak_mem_gib": max(r["peak_mem_bytes"] for r in steps) / 2**30,
    "steps": len(steps),
}
(out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary, indent=1))
sys.exit(0 if len(steps) == 100 and ev[100] < ev[0] else 1)
PY
