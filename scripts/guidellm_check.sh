#!/usr/bin/env bash
# An unmodified external client against `ridgefill serve`: guidellm (openai_http backend,
# /v1/completions, a local tokenizer, offline). Runs on loopback only and stops by itself.
#   bash scripts/guidellm_check.sh [port]          -> benchmarks/guidellm_concurrent2.json + console table
#   bash scripts/guidellm_check.sh [port] sweep    -> benchmarks/guidellm_sweep.json: synchronous,
#       throughput, then constant rates between them (guidellm's sweep), 8 requests each
# guidellm lives in its own venv (.guidellm-venv): its dependency pins differ from ours.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PORT="${1:-8555}"
PROFILE="${2:-concurrent}"
GL=.guidellm-venv
[[ -x "$GL/bin/guidellm" ]] || { python3 -m venv "$GL" && "$GL/bin/pip" install -q "guidellm==0.8.1"; }

source scripts/serve_embedded_for_client.sh

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$GL/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=/v1/completions" \
    --tokenizer "kind=huggingface_auto,model=$TOK" \
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=32 \
    $(if [[ $PROFILE == sweep ]]; then echo "--profile kind=sweep,sweep_size=5"; else echo "--profile kind=concurrent,streams=2"; fi) \
    --constraint kind=max_requests,count=8 \
    --output "kind=json,path=benchmarks/guidellm_$([[ $PROFILE == sweep ]] && echo sweep || echo concurrent2).json" \
    --disable-console-interactive
