"""The served decode before and after issue 15, one run: `ridgefill serve` on the embedded
SmolLM2-135M (Q4_1 GGUF) under the load-test client at C = 1, 4, 16 users, each request a
~1K-token real-text prompt and `--output-tokens` greedy, streamed tokens.

"before" is a checkout of `--before` (default: the commit before this issue's work) served as
it was; "after" is this tree with its defaults (packed weights, the batched paged attention).

    git worktree add /tmp/rf_before b761f9d
    .venv/bin/python benchmarks/decode_loadtest.py --threads 2 --before-tree /tmp/rf_before

Two settings of one tree: `--before-tree .` with `--before-args` / `--after-args` (extra `serve`
flags for each arm), e.g. `--after-args "--prefill-budget-with-decodes 256"`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from serving import ROOT, start_server


def run_clients(port: int, users: int, args, out: Path) -> dict:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ridgefill_clients.loadtest",
            "plain",
            "--url",
            f"http://127.0.0.1:{port}",
            "--num-prompts",
            str(args.requests_per_user * users),
            "--max-concurrency",
            str(users),
            "--rate",
            "inf",
            "--prompt-tokens",
            str(args.prompt_tokens),
            "--output-tokens",
            str(args.output_tokens),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL,
    )
    return json.loads(out.read_text())["summary"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--before-tree", type=Path, required=True, help="a checkout of the code before the change")
    ap.add_argument("--users", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests-per-user", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "decode_loadtest")
    ap.add_argument("--before-args", default="", help="extra serve flags for the before arm")
    ap.add_argument("--after-args", default="", help="extra serve flags for the after arm")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    config = args.out / "serve.toml"
    config.write_text(f"[scheduler]\nmax_num_seqs = {max(args.users)}\n[cache]\nkv_cache_gib = 1.0\n")
    results: dict[str, dict[int, dict]] = {}
    arms = (("before", args.before_tree.resolve(), 8751, args.before_args), ("after", ROOT, 8752, args.after_args))
    for label, root, port, extra in arms:
        proc = start_server(["--config", str(config), "--threads", str(args.threads), *shlex.split(extra)], port, root)
        try:
            results[label] = {c: run_clients(port, c, args, args.out / f"{label}_c{c}.json") for c in args.users}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(
        f"threads={args.threads}; {args.requests_per_user} requests per user of {args.prompt_tokens} prompt / "
        f"{args.output_tokens} output tokens, greedy, streamed; before = {args.before_tree} {args.before_args}; "
        f"after = this tree {args.after_args}"
    )
    print("| users C | code | output tok/s | TTFT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | failed |")
    print("|---|---|---|---|---|---|---|")
    for c in args.users:
        for label in results:
            s = results[label][c]
            print(
                f"| {c} | {label} | {s['output_throughput_tok_s']:.1f} | {s['ttft_p50_s'] * 1e3:.0f} | "
                f"{s['itl_p50_s'] * 1e3:.1f} | {s['itl_p99_s'] * 1e3:.1f} | {s['failed']} |"
            )
    for c in args.users:
        ratio = results["after"][c]["output_throughput_tok_s"] / results["before"][c]["output_throughput_tok_s"]
        print(f"C = {c}: output throughput after / before = {ratio:.2f}x")


if __name__ == "__main__":
    main()
