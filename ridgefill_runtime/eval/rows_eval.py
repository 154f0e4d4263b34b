"""Exact-row selectors against their controls and against exact (issue: exact rows).

Per needle prompt (needles all in the filled prefix): exact's greedy answer, then one lower
sweep shared by every selection (eval/sessions.py), and per arm the chosen rows, the late sweep
and a greedy answer. Per document: key-token and novel-token ΔNLL of each arm's tail against
exact. Arms are a selector set, optionally with a control: random (same count of random rows),
tail (same count added to the tail), hidden (the selectors see the prompt without its question).

  python -m ridgefill_runtime.eval.rows_eval --out DIR [--split 15 --tail 1024 --budget 1.0]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from ..config import EngineConfig, FillConfig, RowsConfig
from ..engine import token_table
from ..fill.corpus import evaluation_docs
from ..fill.maps import FillMaps, check_maps_fit
from ..fill.select import RowSelector
from ..fill.settings import PACKAGED_MAPS, shipped_maps, shipped_unigram
from ..llm import LLM
from ..offline import PromptLogits
from .measures import binomial_floor, novel_mask, paired_bootstrap, target_nll
from .needles import make_prompt, solved
from .run import KEY_RISE
from .sessions import PromptSession, exact_answer

TASKS = ("single", "multikey", "multivalue")
SELECTOR_SETS = {
    "plain": (),
    "special": ("special",),
    "attention": ("special", "attention"),
    "probe": ("special", "probe", "lexical"),
    "lexical": ("special", "lexical"),
    "protected": ("special", "protected"),
    "digits": ("special", "digits"),
}
# Question-blind selectors (protected, digits) read no question: their hidden control would be
# themselves, so it is not run.
# NOTE: the two candidate defaults get all three controls; the single-rule selectors get the
# random control (does the rule beat chance at its own count?) to fit the 2-core time budget.
DEFAULT_ARMS = (
    "plain,attention,attention/random,attention/tail,attention/hidden,"
    "probe@0.33,probe@0.33/random,probe@0.33/tail,probe@0.33/hidden,probe@1,"
    "lexical,lexical/random,protected,protected/random,digits,digits/random"
)
MAX_NEW = 32


def arm_list(names: list[str]) -> list[tuple[str, str, str]]:
    """'selectors[@budget][/control]' -> (arm name, that, control in none | random | tail | hidden)."""
    out = []
    for name in names:
        spec, _, control = name.partition("/")
        out.append((name, spec, control or "none"))
    return out


def rows_for(base: RowsConfig, spec: str, control: str) -> RowsConfig:
    selectors, _, budget = spec.partition("@")
    rows = base.replace(
        selectors=SELECTOR_SETS[selectors], control=control if control in ("random", "tail") else "none"
    )
    return rows.replace(budget_factor=float(budget)) if budget else rows


def needle_prompts(tok, per_task: int, lengths: list[int], tail: int, seed: int) -> list:
    rng = random.Random(seed)
    haystacks = [d.text for d in evaluation_docs()[200:]]
    out = []
    for i in range(per_task):
        for task in TASKS:
            length = lengths[(i * len(TASKS) + TASKS.index(task)) % len(lengths)]
            hay = " ".join(rng.sample(haystacks, 4))
            p = make_prompt(task, tok, hay, length, rng, prefix_limit=length - tail - 64)
            if p.in_prefix(tail):
                out.append(p)
    return out


def needle_row(model, tok, fill, maps, selector, base, arms, prompt, exact: bool | None = None) -> dict:
    """exact: exact's result from an earlier run on the same prompt (None: run it here)."""
    ids = list(prompt.ids)
    text = lambda out: tok.decode(out)  # noqa: E731
    eos = set(tok.eos_token_ids)
    done = lambda out: out[-1] in eos or solved(prompt, text(out))  # noqa: E731
    if exact is None:
        exact = solved(prompt, text(exact_answer(model, ids, MAX_NEW, done=done)))
    row = {"task": prompt.task, "tokens": len(ids), "exact": exact}
    sessions = {"none": PromptSession(model, fill, maps, selector, ids, max_new=MAX_NEW)}
    for name, sel, control in arms:
        key = "hidden" if control == "hidden" else "none"
        if key not in sessions:
            sessions[key] = PromptSession(
                model, fill, maps, selector, ids, hide_from=prompt.question_start, max_new=MAX_NEW
            )
        out = sessions[key].run(rows_for(base, sel, control), max_new=MAX_NEW, done=done)
        row[name] = solved(prompt, text(out.output_ids))
        row[name + ":text"] = text(out.output_ids)
        row[name + ":rows"] = len(out.exact_rows)
    row["prefix"] = len(ids) - fill.tail
    return row


def document_row(model, fill, maps, selector, base, arms, ids) -> dict:
    n, b = len(ids), len(ids) - fill.tail
    _, exact, _, _ = PromptLogits(model, chunk=2048)(ids, logits_from=b)
    targets = torch.tensor(ids[b + 1 :])
    nll_exact = target_nll(exact[:-1], targets)
    _, cut, _, _ = PromptLogits(model, chunk=2048)(ids[b:])
    key = (target_nll(cut[:-1], targets) - nll_exact) > KEY_RISE
    novel = novel_mask(ids)[b + 1 :]
    row = {"tokens": n, "key": int(key.sum()), "novel": int(novel.sum()), "prefix": b}
    session = PromptSession(model, fill, maps, selector, ids)
    for name, sel, control in arms:
        if control == "hidden":
            continue  # NOTE: a document has no question to hide
        out = session.run(rows_for(base, sel, control), score=True)
        d = target_nll(out.tail_logits[:-1], targets) - nll_exact
        row[name] = {
            "dnll_key": float(d[key].mean()) if key.any() else None,
            "dnll_novel": float(d[novel].mean()) if novel.any() else None,
            "rows": len(out.exact_rows),
        }
    return row


def summarize(needles: list[dict], docs: list[dict], arms) -> dict:
    out = {}
    for name, _, _ in arms:
        s = {}
        if needles and name in needles[0]:
            diffs = [100.0 * (r[name] - r["exact"]) for r in needles]
            mean, lo, hi = paired_bootstrap(diffs)
            n = len(diffs)
            s["retrieval"] = {
                "n": n,
                "accuracy": 100.0 * sum(r[name] for r in needles) / n,
                "exact": 100.0 * sum(r["exact"] for r in needles) / n,
                "diff": mean,
                "ci": [lo, hi],
                "bound": min(lo, binomial_floor(n)),
                "row_share": sum(r[name + ":rows"] / r["prefix"] for r in needles) / n,
            }
        vals = [d[name]["dnll_key"] for d in docs if name in d and d[name]["dnll_key"] is not None]
        if vals:
            s["dnll_key"] = paired_bootstrap(vals) + (len(vals),)
            s["dnll_novel"] = paired_bootstrap([d[name]["dnll_novel"] for d in docs if name in d]) + (len(vals),)
        out[name] = s
    return out


def markdown(summary: dict, arms) -> str:
    lines = [
        "| arm | exact rows (share of prefix) | retrieval | Δ vs exact, pts [95% CI] (bound) | key ΔNLL [95% CI] | novel ΔNLL |",
        "|---|---|---|---|---|---|",
    ]
    f = lambda t: f"{t[0]:+.3f} [{t[1]:+.3f}, {t[2]:+.3f}] (n={t[3]})"  # noqa: E731
    for name, _, _ in arms:
        s = summary[name]
        r = s.get("retrieval")
        ret = "—" if not r else f"{r['accuracy']:.1f}% (exact {r['exact']:.1f}%, n={r['n']})"
        diff = "—" if not r else f"{r['diff']:+.1f} [{r['ci'][0]:+.1f}, {r['ci'][1]:+.1f}] ({r['bound']:+.1f})"
        share = "—" if not r else f"{100 * r['row_share']:.1f}%"
        key = f(s["dnll_key"]) if "dnll_key" in s else "—"
        nov = f(s["dnll_novel"]) if "dnll_novel" in s else "—"
        lines.append(f"| {name} | {share} | {ret} | {diff} | {key} | {nov} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", type=int, default=15)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--budget", type=float, default=1.0, help="the probe's budget factor")
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--per-task", type=int, default=14, help="prompts per task (single, multikey, multivalue)")
    ap.add_argument("--lengths", default="2048,2560,3072,4096,5120,7168")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--shard", default="0/1", help="k/n: this process takes items k, k+n, ...")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--model",
        default=None,
        choices=sorted(PACKAGED_MAPS),
        help="a packaged model with shipped maps (e.g. gemma3-270m; default: the embedded SmolLM2)",
    )
    ap.add_argument(
        "--exact-from",
        type=Path,
        default=None,
        help="a finished run on the same prompts: reuse its exact answers (more arms later)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    k, n_shards = (int(x) for x in args.shard.split("/"))
    llm = LLM(EngineConfig(model=args.model)) if args.model else LLM()
    model, tok = llm.engine.model, llm.tokenizer
    maps_path = str(shipped_maps(args.split, args.model))
    maps = FillMaps(maps_path, "resident", model.dtype, model.device)
    check_maps_fit(maps.meta, model.identity, model.config, args.split, maps_path)
    # NOTE: unigram counts ship for the embedded model only: another model runs selectors without them
    unigram = None if args.model else str(shipped_unigram())
    base = RowsConfig(budget_factor=args.budget, unigram=unigram)
    fill = FillConfig(arm="ridgefill", split=args.split, tail=args.tail, maps=maps_path, rows=base)
    selector = RowSelector(token_table(tok, base))
    arms = arm_list(args.arms.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    prompts = needle_prompts(tok, args.per_task, [int(x) for x in args.lengths.split(",")], args.tail, args.seed)
    earlier = {}
    if args.exact_from:
        for f in args.exact_from.glob("needles.*.json"):
            for r in json.loads(f.read_text()):
                earlier[r["index"]] = r
    needles = []
    for i, p in enumerate(prompts):
        if i % n_shards != k:
            continue
        if earlier and earlier[i]["tokens"] != len(p.ids):
            raise SystemExit(f"--exact-from: prompt {i} differs from the earlier run's")
        needles.append(
            needle_row(model, tok, fill, maps, selector, base, arms, p, earlier[i]["exact"] if earlier else None)
        )
        needles[-1]["index"] = i
        (args.out / f"needles.{k}.json").write_text(json.dumps(needles, indent=1))
        print(
            f"rows_eval: prompt {i + 1}/{len(prompts)} {p.task} {len(p.ids)} tokens "
            f"exact={needles[-1]['exact']} {time.time() - t0:.0f}s",
            flush=True,
        )
    docs = []
    texts = [d for d in evaluation_docs() if len(d.text) > 6 * args.doc_tokens][: args.docs]
    for i, d in enumerate(texts):
        if i % n_shards != k:
            continue
        ids = tok.encode(d.text)[: args.doc_tokens]
        r = document_row(model, fill, maps, selector, base, arms, ids)
        r.update(path=d.path, sha256=d.sha256)
        docs.append(r)
        (args.out / f"docs.{k}.json").write_text(json.dumps(docs, indent=1))
        print(f"rows_eval: doc {i + 1}/{len(texts)} key={r['key']} {time.time() - t0:.0f}s", flush=True)
    return 0


def report(out: Path, arms_arg: str = DEFAULT_ARMS) -> str:
    """Merge the shards in `out` into summary.json and table.md."""
    needles: list[dict] = sum((json.loads(p.read_text()) for p in sorted(out.glob("needles.*.json"))), [])
    docs: list[dict] = sum((json.loads(p.read_text()) for p in sorted(out.glob("docs.*.json"))), [])
    arms = arm_list(arms_arg.split(","))
    summary = summarize(needles, docs, arms)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    table = markdown(summary, arms)
    (out / "table.md").write_text(table + "\n")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
