"""Where exact prefill and the fill spend their time, by kind of op (torch.profiler, self CPU time), on one
prompt: what the "fraction of the MAC ceiling" in fill_speed.py leaves out. The ceiling counts multiply-adds
(linear layers, maps, attention) as if each cost the same; this splits the measured time into GEMMs,
attention and the rest (norms, activations, copies), and prints for each kind the fill's time over exact's.

    python benchmarks/fill_op_breakdown.py --threads 2 --model gemma3-270m --split 9 --tokens 16384

Same engines as fill_speed.py (prefix caching off, one chunk); one untimed warm-up request each, then one
profiled request each, exact first. Times under the profiler run a few percent slower than without it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's real-text helper

KINDS = {
    "GEMM": (
        "aten::mm",
        "aten::addmm",
        "aten::bmm",
        "ridgefill::packed_linear",
        "ridgefill::packed_dequantize_t",
        "ridgefill::packed_dequantize_t_bf16",
    ),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "ridgefill::scattered_rows_attention"),
    "norms": ("ridgefill::rms_norm",),
    "activations": ("aten::gelu", "aten::silu", "aten::mul", "aten::mul_", "aten::add", "aten::add_"),
}


def kind_of(name: str) -> str:
    return next((k for k, names in KINDS.items() if name in names), "other")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--model", required=True, help="a packaged model with shipped maps")
    ap.add_argument("--split", type=int, required=True)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--top", type=int, default=8, help="list this many of the ops counted as 'other', by time")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from prefill import real_text_ids
    from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, SchedulerConfig
    from ridgefill_runtime.engine import Engine
    from ridgefill_runtime.fill.ceiling import ceiling, layer_shapes
    from ridgefill_runtime.fill.settings import shipped_maps
    from ridgefill_runtime.llm import LLM, load_fill_maps
    from ridgefill_runtime.sequence import SamplingParams

    llm = LLM(EngineConfig(model=args.model, cache=CacheConfig(kv_cache_gib=0.05)))
    model, n = llm.engine.model, args.tokens
    maps = str(shipped_maps(args.split, args.model))
    fill = FillConfig(arm="ridgefill", split=args.split, tail=args.tail, maps=maps)

    def engine(fill_config: FillConfig) -> Engine:
        cfg = EngineConfig(
            cache=CacheConfig(kv_cache_gib=0.5 * -(-n // 8192), prefix_caching="off"),
            fill=fill_config,
            scheduler=SchedulerConfig(max_num_batched_tokens=n, max_num_seqs=1, chunk_size=n),
        )
        return Engine(model, llm.tokenizer, cfg, load_fill_maps(cfg, model))

    def run(eng: Engine, ids: list[int]) -> tuple[float, tuple[int, ...]]:
        t = time.perf_counter()
        seq = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t, tuple(seq.fill.exact_rows) if seq.fill is not None else ()

    ids = real_text_ids(llm.tokenizer, n)
    load = " ".join(open("/proc/loadavg").read().split()[:3])
    print(f"threads={args.threads} model={args.model} split={args.split} tail={args.tail} tokens={n}; load {load}")
    seconds, by_kind, chosen, others = {}, {}, (), {}
    for name, fc in (("exact", FillConfig()), ("fill", fill)):
        eng = engine(fc)
        run(eng, ids[: args.tail + 256])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            seconds[name], rows = run(eng, ids)
        chosen = rows or chosen
        kinds: dict[str, float] = {}
        for ev in prof.key_averages():
            kinds[kind_of(ev.key)] = kinds.get(kind_of(ev.key), 0.0) + ev.self_cpu_time_total / 1e6
            if kind_of(ev.key) == "other":
                others.setdefault(ev.key, {})[name] = (ev.self_cpu_time_total / 1e6, ev.count)
        by_kind[name] = kinds
    shapes = layer_shapes(model.config, model.cache_spec().layers)
    mac = ceiling(shapes, n, args.split, args.tail, chosen)
    speedup = seconds["exact"] / seconds["fill"]
    print(f"wall: exact {seconds['exact']:.2f} s, fill {seconds['fill']:.2f} s, speedup {speedup:.2f}")
    print(f"MAC ceiling {mac:.2f} (fill / exact MACs {1 / mac:.3f}); measured / ceiling {speedup / mac:.2f}")
    print(f"exact rows chosen by the selectors inside the filled region: {len(chosen)}\n")
    print("| kind | exact s | fill s | fill / exact |")
    print("|---|---|---|---|")
    for kind in (*KINDS, "other"):
        e, f = by_kind["exact"].get(kind, 0.0), by_kind["fill"].get(kind, 0.0)
        print(f"| {kind} | {e:.2f} | {f:.2f} | {f / e if e else float('nan'):.3f} |")
    e, f = sum(by_kind["exact"].values()), sum(by_kind["fill"].values())
    print(f"| all (profiled) | {e:.2f} | {f:.2f} | {f / e:.3f} |")
    if args.top:
        print(f"\nThe {args.top} slowest ops counted as 'other' (self CPU s, calls):\n")
        print("| op | exact s | exact calls | fill s | fill calls |")
        print("|---|---|---|---|---|")
        ranked = sorted(others.items(), key=lambda kv: -max(t for t, _ in kv[1].values()))
        for op, arms in ranked[: args.top]:
            (es, ec), (fs, fc) = arms.get("exact", (0.0, 0)), arms.get("fill", (0.0, 0))
            print(f"| {op} | {es:.2f} | {ec} | {fs:.2f} | {fc} |")


if __name__ == "__main__":
    main()
