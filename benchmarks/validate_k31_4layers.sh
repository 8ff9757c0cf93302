#!/usr/bin/env bash
# H200 validation (issue: cudnn backend): the first four layers of a real-dimension K3.1 checkpoint written by
# `kimi init --preset k3.1-pro --layers 4` (routed experts shrunk to fit: 16 experts, 8 per token; every other
# dimension real), single-document inputs of 4,096 and 8,192 tokens (longer than index_topk = 2,048, so selection is
# real), `cudnn` and `sdpa` (bf16) against the `eager` twin in fp32 as the oracle (`--reference eager`), per layer,
# through `kimi compare`. The JAX reference itself is too slow at this size (2026-11-30 on the H200: 70 s for layer 0
# alone at 4,096 tokens, op by op); it checks the eager twin on the CPU at small sizes instead (tests/, kimi compare).
#
#   bash benchmarks/validate_k31_4layers.sh            # reports under $OUT (or runs/validate); LENGTHS="8192" for one
set -euo pipefail
out=${OUT:-runs/validate}
mkdir -p "$out"
ck=${CKPT:-/tmp/k31-4layers}
export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform  # share the GPU with torch
kimi() { python3 -m kimi_tools.cli "$@"; }
[ -f "$ck/model.safetensors.index.json" ] || \
  kimi init --preset k3.1-pro --layers 4 --out "$ck" --force --set num_experts=16 --set num_experts_per_token=8
# Real English text, repeated to reach 8,192 byte-level tokens (the init checkpoint has no tiktoken.model).
text="${TMPDIR:-/tmp}/alice_x3.txt"
for _ in 1 2 3; do cat kimi/data/alice_ch1.txt; done > "$text"
for T in ${LENGTHS:-4096 8192}; do
  kimi compare --checkpoint "$ck" --text "$text" --tokens "$T" --reference eager --backends "${BACKENDS:-eager,sdpa,cudnn}" \
    --dtype bfloat16 --device cuda --json "$out/compare_T$T.json" --quiet 2>&1 | tee "$out/compare_T$T.txt" || true
done
