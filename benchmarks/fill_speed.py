"""RidgeFill prefill speed on the embedded SmolLM2 (or a packaged model: --model gemma3-270m):
exact vs filled, one run, same threads.

    python benchmarks/fill_speed.py --threads 2 --lengths 2048 4096 8000 --reps 3
    python benchmarks/fill_speed.py --threads 2 --model gemma3-270m --split 9 --lengths 4096 8192

Each figure is time to first token through the whole engine (one request, idle engine,
prompt in one chunk). Ceiling (seed 000, §2.5): 1/r with r = S/L + (1 - S/L)·T/N, which
ignores the maps' own cost and the K/V projections that filled rows still run. The last two
columns count those and attention too (fill/ceiling.py): exact MACs over the fill's, with the
exact rows the selectors chose inside the filled region (`chosen`: on Gemma 3 the "special"
selector picks its user-defined whitespace-run tokens, ~10% of source code), and the measured
speedup as a fraction of that.
"""

from __future__ import annotations

import argparse
import statistics
import time

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: reuses prefill.py's real-text helper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--split", type=int, default=15)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--arm", default="ridgefill", choices=["ridgefill", "identity"])
    ap.add_argument("--model", default=None, help="a packaged model's name (default: the embedded SmolLM2)")
    ap.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure this machine's FMA and copy peaks; add each arm's GFLOP/s as a share of the FMA peak",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, SchedulerConfig
    from ridgefill_runtime.engine import Engine
    from ridgefill_runtime.eval.roofline import fill_work, measure_peaks, prefill_work, weight_bytes
    from ridgefill_runtime.fill.ceiling import ceiling, layer_shapes
    from ridgefill_runtime.fill.settings import shipped_maps
    from ridgefill_runtime.llm import LLM, load_fill_maps
    from ridgefill_runtime.sequence import SamplingParams
    from prefill import real_text_ids

    llm = LLM(EngineConfig(model=args.model, cache=CacheConfig(kv_cache_gib=0.05)))
    model = llm.engine.model
    maps_path = str(shipped_maps(args.split, args.model)) if args.arm == "ridgefill" else None
    fill = FillConfig(arm=args.arm, split=args.split, tail=args.tail, maps=maps_path)

    def engine(n: int, fill_config: FillConfig) -> Engine:
        # NOTE: prefix caching off: the reps repeat the prompt, and a cached prefix is not prefill
        cfg = EngineConfig(
            # NOTE: 0.5 GiB holds 14K Gemma 3 270M tokens, 21K Qwen2.5-Coder-0.5B ones
            cache=CacheConfig(kv_cache_gib=0.5 * -(-n // 8192), prefix_caching="off"),
            fill=fill_config,
            scheduler=SchedulerConfig(max_num_batched_tokens=n, max_num_seqs=1, chunk_size=n),
        )
        return Engine(model, llm.tokenizer, cfg, load_fill_maps(cfg, model))

    chosen: tuple[int, ...] = ()  # the last filled request's exact rows inside its filled region

    def ttft(eng: Engine, ids: list[int]) -> float:
        nonlocal chosen
        t = time.perf_counter()
        seq = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        while eng.has_unfinished():
            eng.step()
        seconds = time.perf_counter() - t
        if seq.fill is not None:
            chosen = tuple(seq.fill.exact_rows)
        return seconds

    L, S, T = model.config.num_layers, args.split, args.tail
    shapes = layer_shapes(model.config, model.cache_spec().layers)
    ids_all = real_text_ids(llm.tokenizer, max(args.lengths))
    print(
        f"threads={torch.get_num_threads()} model={args.model or 'SmolLM2-135M-Instruct'} float32 CPU, arm={args.arm}, "
        f"split={S}/{L}, tail={T}"
    )
    peaks = measure_peaks(args.threads) if args.roofline else None
    if peaks:
        print(peaks.describe())
    wbytes, V, d = weight_bytes(model.weights), model.config.vocab_size, model.config.hidden_size
    print(
        f"{'tokens':>6} | {'exact s':>7} | {'fill s':>7} | {'speedup':>7} | {'ceiling 1/r':>11} | {'measured/ceiling':>16}"
        f" | {'chosen':>6} | {'MAC ceiling':>11} | {'measured/MAC':>12}"
        + (f" | {'exact GFLOP/s':>13} | {'of FMA':>6} | {'fill GFLOP/s':>12} | {'of FMA':>6}" if peaks else "")
    )
    print("-" * (112 + (49 if peaks else 0)))

    def roof_cells(n: int, exact_s: float, fill_s: float) -> str:
        ex = prefill_work(shapes, V, d, wbytes, n).columns(exact_s, peaks)
        fi = fill_work(shapes, V, d, wbytes, n, S, T, chosen).columns(fill_s, peaks)
        return f" | {ex['gflops']:>13.1f} | {ex['of_fma']:>6.2f} | {fi['gflops']:>12.1f} | {fi['of_fma']:>6.2f}"

    warm = ids_all[: T + 256]
    ttft(engine(len(warm), FillConfig()), warm), ttft(engine(len(warm), fill), warm)
    for n in args.lengths:
        ids = ids_all[:n]
        exact_e, fill_e = engine(n, FillConfig()), engine(n, fill)
        ex, fi = [], []
        for _ in range(args.reps):
            ex.append(ttft(exact_e, ids))
            fi.append(ttft(fill_e, ids))
        e, f = statistics.median(ex), statistics.median(fi)
        r = S / L + (1 - S / L) * T / n
        mac = ceiling(shapes, n, S, T, chosen)
        print(
            f"{n:>6} | {e:>7.2f} | {f:>7.2f} | {e / f:>7.2f} | {1 / r:>11.2f} | {(e / f) * r:>16.2f}"
            f" | {len(chosen):>6} | {mac:>11.2f} | {(e / f) / mac:>12.2f}" + (roof_cells(n, e, f) if peaks else ""),
            flush=True,
        )
        print(f"{'':>6}   reps in turns, exact / fill s: " + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(ex, fi)))


if __name__ == "__main__":
    main()
