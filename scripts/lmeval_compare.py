"""Helpers of scripts/lmeval_check.sh, run with the project's Python (they read ridgefill's
tokenizer and run `ridgefill score`; the tokenizer folder lm-eval reads is written by
`ridgefill-export-tokenizer`, ridgefill_runtime/loader/export_tokenizer.py):

  tasks DIR        write two local lm-eval tasks and their jsonl data (no download): a 4-way
                   multiple-choice log-likelihood task and a generate_until task
  compare SAMPLES OUT.json
                   lm-eval's per-sample log-likelihoods (its --log_samples jsonl) against
                   `ridgefill score` on the same texts: max |Δ|, and whether each text's
                   context tokens are a prefix of its whole tokens (else the two score
                   different token sequences and the row is reported, not compared)
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Egypt", "Cairo"),
    ("Russia", "Moscow"),
    ("England", "London"),
    ("Greece", "Athens"),
    ("Austria", "Vienna"),
    ("Portugal", "Lisbon"),
    ("Ireland", "Dublin"),
    ("Norway", "Oslo"),
    ("Sweden", "Stockholm"),
    ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"),
    ("Poland", "Warsaw"),
    ("Hungary", "Budapest"),
    ("China", "Beijing"),
    ("India", "Delhi"),
    ("Peru", "Lima"),
    ("Chile", "Santiago"),
    ("Kenya", "Nairobi"),
    ("Cuba", "Havana"),
    ("Canada", "Ottawa"),
    ("Belgium", "Brussels"),
    ("Turkey", "Ankara"),
    ("Thailand", "Bangkok"),
    ("Argentina", "Buenos Aires"),
    ("Mexico", "Mexico City"),
]
WORDS = [
    "apple",
    "river",
    "candle",
    "garden",
    "window",
    "silver",
    "rabbit",
    "pencil",
    "forest",
    "bottle",
    "castle",
    "button",
    "orange",
    "ladder",
    "mirror",
    "pillow",
    "rocket",
    "saddle",
    "tunnel",
    "violin",
    "wallet",
    "yellow",
    "anchor",
    "basket",
    "carpet",
    "dragon",
    "feather",
    "guitar",
    "hammer",
    "island",
]

CHOICE_TASK = """task: ridgefill_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GENERATE_TASK = """task: ridgefill_repeat
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Repeat the word.\\nWord: lemon\\nRepeat: lemon\\nWord: tiger\\nRepeat: tiger\\nWord: {{{{word}}}}\\nRepeat:"
doc_to_target: "{{{{word}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


def write_tasks(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    capitals = folder / "capitals.jsonl"
    with capitals.open("w") as f:
        for i, (country, capital) in enumerate(CAPITALS):
            # NOTE: the three wrong answers are other capitals; the right one moves round the four places
            others = [CAPITALS[(i + k) % len(CAPITALS)][1] for k in (7, 13, 19)]
            choices = others[: i % 4] + [capital] + others[i % 4 :]
            f.write(json.dumps({"country": country, "choices": choices, "answer": i % 4}) + "\n")
    words = folder / "words.jsonl"
    words.write_text("".join(json.dumps({"word": w}) + "\n" for w in WORDS))
    (folder / "ridgefill_capitals.yaml").write_text(CHOICE_TASK.format(data=capitals.resolve()))
    (folder / "ridgefill_repeat.yaml").write_text(GENERATE_TASK.format(data=words.resolve()))


def _tokenizer():
    from ridgefill_runtime.loader.load import load_checkpoint

    return load_checkpoint(None).tokenizer


def _pairs(samples: Path) -> list[dict]:
    """Each (context, continuation) request of lm-eval's log with the log-likelihood it got."""
    rows = []
    for line in samples.read_text().splitlines():
        doc = json.loads(line)
        for k, (args, resp) in enumerate(zip(doc["arguments"].values(), doc["resps"])):
            loglik, greedy = resp[0]  # NOTE: lm-eval logs both as strings ("-4.5093...", "False")
            rows.append(
                {
                    "doc_id": doc["doc_id"],
                    "choice": k,
                    "context": args["arg_0"],
                    "continuation": args["arg_1"],
                    "lmeval_loglik": float(loglik),
                    "lmeval_greedy": str(greedy) == "True",
                }
            )
    return rows


def _ridgefill_scores(texts: list[str]) -> list[dict]:
    """`ridgefill score` (the CLI, one process, every text) on each text."""
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, text in enumerate(texts):
            files.append(Path(tmp) / f"{i}.txt")
            files[-1].write_text(text, encoding="utf-8")
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "ridgefill_server",
                "score",
                "--json",
                "--threads",
                "2",
                "--text-file",
                *map(str, files),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
    return [json.loads(line) for line in out.stdout.splitlines()]


def compare(samples: Path, out: Path) -> int:
    rows = _pairs(samples)
    tok = _tokenizer()
    scores = _ridgefill_scores([r["context"] + r["continuation"] for r in rows])
    deltas = []
    for row, score in zip(rows, scores):
        ctx = tok.encode(row["context"])
        whole = score["token_ids"]
        row["prefix_clean"] = whole[: len(ctx)] == ctx and score["first_scored"] == 0
        if row["prefix_clean"]:
            first = len(ctx) - 1  # row i scores token i + 1: the continuation's rows start here
            row["ridgefill_loglik"] = sum(score["target_logprobs"][first:])
            row["abs_delta"] = abs(row["ridgefill_loglik"] - row["lmeval_loglik"])
            # lm-eval's is_greedy (every continuation token the server's top-1) against score's argmax
            row["ridgefill_greedy"] = score["argmax"][first:] == whole[first + 1 :]
            deltas.append(row["abs_delta"])
    greedy_agree = sum(r.get("ridgefill_greedy") == r["lmeval_greedy"] for r in rows)
    report = {
        "pairs": len(rows),
        "compared": len(deltas),
        "max_abs_delta": max(deltas) if deltas else None,
        "within_1e-4": all(d <= 1e-4 for d in deltas) and len(deltas) == len(rows),
        "is_greedy_agree": greedy_agree,
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=1))
    print(
        f"{len(deltas)}/{len(rows)} pairs compared; max |Δ loglik| (lm-eval vs ridgefill score) = "
        f"{report['max_abs_delta']:.3g}; is_greedy agrees on {greedy_agree}/{len(rows)}"
    )
    return 0 if report["within_1e-4"] and greedy_agree == len(rows) else 1


def main(argv: list[str]) -> int:
    command, *rest = argv
    if command == "tasks":
        write_tasks(Path(rest[0]))
    elif command == "compare":
        return compare(Path(rest[0]), Path(rest[1]))
    else:
        raise SystemExit(f"unknown command {command!r}: tasks | compare")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
