"""The §4.8 mixed load test (`ridgefill-loadtest mixed`) on a random Qwen3.5-layout hybrid served
by `ridgefill serve`, fill off and fill on, and the stall check: every other user's worst
inter-token gap must stay within 2 x its p50 ITL + one chunk's compute.

    python benchmarks/hybrid_loadtest.py --threads 2 --out benchmarks/hybrid_loadtest

The model: random weights, Qwen3.5 layout (d = 512, 16 layers, 12 GDN + 4 gated attention),
SmolLM2's vocabulary, tokenizer and chat template (written from the embedded GGUF), so the
load-test client's text prompts tokenize. Speed does not depend on the weights' values.
"One chunk's compute" is measured in the same run: the costliest engine step of an exact
`chunk`-row chunked prefill of a prompt as long as the new one (its last chunk), on the same
model and threads, no other work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from serving import ROOT, start_server


def build_model(folder: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from ridgefill_runtime.loader.export_tokenizer import write_hf_tokenizer
    from ridgefill_runtime.loader.gguf import default_model_path, load_gguf

    tokenizer = load_gguf(default_model_path()).tokenizer
    cfg = AutoConfig.for_model(
        "qwen3_5_text",
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=16,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=tokenizer.vocab_size,
        max_position_embeddings=16384,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder, safe_serialization=True)
    # NOTE: tokenizer.json and its config, chat template included (the chat load test needs it)
    write_hf_tokenizer(tokenizer, folder, cfg.max_position_embeddings)


def chunk_seconds(folder: Path, chunk: int, prompt: int, threads: int, reps: int = 3) -> float:
    """The costliest chunk of a `prompt`-token prefill (its last: it attends to the most keys):
    the largest step time over the prompt's chunks, median over `reps` prompts, on an idle engine."""
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.llm import build_engine
    from ridgefill_runtime.sequence import SamplingParams

    torch.set_num_threads(threads)
    eng = build_engine(
        EngineConfig(
            model=str(folder),
            cache=CacheConfig(kv_cache_gib=0.25),
            scheduler=SchedulerConfig(chunk_size=chunk, max_num_batched_tokens=chunk),
        )
    )
    worst = []
    for rep in range(reps + 1):
        eng.add_request([(7 * i + rep) % 1000 + 10 for i in range(prompt)], SamplingParams(max_tokens=1))
        times = []
        while eng.has_unfinished():
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        worst.append(max(times))
    return statistics.median(worst[1:])  # the first prompt warms up


def serve(folder: Path, fill: str, threads: int, port: int, tail: int) -> subprocess.Popen:
    config = folder / f"serve_{fill}.toml"
    # NOTE: the identity fill (x̂ = x_S) needs no maps and does the same work as fitted maps but the map GEMM
    config.write_text(
        f'[model]\npath = "{folder}"\n[fill]\nmode = "{fill}"\nsplit = 8\ntail = {tail}\n'
        '[fill.rows]\nselectors = ["special"]\n'
    )
    return start_server(["--config", str(config), "--threads", str(threads)], port)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "hybrid_loadtest")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--new-prompt-tokens", type=int, default=2048)
    ap.add_argument("--tail", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=512, help="the server's default scheduler.chunk_size")
    ap.add_argument("--reuse", action="store_true", help="reuse load-test results already in --out")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path("/tmp/ridgefill-hybrid-loadtest-model"),
        help="where the random checkpoint is written (reused when present; ~100 MB, not for the repo)",
    )
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    folder = args.model_dir
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        build_model(folder)
    chunk_s = chunk_seconds(folder, args.chunk, args.new_prompt_tokens, args.threads)
    results = {}
    for fill, port in (("off", 8731), ("identity", 8732)):
        out = args.out / f"mixed_fill_{fill}.json"
        if args.reuse and out.exists():
            results[fill] = json.loads(out.read_text())
            continue
        proc = serve(folder, fill, args.threads, port, args.tail)
        try:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "ridgefill_clients.loadtest",
                    "mixed",
                    "--url",
                    f"http://127.0.0.1:{port}",
                    "--concurrency",
                    *map(str, args.concurrency),
                    "--reps",
                    str(args.reps),
                    "--new-prompt-tokens",
                    str(args.new_prompt_tokens),
                    "--new-output-tokens",
                    "4",
                    "--other-prompt-tokens",
                    "64",
                    "--decode-tokens",
                    "64",
                    "--out",
                    str(out),
                ],
                cwd=ROOT,
                check=True,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            results[fill] = json.loads(out.read_text())
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    print(
        f"\nthreads={args.threads}; one {args.chunk}-row chunk's compute (the costliest of a "
        f"{args.new_prompt_tokens}-token prefill, exact): {chunk_s:.2f} s"
    )
    print(
        f"{'fill':>8} | {'C':>2} | {'new TTFT s':>10} | {'filled':>6} | {'ITL p50 s':>9} | {'ITL max s':>9} | "
        f"{'bound s':>7} | ok"
    )
    for fill, result in results.items():
        for row in result["summary"]:
            if row["users"] == 1:
                print(f"{fill:>8} | {1:>2} | {row['new_ttft_s']:>10.2f} | {row['new_filled_rows']:>6} |")
                continue
            bound = 2 * row["itl_p50_s"] + chunk_s
            print(
                f"{fill:>8} | {row['users']:>2} | {row['new_ttft_s']:>10.2f} | {row['new_filled_rows']:>6} | "
                f"{row['itl_p50_s']:>9.3f} | {row['itl_max_s']:>9.2f} | {bound:>7.2f} | "
                f"{'yes' if row['itl_max_s'] <= bound else 'NO'}"
            )


if __name__ == "__main__":
    main()
