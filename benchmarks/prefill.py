"""Exact prefill speed on the embedded SmolLM2: ridgefill vs transformers, same run, same threads.

    python benchmarks/prefill.py --threads 2 --lengths 1024 2048 4096 --reps 3

Ours goes through the whole engine (schedule -> run -> sample the first token), so the
figure is time to first token for one request on an idle server. Transformers runs one
forward over the prompt with its KV cache on, keeping only the last position's logits.
Both load the same GGUF and run float32 on the CPU. Reported: median of `reps` runs,
interleaved so both see the same machine state.
"""

from __future__ import annotations

import argparse
import glob
import statistics
import time

import torch


def real_text_ids(tokenizer, n: int) -> list[int]:
    """n token ids of real English/reST text and Python (licenses, then torch's sources on this
    machine, the package's top level first: the first ~60K tokens are the same on any machine
    with the same torch)."""
    top = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(glob.glob(torch.__path__[0] + "/*.py"))
    deeper = sorted(glob.glob(torch.__path__[0] + "/**/*.py", recursive=True))
    ids: list[int] = []
    for f in dict.fromkeys(top + deeper):  # in order, each file once
        try:
            ids += tokenizer.encode(open(f, encoding="utf-8").read())
        except (UnicodeDecodeError, IsADirectoryError):
            continue
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError("not enough local text for the benchmark")


def engine_with_chunk(llm, chunk: int):
    """A fresh engine over the same loaded model whose steps take `chunk` prompt rows."""
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.engine import Engine

    # NOTE: prefix caching off: every rep sends the same prompt, and a cached prefix is not prefill
    config = EngineConfig(
        cache=CacheConfig(kv_cache_gib=0.25, prefix_caching="off"),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=1, chunk_size=chunk),
    )
    return Engine(llm.engine.model, llm.tokenizer, config)


def time_ours(engine, ids: list[int]) -> float:
    from ridgefill_runtime.sequence import SamplingParams

    t = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - t


@torch.inference_mode()
def time_hf(model, ids: list[int]) -> float:
    x = torch.tensor([ids])
    t = time.perf_counter()
    model(x, logits_to_keep=1, use_cache=True)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=512, help="also time chunked prefill at this chunk size")
    ap.add_argument(
        "--weights",
        nargs="+",
        default=["auto"],
        choices=["auto", "packed", "dequantized"],
        help="ridgefill arms, by the weights setting, timed in the same reps",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from ridgefill_runtime.config import CacheConfig, EngineConfig
    from ridgefill_runtime.loader.gguf import default_model_path
    from ridgefill_runtime.llm import LLM

    path = default_model_path()
    llms = {w: LLM(EngineConfig(cache=CacheConfig(kv_cache_gib=0.05), weights=w)) for w in args.weights}
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids_all = real_text_ids(next(iter(llms.values())).tokenizer, max(args.lengths))

    print(
        f"threads={torch.get_num_threads()} torch={torch.__version__} model=SmolLM2-135M-Instruct (GGUF, float32, CPU)"
    )
    for llm in llms.values():
        time_ours(engine_with_chunk(llm, 128), ids_all[:128])  # warm up
    time_hf(hf, ids_all[:128])
    for w, llm in llms.items():
        print(f"\nweights = {w}")
        print(
            f"{'tokens':>6} | {'transformers tok/s':>18} | {'ours tok/s':>10} | {'ratio':>5} | "
            f"{'ours chunk=' + str(args.chunk) + ' tok/s':>22} | {'ratio':>5}"
        )
        print("-" * 84)
        for n in args.lengths:
            ids = ids_all[:n]
            whole, split = engine_with_chunk(llm, n), engine_with_chunk(llm, args.chunk)
            ours, chunked, ref = [], [], []
            for _ in range(args.reps):
                ref.append(time_hf(hf, ids))
                ours.append(time_ours(whole, ids))
                chunked.append(time_ours(split, ids))
            r, o, c = (statistics.median(v) for v in (ref, ours, chunked))
            print(f"{n:>6} | {n / r:>18.0f} | {n / o:>10.0f} | {r / o:>5.2f} | {n / c:>22.0f} | {r / c:>5.2f}")


if __name__ == "__main__":
    main()
