"""Issue 29's fidelity-by-size table: RidgeFill against exact on four real models, from the runs'
own outputs (nothing is measured here; benchmarks/fidelity_by_size/run.sh makes the Qwen runs).

    python benchmarks/fidelity_by_size.py > benchmarks/fidelity_by_size.md

Each model at half depth (equal skipped-compute share: the same fraction of layers filled), tail
1,024, shipped maps: `ridgefill eval` over 4 Python-docs documents of ≤ 4,500 tokens (ΔNLL over
the last 1,024 rows, paired bootstrap 95% intervals), needles in the filled region, the code
workload's first-line exact match against exact prefill (benchmarks/code_completion.py), and
benchmarks/fill_speed.py's time to first token at each length it ran (4K and up) against its
ceiling. A cell is "—" where
that run does not exist (said in the notes under the table).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

B = Path(__file__).resolve().parent

# label, parameters, split / layers, eval.json, fill_speed output, code_completion.json
MODELS = (
    (
        "SmolLM2-135M",
        "135M",
        (15, 30),
        "fill_eval/split15/eval.json",
        "fill_speed_result.txt",
        "code_completion/smollm2",
    ),
    ("Gemma 3 270M", "270M", (9, 18), "gemma3_eval/split9/eval.json", "gemma3_eval/fill_speed_split9.txt", None),
    (
        "Qwen2.5-Coder-0.5B",
        "494M",
        (12, 24),
        "fidelity_by_size/qwen2.5-coder-0.5b-split12/eval.json",
        "fidelity_by_size/qwen2.5-coder-0.5b-fill_speed.txt",
        "code_completion/qwen2.5-coder-0.5b",
    ),
    (
        "Qwen2.5-Coder-1.5B",
        "1.54B",
        (14, 28),
        "fidelity_by_size/qwen2.5-coder-1.5b-split14/eval.json",
        "fidelity_by_size/qwen2.5-coder-1.5b-fill_speed.txt",
        "code_completion/qwen2.5-coder-1.5b",
    ),
)


def interval(cell, sign: str = "+") -> str:
    mean, lo, hi, n = cell
    return f"{mean:{sign}.3f} [{lo:{sign}.3f}, {hi:{sign}.3f}]" if n else "—"


def retrieval(summary: dict) -> str:
    r = summary["ridgefill"]["retrieval"]
    if not r or not r["n"]:
        return f"— (exact solves {summary['needles_solved_by_exact']} of {summary['needles_in_prefix']})"
    return f"{r['diff_vs_exact']:+.0f} pts (n={r['n']})"


def speeds(path: Path) -> str:
    """Every prompt length of a fill_speed output: speedup of its ceiling, at 4K/8K/..."""
    if not path.exists():
        return "—"
    cells = []
    for line in path.read_text().splitlines():
        row = [c.strip() for c in line.split("|")]
        if len(row) >= 5 and row[0].isdigit() and int(row[0]) >= 4096:
            cells.append(f"{row[3]}× of {row[4]}× @{round(int(row[0]) / 1024)}K")
    return "; ".join(cells) or "—"


def code_match(folder: str | None) -> str:
    path = B / folder / "code_completion.json" if folder else None
    if path is None or not path.exists():
        return "—"
    summary = json.loads(path.read_text())["summary"]
    cells = []
    for length, arms in summary.items():
        mean, lo, hi, n = arms["ridgefill"]["exact_match"]
        cells.append(f"{mean:.2f} [{lo:.2f}, {hi:.2f}] @{int(length) // 1024}K n={n}")
    return "; ".join(cells)


def main() -> None:
    print(
        "| model | params | split | ΔNLL novel | ΔNLL key | KL(exact‖fill) | top-1 agreement | needles vs exact "
        "| code first line = exact's | fill speedup (of its ceiling) at 4K–8K |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, params, (split, layers), eval_json, speed, code in MODELS:
        path = B / eval_json
        if not path.exists():
            print(f"| {label} | {params} | {split}/{layers} | not run | | | | | | |")
            continue
        summary = json.loads(path.read_text())["summary"]
        s = summary["ridgefill"]
        print(
            f"| {label} | {params} | {split}/{layers} | {interval(s['dnll_novel'])} | {interval(s['dnll_key'])} | "
            f"{interval(s['kl'])} | {interval(s['agree'], '')} | {retrieval(summary)} | {code_match(code)} | "
            f"{speeds(B / speed)} |"
        )
    threads = {re.search(r"threads=(\d+)", (B / m[4]).read_text()).group(1) for m in MODELS if (B / m[4]).exists()}
    print(f"\nthreads: {', '.join(sorted(threads)) or '—'} (every run)")


if __name__ == "__main__":
    main()
