# Sourced by the external-client checks (guidellm_check.sh, vllm_bench_check.sh): exports the
# embedded model's tokenizer to a folder Hugging Face's transformers loads offline ($TOK), and
# starts `ridgefill serve` on loopback port $PORT (2 threads), stopped when the script exits.

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
    "model_max_length": 8192, "chat_template": tok.chat_template}))
PY

.venv/bin/ridgefill serve --threads 2 --port "$PORT" > "$TOK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; rm -rf "$TOK"' EXIT
for _ in $(seq 1 120); do
    curl -s -o /dev/null -w "%{http_code}" "127.0.0.1:$PORT/health" | grep -q 200 && break
    sleep 1
done
