"""One scoring request with n choices against n = 1 (issue 32): echo, logprobs 20, a long prompt,
max_tokens 1, through a real `ridgefill serve` (embedded SmolLM2). Before issue 32's change each
choice scored the prompt itself (n full prefills, every row's logits); now choice 0 scores it
and the others start from its published blocks.

Prints the wall time of each request and the server's RSS growth across it, n = 1 then n = 16,
alternated --reps times, one server, one request at a time.

  .venv/bin/python benchmarks/n_scoring/bench.py --threads 2 --tokens 6000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "reliability"))

from _server import rss_mib, serve  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--tokens", type=int, default=6000)
    p.add_argument("--n", type=int, default=16)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    rows = []
    with serve("--threads", str(args.threads), "--num-blocks", "2048") as srv:
        ids = httpx.post(
            srv.url + "/tokenize", json={"prompt": "The river mill ground wheat for the valley. " * 1200}, timeout=120
        ).json()["tokens"][: args.tokens]
        for rep in range(args.reps):
            for n in (1, args.n):
                body = {"prompt": ids, "max_tokens": 1, "echo": True, "logprobs": 20, "n": n, "temperature": 0}
                rss0 = rss_mib(srv.proc.pid)
                t0 = time.perf_counter()
                r = httpx.post(srv.url + "/v1/completions", json=body, timeout=3600)
                seconds = time.perf_counter() - t0
                assert r.status_code == 200, r.text
                out = r.json()
                cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
                rows.append(
                    {
                        "rep": rep,
                        "n": n,
                        "seconds": seconds,
                        "rss_growth_mib": rss_mib(srv.proc.pid) - rss0,
                        "rss_mib": rss_mib(srv.proc.pid),
                        "choices": len(out["choices"]),
                        "cached_tokens_min": cached,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    one = statistics.median(r["seconds"] for r in rows if r["n"] == 1)
    many = statistics.median(r["seconds"] for r in rows if r["n"] == args.n)
    print(f"threads {args.threads}, {args.tokens} prompt tokens, echo + logprobs 20, max_tokens 1")
    print(f"n = 1: {one:.1f} s; n = {args.n}: {many:.1f} s; ratio {many / one:.2f} (median of {args.reps})")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "n1_s": one, "n_s": many, "ratio": many / one}, indent=1))


if __name__ == "__main__":
    main()
