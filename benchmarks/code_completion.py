"""Issue 29's long-prompt workload: repository-level code completion (prompts built by
ridgefill_runtime/eval/code_completion.py from standard-library packages, measures in
eval/code_completion_run.py). Per arm and length: exact match and edit similarity of the greedy
next line against exact prefill's, ΔNLL on novel and key tokens of the last 512 prompt tokens,
means with bootstrap 95% intervals over prompts.

  python benchmarks/code_completion.py --threads 2 --split 15 --tail 1024 --lengths 4096 \\
      --prompts-per-length 4 --arms nofill,ridgefill --out benchmarks/code_completion/smollm2

Resumable: each prompt's record is saved to OUT/records.json as it is measured, and a rerun with
the same settings measures only the prompts missing there. Writes OUT/code_completion.json (the
records and the summary) and OUT/code_completion.md (the table).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from ridgefill_runtime.config import EngineConfig, FillConfig, RowsConfig
from ridgefill_runtime.eval.code_completion import code_prompts
from ridgefill_runtime.eval.code_completion_run import MAX_NEW, SCORED, markdown, prompt_record, summarize
from ridgefill_runtime.eval.run import Arm
from ridgefill_runtime.fill.maps import FillMaps, check_maps_fit
from ridgefill_runtime.fill.settings import PACKAGED_MAPS, shipped_maps
from ridgefill_runtime.llm import LLM

ARMS = ("nofill", "identity", "ridgefill")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--model", default=None, help="as `ridgefill serve --model` (default: the embedded SmolLM2)")
    ap.add_argument("--split", type=int, default=15)
    ap.add_argument("--tail", type=int, default=1024)
    ap.add_argument("--maps", default=None, help="map file (default: the shipped maps for the model and --split)")
    ap.add_argument("--selectors", default="special", help="fill.rows.selectors of the fill arms, comma-separated")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--prompts-per-length", type=int, default=4)
    ap.add_argument("--arms", default="nofill,ridgefill", help=f"comma-separated, of {', '.join(ARMS)}")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--note", default="", help="a sentence added under the table (e.g. what else ran on the machine)")
    return ap.parse_args()


def build_arms(args, model) -> tuple[list[Arm], str]:
    packaged = args.model if args.model in PACKAGED_MAPS else None
    maps_path = args.maps or str(shipped_maps(args.split, packaged))
    maps = None
    rows = RowsConfig(selectors=tuple(args.selectors.split(",")))
    arms = []
    for name in args.arms.split(","):
        if name not in ARMS:
            raise SystemExit(f"unknown arm {name!r}: one of {', '.join(ARMS)}")
        if name == "ridgefill" and maps is None:
            maps = FillMaps(maps_path, "resident", model.dtype, model.device)
            check_maps_fit(maps.meta, model.identity, model.config, args.split, maps_path)
        fill = FillConfig(
            arm=name, split=args.split, tail=args.tail, maps=maps_path if name == "ridgefill" else None, rows=rows
        )
        arms.append(Arm(name, fill, maps if name == "ridgefill" else None))
    return arms, maps_path


def settings_of(args, maps_path: str) -> dict:
    """What a record depends on: a rerun resumes only under the same settings."""
    return {
        "model": args.model or "embedded SmolLM2-135M-Instruct",
        "split": args.split,
        "tail": args.tail,
        "maps": maps_path if "ridgefill" in args.arms else None,
        "selectors": args.selectors,
        "arms": args.arms,
        "scored": SCORED,
        "max_new": MAX_NEW,
    }


def load_records(path: Path, settings: dict) -> list[dict]:
    if not path.exists():
        return []
    saved = json.loads(path.read_text())
    if saved["settings"] != settings:
        raise SystemExit(f"{path} was measured with {saved['settings']}, not {settings}: use another --out")
    return saved["records"]


def prompt_table(records: list[dict], names: list[str]) -> str:
    """One row per prompt: where the far name is, and the answer lines (= : equal to exact's)."""
    code = lambda line: "`" + line.strip().replace("|", "\\|").replace("`", "'") + "`"  # noqa: E731
    head = "| length | target (next line) | name: defined in, distance | exact | " + " | ".join(names) + " |"
    lines = [head, "|" + "---|" * (4 + len(names))]
    for r in records:
        arms = " | ".join("=" if r[n]["exact_match"] else code(r[n]["line"]) for n in names)
        lines.append(
            f"| {r['length']} | {r['target']} ({r['cut_line'] + 1}) | {r['name']}: {r['defined_in']}, "
            f"{r['distance']} | {code(r['exact_line'])} | {arms} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(EngineConfig(model=args.model))
    model, tok = llm.engine.model, llm.tokenizer
    arms, maps_path = build_arms(args, model)
    settings = settings_of(args, maps_path)
    args.out.mkdir(parents=True, exist_ok=True)
    partial = args.out / "records.json"
    records = load_records(partial, settings)
    prompts = code_prompts(tok.encode, args.lengths, args.prompts_per_length)
    done = {(r["length"], r["target"], r["cut_line"]) for r in records}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        key = (p.length, p.target, p.cut_line)
        if key in done:
            continue
        t = time.perf_counter()
        record = prompt_record(model, tok, p, arms)
        records.append(record)
        partial.write_text(json.dumps({"settings": settings, "records": records}, indent=1))
        agree = " ".join(f"{a.name} em={record[a.name]['exact_match']:.0f}" for a in arms)
        print(
            f"code_completion: {i + 1}/{len(prompts)} {p.target} L={len(p.ids)} {p.name} at {p.distance}: "
            f"{agree} ({time.perf_counter() - t:.0f} s, {time.perf_counter() - start:.0f} s in all)",
            flush=True,
        )
    names = [a.name for a in arms]
    summary = summarize(records, names, lambda r: r["length"])
    out = {"settings": settings, "threads": args.threads, "summary": summary, "records": records}
    (args.out / "code_completion.json").write_text(json.dumps(out, indent=1))
    header = (
        f"Code completion, {settings['model']}, split {args.split}/{model.config.num_layers}, tail {args.tail}, "
        f"selectors {args.selectors}, {args.threads} threads. Mean over prompts with bootstrap 95% intervals; "
        f"answers: greedy next line (≤ {MAX_NEW} tokens) vs exact prefill's; ΔNLL (arm − exact, nats/token) "
        f"over the last {SCORED} prompt tokens.\n\n"
    )
    exact_src = "; ".join(
        f"{L}: {s['exact_vs_source'][0]:.2f} (n={s['exact_vs_source'][3]})" for L, s in summary.items()
    )
    footer = f"\n\nExact prefill's line equal to the source's own next line, by length: {exact_src}."
    footer += f" {args.note}\n\n" if args.note else "\n\n"
    footer += prompt_table(records, names) + "\n"
    (args.out / "code_completion.md").write_text(header + markdown(summary, names) + footer)
    print(header + markdown(summary, names) + footer)


if __name__ == "__main__":
    main()
