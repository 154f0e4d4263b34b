#!/usr/bin/env bash
# Start `ridgefill serve` on a free loopback port, wait for /health, send one completion,
# check that text came back, then stop the server with SIGTERM and check it exited 0.
# Extra args go to `ridgefill serve`. Used by .ci/run (the first request of a fresh install).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY=.venv/bin/python
PORT="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
LOG="$(mktemp -t ridgefill-serve.XXXXXX.log)"
.venv/bin/ridgefill serve --host 127.0.0.1 --port "$PORT" "$@" >"$LOG" 2>&1 &
SERVER=$!
trap 'kill -9 "$SERVER" 2>/dev/null || true' EXIT

start=$SECONDS
until curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; do
    if ! kill -0 "$SERVER" 2>/dev/null; then
        echo "smoke: the server exited before it was ready; its log:" >&2; cat "$LOG" >&2; exit 1
    fi
    if (( SECONDS - start > 600 )); then
        echo "smoke: /health not ready after 600 s; the server's log:" >&2; cat "$LOG" >&2; exit 1
    fi
    sleep 0.5
done
echo "smoke: ready in $((SECONDS - start)) s"

body='{"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'
answer="$(curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'Content-Type: application/json' -d "$body")" \
    || { echo "smoke: the completion request failed; the server's log:" >&2; cat "$LOG" >&2; exit 1; }
"$PY" - "$answer" <<'PYCHECK'
import json, sys
reply = json.loads(sys.argv[1])
text, usage = reply["choices"][0]["text"], reply["usage"]
assert text.strip() and usage["completion_tokens"] > 0, reply
print(f"smoke: answered {usage['completion_tokens']} tokens: {text!r}")
PYCHECK

kill -TERM "$SERVER"
if wait "$SERVER"; then
    echo "smoke: the server stopped cleanly on SIGTERM"
else
    rc=$?
    echo "smoke: the server exited with $rc on SIGTERM; its log:" >&2; cat "$LOG" >&2; exit 1
fi
trap - EXIT
