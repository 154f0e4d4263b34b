"""A chat workload on one shared system prompt, served with and without the prefix cache.

`ridgefill-loadtest chat`: N chat requests arrive at a fixed rate, each a shared ~2K-token system
prompt plus its own short user turn. The embedded model is served twice from this tree, with
`--prefix-caching on` and `off`, one after the other; everything else equal. Prints TTFT / ITL
percentiles, throughput and the prompt tokens the server reported as cached.

  .venv/bin/python benchmarks/prefix_chat_loadtest.py --threads 2 [--model gemma3-270m]

The hit rate is the server's own: ridgefill_prefix_cache_hits / ridgefill_prefix_cache_queries
from /metrics after the run (prompt tokens found / looked up).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from serving import ROOT, start_server


def run_clients(port: int, args, out: Path) -> dict:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ridgefill_clients.loadtest",
            "chat",
            "--url",
            f"http://127.0.0.1:{port}",
            "--num-prompts",
            str(args.requests),
            "--rate",
            str(args.rate),
            "--system-tokens",
            str(args.system_tokens),
            "--user-tokens",
            str(args.user_tokens),
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


def hit_rate(port: int) -> tuple[float, float]:
    """(prompt tokens found, looked up) in the prefix cache, from the server's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text

    def value(name: str) -> float:
        return float(re.search(rf"^{name}_total (\S+)$", text, re.M).group(1))

    return value("ridgefill_prefix_cache_hits"), value("ridgefill_prefix_cache_queries")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.5, help="requests per second")
    ap.add_argument("--system-tokens", type=int, default=2048)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--model", default=None, help="a packaged model name or path (default: the embedded one)")
    ap.add_argument(
        "--hybrid",
        action="store_true",
        help="serve hybrid_loadtest.py's random Qwen3.5-layout hybrid (12 GDN + 4 attention layers, SmolLM2's tokenizer)",
    )
    ap.add_argument("--snapshot-every", type=int, default=None, help="the server's cache.snapshot_every (hybrids)")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/prefix_chat_loadtest[/MODEL]")
    args = ap.parse_args()
    if args.hybrid:
        from hybrid_loadtest import build_model

        args.model = str(Path(tempfile.mkdtemp()) / "hybrid")
        build_model(Path(args.model))
    name = "hybrid" if args.hybrid else args.model or ""
    if args.snapshot_every is not None:
        name += f"-snapshot-every-{args.snapshot_every}"
    args.out = args.out or ROOT / "benchmarks" / "prefix_chat_loadtest" / name
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    model = ["--model", args.model] if args.model else []
    if args.snapshot_every is not None:
        model += ["--snapshot-every", str(args.snapshot_every)]
    for label, setting, port in (("prefix cache on", "on", 8761), ("prefix cache off", "off", 8762)):
        proc = start_server(["--threads", str(args.threads), "--prefix-caching", setting, *model], port)
        try:
            results[label] = run_clients(port, args, args.out / f"{setting}.json")
            results[label]["prefix_hits"], results[label]["prefix_queries"] = hit_rate(port)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    (args.out / "summary.json").write_text(json.dumps(results, indent=1))
    print(
        f"threads={args.threads}; model {name or 'embedded'}; {args.requests} chat requests at {args.rate}/s, a shared system prompt of "
        f"~{args.system_tokens} tokens + ~{args.user_tokens} user tokens each, {args.output_tokens} output tokens"
    )
    print(
        "| server | TTFT p50 (ms) | TTFT p90 | TTFT p99 | ITL p50 (ms) | ITL p99 | output tok/s | cached prompt tokens | "
        "hit rate | failed |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, s in results.items():
        print(
            f"| {label} | {s['ttft_p50_s'] * 1e3:.0f} | {s['ttft_p90_s'] * 1e3:.0f} | {s['ttft_p99_s'] * 1e3:.0f} | "
            f"{s['itl_p50_s'] * 1e3:.1f} | {s['itl_p99_s'] * 1e3:.1f} | {s['output_throughput_tok_s']:.1f} | "
            f"{s['cached_tokens_total']} | {s['prefix_hits'] / max(1, s['prefix_queries']):.1%} | {s['failed']} |"
        )
    on, off = results["prefix cache on"], results["prefix cache off"]
    print(f"TTFT p50 off / on = {off['ttft_p50_s'] / on['ttft_p50_s']:.1f}x")


if __name__ == "__main__":
    main()
