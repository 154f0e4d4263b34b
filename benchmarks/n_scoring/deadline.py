"""A scoring request past its `timeout` stops computing its prompt (issue 32).

One `ridgefill serve` (embedded SmolLM2, default settings, --threads T); a ~6,000-token prompt
with `echo: true, logprobs: 20, max_tokens: 1`, first with `timeout: 2`, then without. Prints the
wall time, finish reason and how many prompt rows were scored.

    .venv/bin/python benchmarks/n_scoring/deadline.py --threads 2
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from serving import start_server  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=2.0)
    ap.add_argument("--port", type=int, default=8799)
    args = ap.parse_args()
    proc = start_server(["--threads", str(args.threads)], args.port)
    prompt = " ".join(f"w{i % 500}" for i in range(1600))
    print(f"threads={args.threads}; echo + logprobs 20 + max_tokens 1; chunk_size 512 (default)\n")
    print("| timeout | HTTP | wall s | finish | prompt tokens | rows scored |")
    print("|---|---|---|---|---|---|")
    try:
        for timeout in (args.timeout, None):
            body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 20}
            if timeout is not None:
                body["timeout"] = timeout
            t = time.monotonic()
            r = httpx.post(f"http://127.0.0.1:{args.port}/v1/completions", json=body, timeout=900)
            wall = time.monotonic() - t
            reply = r.json()
            choice = reply["choices"][0]
            scored = sum(lp is not None for lp in choice["logprobs"]["token_logprobs"])
            print(
                f"| {timeout or 'none'} | {r.status_code} | {wall:.2f} | {choice['finish_reason']} | "
                f"{reply['usage']['prompt_tokens']:,} | {scored:,} |"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
