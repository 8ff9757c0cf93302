#!/usr/bin/env bash
# Every H200 measurement of the cudnn backend in one unattended pass, in priority order, so that a short device lease
# is spent on GPU work rather than on waiting between calls (the GPU wheels must be installed and /tmp/site/env.sh
# sourced first: ../shared/gpu/README.md). Results go to DIR (default runs/h200): one log per step, the JSON of each
# benchmark, status.txt (one line per step: name, exit code, seconds) and DONE at the end.
#
#   setsid nohup bash benchmarks/run_h200.sh /root/h200 > /root/h200.log 2>&1 &     # detached: survives the call
#
# Steps (GPU-timed steps never share the GPU with another step):
#   A  kimi init of the 4-layer real-dimension checkpoint (CPU, in the background)  |  kda_layer.py (benchmark 3)
#   B  GPU tests (tests/gpu)  |  validate_k31_4layers.sh (both correctness only, so they may share the GPU)
#   C  train_step_4layers.py (benchmark 5)
#   D  sparse_mla_fwd.py, indexer_topk.py, dsa_vs_dense_layer.py (benchmarks 1, 2, 4 again, same commit as the rest)
set -uo pipefail
dir=$(realpath -m "${1:-runs/h200}")
mkdir -p "$dir"
# Work on a private copy so the checkout may change while this runs.
src=$(pwd)
work=$(mktemp -d)/repo
cp -r "$src" "$work" && cd "$work" || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
export CKPT=${CKPT:-/tmp/k31-4layers}
t0=$(date +%s)
echo "start $(date -u +%FT%TZ) commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader 2>/dev/null)" > "$dir/status.txt"

step() {  # step NAME TIMEOUT_S CMD...: run CMD with a time limit, log to DIR/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  timeout "$limit" "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s (at $(( $(date +%s) - t0 ))s)" >> "$dir/status.txt"
  return $rc
}

# A
step init 600 python3 -m kimi.cli init --preset k3.1-pro --layers 4 --out "$CKPT" --force \
  --set num_experts=16 --set num_experts_per_token=8 &
init_pid=$!
step kda_layer 900 python3 benchmarks/kda_layer.py --seq-lens 8192 32768 --out "$dir/kda_layer.json"
wait $init_pid
# B
step gpu_tests 1200 python3 -m pytest tests/gpu -m gpu -q -rfE -s -p no:cacheprovider &
tests_pid=$!
OUT=$dir step validate 1200 bash benchmarks/validate_k31_4layers.sh
wait $tests_pid
# C
step train_step_4layers 900 python3 benchmarks/train_step_4layers.py --seq-lens 8192 32768 \
  --out "$dir/train_step_4layers.json"
# D
step sparse_mla_fwd 400 python3 benchmarks/sparse_mla_fwd.py --out "$dir/sparse_mla_fwd.json"
step indexer_topk 400 python3 benchmarks/indexer_topk.py --out "$dir/indexer_topk.json"
step dsa_vs_dense_layer 400 python3 benchmarks/dsa_vs_dense_layer.py --out "$dir/dsa_vs_dense_layer.json"
echo "done at $(( $(date +%s) - t0 ))s" >> "$dir/status.txt"
touch "$dir/DONE"
