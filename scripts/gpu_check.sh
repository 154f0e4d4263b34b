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

export RIDGEFILL_REQUIRE_EXTENSION=1
out="${OUT:-/tmp/gpu_check}"
mkdir -p "$out"
# The kernels (attention with split-KV, packed weights, GDN, RIPE, maps) against their references,
# then the engine's decode graphs against eager CUDA.
timeout 240 .venv/bin/python -m pytest -m gpu -q -p no:cacheprovider tests/ops tests/models/test_looped_gpu.py \
    tests/engine/test_decode_graphs.py 2>&1 | tee "$out/gpu_tests.txt" || tests_rc=$?
echo "gpu_check: gpu tests done at $((SECONDS - start))s (rc ${tests_rc:-0}); the benchmarks run either way"

# Also the CPU suite once with the extension loaded (schema/fake checks).
timeout 120 .venv/bin/python -m pytest -q -p no:cacheprovider tests/ops/test_extension_build.py

# Benchmarks, each printing its own table: kernels, the packed weight sweep, split-KV attention,
# decode with and without CUDA graphs against transformers.
timeout 120 .venv/bin/python benchmarks/cuda_kernels.py 2>&1 | tee "$out/kernels.txt"
timeout 90 .venv/bin/python benchmarks/packed_sweep.py --device cuda 2>&1 | tee "$out/packed_sweep_cuda.txt" || true
timeout 120 .venv/bin/python benchmarks/paged_attention_cuda.py --out "$out/paged_attention_cuda.json" 2>&1 \
    | tee "$out/paged_attention_cuda.txt" || true
timeout 180 .venv/bin/python benchmarks/decode_cuda.py --context 1024 --new 64 --batches 1 4 16 64 \
    --out "$out/decode_cuda.json" 2>&1 | tee "$out/decode_cuda.txt" || true
echo "gpu_check: finished in $((SECONDS - start))s"
exit "${tests_rc:-0}"
