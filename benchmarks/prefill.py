"""Exact prefill speed on the embedded SmolLM2 or a packaged model (--model): ridgefill vs
transformers and (--llama-cpp) llama.cpp, same run, same file, same threads.

    python benchmarks/prefill.py --threads 2 --lengths 1024 2048 4096 --reps 3
    python benchmarks/prefill.py --threads 2 --model qwen2.5-coder-0.5b --llama-cpp --no-hf --lengths 1024 4096

Ours goes through the whole engine (schedule -> run -> sample the first token), so the
figure is time to first token for one request on an idle server. Transformers runs one
forward over the prompt with its KV cache on, keeping only the last position's logits, in
float32 from the same GGUF. llama.cpp (llama-cpp-python) evaluates the prompt ids in
n_batch=512 pieces on a fresh context, with its own quantized kernels and float16 K/V; its
ratio column is llama.cpp's time over ours (above 1: we are faster). Reported: median of
`reps` runs, interleaved so every arm sees the same machine state.
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


def llama_cpp_timer(path, n_ctx: int, threads: int):
    """ids -> seconds for llama.cpp to evaluate them from an empty context."""
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False
    )

    def timed(ids: list[int]) -> float:
        llm.reset()  # NOTE: eval then drops every cached cell from position 0: a cold prompt
        t = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - t

    return timed


def roofline_counter(model, threads: int):
    """(model, n, seconds) -> roofline columns of an exact n-row prefill (eval/roofline.py), with
    this machine's peaks measured once, now; None for a model the MAC count does not cover."""
    from ridgefill_runtime.eval.roofline import measure_peaks, prefill_work, weight_bytes
    from ridgefill_runtime.fill.ceiling import layer_shapes

    try:
        shapes = layer_shapes(model.config, model.cache_spec().layers)
    except ValueError as e:
        print(f"no roofline columns: {e}")
        return None
    peaks = measure_peaks(threads)
    print(peaks.describe())
    cfg = model.config

    def columns(m, n: int, seconds: float) -> dict:
        work = prefill_work(shapes, cfg.vocab_size, cfg.hidden_size, weight_bytes(m.weights), n)
        return work.columns(seconds, peaks)

    return columns


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
    ap.add_argument("--model", default=None, help="a packaged model's name (default: the embedded SmolLM2)")
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="the transformers arm")
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=False, help="the llama.cpp arm")
    ap.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure this machine's FMA and copy peaks and add ours' GFLOP/s and roofline fraction",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from ridgefill_runtime.config import CacheConfig, EngineConfig
    from ridgefill_runtime.loader.gguf import default_model_path
    from ridgefill_runtime.loader.packaged import packaged_model_path
    from ridgefill_runtime.llm import LLM

    path = packaged_model_path(args.model) if args.model else default_model_path()
    llms = {
        w: LLM(EngineConfig(model=args.model, cache=CacheConfig(kv_cache_gib=0.05), weights=w)) for w in args.weights
    }
    ids_all = real_text_ids(next(iter(llms.values())).tokenizer, max(args.lengths))
    peers = {}
    if args.hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
        peers["transformers"] = lambda ids: time_hf(hf, ids)
    if args.llama_cpp:
        peers["llama.cpp"] = llama_cpp_timer(path, max(args.lengths) + 16, args.threads)

    print(f"threads={torch.get_num_threads()} torch={torch.__version__} model={path.name} (float32 activations, CPU)")
    roof = roofline_counter(next(iter(llms.values())).engine.model, args.threads) if args.roofline else None
    for llm in llms.values():
        time_ours(engine_with_chunk(llm, 128), ids_all[:128])  # warm up
    for timed in peers.values():
        timed(ids_all[:128])
    for w, llm in llms.items():
        print(f"\nweights = {w}; ratio = peer time / ours (above 1: ours faster)")
        head = " | ".join(f"{p} tok/s | ratio" for p in peers)
        roof_head = " | ours GFLOP/s | of FMA peak | of roofline" if roof else ""
        print(f"{'tokens':>6} | ours tok/s | ours chunk={args.chunk} tok/s | {head}{roof_head}")
        for n in args.lengths:
            ids = ids_all[:n]
            whole, split = engine_with_chunk(llm, n), engine_with_chunk(llm, args.chunk)
            times: dict[str, list[float]] = {"ours": [], "chunked": [], **{p: [] for p in peers}}
            for _ in range(args.reps):
                for p, timed in peers.items():
                    times[p].append(timed(ids))
                times["ours"].append(time_ours(whole, ids))
                times["chunked"].append(time_ours(split, ids))
            med = {k: statistics.median(v) for k, v in times.items()}
            cells = " | ".join(f"{n / med[p]:.0f} | {med[p] / med['ours']:.2f}" for p in peers)
            if roof:
                c = roof(llm.engine.model, n, med["ours"])
                cells += f" | {c['gflops']:.1f} | {c['of_fma']:.2f} | {c['of_roofline']:.2f}"
            print(f"{n:>6} | {n / med['ours']:.0f} | {n / med['chunked']:.0f} | {cells}", flush=True)


if __name__ == "__main__":
    main()
