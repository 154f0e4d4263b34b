#!/usr/bin/env bash
# On a machine with a CUDA GPU: build the extension, run the GPU tests, then
# the GPU benchmarks (outputs under $OUT, or /tmp/gpu_check). Budget: under 10
# minutes on an H200 (build ~1-2 min for one arch on 16 cores, tests ~2-3 min,
# benchmarks ~4 min);
# each stage has its own timeout so an overrun fails loudly instead of eating
# the whole lease.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
start=$SECONDS

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU visible (nvidia-smi -L failed)" >&2
    exit 2
fi
nvidia-smi -L

# Only the local GPU's architecture: a 3-arch build is for wheels and CI.
if [[ -z "${TORCH_CUDA_ARCH_LIST:-}" ]]; then
    cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | tr -d ' ')"
    export TORCH_CUDA_ARCH_LIST="$cc"
fi
echo "gpu_check: TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

timeout 240 bash scripts/install.sh
echo "gpu_check: install done at $((SECONDS - start))s"

name=gpu_check
source scripts/gpu_check_stages.sh
