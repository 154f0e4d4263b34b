#!/usr/bin/env bash
# An unmodified external client against `ridgefill serve`: guidellm (openai_http backend,
# /v1/completions, a local tokenizer, offline). Runs on loopback only and stops by itself.
#   bash scripts/guidellm_check.sh [port]     -> benchmarks/guidellm_concurrent2.json + console table
# guidellm lives in its own venv (.guidellm-venv): its dependency pins differ from ours.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PORT="${1:-8555}"
GL=.guidellm-venv
[[ -x "$GL/bin/guidellm" ]] || { python3 -m venv "$GL" && "$GL/bin/pip" install -q "guidellm==0.8.1"; }

# A tokenizer folder guidellm's transformers can load offline: the embedded model's own BPE.
TOK="$(mktemp -d)"
.venv/bin/python - "$TOK" <<'PY'
import json, sys
from pathlib import Path
from ridgefill_runtime.loader.load import load_checkpoint
tok = load_checkpoint(None).tokenizer
out = Path(sys.argv[1])
tok.backend.save(str(out / "tokenizer.json"))
(out / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
    "model_max_length": 8192}))
PY

.venv/bin/ridgefill serve --threads 2 --port "$PORT" > "$TOK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; rm -rf "$TOK"' EXIT
for _ in $(seq 1 120); do
    curl -s -o /dev/null -w "%{http_code}" "127.0.0.1:$PORT/health" | grep -q 200 && break
    sleep 1
done

HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$GL/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT,request_format=/v1/completions" \
    --tokenizer "kind=huggingface_auto,model=$TOK" \
    --data kind=synthetic_text,prompt_tokens=256,output_tokens=32 \
    --profile kind=concurrent,streams=2 --constraint kind=max_requests,count=8 \
    --output kind=json,path=benchmarks/guidellm_concurrent2.json --disable-console-interactive
