"""Decode speed on the embedded SmolLM2 (Q4_1 GGUF) or a packaged model (--model): ridgefill vs
llama.cpp vs transformers, one run, same file, same threads.

    python benchmarks/decode.py --threads 2 --context 1024 --new 64 --batches 1 4 16 64 --out decode.json
    python benchmarks/decode.py --threads 2 --model qwen2.5-coder-0.5b --batches 1 4 --weights packed

ridgefill runs twice, once per `weights` setting: "packed" keeps the GGUF's quantized blocks and
multiplies with the weight-only kernel, "dequantized" expands them to `--dtype`. Each arm loads
the model once; every batch size B gets a fresh Engine over it (a KV pool with room for all B
sequences, max_num_seqs = B). B requests, each a distinct `--context`-token real-text prompt,
greedy with ignore_eos, are prefilled untimed; then `--new` engine steps are timed while all B
sequences decode (one token each per step). Since decodes run before prefills in a step, the
first-admitted sequences have already decoded a few tokens when the last one gets its first,
so the B contexts differ by at most the number of prefill steps (requests get that much extra
max_tokens so none finishes inside the timed window; they are aborted after it).

ITL: median (p50) and p90 of the timed step times. Aggregate tok/s = B / median step time.
"agg vs B=1": that arm's aggregate over its own B=1 aggregate. "ITL vs llama.cpp": that B=1
row's ITL divided by llama.cpp's (above 1: slower than llama.cpp).

llama.cpp (llama-cpp-python, B=1, flash attention on as in llama-server): the prompt ids in n_batch=512 evals, then `--new`
single-token evals with greedy argmax over the last logits, each eval timed. transformers
(B=1, --no-hf to skip): one forward over the prompt with its KV cache, then `--new`
single-token forwards with past_key_values, greedy, each timed.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # NOTE: prefill.py's real-text helper
from prefill import real_text_ids  # noqa: E402


def real_text_prompts(tokenizer, count: int, n: int) -> list[list[int]]:
    """`count` distinct n-token prompts: consecutive windows of the local text."""
    ids = real_text_ids(tokenizer, count * n)
    return [ids[i * n : (i + 1) * n] for i in range(count)]


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summary(step_s: list[float], batch: int) -> dict:
    p50 = statistics.median(step_s)
    return {
        "steps": len(step_s),
        "itl_p50_ms": p50 * 1e3,
        "itl_p90_ms": percentile(step_s, 0.9) * 1e3,
        "agg_tok_s": batch / p50,
    }


# -- ridgefill ---------------------------------------------------------------------------------


def ridgefill_engine(
    llm, weights: str, dtype: str, batch: int, max_tokens: int, context: int, chunk: int, kv_dtype: str = "auto"
):
    """A fresh engine over the loaded model, its KV pool sized for `batch` whole sequences."""
    from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
    from ridgefill_runtime.engine import Engine

    block = 16
    blocks = batch * (-(-(context + max_tokens + 1) // block) + 1)
    config = EngineConfig(
        dtype=dtype,
        weights=weights,
        cache=CacheConfig(block_size=block, num_blocks=blocks, kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=chunk + batch, chunk_size=chunk),
    )
    return Engine(llm.engine.model, llm.tokenizer, config)


def kv_elem_bytes(kv) -> float:
    """Bytes the pool stores per cached K or V element (a narrower kv_dtype's scales included)."""
    slabs = {id(t): t for t in kv.k.values()}
    k = next(iter(slabs.values()))
    return kv.bytes_per_token() / (2 * len(slabs) * k.shape[1] * k.shape[2])


def time_ridgefill(
    llm, weights: str, dtype: str, prompts: list[list[int]], new: int, chunk: int, kv_dtype: str = "auto"
) -> dict:
    from ridgefill_runtime.sequence import SamplingParams

    batch, context = len(prompts), len(prompts[0])
    # prefill steps until the last sequence has its first token: at most this many
    slack = batch * -(-context // chunk) + batch + 2
    max_tokens = new + slack
    engine = ridgefill_engine(llm, weights, dtype, batch, max_tokens, context, chunk, kv_dtype)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    t = time.perf_counter()
    prefill_steps = 0
    while not all(s.output_ids for s in seqs):
        engine.step()
        prefill_steps += 1
        if prefill_steps > 10 * slack:
            raise RuntimeError(f"B={batch}: prefill did not finish in {prefill_steps} steps")
    prefill_s = time.perf_counter() - t
    lead = max(len(s.output_ids) for s in seqs) - 1
    steps, short = [], 0
    for _ in range(new):
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        short += len(outs) != batch or any(s.finished for s in seqs)
    tokens = list(seqs[0].output_ids[: new + 1]) if batch == 1 else None  # greedy, for the cross-check
    for s in seqs:
        engine.abort(s)
    stats = engine.stats()
    row = summary(steps, batch)
    row.update(
        kv_elem_bytes=kv_elem_bytes(engine.kv),
        prefill_s=prefill_s,
        prefill_steps=prefill_steps,
        max_lead_tokens=lead,
        steps_not_full_batch=short,
        preemptions=stats.preemptions_total,
    )
    if tokens is not None:
        row["tokens"] = tokens
    return row


# -- llama.cpp ---------------------------------------------------------------------------------


def time_llama_cpp(path, ids: list[int], new: int, threads: int) -> dict:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(
        model_path=str(path),
        n_ctx=len(ids) + new + 16,
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        # NOTE: llama-server's default (-fa auto) turns flash attention on for the CPU; the
        # binding's default is off, which made its 16K-context step 2.7x slower (53.5 vs 20 ms)
        flash_attn=True,
        verbose=False,
    )
    n_vocab = llm.n_vocab()

    def last_argmax() -> int:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,))
        return int(logits.argmax())

    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t
    token = last_argmax()
    steps, tokens = [], [token]
    for _ in range(new):
        t = time.perf_counter()
        llm.eval([token])
        token = last_argmax()
        steps.append(time.perf_counter() - t)
        tokens.append(token)
    row = summary(steps, 1)
    row.update(prefill_s=prefill_s, version=llama_cpp.__version__, tokens=tokens)
    return row


# -- transformers ------------------------------------------------------------------------------


@torch.inference_mode()
def time_hf(model, ids: list[int], new: int) -> dict:
    # NOTE: transformers 5.x renamed past_key_values to cache (the old name warns)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    t = time.perf_counter()
    out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
    prefill_s = time.perf_counter() - t
    past = getattr(out, kw)
    token = int(out.logits[0, -1].argmax())
    steps, tokens = [], [token]
    for _ in range(new):
        t = time.perf_counter()
        out = model(torch.tensor([[token]]), use_cache=True, **{kw: past})
        past = getattr(out, kw)
        token = int(out.logits[0, -1].argmax())
        steps.append(time.perf_counter() - t)
        tokens.append(token)
    row = summary(steps, 1)
    row.update(prefill_s=prefill_s, tokens=tokens)
    return row


# -- report ------------------------------------------------------------------------------------


def alternate(llm, path, ids: list[int], args) -> dict:
    """ridgefill packed (each --kv-dtypes cache) and llama.cpp at B=1, alternating, `args.rounds` times."""
    ours: dict[str, list[float]] = {kv: [] for kv in args.kv_dtypes}
    theirs = []
    for _ in range(args.rounds):
        for kv in args.kv_dtypes:
            ours[kv].append(time_ridgefill(llm, "packed", args.dtype, [ids], args.new, args.chunk, kv)["itl_p50_ms"])
        theirs.append(time_llama_cpp(path, ids, args.new, args.threads)["itl_p50_ms"])
    return {"ridgefill_itl_ms": ours, "llama_cpp_itl_ms": theirs}


def table(rows: list[dict]) -> str:
    llama = next((r for r in rows if r["arm"] == "llama.cpp"), None)
    base = {r["arm"]: r["agg_tok_s"] for r in rows if r["batch"] == 1}
    head = ["arm", "B", "ITL p50 ms", "ITL p90 ms", "agg tok/s", "agg vs B=1", "ITL vs llama.cpp"]
    roof = any("of_roofline" in r for r in rows)
    if roof:
        head += ["GFLOP/s", "of FMA peak", "GB/s", "of copy peak", "of roofline"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for r in rows:
        vs_b1 = f"{r['agg_tok_s'] / base[r['arm']]:.2f}x" if r["arm"] in base else "-"
        vs_llama = f"{r['itl_p50_ms'] / llama['itl_p50_ms']:.2f}x" if llama and r["batch"] == 1 else "-"
        cells = [r["arm"], r["batch"], f"{r['itl_p50_ms']:.2f}", f"{r['itl_p90_ms']:.2f}", f"{r['agg_tok_s']:.1f}"]
        cells += [vs_b1, vs_llama]
        if roof and "of_roofline" in r:
            cells += [f"{r['gflops']:.1f}", f"{r['of_fma']:.2f}", f"{r['gbs']:.1f}", f"{r['of_copy']:.2f}"]
            cells += [f"{r['of_roofline']:.2f}"]
        elif roof:
            cells += ["-"] * 5
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def add_roofline(rows: list[dict], model, wbytes: dict[str, int], context: int, peaks) -> None:
    """Each row's GFLOP/s, GB/s and roofline fraction (ridgefill_runtime/eval/roofline.py), from its
    median step time. llama.cpp's row is counted with the packed arm's weight bytes (the same GGUF
    blocks) and its float16 K/V; transformers' with the dequantized arm's and float32 K/V."""
    from ridgefill_runtime.eval.roofline import decode_work
    from ridgefill_runtime.fill.ceiling import layer_shapes

    try:
        shapes = layer_shapes(model.config, model.cache_spec().layers)
    except ValueError as e:  # a recurrent layer: no attention count
        print(f"no roofline columns: {e}")
        return
    cfg = model.config
    for r in rows:
        arm = {"llama.cpp": "ridgefill packed", "transformers": "ridgefill dequantized"}.get(r["arm"], r["arm"])
        w = wbytes.get(arm.split(",")[0])
        if w is None:  # that arm's weights were not loaded in this run
            continue
        kv = r.get("kv_elem_bytes", 2 if r["arm"] == "llama.cpp" else 4)
        work = decode_work(shapes, cfg.vocab_size, cfg.hidden_size, w, kv, r["batch"], context)
        r.update(work.columns(r["itl_p50_ms"] / 1e3, peaks))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=64, help="timed decode steps (tokens per sequence)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--weights", nargs="+", default=["packed", "dequantized"], choices=["packed", "dequantized"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk (untimed)")
    ap.add_argument(
        "--kv-dtypes",
        nargs="+",
        default=["auto"],
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
        help="cache.kv_dtype of the packed arm (one arm each; llama.cpp's cache is float16)",
    )
    ap.add_argument(
        "--gemm-dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="model.gemm_dtype of the packed arm (one arm each): bfloat16 multiplies decode batches' whole "
        "16-row blocks in bfloat16 (AVX512-BF16)",
    )
    ap.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="the transformers arm")
    ap.add_argument("--llama-cpp", action=argparse.BooleanOptionalAction, default=True, help="the llama.cpp arm")
    ap.add_argument(
        "--rounds",
        type=int,
        default=5,
        help="B=1 head to head: rounds alternating ridgefill packed and llama.cpp (this VM's speed "
        "drifts by up to 1.5x between minutes, so one pass each is not a comparison)",
    )
    ap.add_argument(
        "--roofline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure this machine's FMA and copy peaks first and add the roofline columns",
    )
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--model", default=None, help="a packaged model's name (default: the embedded SmolLM2)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from ridgefill_runtime.config import CacheConfig, EngineConfig
    from ridgefill_runtime.eval.roofline import weight_bytes
    from ridgefill_runtime.llm import LLM
    from ridgefill_runtime.loader.gguf import default_model_path
    from ridgefill_runtime.loader.packaged import packaged_model_path
    from ridgefill_runtime.ops.packed_linear import bf16_gemm_native, with_gemm_dtype

    path = packaged_model_path(args.model) if args.model else default_model_path()
    if "bfloat16" in args.gemm_dtypes and not bf16_gemm_native(torch.device("cpu")):
        sys.exit("--gemm-dtypes bfloat16 needs a CPU with AVX512-BF16 or AMX; this one would emulate it")
    header = {
        "threads": torch.get_num_threads(),
        "context": args.context,
        "new": args.new,
        "dtype": args.dtype,
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "model": str(path),
    }
    peaks = None
    if args.roofline:
        from ridgefill_runtime.eval.roofline import measure_peaks

        peaks = measure_peaks(args.threads)
        header["peaks"] = {"fma_gflops": peaks.fma_gflops, "copy_gbs": peaks.copy_gbs, "lanes": peaks.lanes}
    print(" ".join(f"{k}={v}" for k, v in header.items()))
    rows: list[dict] = []
    wbytes: dict[str, int] = {}
    skipped: dict[str, str] = {}
    prompts = None

    for weights in args.weights:
        llm = LLM(
            EngineConfig(model=args.model, dtype=args.dtype, weights=weights, cache=CacheConfig(kv_cache_gib=0.05))
        )
        if prompts is None:
            prompts = real_text_prompts(llm.tokenizer, max(args.batches), args.context)
        time_ridgefill(llm, weights, args.dtype, [prompts[0][:64]], 4, args.chunk)  # warm up
        packed_arms = [(g, kv) for g in args.gemm_dtypes for kv in args.kv_dtypes] if weights == "packed" else []
        for gemm, kv in packed_arms or [("float32", "auto")]:
            with_gemm_dtype(llm.engine.model.weights, getattr(torch, gemm))
            arm = f"ridgefill {weights}" + ("" if kv == "auto" else f", kv {kv}")
            arm += "" if gemm == "float32" else f", gemm {gemm}"
            for b in args.batches:
                r = time_ridgefill(llm, weights, args.dtype, prompts[:b], args.new, args.chunk, kv)
                rows.append({"arm": arm, "batch": b, **r})
                print(
                    f"  {arm} B={b}: ITL {r['itl_p50_ms']:.2f} ms, {r['agg_tok_s']:.1f} tok/s "
                    f"(prefill {r['prefill_s']:.1f} s in {r['prefill_steps']} steps)",
                    flush=True,
                )
        with_gemm_dtype(llm.engine.model.weights, torch.float32)  # the head to head below runs float32
        wbytes[f"ridgefill {weights}"] = weight_bytes(llm.engine.model.weights)
        model = llm.engine.model
        if weights == "packed":
            packed_llm = llm
        del llm

    if args.llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:  # a broken build raises more than ImportError
            skipped["llama.cpp"] = f"llama_cpp does not import: {type(e).__name__}: {e}"
        else:
            r = time_llama_cpp(path, prompts[0], args.new, args.threads)
            rows.append({"arm": "llama.cpp", "batch": 1, **r})
            print(f"  llama.cpp B=1: ITL {r['itl_p50_ms']:.2f} ms", flush=True)
    else:
        skipped["llama.cpp"] = "--no-llama-cpp"

    if args.hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=getattr(torch, args.dtype)
        ).eval()
        time_hf(hf, prompts[0][:64], 4)  # warm up
        r = time_hf(hf, prompts[0], args.new)
        rows.append({"arm": "transformers", "batch": 1, **r})
        print(f"  transformers B=1: ITL {r['itl_p50_ms']:.2f} ms", flush=True)
        del hf
    else:
        skipped["transformers"] = "--no-hf"

    head_to_head = None
    if args.rounds and "llama.cpp" not in skipped and "packed" in args.weights:
        head_to_head = alternate(packed_llm, path, prompts[0], args)

    for arm, why in skipped.items():
        print(f"skipped {arm}: {why}")
    if peaks:
        add_roofline(rows, model, wbytes, args.context, peaks)
        print(peaks.describe())
    print()
    print(table(rows))
    if head_to_head:
        ours_by_kv, theirs = head_to_head["ridgefill_itl_ms"], head_to_head["llama_cpp_itl_ms"]
        print(f"\nB=1 head to head, {args.rounds} alternating rounds of {args.new} tokens (ITL p50 per round, ms):")
        print("| round | " + " | ".join(str(i + 1) for i in range(len(theirs))) + " | median |")
        print("|---" * (len(theirs) + 2) + "|")
        named = [(f"ridgefill packed, kv {kv}", xs) for kv, xs in ours_by_kv.items()] + [("llama.cpp", theirs)]
        for name, xs in named:
            print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in xs) + f" | {statistics.median(xs):.2f} |")
        for kv, ours in ours_by_kv.items():
            ratios = [a / b for a, b in zip(ours, theirs)]
            print(
                f"ridgefill (kv {kv}) / llama.cpp per round: {', '.join(f'{r:.2f}' for r in ratios)}; "
                f"median {statistics.median(ratios):.2f}"
            )
    # sanity: the B=1 arms decode the same prompt greedily; the same first tokens say they ran the same model
    ref = {r["arm"]: r["tokens"] for r in rows if r["batch"] == 1 and r.get("tokens")}
    base_arm = "llama.cpp" if "llama.cpp" in ref else "transformers" if "transformers" in ref else None
    for arm, toks in ref.items():
        if base_arm and arm != base_arm:
            other = ref[base_arm]
            same = next((i for i, (a, b) in enumerate(zip(toks, other)) if a != b), min(len(toks), len(other)))
            print(f"greedy tokens, {arm} vs {base_arm}: first {same} of {len(toks)} agree")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({**header, "skipped": skipped, "rows": rows, "head_to_head": head_to_head}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
