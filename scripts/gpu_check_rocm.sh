#!/usr/bin/env bash
# On a machine with an AMD GPU and ROCm: build the extension with hipcc for the local GPU, run the
# GPU tests, then the GPU benchmarks (outputs under $OUT, or /tmp/gpu_check_rocm). The ROCm twin
# of scripts/gpu_check.sh: same tests, same benchmarks, same budget (under 10 minutes; each stage
# has its own timeout so an overrun fails loudly).
#
# Needs a ROCm build of torch in .venv first (install.sh keeps a torch that already satisfies its
# pin, and ROCm builds carry a +rocm local version), e.g.
#   python3 -m venv .venv && .venv/bin/pip install torch==2.14.1 --index-url https://download.pytorch.org/whl/rocm7.1
# and rocWMMA's headers (ROCm's rocwmma-dev package; the int8 map GEMM's tensor-core path).
# NOTE: never run on AMD hardware by this project so far; scripts/hip_check.sh is the compile
# check that CI runs without a GPU.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS

if ! command -v rocminfo >/dev/null || ! rocminfo >/dev/null 2>&1; then
    echo "gpu_check_rocm: no AMD GPU visible (rocminfo failed)" >&2
    exit 2
fi
if ! .venv/bin/python -c 'import sys, torch; sys.exit(0 if torch.version.hip else 1)' 2>/dev/null; then
    echo "gpu_check_rocm: .venv has no ROCm build of torch; install one first (see this script's header)" >&2
    exit 2
fi

# Only the local GPU's architecture (gfx942, gfx1201, ...): a multi-arch build is for wheels.
if [[ -z "${PYTORCH_ROCM_ARCH:-}" ]]; then
    PYTORCH_ROCM_ARCH="$(rocminfo | grep -o -m 1 'gfx[0-9a-f]*')"
    export PYTORCH_ROCM_ARCH
fi
echo "gpu_check_rocm: PYTORCH_ROCM_ARCH=$PYTORCH_ROCM_ARCH"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

timeout 300 bash scripts/install.sh
echo "gpu_check_rocm: install done at $((SECONDS - start))s"

name=gpu_check_rocm
source scripts/gpu_check_stages.sh
