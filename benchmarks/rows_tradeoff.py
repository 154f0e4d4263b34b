"""The exact-rows trade-off in one table and one plot: split x tail x budget -> filled-region
retrieval, key-token ΔNLL, measured prefill speedup (issue: exact rows).

    python benchmarks/rows_tradeoff.py --speed benchmarks/exact_rows_speed.json --length 4096 \
        --eval 15,1024=benchmarks/rows_eval/main --eval 11,1024=benchmarks/rows_eval/s11_t1024 \
        --eval 15,512=benchmarks/rows_eval/s15_t512 --out benchmarks/rows_tradeoff

Quality comes from rows_eval summaries (run `python -m ridgefill_runtime.eval.rows_eval` per
split and tail, then its report()); speed from exact_rows_speed.py's JSON, same machine.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ARMS = ("plain", "lexical", "attention", "probe@0.33", "probe@1")
SPEED_NAME = {
    "plain": "special",
    "lexical": "lexical",
    "attention": "attention 10%",
    "probe@0.33": "probe@0.33",
    "probe@1": "probe@1",
}


def speed_key(split: int, tail: int, arm: str, default: tuple[int, int]) -> str:
    name = SPEED_NAME[arm]
    return name if (split, tail) == default else f"s{split} t{tail} {name}"


def rows(evals: dict, speed: dict, length: int) -> list[dict]:
    lengths = speed["lengths"]
    at = lengths.get(str(length)) or lengths[length]
    default = (speed["split"], speed["tail"])
    out = []
    for (split, tail), path in evals.items():
        summary = json.loads((Path(path) / "summary.json").read_text())
        for arm in ARMS:
            if arm not in summary or "retrieval" not in summary[arm]:
                continue
            s, key = summary[arm], speed_key(split, tail, arm, default)
            r = s["retrieval"]
            out.append(
                {
                    "split": split,
                    "tail": tail,
                    "arm": arm,
                    "rows": r["row_share"],
                    "retrieval": r["accuracy"],
                    "exact": r["exact"],
                    "diff": r["diff"],
                    "ci": r["ci"],
                    "bound": r["bound"],
                    "n": r["n"],
                    "dnll_key": s.get("dnll_key"),
                    "speedup": at["ttft"]["exact"] / at["ttft"][key] if key in at["ttft"] else None,
                }
            )
    return out


def table(points: list[dict], length: int) -> str:
    lines = [
        f"| split | tail | selection | exact rows (share of prefix) | retrieval (exact) | Δ vs exact, pts [95% CI] | "
        f"key ΔNLL [95% CI] | speedup at {length} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        k = p["dnll_key"]
        key = "—" if not k else f"{k[0]:+.3f} [{k[1]:+.3f}, {k[2]:+.3f}]"
        sp = "—" if p["speedup"] is None else f"{p['speedup']:.2f}×"
        lines.append(
            f"| {p['split']} | {p['tail']} | {p['arm']} | {100 * p['rows']:.1f}% | {p['retrieval']:.1f}% "
            f"({p['exact']:.1f}%, n={p['n']}) | {p['diff']:+.1f} [{p['ci'][0]:+.1f}, {p['ci'][1]:+.1f}] | "
            f"{key} | {sp} |"
        )
    return "\n".join(lines)


def plot(points: list[dict], path: Path, length: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for p in points:
        if p["speedup"] is None:
            continue
        label = f"s{p['split']} t{p['tail']} {p['arm']}"
        a.scatter(p["speedup"], p["retrieval"])
        a.annotate(label, (p["speedup"], p["retrieval"]), fontsize=7)
        if p["dnll_key"]:
            b.scatter(p["speedup"], p["dnll_key"][0])
            b.annotate(label, (p["speedup"], p["dnll_key"][0]), fontsize=7)
    exact = points[0]["exact"] if points else 0
    a.axhline(exact, color="k", lw=0.8, ls="--", label="exact")
    a.set(xlabel=f"prefill speedup vs exact at {length} tokens", ylabel="filled-region retrieval, %")
    a.legend(fontsize=8)
    b.axhline(0.5, color="r", lw=0.8, ls="--", label="goal 0.5 nats")
    b.set(xlabel=f"prefill speedup vs exact at {length} tokens", ylabel="key-token ΔNLL, nats")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--speed", type=Path, required=True)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--eval", action="append", required=True, help="SPLIT,TAIL=DIR")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    evals = {}
    for e in args.eval:
        st, path = e.split("=")
        split, tail = (int(x) for x in st.split(","))
        evals[(split, tail)] = path
    points = rows(evals, json.loads(args.speed.read_text()), args.length)
    md = table(points, args.length)
    args.out.with_suffix(".md").write_text(md + "\n")
    plot(points, args.out.with_suffix(".png"), args.length)
    print(md)


if __name__ == "__main__":
    main()
