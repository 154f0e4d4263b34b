"""K/V memory of Gemma 3 270M (15 of 18 layers slide over 512 positions) with window-bounded pages
vs every page kept, measured from the engine's own pool after every step, and llama.cpp's KV
allocation for the same context beside it (its log, swa_full off and on).

    python benchmarks/window_kv_memory.py --threads 2 --lengths 4096 8192

Per context length and arm (exact; RidgeFill at split 9, tail 1024, the shipped maps), one
request of that many prompt tokens plus --new greedy tokens runs alone in three engines: one whose
pool frees sliding-window pages and whose fill writes a filled row's sliding-window late K/V only
when a late row reaches it ("bounded", cache.prefix_caching = "off"); the same pool with the prefix
cache on ("bounded + prefix cache": pages let go stay cache entries, which count as free, and the
fill writes every filled row, as a cached block needs); and one that keeps every page and writes
every filled row ("every page", cache.window_bounded = false). "peak" is the most
the pool held after any step, prefill included. "rows" counts K/V rows held, one per layer and position (a block of 16
positions in 18 layers is 288 rows), so the figure does not depend on the dtype; MiB are at our
float32 (2,048 B a row: one KV head of 256, K and V). llama.cpp allocates its cache up front for
n_ctx = prompt + new, in f16; its rows are cells x layers from its log.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

# mode -> (cache.prefix_caching, cache.window_bounded)
MODES = {"every page": ("off", False), "bounded": ("off", True), "bounded + prefix cache": ("on", True)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--split", type=int, default=9)
    ap.add_argument("--tail", type=int, default=1024)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig
    from ridgefill_runtime.engine import Engine
    from ridgefill_runtime.fill.settings import shipped_maps
    from ridgefill_runtime.llm import LLM, load_fill_maps
    from ridgefill_runtime.loader.packaged import packaged_model_path
    from prefill import real_text_ids

    llm = LLM(EngineConfig(model="gemma3-270m", cache=CacheConfig(kv_cache_gib=0.05)))
    model = llm.engine.model
    ridgefill = FillConfig(
        arm="ridgefill", split=args.split, tail=args.tail, maps=str(shipped_maps(args.split, "gemma3-270m"))
    )
    # NOTE: the default selection ("special") makes scattered exact prefix rows, whose windows reach
    # most filled rows; without exact rows only the tail's window does (the bound the issue names)
    fills = {
        "exact": FillConfig(),
        "ridgefill": ridgefill,
        "ridgefill, no exact rows": dataclasses.replace(ridgefill, rows=RowsConfig(selectors=())),
    }
    ids_all = real_text_ids(llm.tokenizer, max(args.lengths))
    row_bytes = 2 * model.config.num_kv_heads * model.config.head_dim * 4
    print(
        f"threads={torch.get_num_threads()} Gemma 3 270M (Q4_K_M GGUF, float32 CPU), block 16, chunk 512, "
        f"+{args.new} greedy tokens; K/V row = one layer at one position = {row_bytes} B at float32\n"
    )
    print(
        "| prompt | arm | cache | peak rows | rows held decoding | MiB decoding | vs every page | "
        "late window-layer rows written | prefill s | same tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in args.lengths:
        ids = ids_all[:n]
        for arm, fill in fills.items():
            runs = {}
            for mode, (prefix, bounded) in MODES.items():
                cache = CacheConfig(kv_cache_gib=4.0, prefix_caching=prefix, window_bounded=bounded)
                cfg = EngineConfig(cache=cache, fill=fill)
                runs[mode] = _run(
                    Engine(model, llm.tokenizer, cfg, load_fill_maps(cfg, model)), ids, args.new, args.split
                )
            full = runs["every page"]
            for mode, r in runs.items():
                same = "yes" if r["tokens"] == full["tokens"] else "NO"
                print(
                    f"| {n} | {arm} | {mode} | {r['peak']:,} | {r['decode']:,} | {r['decode'] * row_bytes / 2**20:.1f} | "
                    f"{r['decode'] / full['decode']:.0%} | {r['written']:,} | {r['prefill_s']:.1f} | {same} |"
                )
    print("\nllama.cpp (llama-cpp-python), KV allocated at n_ctx = prompt + new, f16:\n")
    print("| n_ctx | swa_full | rows allocated | vs swa_full on |")
    print("|---|---|---|---|")
    path = packaged_model_path("gemma3-270m")
    for n in args.lengths:
        on = _llama_cpp_rows(path, n + args.new, True, args.threads)
        off = _llama_cpp_rows(path, n + args.new, False, args.threads)
        print(f"| {n + args.new} | on | {on:,} | 100% |\n| {n + args.new} | off | {off:,} | {off / on:.0%} |")


def _rows(engine, used: int) -> int:
    """K/V rows (layer x position) the pool's `used` blocks hold."""
    caches = engine.caches
    layers = caches.layout.group_size if caches.layout is not None else len(caches.spec.attention_layers)
    return used * layers * caches.block_size


def _run(engine, ids: list[int], new: int, split: int) -> dict:
    """One request alone: the pool's rows after every step (peak; most while decoding), the K/V
    rows the prefill wrote at late sliding-window layers, its time to first token, the tokens."""
    from ridgefill_runtime.sequence import SamplingParams

    late_windowed = {
        i for i in engine.caches.spec.attention_layers if i >= split and engine.model.config.family_config.window_of(i)
    }
    written = [0]
    write = engine.kv.write

    def counted(layer, slots, k, v):
        if layer in late_windowed and not seq.output_ids:
            written[0] += len(slots)
        write(layer, slots, k, v)

    engine.kv.write = counted
    seq = engine.add_request(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    peak = decode = 0
    t, prefill_s = time.perf_counter(), None
    while engine.has_unfinished():
        engine.step()
        if prefill_s is None and seq.output_ids:
            prefill_s = time.perf_counter() - t
        rows = _rows(engine, engine.stats().kv_blocks_used)
        peak = max(peak, rows)
        if seq.output_ids and not seq.finished:
            decode = max(decode, rows)
    engine.kv.write = write
    return dict(peak=peak, decode=decode, written=written[0], prefill_s=prefill_s, tokens=list(seq.output_ids))


def _llama_cpp_rows(path, n_ctx: int, swa_full: bool, threads: int) -> int:
    """Cells x layers of every KV cache llama.cpp creates, from its log (a child process: the
    log goes to the C stderr)."""
    code = (
        "import llama_cpp, sys; llama_cpp.Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), "
        "n_threads=int(sys.argv[3]), verbose=True, swa_full=sys.argv[4] == '1')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(path), str(n_ctx), str(threads), "1" if swa_full else "0"],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ),
    )
    found = re.findall(r"llama_kv_cache: size = .*?\(\s*(\d+) cells,\s*(\d+) layers", out.stderr)
    if not found:
        raise RuntimeError("llama.cpp printed no KV cache size:\n" + out.stderr[-2000:])
    return sum(int(c) * int(l) for c, l in found)


if __name__ == "__main__":
    main()
