# The tests and benchmarks of a GPU check, shared by scripts/gpu_check.sh (NVIDIA) and
# scripts/gpu_check_rocm.sh (AMD): sourced after the extension is built. Needs $start (the check's
# start, in $SECONDS) and $name (its log prefix); writes under ${OUT:-/tmp/$name} and exits with
# the GPU tests' status. ROCm torch exposes AMD GPUs as "cuda", so the same commands serve both.
export RIDGEFILL_REQUIRE_EXTENSION=1
out="${OUT:-/tmp/$name}"
mkdir -p "$out"
.venv/bin/python -c 'import torch; p = torch.cuda.get_device_properties(0); print(p.name, torch.version.hip or torch.version.cuda)' \
    | tee "$out/device.txt"
# The kernels (attention with split-KV, packed weights, GDN, RIPE, maps) against their references,
# then the engine's decode graphs against eager execution.
timeout 240 .venv/bin/python -m pytest -m gpu -q -p no:cacheprovider tests/ops tests/models/test_looped_gpu.py \
    tests/engine/test_decode_graphs.py 2>&1 | tee "$out/gpu_tests.txt" || tests_rc=$?
echo "$name: gpu tests done at $((SECONDS - start))s (rc ${tests_rc:-0}); the benchmarks run either way"

# Also the CPU suite once with the extension loaded (schema/fake checks).
timeout 120 .venv/bin/python -m pytest -q -p no:cacheprovider tests/ops/test_extension_build.py

# Benchmarks, each printing its own table: kernels, the packed weight sweep, split-KV attention,
# decode with and without graphs against transformers.
timeout 120 .venv/bin/python benchmarks/cuda_kernels.py 2>&1 | tee "$out/kernels.txt"
timeout 90 .venv/bin/python benchmarks/packed_sweep.py --device cuda 2>&1 | tee "$out/packed_sweep_cuda.txt" || true
timeout 120 .venv/bin/python benchmarks/paged_attention_cuda.py --out "$out/paged_attention_cuda.json" 2>&1 \
    | tee "$out/paged_attention_cuda.txt" || true
timeout 180 .venv/bin/python benchmarks/decode_cuda.py --context 1024 --new 64 --batches 1 4 16 64 \
    --out "$out/decode_cuda.json" 2>&1 | tee "$out/decode_cuda.txt" || true
echo "$name: finished in $((SECONDS - start))s"
exit "${tests_rc:-0}"
