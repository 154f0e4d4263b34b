"""`ridgefill eval`: every arm paired with exact in the same run (seed 000, §3)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from ..cache.spec import spec_of
from ..config import CacheConfig, EngineConfig, FillConfig, SchedulerConfig
from ..engine import Engine
from ..fill.select import RowSelector
from ..offline import PromptLogits
from ..sequence import SamplingParams
from .measures import binomial_floor, kl_and_agreement, novel_mask, paired_bootstrap, target_nll
from .needles import TASKS, make_prompt, solved

KEY_RISE = 2.0  # nats: a key token's exact loss rises by more than this without the prefix
SPLICES = ("keys", "values", "both")
# hybrids: also the late Gated DeltaNet layers' states (conv and recurrent) at the prefix's end,
# and everything at once (seed 000 §1: on Qwen3.5 the error is in the values and the state)
HYBRID_SPLICES = SPLICES + ("state", "all")
CHUNK = 2048  # NOTE: big chunks: the CPU's masked-attention path for later chunks is slower


@dataclass
class Arm:
    name: str
    fill: FillConfig
    maps: object = None
    # NOTE: the exact-row selector for fill.rows; the default knows only position 0 (no token
    # table), which is all the "special" selection needs on a bare model
    selector: RowSelector | None = None


def document_measures(model, ids: list[int], arms: list[Arm], tail: int, splice_arm: str | None) -> dict:
    """Per arm: mean ΔNLL on novel and key tokens, mean KL(exact‖arm), top-1 agreement."""
    n, b = len(ids), len(ids) - tail
    _, exact_all, exact_runner, exact_seq = PromptLogits(model, chunk=CHUNK)(ids, logits_from=b)
    exact = exact_all[:-1]  # rows b..n-2 predict tokens b+1..n-1
    targets = torch.tensor(ids[b + 1 :])
    nll_exact = target_nll(exact, targets)
    _, cut, _, _ = PromptLogits(model, chunk=CHUNK)(ids[b:])  # the context cut to its last `tail` tokens
    key = (target_nll(cut[:-1], targets) - nll_exact) > KEY_RISE
    novel = novel_mask(ids)[b + 1 :]
    out = {"tokens": n, "novel": int(novel.sum()), "key": int(key.sum())}
    runs = [(a.name, a, None) for a in arms]
    if splice_arm:
        base = next(a for a in arms if a.name == splice_arm)
        runs += [(f"{splice_arm}+exact_{what}", base, what) for what in splices_for(model)]
    for name, arm, splice in runs:
        hook = None if splice is None else _splicer(exact_runner, exact_seq, splice, arm.fill.split)
        state = None if splice not in ("state", "all") else _state_splicer(model, ids[:b], arm.fill.split)
        _, logits, _, _ = PromptLogits(model, arm.fill, arm.maps, chunk=CHUNK, selector=arm.selector)(
            ids, after_fill=hook, at_prefix_end=state
        )
        logits = logits[:-1]
        d = target_nll(logits, targets) - nll_exact
        kl, agree = kl_and_agreement(exact, logits)
        out[name] = {
            "dnll_novel": float(d[novel].mean()) if novel.any() else None,
            "dnll_key": float(d[key].mean()) if key.any() else None,
            "dnll_all": float(d.mean()),
            "kl": float(kl.mean()),
            "agree": float(agree.double().mean()),
        }
    return out


def splices_for(model) -> tuple[str, ...]:
    """The splices a model has: K/V ones, and state ones when recurrent layers sit in it."""
    return HYBRID_SPLICES if spec_of(model).recurrent_layers else SPLICES


def _splicer(exact_runner, exact_seq, what: str, split: int):
    """Copy the exact run's late keys and/or values into the filled slots (same positions)."""
    parts = ("k",) * (what in ("keys", "both", "all")) + ("v",) * (what in ("values", "both", "all"))

    def splice(runner, seq):
        src = exact_runner._seq_slots(exact_seq, 0, seq.fill.boundary)
        dst = runner._seq_slots(seq, 0, seq.fill.boundary)
        for layer in (l for l in runner.caches.spec.attention_layers if l >= split):
            runner.kv.copy_from(layer, dst, exact_runner.kv, src, parts)

    return splice


def _state_splicer(model, prefix: list[int], split: int):
    """At the prefix's end, the late recurrent layers' states of an exact run over the prefix alone."""
    _, _, exact, seq = PromptLogits(model, chunk=CHUNK)(prefix)

    def splice(runner, filled_seq):
        for layer in (l for l in runner.caches.spec.recurrent_layers if l >= split):
            for name, t in runner.states.state(layer).items():
                t[filled_seq.state_slot] = exact.states.state(layer)[name][seq.state_slot]

    return splice


def needle_results(
    model, tokenizer, arms: list[Arm], haystacks: list[str], lengths, per_task: int, tail: int, seed: int = 0
) -> list[dict]:
    """Greedy answers per arm for prompts whose needles all lie in the prefix."""
    rng = random.Random(seed)
    prompts = []
    for task in TASKS:
        for i in range(per_task):
            length = lengths[i % len(lengths)]
            hay = " ".join(rng.sample(haystacks, 3))
            prompts.append(make_prompt(task, tokenizer, hay, length, rng, prefix_limit=length - tail - 64))
    prompts = [p for p in prompts if p.in_prefix(tail)]
    engines = {"exact": _engine(model, tokenizer, FillConfig(), None)}
    engines.update({a.name: _engine(model, tokenizer, a.fill, a.maps) for a in arms})
    rows = []
    for p in prompts:
        row = {"task": p.task, "tokens": len(p.ids)}
        for name, eng in engines.items():
            seq = eng.add_request(list(p.ids), SamplingParams(max_tokens=32, temperature=0))
            while eng.has_unfinished():
                eng.step()
            row[name] = solved(p, seq.text)
        rows.append(row)
    return rows


def _engine(model, tokenizer, fill: FillConfig, maps) -> Engine:
    # NOTE: no prefix caching: every arm of an evaluation computes its prompt itself
    cfg = EngineConfig(
        cache=CacheConfig(kv_cache_gib=0.5, prefix_caching="off"),
        fill=fill,
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, chunk_size=2048),
    )
    return Engine(model, tokenizer, cfg, maps)


def summarize(docs: list[dict], needles: list[dict], names: list[str]) -> dict:
    summary = {}
    for name in names:
        s = {}
        for m in ("dnll_novel", "dnll_key", "kl", "agree"):
            vals = [d[name][m] for d in docs if name in d and d[name][m] is not None]
            s[m] = paired_bootstrap(vals) + (len(vals),)
        solved_by_exact = [r for r in needles if r["exact"]]
        if name in (needles[0] if needles else {}):
            diffs = [100.0 * (r[name] - r["exact"]) for r in solved_by_exact]
            mean, lo, hi = paired_bootstrap(diffs)
            n = len(diffs)
            s["retrieval"] = {
                "n": n,
                "accuracy": 100.0 * sum(r[name] for r in solved_by_exact) / n if n else None,
                "diff_vs_exact": mean,
                "ci": [lo, hi],
                "lower_bound": min(lo, binomial_floor(n)) if n else None,
            }
        summary[name] = s
    summary["needles_in_prefix"] = len(needles)
    summary["needles_solved_by_exact"] = sum(r["exact"] for r in needles)
    return summary


def markdown(summary: dict, names: list[str]) -> str:
    f = lambda t: "n/a" if t[0] != t[0] else f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}] (n={t[3]})"  # noqa: E731
    lines = [
        "| arm | ΔNLL novel | ΔNLL key | KL(exact‖arm) | top-1 agreement | filled-region retrieval (Δ vs exact) |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        s = summary[name]
        r = s.get("retrieval")
        ret = (
            "—"
            if not r or r["n"] == 0
            else (
                f"{r['accuracy']:.1f}% ({r['diff_vs_exact']:+.1f} pts "
                f"[{r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}], bound {r['lower_bound']:+.1f}, n={r['n']})"
            )
        )
        lines.append(f"| {name} | {f(s['dnll_novel'])} | {f(s['dnll_key'])} | {f(s['kl'])} | {f(s['agree'])} | {ret} |")
    return "\n".join(lines)
