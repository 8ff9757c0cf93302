#!/usr/bin/env bash
# Every H200 measurement of the cudnn backend in one unattended pass, in priority order, so that a short device lease
# is spent on GPU work rather than on waiting between calls (the GPU wheels must be installed and /tmp/site/env.sh
# sourced first: ../shared/gpu/README.md). Results go to DIR (default runs/h200): one log per step, the JSON of each
# benchmark, status.txt (one line per step: name, exit code, seconds) and DONE at the end.
#
#   setsid nohup bash benchmarks/run_h200.sh /root/h200 > /root/h200.log 2>&1 &     # detached: survives the call
#
# Steps (STEPS="..." picks a subset; GPU-timed steps never share the GPU with another step):
#   A  fla_warmup (fla autotuning, background; not in the default STEPS) | init: kimi init of the 4-layer
#      real-dimension checkpoint (CPU, background) | kda_layer: benchmark 3
#   B  gpu_tests: tests/gpu (or $GPU_TESTS), then validate: validate_k31_4layers.sh (LENGTHS="4096 8192"). The two
#      are not run side by side: at 8,192 tokens the fp32 oracle needs most of the GPU's memory.
#   C  train_step_4layers: benchmark 5
#   D  sparse_mla_fwd, indexer_topk, dsa_vs_dense_layer: benchmarks 1, 2, 4 again, same commit as the rest
#   E  profile: Nsight Compute counters of one sparse forward call at S = 8192 (ncu_sparse_mla: the full section
#      set; ncu_tensor_ops: tensor-pipe bf16 ops of that call; ncu_matmul_ops: of one 4096^3 matmul, to calibrate the counter;
#      ncu reads counters on Firecracker machines only: ../.library/device/KINDS.md) and the kernel breakdown of the
#      indexer at 8K, ours against cuDNN whole rows (indexer_profile: torch.profiler)
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

cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# Triton's autotune choices (fla caches them there): restore a carried snapshot, save ours after the autotuning.
# Carry the snapshot to a fresh machine as TRITON_AUTOTUNE_TGZ=path to skip the ~5 minutes of fla autotuning.
[ -f "${TRITON_AUTOTUNE_TGZ:-}" ] && mkdir -p "$cache" && tar xzf "$TRITON_AUTOTUNE_TGZ" -C "$cache"
save_autotune() { (cd "$cache" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$dir/triton_autotune.tgz" -T -); }

step() {  # step NAME TIMEOUT_S CMD...: run CMD with a time limit, log to DIR/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  timeout "$limit" "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s (at $(( $(date +%s) - t0 ))s)" >> "$dir/status.txt"
  return $rc
}

want() { [[ " ${STEPS:-init kda_layer gpu_tests validate train_step_4layers sparse_mla_fwd indexer_topk dsa_vs_dense_layer profile} " == *" $1 "* ]]; }

# A  (fla_warmup: the first fla call autotunes for 5.3 to 6 minutes on a fresh machine; run it beside the CPU and
#     non-fla work so that later steps find its choices in the Triton cache)
pids=()
if want fla_warmup; then
  step fla_warmup 600 python3 benchmarks/kda_layer.py --seq-lens 8192 --rounds 1 --reps 1 \
    --out "$dir/fla_warmup.json" &
  warm_pid=$!
fi
if want init; then
  step init 600 python3 -m kimi_tools.cli init --preset k3.1-pro --layers 4 --out "$CKPT" --force \
    --set num_experts=16 --set num_experts_per_token=8 &
  pids+=($!)
fi
want kda_layer && step kda_layer 900 python3 benchmarks/kda_layer.py --seq-lens 8192 32768 --out "$dir/kda_layer.json" \
  && save_autotune
# B (GPU_TESTS narrows the tests; validation waits for them: at 8,192 tokens its fp32 oracle needs most of the GPU)
if want gpu_tests; then
  # shellcheck disable=SC2086
  step gpu_tests 1200 python3 -m pytest ${GPU_TESTS:-tests/gpu} -m gpu -q -rfE -s -p no:cacheprovider --durations=15 &
  pids+=($!)
fi
for p in "${pids[@]}"; do wait "$p"; done
want validate && OUT=$dir step validate 1200 bash benchmarks/validate_k31_4layers.sh
[ -n "${warm_pid:-}" ] && wait "$warm_pid" && save_autotune
# C
# shellcheck disable=SC2086
want train_step_4layers && step train_step_4layers 900 python3 benchmarks/train_step_4layers.py ${TRAIN_ARGS:-} \
  --out "$dir/train_step_4layers.json"
# D
want sparse_mla_fwd && step sparse_mla_fwd 400 python3 benchmarks/sparse_mla_fwd.py --out "$dir/sparse_mla_fwd.json"
want indexer_topk && step indexer_topk 400 python3 benchmarks/indexer_topk.py --out "$dir/indexer_topk.json"
want dsa_vs_dense_layer && step dsa_vs_dense_layer 400 python3 benchmarks/dsa_vs_dense_layer.py \
  --out "$dir/dsa_vs_dense_layer.json"
# E
if want profile; then
  ncu_one=("$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)" --clock-control none
           --launch-count 1 --import-source no)
  sparse_call=(-k regex:_sparse_mla_fwd_kernel --launch-skip 1 python3 benchmarks/sparse_mla_fwd.py --profile-call 8192)
  ops=sm__ops_path_tensor_src_bf16_dst_fp32.sum,gpu__time_duration.sum
  step ncu_sparse_mla 300 "${ncu_one[@]}" --set full "${sparse_call[@]}"
  step ncu_tensor_ops 300 "${ncu_one[@]}" --metrics "$ops" "${sparse_call[@]}"
  step ncu_matmul_ops 120 "${ncu_one[@]}" --metrics "$ops" -k 'regex:gemm|nvjet|cutlass|xmma' python3 -c \
    'import torch; a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); a @ a; torch.cuda.synchronize()'
  step indexer_profile 300 python3 benchmarks/indexer_topk.py --profile 8192 --out "$dir/indexer_topk_profile.json"
fi
save_autotune
echo "done at $(( $(date +%s) - t0 ))s" >> "$dir/status.txt"
touch "$dir/DONE"
