#!/usr/bin/env bash
# `vllm bench serve`, unmodified, against `ridgefill serve` (the embedded model, 2 threads,
# loopback): random 256-token prompts, 32 tokens out, 16 prompts at concurrency 2, streamed, on
# /v1/completions and on /v1/chat/completions.
#   bash scripts/vllm_bench_check.sh [port]   -> benchmarks/vllm_bench/{completions,chat}.json
# vLLM lives in its own venv ($VLLM_VENV, default .vllm-venv; ~9.5 GB: its torch and CUDA
# wheels). vLLM 0.33.0 installs from PyPI on this CPU-only machine and its benchmark client runs
# without a GPU; only the client is used.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PORT="${1:-8556}"
VV="${VLLM_VENV:-.vllm-venv}"
[[ -x "$VV/bin/vllm" ]] || { python3 -m venv "$VV" && "$VV/bin/pip" install -q "vllm==0.33.0"; }

source scripts/serve_embedded_for_client.sh

mkdir -p benchmarks/vllm_bench
for ENDPOINT in completions chat; do
    if [[ $ENDPOINT == chat ]]; then BACKEND=openai-chat; PATH_=/v1/chat/completions; else BACKEND=openai; PATH_=/v1/completions; fi
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$VV/bin/vllm" bench serve \
        --backend "$BACKEND" --base-url "http://127.0.0.1:$PORT" --endpoint "$PATH_" \
        --model ridgefill --tokenizer "$TOK" \
        --dataset-name random --random-input-len 256 --random-output-len 32 --num-prompts 16 \
        --max-concurrency 2 --ignore-eos --seed 0 \
        --save-result --result-dir benchmarks/vllm_bench --result-filename "$ENDPOINT.json"
done
