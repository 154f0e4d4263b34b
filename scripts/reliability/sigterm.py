"""SIGTERM against a `serve` subprocess with 8 streams running and a stalled request (a
body that declares 1000 bytes and sends 10, from a client that never reads): reports how
long the drain took, the exit status, how each stream ended and what the server logged.
Loopback only; ends by itself (grace + about a minute).

    .venv/bin/python scripts/reliability/sigterm.py [--grace 10 --max-tokens 400]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _server import Server  # noqa: E402


def stream(url: str, max_tokens: int, started: threading.Event, outcome: list) -> None:
    body = {
        "prompt": "Write a long story about a lighthouse.",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    tokens, end = 0, "cut (no [DONE])"
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    end = end if end != "cut (no [DONE])" else "done"
                    break
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    end = f"error event: {chunk['error']['message']}"
                    continue
                tokens += 1
                started.set()
                reason = chunk["choices"][0]["finish_reason"]
                if reason:
                    end = f"finish_reason {reason}"
    except httpx.HTTPError as e:
        end = f"connection error: {type(e).__name__}"
    started.set()
    outcome.append((tokens, end))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--max-tokens", type=int, default=400, help="per stream; more than the grace allows")
    args = p.parse_args()
    srv = Server("--num-blocks", "256", "--max-num-seqs", str(args.streams), "--shutdown-grace-s", str(args.grace))
    try:
        outcomes: list = []
        threads = []
        for _ in range(args.streams):
            started = threading.Event()
            t = threading.Thread(target=stream, args=(srv.url, args.max_tokens, started, outcomes), daemon=True)
            t.start()
            threads.append((t, started))
        for _, started in threads:
            started.wait(120)
        stalled = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
        stalled.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"prompt":'
        )
        time.sleep(0.5)
        lines_before = len(srv.log)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        try:
            rc = srv.proc.wait(args.grace + 60)
        except subprocess.TimeoutExpired:
            rc = "did not exit (killed)"
        drain_s = time.monotonic() - t0
        for t, _ in threads:
            t.join(10)
        stalled.settimeout(1)
        try:
            answer = stalled.recv(65536).split(b"\r\n", 1)[0].decode() or "closed, no answer"
        except OSError as e:
            answer = f"no answer ({type(e).__name__})"
        stalled.close()
    finally:
        srv.stop()
    print(
        f"SIGTERM with {args.streams} streams ({args.max_tokens} tokens each) and a stalled request: "
        f"exit status {rc} after {drain_s:.1f} s (grace {args.grace:g} s)"
    )
    for tokens, end in sorted(outcomes):
        print(f"  stream: {tokens} chunks, then {end}")
    print(f"  stalled request: {answer}")
    log = srv.non_access_lines(lines_before)
    print(
        f"server log after SIGTERM: {len(log)} lines besides access lines, "
        f"{sum('Traceback' in line for line in log)} tracebacks"
    )
    for line in log[:12]:
        print("  log:", line.rstrip()[:160])
    return 0


if __name__ == "__main__":
    sys.exit(main())
