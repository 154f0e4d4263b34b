"""Seed 001 on the looped demonstration model (ridgefill_runtime/data/looped, float32, CPU), in one run:

(a) ripening: relative distance of loop r's prefix K/V to loop R's, Δ_r = ||K(r) - K(R)|| / ||K(R)||
    over prompt positions (averaged over core layers and prompts), and the rate ρ of Δ_r ≈ c ρ^r
    (least squares on log Δ_r over the second half of the loops);
(b) KL(full || arm) per decoded position: each prompt's greedy continuation under the full cache is
    replayed token by token through each arm (deepest plane, RIPE(W), and the full cache in bf16 as
    the precision floor); count of positions above 0.1 and the largest KL (Table 4);
(c) acceptance α_d of greedy self-speculation for d in {2, 4, 8} with full-cache and deepest-plane
    drafts (γ = 4), and the measured tokens per verification τ against Eq. (7), τ = (1 - α^(γ+1)) / (1 - α);
(d) self-speculative decoding against sequential decoding through the engine, each request alone:
    tokens/s, speedup and identical greedy output for γ in {2, 4, 8} (RIPE W = 64 >= γ), with the
    speedup Eq. (8) predicts from the measured τ and c(d) = n_pre + d n_core + n_coda (η = 1).

Prompts are Python documentation (never in the model's training text), cut to --prompt-tokens.

    .venv/bin/python benchmarks/looped_ripe.py --threads 2 [--prompts 32] [--new 48] [--loops 32]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.build import CacheBudget, build_caches
from ridgefill_runtime.cache.spec import spec_of
from ridgefill_runtime.config import CacheConfig, EngineConfig, LoopConfig, LoopOverrides, LoopPlan
from ridgefill_runtime.fill.corpus import evaluation_docs
from ridgefill_runtime.layers.loop_attention import LoopRead
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.runner import Runner
from ridgefill_runtime.scheduler import ScheduledSeq
from ridgefill_runtime.sequence import SamplingParams, Sequence

BLOCK = 16


def prompts_from_docs(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens, one per evaluation document, from each document's middle."""
    out = []
    for doc in evaluation_docs():
        ids = tokenizer.encode(doc.text)
        if len(ids) >= 2 * length:
            mid = len(ids) // 2
            out.append(ids[mid : mid + length])
        if len(out) == count:
            return out
    raise SystemExit(f"only {len(out)} evaluation documents have {2 * length} tokens")


# -- replay: one sequence, prefill then token-by-token decode, every row's logits ------------------


class Replay:
    """Drives the runner's tensor preparation and the model directly (as the parity harness does)."""

    def __init__(self, model, looped: LoopConfig, tokens: int):
        self.model = model
        self.caches = build_caches(
            spec_of(model, looped),
            CacheBudget(block_size=BLOCK, num_blocks=-(-tokens // BLOCK), state_slots=1),
            model.device,
        )
        self.runner = Runner(model, self.caches, BLOCK)
        self.blocks = BlockManager(self.caches.num_blocks, BLOCK)

    def run(self, tokens: list[int], prompt_len: int, read: LoopRead, chunk: int) -> torch.Tensor:
        """Logits [len(tokens) - prompt_len + 1, V] of the prompt's last row and each decoded row."""
        seq = Sequence(prompt_ids=list(tokens), params=SamplingParams(max_tokens=0))
        seq.state_slot, seq.loop = 0, LoopPlan(read.loops, read.window, 0, 1)
        self.caches.states.free_slot(0)
        out = []
        while seq.num_computed < len(tokens):
            n = min(chunk, prompt_len - seq.num_computed) if seq.num_computed < prompt_len else 1
            self.blocks.grow(seq.block_table, seq.num_computed + n)
            item = ScheduledSeq(seq, seq.num_computed, n)
            ids, pos, batch = self.runner.prepare([item])
            logits = self.model.forward(ids, pos, batch, self.caches, reads=(read,))
            seq.num_computed += n
            if seq.num_computed >= prompt_len:
                out.append(logits[-1:])
        self.last_slots = self.runner._seq_slots_at(seq, torch.arange(len(tokens)))
        self.blocks.free(seq.block_table)
        return torch.cat(out).float()


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per row."""
    lp, lq = p_logits.log_softmax(-1), q_logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)


# -- (a) ripening -------------------------------------------------------------------------------


def ripening(model, prompts, loops: int) -> dict:
    replay = Replay(model, LoopConfig(cache="full", loops=loops, block=0), max(len(p) for p in prompts))
    core = list(model.core)
    dist = {"k": torch.zeros(loops), "v": torch.zeros(loops)}
    for p in prompts:
        replay.run(p, len(p), LoopRead(loops, None), chunk=len(p))
        slots = replay.last_slots
        for layer in core:
            for part, slab in (("k", replay.caches.kv.k), ("v", replay.caches.kv.v)):
                deep = slab[(layer, loops)][slots].float()
                for r in range(1, loops + 1):
                    dist[part][r - 1] += float((slab[(layer, r)][slots].float() - deep).norm() / deep.norm())
    n = len(prompts) * len(core)
    table = {part: (d / n).tolist() for part, d in dist.items()}
    fit_from = loops // 2
    rates = {}
    for part, values in table.items():
        r = torch.arange(fit_from, loops, dtype=torch.float64)  # loops R/2 .. R-1 (Δ_R = 0)
        y = torch.tensor(values[fit_from - 1 : loops - 1], dtype=torch.float64).log()
        a = torch.stack([torch.ones_like(r), r], 1)
        coef = torch.linalg.lstsq(a, y[:, None]).solution[:, 0]
        rates[part] = math.exp(float(coef[1]))
    return {"delta": table, "rho": rates, "fit_loops": [fit_from, loops - 1]}


# -- (b) KL per decoded position ------------------------------------------------------------------


def kl_table(model, model_bf16, engine, prompts, loops: int, new: int, windows: list[int]) -> dict:
    trajectories = greedy(engine, prompts, new, LoopOverrides(block=0, cache="full"))
    total = max(len(p) for p in prompts) + new
    full = Replay(model, LoopConfig(cache="full", loops=loops, block=0), total)
    floor = Replay(model_bf16, LoopConfig(cache="full", loops=loops, block=0), total)
    arms = {"full, bf16 (precision floor)": (floor, LoopRead(loops, None))}
    arms["deepest plane (W = 0)"] = (full, LoopRead(loops, 0))
    for w in windows:
        arms[f"RIPE, W = {w}"] = (full, LoopRead(loops, w))
    rows = {name: [] for name in arms}
    for p, gen in zip(prompts, trajectories):
        tokens = p + gen[:-1]
        reference = full.run(tokens, len(p), LoopRead(loops, None), chunk=len(p))
        for name, (replay, read) in arms.items():
            chunk = len(p) if read.window is None or read.window == 0 else read.window + 1
            rows[name].append(kl(reference, replay.run(tokens, len(p), read, chunk)))
    out = {}
    for name, values in rows.items():
        v = torch.cat(values)
        out[name] = {
            "positions": v.numel(),
            "tail_gt_0.1": int((v > 0.1).sum()),
            "max_kl": float(v.max()),
            "mean_kl": float(v.mean()),
            "median_kl": float(v.median()),
        }
    return out


# -- (c), (d) through the engine ------------------------------------------------------------------


def greedy(engine, prompts, new: int, looped: LoopOverrides) -> list[list[int]]:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, looped=looped)
    outs = []
    for p in prompts:
        seq = engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
        outs.append(list(seq.output_ids))
    return outs


def timed(engine, prompts, new: int, looped: LoopOverrides) -> dict:
    spec0 = dict(vars(engine.scheduler.spec))
    t0 = time.perf_counter()
    outs = greedy(engine, prompts, new, looped)
    seconds = time.perf_counter() - t0
    spec1 = vars(engine.scheduler.spec)
    d = {k: spec1[k] - spec0[k] for k in spec0}
    return {"outputs": outs, "seconds": seconds, **d}


def acceptance(steps: int, accepted: int, all_accepted: int) -> float:
    """α: accepted drafts over drafts tested (each verification tests up to its first rejection)."""
    tested = accepted + (steps - all_accepted)
    return accepted / tested if tested else float("nan")


def tau_eq7(alpha: float, block: int) -> float:
    return block + 1 if alpha >= 1 else (1 - alpha ** (block + 1)) / (1 - alpha)


def cost(model, loops: int) -> int:
    lc = model.config.family_config
    return lc.prelude + loops * lc.core + lc.coda


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=160)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--loops", type=int, default=32)
    ap.add_argument("--spec-prompts", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    looped = LoopConfig(loops=args.loops, cache="full", window=0, block=8, draft_loops=2)
    engine = build_engine(EngineConfig(model="looped", looped=looped, cache=CacheConfig(kv_cache_gib=2.0)))
    model, tok = engine.model, engine.tokenizer
    bf16 = build_engine(
        EngineConfig(model="looped", dtype="bfloat16", looped=looped, cache=CacheConfig(num_blocks=4))
    ).model
    prompts = prompts_from_docs(tok, args.prompts, args.prompt_tokens)
    report = {
        "threads": args.threads,
        "loops": args.loops,
        "prompts": len(prompts),
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new,
    }
    t = time.perf_counter()
    report["ripening"] = ripening(model, prompts[:8], args.loops)
    print("(a) ripening:", json.dumps(report["ripening"]["rho"]), f"{time.perf_counter() - t:.0f}s", flush=True)
    t = time.perf_counter()
    report["kl"] = kl_table(model, bf16, engine, prompts, args.loops, args.new, [4, 16, 64, 256])
    print("(b) KL:", json.dumps(report["kl"]), f"{time.perf_counter() - t:.0f}s", flush=True)
    spec_prompts = prompts[: args.spec_prompts]
    acc = {}
    for cache in ("full", "deepest"):
        for d in (2, 4, 8):
            r = timed(engine, spec_prompts, args.new, LoopOverrides(cache=cache, block=4, draft_loops=d))
            alpha = acceptance(r["steps"], r["accepted"], r["all_accepted"])
            tau = (r["accepted"] + r["steps"]) / r["steps"]
            acc[f"{cache}, d = {d}"] = {"alpha": alpha, "tau": tau, "tau_eq7": tau_eq7(alpha, 4), "steps": r["steps"]}
            print("(c)", cache, d, json.dumps(acc[f"{cache}, d = {d}"]), flush=True)
    report["acceptance"] = acc
    seq = timed(engine, spec_prompts, args.new, LoopOverrides(cache="ripe", window=64, block=0))
    tokens = sum(len(o) for o in seq["outputs"])
    speed = {"sequential": {"tok_s": tokens / seq["seconds"], "seconds": seq["seconds"]}}
    for d in (2, 4):
        for block in (2, 4, 8):
            r = timed(
                engine, spec_prompts, args.new, LoopOverrides(cache="ripe", window=64, block=block, draft_loops=d)
            )
            tau = (r["accepted"] + r["steps"]) / r["steps"]
            predicted = tau * cost(model, args.loops) / (block * cost(model, d) + cost(model, args.loops))
            same = sum(a == b for a, b in zip(r["outputs"], seq["outputs"]))
            speed[f"d = {d}, γ = {block}"] = {
                "tok_s": tokens / r["seconds"],
                "speedup": seq["seconds"] / r["seconds"],
                "tau": tau,
                "eq8_speedup": predicted,
                "identical": f"{same}/{len(spec_prompts)}",
            }
            print("(d)", d, block, json.dumps(speed[f"d = {d}, γ = {block}"]), flush=True)
    report["speed"] = speed
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
