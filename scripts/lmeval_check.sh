#!/usr/bin/env bash
# EleutherAI's lm-eval, unmodified, against `ridgefill serve` through its local-completions model:
# a local 4-way log-likelihood task (30 questions) and a local generate_until task (30 words),
# both written here (no dataset download), then lm-eval's log-likelihoods against `ridgefill
# score`'s on the same texts (scripts/lmeval_compare.py). Loopback only; stops by itself.
#   bash scripts/lmeval_check.sh [port]   -> benchmarks/lmeval/ (lm-eval's results and per-sample
#                                           logs, comparison.json, run.log)
#   bash scripts/lmeval_check.sh [port] remote -> benchmarks/lmeval_remote/: the same, with lm-eval's
#       remote tokenizer backend (GET /tokenizer_info, POST /tokenize and /detokenize) in place of
#       a local copy of the tokenizer
# lm-eval lives in its own venv (.lmeval-venv): its dependency pins differ from ours. The API
# model needs no torch: "lm-eval[api]" and transformers (for the tokenizer) only.
# RIDGEFILL_PYTHON: the project's Python (default .venv/bin/python, as scripts/install.sh makes).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT="$PWD"
PORT="${1:-8566}"
BACKEND="${2:-huggingface}"  # lm-eval's tokenizer_backend: huggingface (a local copy) or remote (the server's)
PY="${RIDGEFILL_PYTHON:-.venv/bin/python}"
LE="${LMEVAL_VENV:-.lmeval-venv}"
OUT=benchmarks/lmeval$([[ $BACKEND == remote ]] && echo _remote || true)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this tree's ridgefill, whichever Python runs it

[[ -x "$LE/bin/lm_eval" ]] || { python3 -m venv "$LE" && "$LE/bin/pip" install -q "lm-eval[api]==0.4.13" "transformers>=4.40"; }

WORK="$(mktemp -d)"
"$PY" scripts/lmeval_compare.py tasks "$WORK/tasks"
"$PY" -m ridgefill_runtime.loader.export_tokenizer "$WORK/tokenizer"  # the served model's, for lm-eval

"$PY" -m ridgefill_server serve --threads 2 --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; rm -rf "$WORK"' EXIT  # NOTE: a failed kill in the trap would be the exit status
for _ in $(seq 1 180); do
    curl -s -o /dev/null -w "%{http_code}" "127.0.0.1:$PORT/health" | grep -q 200 && break
    kill -0 $SERVER 2>/dev/null || { tail -20 "$WORK/server.log"; exit 1; }
    sleep 1
done

rm -rf "$OUT/results"
mkdir -p "$OUT"
HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$LE/bin/lm_eval" run \
    --model local-completions \
    --model_args "base_url=http://127.0.0.1:$PORT/v1/completions,model=ridgefill,$([[ $BACKEND == remote ]] && echo tokenizer_backend=remote || echo tokenizer_backend=huggingface,tokenizer=$WORK/tokenizer),tokenized_requests=True,num_concurrent=1,max_retries=1,timeout=120" \
    --tasks ridgefill_capitals,ridgefill_repeat --include_path "$WORK/tasks" \
    --batch_size 1 --log_samples --output_path "$OUT/results" 2>&1 | tee "$OUT/run.log"

kill $SERVER; wait $SERVER 2>/dev/null || true
SAMPLES="$(find "$OUT/results" -name 'samples_ridgefill_capitals_*.jsonl' | head -1)"
"$PY" scripts/lmeval_compare.py compare "$SAMPLES" "$OUT/comparison.json" | tee -a "$OUT/run.log"
