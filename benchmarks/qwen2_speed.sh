#!/usr/bin/env bash
# Issue 29's speed runs on the two Qwen2.5-Coder GGUFs, one after another on a quiet machine (no
# helper, build or test beside them), 2 threads: decode and prefill against llama.cpp on the same
# files, and the fill's time to first token on the 0.5B at its shipped split. Outputs beside this file.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=benchmarks/qwen2_speed
mkdir -p $OUT
uptime | tee $OUT/load.txt
for m in qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
    .venv/bin/python benchmarks/decode.py --threads 2 --model $m --context 1024 --new 32 --batches 1 4 \
        --weights packed --no-hf --rounds 3 --out $OUT/decode_$m.json | tee $OUT/decode_$m.txt
done
.venv/bin/python benchmarks/prefill.py --threads 2 --model qwen2.5-coder-0.5b --llama-cpp --no-hf \
    --lengths 1024 4096 --reps 2 | tee $OUT/prefill_qwen2.5-coder-0.5b.txt
.venv/bin/python benchmarks/prefill.py --threads 2 --model qwen2.5-coder-1.5b --llama-cpp --no-hf \
    --lengths 1024 --reps 2 | tee $OUT/prefill_qwen2.5-coder-1.5b.txt
.venv/bin/python benchmarks/fill_speed.py --threads 2 --model qwen2.5-coder-0.5b --split 12 --lengths 4096 --reps 2 \
    | tee benchmarks/fidelity_by_size/qwen2.5-coder-0.5b-fill_speed.txt
uptime | tee -a $OUT/load.txt
