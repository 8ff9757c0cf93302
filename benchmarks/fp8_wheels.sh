#!/usr/bin/env bash
# torchao for the H200 machine (torch 2.11.0+cu130, Python 3.12, no package index; kernels_torch.fp8), as one wheel
# in .whl/ (listed in git's info/exclude, so it travels only when a device call carries it).
#
#   bash benchmarks/fp8_wheels.sh          (from the project root, on the CPU machine; downloads .whl/torchao-*.whl)
#
# torchao 0.18.0: the newest release, built against torch 2.11 (its __init__ loads its C++ extensions for torch
# >= 2.11.0; torchao 0.17.0 was the first built that way, 0.16.0 wants torch 2.10.0 exactly); torchao.float8 and the
# MoE training prototype's Float8TrainingOpConfig (FP8 rowwise grouped GEMMs on SM90) are pure Python and Triton. The
# wheel is cp310-abi3, 3.4 MB, and declares no dependencies (torch and triton are the machine's own).
#
# On the H200, in each device call that needs it: carry [".whl"] (beside the GPU wheels' part if those are needed
# too: ../shared/gpu/README.md) and begin the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PYTHONPATH || exit;
# then check: python3 -c "import torchao, torchao.float8, torchao.prototype.moe_training; print(torchao.__version__)"
#
# Transformer Engine is not used: transformer-engine-torch 2.20.2 is a source distribution only on PyPI (498 kB) whose
# build either fetches a prebuilt wheel for the exact torch version from GitHub (unreachable from the H200) or compiles
# its CUDA extension against the installed torch; its core wheel transformer-engine-cu13 2.20.2 is 276.5 MB, over
# the 64 MiB a device call can carry; and its te.Linear / te.GroupedLinear would replace this model's modules.
set -euo pipefail
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl torchao==0.18.0
ls -l .whl/torchao-0.18.0-*.whl
