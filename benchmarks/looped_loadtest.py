"""The looped demonstration model served by `ridgefill serve --model looped` under the load-test
client (`ridgefill-loadtest plain`, several users at once, greedy, streamed): sequential decoding
against self-speculative decoding (Algorithm 1), in one run, same server settings otherwise.

    .venv/bin/python benchmarks/looped_loadtest.py --threads 2 --out benchmarks/looped_loadtest
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from serving import ROOT, start_server


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "looped_loadtest")
    ap.add_argument("--loops", type=int, default=32)
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=48)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for label, block, port in (("sequential", 0, 8741), ("self-speculative, d = 4, γ = 4", 4, 8742)):
        config = args.out / f"serve_block{block}.toml"
        config.write_text(
            f'[looped]\nloops = {args.loops}\ncache = "ripe"\nwindow = 64\nblock = {block}\n'
            f"draft_loops = 4\n[scheduler]\nmax_num_seqs = {args.users}\n"
        )
        out = args.out / f"plain_block{block}.json"
        proc = start_server(["--model", "looped", "--config", str(config), "--threads", str(args.threads)], port)
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ridgefill_clients.loadtest",
                    "plain",
                    "--url",
                    f"http://127.0.0.1:{port}",
                    "--num-prompts",
                    str(args.num_prompts),
                    "--max-concurrency",
                    str(args.users),
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
            results[label] = json.loads(out.read_text())["summary"]
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(
        f"threads={args.threads}, R = {args.loops}, RIPE W = 64, {args.users} users, {args.num_prompts} requests "
        f"of {args.prompt_tokens} prompt / {args.output_tokens} output tokens (greedy, streamed)"
    )
    print(
        "| decoding | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | ITL p50 (ms) | ITL p99 (ms) | "
        "tokens / verification | failed |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for label, s in results.items():
        tpv = f"{s['tokens_per_verification']:.2f}" if "tokens_per_verification" in s else "–"
        print(
            f"| {label} | {s['output_throughput_tok_s']:.1f} | {s['ttft_p50_s'] * 1e3:.0f} | "
            f"{s['tpot_p50_s'] * 1e3:.0f} | {s['itl_p50_s'] * 1e3:.0f} | {s['itl_p99_s'] * 1e3:.0f} | {tpv} | "
            f"{s['failed']} |"
        )
    base, spec = results["sequential"], results["self-speculative, d = 4, γ = 4"]
    print(
        f"\nthroughput ratio (self-speculative / sequential): "
        f"{spec['output_throughput_tok_s'] / base['output_throughput_tok_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
