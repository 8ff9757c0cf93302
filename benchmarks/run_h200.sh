#!/usr/bin/env bash
# Every H200 measurement of the cudnn backend in one unattended pass, in priority order, so that a short device lease is
# spent on GPU work rather than on waiting between calls (the GPU-only packages must be installed first:
# docs/kernels.md, "Installing the GPU-only packages"; on the project's H200, source /tmp/site/env.sh). Results go to
# DIR (default runs/h200): one log per step, the JSON of each benchmark, status.txt (one line per step: name, exit code,
# seconds) and DONE at the end.
#
#   setsid nohup bash benchmarks/run_h200.sh /root/h200 > /root/h200.log 2>&1 &     # detached: survives the call
#
# Triton's autotune choices for fla's kernels are restored from benchmarks/results/triton_autotune_h200.tgz by default
# (fla's first call then takes about 30 s instead of about 5.5 minutes; TRITON_AUTOTUNE_TGZ=other.tgz, or "" for none),
# and CUDA_HOME defaults to /usr/local/cuda (cuDNN's SM90 KDA engine compiles with NVRTC and needs the CUDA headers).
#
# Steps (STEPS="..." picks a subset and runs it in the order given; GPU-timed steps never share the GPU). A word
# "a,b+c" runs lanes side by side (split by '+'; a lane's steps, split by ',', in order) after init has finished: for
# correctness steps that fit the GPU together, never for timed ones.
#   init         kimi init of the 4-layer real-dimension checkpoint (16 experts, random; CPU, in the background)
#   probe        benchmarks/probe_h200.py: versions, FlashMLA and cuDNN KDA on small cases
#   tests_main   tests/gpu/test_gpu_sparse_mla.py (both sparse kernels) and test_gpu_kda_cudnn.py (KDA kernels in
#                $KDA_TEST_KERNELS, default "cudnn"; fla's own check runs in tests_fla)
#   sparse_mla_fwd   benchmark 1, FlashMLA and Triton (--no-sweep unless SWEEP=1)
#   kda_layer    benchmark 3: layer and recurrence, cuDNN KDA and fla, 8K and 32K
#   kda_layer_es (not in the default STEPS): the same under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
#   validate     validate_k31_4layers.sh (LENGTHS="4096 8192"), default kernels (FlashMLA, cuDNN KDA)
#   tests_dsa    tests/gpu/test_gpu_dsa_cudnn.py with KIMI_SPARSE_KERNEL=flash_mla
#   train_step_4layers  benchmark 5 (MFU, tokens/s, peak memory)
#   dsa_vs_dense_layer  benchmark 4 with the per-call breakdown, 16K-128K
#   jax_oracle   kimi compare --reference jax (fp32 JAX on the GPU) of the 4-layer checkpoint at 2,049 tokens: KDA
#                layers 0-2 and DSA layer 3, cudnn and eager (bf16)
#   tests_fla    all of tests/gpu on the other kernels: KDA on fla (KIMI_TEST_KDA_KERNELS=fla), DSA on Triton
#   tests_fla_ops (not in the default STEPS): the same, only the files whose kernel those switches change (KDA layer
#                and recurrence, DSA layer, short convolution): 13 minutes on 2026-12-02, 7 of them fla's autotuning of
#                the recurrence tests' shapes, which the carried snapshot lacked (the step saves the cache after it)
#   tests_new    the GPU tests of hardening, generation, LoRA and gradients, distillation, fused SiTU-GLU, the Triton KDA
#                preparation, the chunked LM loss (default kernels)
#   train_full, train_lora, train_fp8   train_4layers_h200.sh: kimi train of the 4-layer checkpoint, 100 steps of 8K tokens of
#                $DATA (default ../shared/data/tinyshakespeare.txt; carry it when that folder does not travel)
#   generate_decode  benchmarks/generate_decode.py: prefill tokens/s and decode against the copy-probe roofline with a
#                32K context, 16 experts top-8 and 112 top-16, batch 1 and 8, loop / static / captured step / compiled
#                step (GEN_ARGS replaces "--modes loop static graph compile")
#   short_conv (not in the default STEPS): benchmarks/short_conv.py, fla's causal_conv1d against cuDNN FE's
#   tests_conv (not in the default STEPS): the GPU tests of the short convolution kernels (op and layer gradients)
#   tests_kernels (not in the default STEPS): the GPU tests of the fused SiTU-GLU, the Triton KDA preparation and
#                the chunked LM loss, one step
#   situ_glu (not in the default STEPS): benchmarks/situ_glu.py, the fused SiTU-GLU against the plain ops
#   fp8_wheels   install torchao from .whl/ (benchmarks/fp8_wheels.sh downloads it; carry .whl) into /tmp/site
#   tests_moe    tests/gpu/test_gpu_moe_grouped.py: grouped experts vs the loop, Triton gather-sums, no host sync
#   tests_compile tests/gpu/test_gpu_compile.py: decoder blocks compiled by inductor (sdpa and cudnn, bf16, grouped
#                experts), and opcheck of the cudnn backend's kimi:: ops on the device
#   moe_layer    benchmarks/moe_layer.py: one MoE layer at K3.1's expert shapes, loop vs grouped vs bare GEMMs
#   tests_fp8    tests/gpu/test_gpu_fp8.py (torchao installed by fp8_wheels)
#   fp8_gemm     benchmarks/fp8_gemm.py: torchao's FP8 GEMMs at the step's shapes against bf16 (FP8_GEMM_ARGS, e.g.
#                "--compile --recipes rowwise"; the FP8 steps take FP8_STEP_ARGS, e.g. "--fp8-compile")
#   fp8_bound    benchmarks/fp8_bound.py (CPU, seconds): the FP8 step's bound at 112 experts from this run's fp8_gemm,
#                train_step_e112 and train_step_e112_fp8 (run those first)
#   train_step_e16_torchrun, train_step_e112_torchrun   benchmark 5 under torchrun (--parallel: kimi train's FSDP2
#                path with bf16 mixed precision and NCCL), beside train_step_e16 / _e112 of the same run (PAR_ARGS: the
#                FSDP2 policy flags; PROFILE=1: a profiler table per row). On one GPU with bf16 masters the trainer
#                leaves FSDP2 out (it would only copy); train_step_e16_torchrun_fsdp / _e112_torchrun_fsdp (not in
#                the default STEPS) force it (--shard-one-rank), to measure what it costs
#   train_step_compiled (not in the default STEPS): benchmark 5 eager and compiled (--compile: compile_blocks,
#                inductor) on the cudnn backend, 8K and 32K (32K recomputing the MLP / MoE blocks), one JSON: 112
#                experts top-16 on an H200 (the first 1, 2 or 4 layers whole at 32K, as train_step_e112), 16 top-8
#                on any other GPU (COMPILED_ARGS replaces the lengths and recompute options)
#   train_step_e16_policies (not in the default STEPS): the torchrun row at 8K under each FSDP2 policy of $POLICIES
#                (reshard:reduce:masters words, e.g. "always:bf16:fp32"), each profiled
#   rank_rehearsal  benchmarks/rank_rehearsal.py: one rank of kimi plan's layouts at real dimensions, built by the
#                trainer's code on torch's fake process group, against the planner's memory and time
#                (REHEARSAL_ARGS, default "--seq-len 8192"; planned for 80 GB on an H100, 141 GB on an H200, and for
#                90% of the machine's available host memory (pinned host blocks round up to powers of two): on an
#                H100 of a 128 GB machine full fine-tuning at 512 GPUs and no LoRA layout, on an H200 full at 256
#                GPUs and LoRA at 64, none offloading its states; adamw-bf16 needs torchao: fp8_wheels first)
#   offload_copy (not in the default STEPS): benchmarks/offload_copy.py, the host copy rate of kimi train's
#                --offload-activations (device -> pinned host on a side stream, back, and beside bf16 matmuls), 1 MB
#                to 1 GB
#   host_optimizer (not in the default STEPS): benchmarks/host_optimizer.py, the host side of --offload cpu: the
#                trainer's optimizer step on host tensors (adamw-bf16, adamw-fp32) and FSDP2's gradient copy to the
#                host, first and accumulating (HOST_OPT_ARGS, default "--numel 2e9"; torchao from fp8_wheels)
#   tests_offload (not in the default STEPS): tests/gpu/test_gpu_offload.py, activation offload on CUDA equal to
#                none (side-stream copies to pinned memory and back)
#   train_step_offload (not in the default STEPS): benchmark 5 at 16 experts, 8K, under each activation policy of
#                $ACT_POLICIES (recompute:offload words, e.g. "attn:none mlp:attn none:all"), one JSON each
#   tests_fp8_model  the FP8 tiny-model test alone (per-layer outputs and gradients against bf16)
#   tests_train_gpu  the gpu-marked tests outside tests/gpu (tests/test_train.py: the CUDA RNG restored on resume)
#   init112      kimi init of the 4-layer checkpoint with 112 experts top-16 at $CKPT112 (CPU, in the background;
#                about 16 GB, over 10 minutes on the H200 machine before the MXFP4 encoding moved to the
#                drawing threads: put it early, before the long steps)
#   validate112  validate_k31_4layers.sh on that checkpoint
#   compare_fp8  kimi compare --fp8 rowwise of the 4-layer checkpoint at 4K and 8K: cudnn bf16 and cudnn FP8 against the
#                fp32 eager oracle, per layer (torchao installed by fp8_wheels)
#   indexer_topk, profile (not in the default STEPS): benchmark 2; Nsight Compute counters of the Triton sparse
#                forward and the indexer's kernel breakdown (ncu reads counters on Firecracker machines only)
set -uo pipefail
dir=$(realpath -m "${1:-runs/h200}")
mkdir -p "$dir"
# Work on a private copy so the checkout may change while this runs.
src=$(pwd)
work=$(mktemp -d)/repo
cp -r "$src" "$work" && cd "$work" || exit 1
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform
export CKPT=${CKPT:-/tmp/k31-4layers} CKPT112=${CKPT112:-/tmp/k31-4layers-e112}
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda/include ] && export CUDA_HOME=/usr/local/cuda
t0=$(date +%s)
echo "start $(date -u +%FT%TZ) commit ${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)} $(nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader 2>/dev/null)" > "$dir/status.txt"
# The training text is copied too (resolved from the caller's directory, default beside the checkout as
# train_4layers_h200.sh's): the device tool's next call may remove a carried, ignored folder such as .data.
data_src=$(cd "$src" && realpath -m "${DATA:-../shared/data/tinyshakespeare.txt}")
if [ -e "$data_src" ]; then
  mkdir -p "$work/../data" && cp -r "$data_src" "$work/../data/" && export DATA="$work/../data/$(basename "$data_src")" \
    || echo "DATA=$data_src: copy failed (train_* steps will fail)" >> "$dir/status.txt"
else
  echo "DATA=$data_src: no such file at the start (train_* steps will fail)" >> "$dir/status.txt"
fi

cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
# Triton's autotune choices (fla caches them there): restore the carried snapshot, save ours after the autotuning.
tgz=${TRITON_AUTOTUNE_TGZ-benchmarks/results/triton_autotune_h200.tgz}
[ -n "$tgz" ] && [ -f "$tgz" ] && mkdir -p "$cache" && tar xzf "$tgz" -C "$cache" && echo "restored $tgz" >> "$dir/status.txt"
save_autotune() { (cd "$cache" 2>/dev/null && find . -name '*.autotune.json' | tar czf "$dir/triton_autotune.tgz" -T -); }

step() {  # step NAME TIMEOUT_S CMD...: run CMD with a time limit, log to DIR/NAME.log, record rc and seconds
  local name=$1 limit=$2; shift 2
  local s=$(date +%s)
  timeout "$limit" "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - s ))s (at $(( $(date +%s) - t0 ))s)" >> "$dir/status.txt"
  return $rc
}

default_steps="init probe tests_main tests_new sparse_mla_fwd kda_layer validate tests_dsa train_step_4layers \
dsa_vs_dense_layer jax_oracle train_full train_lora generate_decode tests_fla"
# -v: the log names each test as it runs; faulthandler_timeout: a test past 240 s dumps every thread's stack
pytest_gpu=(python3 -m pytest -m gpu -v -rfE -s -p no:cacheprovider --durations=15 -o faulthandler_timeout=240)
init_pid=
wait_pid() { while [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; do sleep 5; done; }  # also from a lane's subshell
wait_init() { wait_pid "$init_pid"; init_pid=; }  # the steps that read $CKPT

alice_x3() {  # the bundled text three times (8K byte-level tokens, as validate_k31_4layers.sh); prints its path
  local text="${TMPDIR:-/tmp}/alice_x3.txt"
  for _ in 1 2 3; do cat kimi/data/alice_ch1.txt; done > "$text"
  echo "$text"
}

run_step() {  # run_step NAME: one step of the list above
  case $1 in
  init)
    step init 600 python3 -m kimi_tools.cli init --preset k3.1-pro --layers 4 --out "$CKPT" --force \
      --set num_experts=16 --set num_experts_per_token=8 &
    init_pid=$! ;;
  probe) step probe 300 python3 benchmarks/probe_h200.py ;;
  fp8_wheels) step fp8_wheels 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl ;;
  tests_moe) step tests_moe 600 "${pytest_gpu[@]}" tests/gpu/test_gpu_moe_grouped.py ;;
  # 1500 s: on a machine without the opchecks' autotune choices, fla's first calls at their shapes autotune for
  # minutes (an H100, 2026-12-05: 11 of 14 tests in the first 600 s); the choices are saved for the next lease
  tests_compile) step tests_compile 1500 "${pytest_gpu[@]}" tests/gpu/test_gpu_compile.py; save_autotune ;;
  # shellcheck disable=SC2086
  moe_layer) step moe_layer 600 python3 benchmarks/moe_layer.py ${MOE_ARGS:-} --out "$dir/moe_layer.json" ;;
  tests_fp8) step tests_fp8 600 "${pytest_gpu[@]}" tests/gpu/test_gpu_fp8.py ;;
  # shellcheck disable=SC2086
  fp8_gemm) step fp8_gemm 600 python3 benchmarks/fp8_gemm.py ${FP8_GEMM_ARGS:-} --out "$dir/fp8_gemm.json" ;;
  fp8_bound) step fp8_bound 60 python3 benchmarks/fp8_bound.py --gemm "$dir/fp8_gemm.json" \
    --bf16 "$dir/train_step_e112.json" --fp8 "$dir/train_step_e112_fp8.json" --out "$dir/fp8_bound.json" ;;
  # benchmark 5 at one density each (bf16, and FP8 through torchao's rowwise recipe: fp8_wheels first)
  train_step_e16 | train_step_e112 | train_step_e16_fp8 | train_step_e112_fp8 | train_step_e16_torchrun | \
  train_step_e112_torchrun | train_step_e16_torchrun_fsdp | train_step_e112_torchrun_fsdp)
    # 32K rows recompute each layer's MLP / MoE block; at 112 experts that ran out of memory (138.4 GiB on the
    # 139 GiB H200, 2026-12-03: the experts' weights and gradients add ~24 GiB), so there the first 1, 2 or 4 layers
    # (the first count that fits) are recomputed whole too (BENCH5_ARGS replaces the lengths, the recompute options
    # and the backends together)
    local e=16 k=8 full=0 extra=""
    case $1 in *e112*) e=112 k=16 full="1 2 4" ;; esac
    case $1 in *_fp8) extra="--fp8 rowwise ${FP8_STEP_ARGS:-}" ;; esac  # FP8_STEP_ARGS="--fp8-compile": compiled
    # *_torchrun: the same rows through kimi train's parallel path (FSDP2, bf16 compute, masters by policy) under
    # torchrun with NCCL on this one GPU (TORCHRUN_ARGS, e.g. "--nproc-per-node 2" on a larger machine)
    local launch=(python3)
    # PAR_ARGS: the FSDP2 policy flags of the torchrun rows, replacing the default below (e.g. "--masters bf16
    # --reshard-after-forward always"; without --masters a row runs fp32 masters);
    # default: at 16 experts bf16 weights, gradients and reduction (adamw-bf16's, the policy the 0.95x target is
    # measured under), at 112 experts the optimizer kimi plan picks for this one-GPU layout (--masters planned: fp32
    # AdamW where it fits the card, else adamw-bf16). PROFILE=1: every row also writes a torch profiler table of one
    # step beside its JSON
    local par_default="--masters bf16"
    case $1 in *e112*) par_default="--masters planned" ;; esac
    case $1 in *_torchrun | *_torchrun_fsdp) launch=(torchrun --standalone ${TORCHRUN_ARGS:---nproc-per-node 1})
      extra="$extra --parallel ${PAR_ARGS:-$par_default}" ;; esac
    # *_torchrun_fsdp: FSDP2 forced where one rank would only copy (bf16 masters), to measure what it costs
    case $1 in *_torchrun_fsdp) extra="$extra --shard-one-rank" ;; esac
    [ "${PROFILE:-0}" = 1 ] && extra="$extra --profile"
    # shellcheck disable=SC2086
    step "$1" 900 "${launch[@]}" benchmarks/train_step_4layers.py --experts $e --experts-per-token $k $extra \
      ${BENCH5_ARGS:---seq-lens 8192 --recompute-seq-lens 32768 --recompute-mode mlp --recompute-full-layers $full \
      --backends cudnn} \
      --out "$dir/$1.json" ;;
  train_step_compiled)  # benchmark 5, eager then compiled blocks, cudnn: the density by the GPU (H200: 112 experts)
    local e=16 k=8 full=0
    case $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1) in *H200*) e=112 k=16 full="1 2 4" ;; esac
    # shellcheck disable=SC2086
    step train_step_compiled 2400 python3 benchmarks/train_step_4layers.py --experts $e --experts-per-token $k \
      --compile --backends cudnn ${COMPILED_ARGS:---seq-lens 8192 --recompute-seq-lens 32768 --recompute-mode mlp \
      --recompute-full-layers $full} --out "$dir/train_step_compiled.json" ;;
  train_step_e16_policies)  # the torchrun row at 8K under each FSDP2 policy (POLICIES: reshard:reduce words), profiled
    for pol in ${POLICIES:-always:fp32:fp32 always:bf16:fp32 always:bf16:bf16 auto:bf16:bf16}; do
      IFS=: read -r rs rd ms <<< "$pol"
      # shellcheck disable=SC2086
      step "train_step_e16_torchrun_${rs}_${rd}_${ms}" 600 torchrun --standalone --nproc-per-node 1 \
        benchmarks/train_step_4layers.py --experts 16 --experts-per-token 8 --parallel --profile \
        --reshard-after-forward "$rs" --reduce-dtype "$rd" --masters "$ms" ${POLICY_BENCH5_ARGS:---seq-lens 8192 \
        --recompute-seq-lens --backends cudnn} --out "$dir/train_step_e16_torchrun_${rs}_${rd}_${ms}.json"
    done ;;
  init112)
    step init112 1500 python3 -m kimi_tools.cli init --preset k3.1-pro --layers 4 --out "$CKPT112" --force \
      --set num_experts=112 --set num_experts_per_token=16 &
    init112_pid=$! ;;
  validate112) wait_pid "${init112_pid:-}"; init112_pid=
    OUT=$dir/v112 CKPT=$CKPT112 step validate112 1200 bash benchmarks/validate_k31_4layers.sh ;;
  tests_main) KIMI_TEST_KDA_KERNELS=${KDA_TEST_KERNELS:-cudnn} step tests_main 1200 "${pytest_gpu[@]}" \
    tests/gpu/test_gpu_sparse_mla.py tests/gpu/test_gpu_kda_cudnn.py -k "not cu_seqlens_int32_and_int64" ;;
  tests_new) step tests_new 900 "${pytest_gpu[@]}" tests/gpu/test_gpu_hardening.py tests/gpu/test_gpu_generate.py \
    tests/gpu/test_gpu_situ.py tests/gpu/test_gpu_kda_prep.py tests/gpu/test_gpu_linear_cross_entropy.py \
    tests/gpu/test_gpu_lora_grad.py tests/gpu/test_gpu_distill.py ;;
  # the same files one step each (a hang costs one step)
  tests_kernels) step tests_kernels 600 "${pytest_gpu[@]}" tests/gpu/test_gpu_situ.py tests/gpu/test_gpu_kda_prep.py \
    tests/gpu/test_gpu_linear_cross_entropy.py ;;
  # CONV_TESTS_K: the default leaves out fla's conv cases (its causal_conv1d autotunes for every test shape)
  tests_conv) step tests_conv 900 "${pytest_gpu[@]}" tests/gpu/test_gpu_short_conv.py \
    tests/gpu/test_gpu_kda_cudnn.py -k "${CONV_TESTS_K:-short_conv and not fla}" ;;
  short_conv) step short_conv 600 python3 benchmarks/short_conv.py --out "$dir/short_conv.json" ;;
  tests_gen) step tests_gen 600 "${pytest_gpu[@]}" tests/gpu/test_gpu_generate.py tests/gpu/test_gpu_generate_captured.py ;;
  tests_distill) step tests_distill 500 "${pytest_gpu[@]}" tests/gpu/test_gpu_distill.py ;;
  # the rehearsal steps adamw-bf16 where kimi plan picks it, through torchao: run fp8_wheels first (carry .whl)
  # shellcheck disable=SC2086
  rank_rehearsal) step rank_rehearsal 900 python3 benchmarks/rank_rehearsal.py ${REHEARSAL_ARGS:---seq-len 8192} \
    --out "$dir/rank_rehearsal.json" ;;
  tests_fp8_model) step tests_fp8_model 400 "${pytest_gpu[@]}" tests/gpu/test_gpu_fp8.py -k tiny_model ;;
  tests_train_gpu) step tests_train_gpu 300 "${pytest_gpu[@]}" tests/test_train.py ;;
  tests_lora) step tests_lora 300 "${pytest_gpu[@]}" tests/gpu/test_gpu_lora_grad.py -k "not jax_grad" ;;
  tests_jaxgrad) step tests_jaxgrad 200 "${pytest_gpu[@]}" -o faulthandler_timeout=120 \
    tests/gpu/test_gpu_lora_grad.py -k jax_grad ;;
  # shellcheck disable=SC2046
  sparse_mla_fwd) step sparse_mla_fwd 400 python3 benchmarks/sparse_mla_fwd.py \
    $([ "${SWEEP:-0}" = 1 ] || echo --no-sweep) --out "$dir/sparse_mla_fwd.json" ;;
  # shellcheck disable=SC2086
  kda_layer) step kda_layer 900 python3 benchmarks/kda_layer.py --seq-lens 8192 32768 ${KDA_ARGS:-} \
    --out "$dir/kda_layer.json" && save_autotune ;;
  # shellcheck disable=SC2086
  kda_layer_es) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True step kda_layer_es 900 python3 benchmarks/kda_layer.py \
    --seq-lens 8192 32768 ${KDA_ARGS:-} --out "$dir/kda_layer_es.json" ;;
  validate) wait_init; OUT=$dir step validate 1200 bash benchmarks/validate_k31_4layers.sh ;;
  tests_dsa) KIMI_SPARSE_KERNEL=flash_mla step tests_dsa 900 "${pytest_gpu[@]}" tests/gpu/test_gpu_dsa_cudnn.py ;;
  # shellcheck disable=SC2086
  train_step_4layers) step train_step_4layers 900 python3 benchmarks/train_step_4layers.py \
    ${TRAIN_ARGS:---seq-lens 8192 --recompute-seq-lens 32768 --recompute-mode mlp --backends cudnn} \
    --out "$dir/train_step_4layers.json" ;;
  dsa_vs_dense_layer) step dsa_vs_dense_layer 600 python3 benchmarks/dsa_vs_dense_layer.py --breakdown \
    --sizes "${DSA_SIZES:-16384,32768,65536,131072}" --sdpa-max 0 --out "$dir/dsa_vs_dense_layer.json" ;;
  jax_oracle)
    wait_init
    text=$(alice_x3)
    step jax_oracle 900 python3 -m kimi_tools.cli compare --checkpoint "$CKPT" --text "$text" --tokens 2049 \
      --reference jax --backends cudnn,eager --dtype bfloat16 --device cuda --json "$dir/jax_oracle_T2049.json" \
      --quiet ;;
  compare_fp8)
    wait_init
    text=$(alice_x3)
    for T in ${LENGTHS:-4096 8192}; do
      step "compare_fp8_T$T" 600 python3 -m kimi_tools.cli compare --checkpoint "$CKPT" --text "$text" --tokens "$T" \
        --reference eager --backends cudnn --fp8 rowwise --dtype bfloat16 --device cuda \
        --json "$dir/compare_fp8_T$T.json"
    done ;;
  train_full | train_lora | train_fp8)
    wait_init
    step "$1" 600 bash benchmarks/train_4layers_h200.sh "${1#train_}" "$dir/$1" ;;
  # shellcheck disable=SC2086
  generate_decode) step generate_decode 900 python3 benchmarks/generate_decode.py \
    ${GEN_ARGS:---modes loop static graph compile} --out "$dir/generate_decode.json" ;;
  tests_fla)  # everything again on the other kernels: fla's KDA, the Triton sparse forward in the DSA layer
    KIMI_TEST_KDA_KERNELS=fla KIMI_SPARSE_KERNEL=triton step tests_fla 1200 "${pytest_gpu[@]}" tests/gpu
    save_autotune ;;
  # optional
  tests_fla_ops) KIMI_TEST_KDA_KERNELS=fla KIMI_SPARSE_KERNEL=triton step tests_fla_ops 900 "${pytest_gpu[@]}" \
    tests/gpu/test_gpu_kda_cudnn.py tests/gpu/test_gpu_dsa_cudnn.py tests/gpu/test_gpu_short_conv.py
    save_autotune ;;
  situ_glu) step situ_glu 300 python3 benchmarks/situ_glu.py --out "$dir/situ_glu.json" ;;
  tests_offload) step tests_offload 300 "${pytest_gpu[@]}" tests/gpu/test_gpu_offload.py ;;
  host_optimizer) step host_optimizer 600 python3 benchmarks/host_optimizer.py ${HOST_OPT_ARGS:---numel 2e9} \
    --out "$dir/host_optimizer.json" ;;
  offload_copy) step offload_copy 300 python3 benchmarks/offload_copy.py --out "$dir/offload_copy.json" ;;
  train_step_offload)  # benchmark 5's 8K row under each recompute:offload policy (none:none is the baseline)
    for pol in ${ACT_POLICIES:-none:none attn:none mlp:attn attn:mlp none:all}; do
      IFS=: read -r rc off <<< "$pol"
      local lens=(--seq-lens 8192 --recompute-seq-lens)
      [ "$rc" != none ] && lens=(--seq-lens --recompute-seq-lens 8192 --recompute-mode "$rc")
      step "train_step_offload_${rc}_${off}" 600 python3 benchmarks/train_step_4layers.py --experts 16 \
        --experts-per-token 8 --backends cudnn "${lens[@]}" --offload-activations "$off" \
        --out "$dir/train_step_offload_${rc}_${off}.json"
    done ;;
  indexer_topk) step indexer_topk 400 python3 benchmarks/indexer_topk.py --out "$dir/indexer_topk.json" ;;
  profile)
    ncu_one=("$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)" --clock-control none
             --launch-count 1 --import-source no)
    sparse_call=(-k regex:_sparse_mla_fwd_kernel --launch-skip 1 python3 benchmarks/sparse_mla_fwd.py --profile-call 8192)
    ops=sm__ops_path_tensor_src_bf16_dst_fp32.sum,gpu__time_duration.sum
    step ncu_sparse_mla 300 "${ncu_one[@]}" --set full "${sparse_call[@]}"
    step ncu_tensor_ops 300 "${ncu_one[@]}" --metrics "$ops" "${sparse_call[@]}"
    step ncu_matmul_ops 120 "${ncu_one[@]}" --metrics "$ops" -k 'regex:gemm|nvjet|cutlass|xmma' python3 -c \
      'import torch; a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16); a @ a; torch.cuda.synchronize()'
    step indexer_profile 300 python3 benchmarks/indexer_topk.py --profile 8192 --out "$dir/indexer_topk_profile.json" ;;
  *) echo "$1 unknown step (see the list at the top of run_h200.sh)" >> "$dir/status.txt" ;;
  esac
}

run_lanes() {  # run_lanes "a,b+c": lanes split by '+' run side by side, the steps of a lane (split by ',') in order
  wait_init
  local lane pids=()
  IFS='+' read -ra lanes <<< "$1"
  for lane in "${lanes[@]}"; do
    case ",$lane," in  # a step that starts in the background must be a word of its own (its pid stays in a lane)
    *,init,* | *,init112,* | *,,*) echo "lanes '$1': init, init112 and empty steps go outside lanes" >> "$dir/status.txt"
      return 1 ;;
    esac
  done
  for lane in "${lanes[@]}"; do
    ( IFS=',' read -ra steps <<< "$lane"; for s in "${steps[@]}"; do run_step "$s"; done ) &
    pids+=($!)
  done
  wait "${pids[@]}"
}

for name in ${STEPS:-$default_steps}; do  # in the order given
  case $name in
  *[+,]*) run_lanes "$name" ;;
  *) run_step "$name" ;;
  esac
done
wait_init
wait_pid "${init112_pid:-}"  # a checkpoint being written when no step read it
echo "done at $(( $(date +%s) - t0 ))s" >> "$dir/status.txt"
touch "$dir/DONE"
