"""Prefill time with exact prefix rows (seed 000, §2.4 and Appendix H), one run, same threads.

    python benchmarks/exact_rows_speed.py --threads 2 --lengths 4096 8000 --reps 3

Time to first token through the whole engine (one request, idle engine, each sweep in one
chunk) for: exact prefill; the fill with E = 0, 256, 512, 1024 exact prefix rows drawn at
random (the cost line τ(E) = τ0 + E·σ); the fill with a tail 512 rows longer (what a tail row
costs); and each candidate selector configuration. κ = σ / (a tail row's cost); the fill stops
paying off at E* = (τ_exact − τ0) / σ exact rows.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: reuses prefill.py's real-text helper

PROBE = ("special", "probe", "lexical")
CANDIDATES = {  # name -> (split, tail, RowsConfig changes); None: the command line's split / tail
    "special": (None, None, dict(selectors=("special",))),
    "attention 10%": (None, None, dict(selectors=("special", "attention"))),
    "lexical": (None, None, dict(selectors=("special", "lexical"))),
    "probe@0.33": (None, None, dict(selectors=PROBE, budget_factor=0.33)),
    "probe@1": (None, None, dict(selectors=PROBE, budget_factor=1.0)),
    # the trade-off grid's other split and tail
    "s11 t1024 special": (11, 1024, dict(selectors=("special",))),
    "s11 t1024 lexical": (11, 1024, dict(selectors=("special", "lexical"))),
    "s11 t1024 probe@0.33": (11, 1024, dict(selectors=PROBE, budget_factor=0.33)),
    "s11 t1024 probe@1": (11, 1024, dict(selectors=PROBE, budget_factor=1.0)),
    "s15 t512 special": (15, 512, dict(selectors=("special",))),
    "s15 t512 lexical": (15, 512, dict(selectors=("special", "lexical"))),
    "s15 t512 probe@0.33": (15, 512, dict(selectors=PROBE, budget_factor=0.33)),
    "s15 t512 probe@1": (15, 512, dict(selectors=PROBE, budget_factor=1.0)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--split", type=int, default=15)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--json", type=Path, default=None, help="also write the medians here")
    ap.add_argument("--no-grid", action="store_true", help="only the command line's split and tail")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
    from ridgefill_runtime.engine import Engine
    from ridgefill_runtime.fill.settings import shipped_maps, shipped_unigram
    from ridgefill_runtime.llm import LLM, load_fill_maps
    from ridgefill_runtime.sequence import SamplingParams
    from prefill import real_text_ids

    llm = LLM(EngineConfig(cache=CacheConfig(kv_cache_gib=0.05)))
    model = llm.engine.model
    base = RowsConfig(selectors=(), unigram=str(shipped_unigram()))

    def fill(tail=None, split=None, **rows) -> FillConfig:
        split, tail = split or args.split, tail or args.tail
        return FillConfig(
            arm="ridgefill", split=split, tail=tail, maps=str(shipped_maps(split)), rows=base.replace(**rows)
        )

    def engine(n: int, fill_config: FillConfig, select=None) -> Engine:
        cfg = EngineConfig(
            cache=CacheConfig(kv_cache_gib=0.5),
            fill=fill_config,
            scheduler=SchedulerConfig(max_num_batched_tokens=n, max_num_seqs=1, chunk_size=n),
        )
        eng = Engine(model, llm.tokenizer, cfg, load_fill_maps(cfg, model))
        if select is not None:
            eng.scheduler.select = select
        return eng

    def ttft(eng: Engine, ids: list[int]) -> tuple[float, int]:
        t = time.perf_counter()
        seq = eng.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t, len(seq.fill.exact_rows)

    def random_rows(e: int):
        return lambda seq: random.Random(e).sample(range(1, seq.fill.boundary), e)

    ids_all = real_text_ids(llm.tokenizer, max(args.lengths))
    L, S, T = model.config.num_layers, args.split, args.tail
    print(
        f"threads={torch.get_num_threads()} model=SmolLM2-135M-Instruct float32 CPU, ridgefill split={S}/{L}, "
        f"tail={T}; time to first token, median of {args.reps}, configurations interleaved"
    )
    warm = ids_all[: T + 512]
    ttft(engine(len(warm), FillConfig()), warm), ttft(engine(len(warm), fill(selectors=("special",))), warm)
    record = {"threads": args.threads, "split": S, "tail": T, "reps": args.reps, "lengths": {}}
    for n in args.lengths:
        ids = ids_all[:n]
        configs = {
            "exact": (engine(n, FillConfig()), None),
            "E=0": (engine(n, fill(selectors=("special",)), lambda s: []), 0),
        }
        configs.update({f"E={e}": (engine(n, fill(selectors=("special",)), random_rows(e)), e) for e in args.rows})
        configs["tail+512"] = (engine(n, fill(tail=T + 512, selectors=("special",)), lambda s: []), None)
        configs.update(
            {
                name: (engine(n, fill(tail, split, **rows)), None)
                for name, (split, tail, rows) in CANDIDATES.items()
                if not (args.no_grid and split)
            }
        )
        times = {name: [] for name in configs}
        counts = {}
        for _ in range(args.reps):
            for name, (eng, _) in configs.items():
                t, e = ttft(eng, ids)
                times[name].append(t)
                counts[name] = e
        med = {name: statistics.median(v) for name, v in times.items()}
        es = [0] + list(args.rows)
        xs, ys = torch.tensor(es, dtype=torch.float64), torch.tensor([med[f"E={e}"] for e in es], dtype=torch.float64)
        sigma = float(((xs - xs.mean()) * (ys - ys.mean())).sum() / ((xs - xs.mean()) ** 2).sum())
        tau0 = float(ys.mean() - sigma * xs.mean())
        tail_row = (med["tail+512"] - med["E=0"]) / 512
        print(f"\n{n} tokens (prefix {n - T} rows)")
        print(f"{'configuration':>20} | {'exact rows':>10} | {'TTFT s':>7} | {'speedup vs exact':>16}")
        print("-" * 64)
        for name in configs:
            rows = "—" if name in ("exact", "tail+512") else str(counts[name])
            print(f"{name:>20} | {rows:>10} | {med[name]:>7.2f} | {med['exact'] / med[name]:>16.2f}")
        print(
            f"cost line: tau0 = {tau0:.3f} s, sigma = {1e3 * sigma:.3f} ms per exact row, "
            f"tail row = {1e3 * tail_row:.3f} ms, kappa = {sigma / tail_row:.2f}, "
            f"break-even E* = (tau_exact - tau0)/sigma = {(med['exact'] - tau0) / sigma:.0f} rows "
            f"({100 * (med['exact'] - tau0) / sigma / (n - T):.0f}% of the prefix)"
        )
        record["lengths"][n] = {
            "ttft": med,
            "exact_rows": counts,
            "tau0": tau0,
            "sigma": sigma,
            "tail_row": tail_row,
            "kappa": sigma / tail_row,
            "break_even_rows": (med["exact"] - tau0) / sigma,
        }
    if args.json:
        import json

        args.json.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
