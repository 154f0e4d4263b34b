"""The code-completion workload's measures (prompts: eval/code_completion.py).

Per prompt and arm:
- the greedy completion, MAX_NEW tokens at most, through the engine (the server's path); its
  answer line is the first line holding a non-space character, trailing whitespace dropped and
  indentation kept (an arm that indents differently writes different code). Every arm decodes
  the same number of tokens, so a line still unfinished at MAX_NEW is cut alike in all arms.
- exact match of the arm's answer line with exact prefill's (1 or 0) and their edit similarity,
  1 - Levenshtein(a, b) / max(len(a), len(b)) on characters (1 when both are empty);
- ΔNLL (arm - exact) over the last `scored` prompt tokens, on novel tokens (no 8-token run
  containing them earlier in the prompt) and key tokens (exact loss rises by more than KEY_RISE
  nats when the context is cut to the arms' exact tail, i.e. when the filled region is removed).
Summaries: per arm and length, the mean over prompts with a bootstrap 95% interval
(measures.paired_bootstrap; exact match and similarity are already paired with exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import CacheConfig, EngineConfig, FillConfig, SchedulerConfig
from ..engine import Engine
from ..sequence import SamplingParams
from .code_completion import CodePrompt
from .measures import novel_mask, paired_bootstrap
from .run import CHUNK, KEY_RISE, Arm

MAX_NEW = 48  # tokens: a long line of code is about 20-30 tokens
SCORED = 512  # last prompt tokens on which ΔNLL is measured
MEASURES = ("exact_match", "edit_similarity", "dnll_novel", "dnll_key")


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insert, delete, substitute: 1 each) by the two-row dynamic program."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))  # distances from a[:0] to every prefix of b
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(a: str, b: str) -> float:
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def answer_line(text: str) -> str:
    """The completion's first line with a non-space character (the whole text when none)."""
    for line in text.split("\n"):
        if line.strip():
            return line.rstrip()
    return text.rstrip()


@dataclass(frozen=True)
class Comparison:
    exact_match: float
    edit_similarity: float

    def __post_init__(self) -> None:
        if self.exact_match not in (0.0, 1.0) or not 0.0 <= self.edit_similarity <= 1.0:
            raise ValueError(f"not a comparison: {self}")

    @classmethod
    def of(cls, arm_line: str, exact_line: str) -> Comparison:
        return cls(float(arm_line == exact_line), edit_similarity(arm_line, exact_line))


@dataclass(frozen=True)
class ArmRun:
    line: str  # the greedy completion's answer line
    nll: torch.Tensor  # [n - 1 - first]: -log p(prompt token i + 1) for rows i = first..n-2 (float64)
    first: int  # the first row with logits (the fill boundary; 0 for exact)


def run_arm(model, tokenizer, fill: FillConfig, maps, ids: list[int], max_new: int = MAX_NEW) -> ArmRun:
    """One arm on one prompt, through a fresh engine sized to it (the server's path): the prompt
    rows' target log-probabilities and the greedy completion, from one prefill."""
    # NOTE: no prefix caching: every arm computes its prompt itself
    blocks = (len(ids) + max_new) // 16 + 4
    cfg = EngineConfig(
        cache=CacheConfig(num_blocks=blocks, block_size=16, prefix_caching="off"),
        fill=fill,
        scheduler=SchedulerConfig(max_num_batched_tokens=CHUNK, chunk_size=CHUNK),
    )
    eng = Engine(model, tokenizer, cfg, maps)
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True, prompt_logprobs=True)
    seq = eng.add_request(list(ids), params)
    while eng.has_unfinished():
        eng.step()
    nll = -torch.tensor(seq.logprobs.prompt, dtype=torch.float64)
    return ArmRun(answer_line(tokenizer.decode(seq.output_ids)), nll, seq.fill.boundary)


def dnll_masks(ids: list[int], exact: ArmRun, cut: ArmRun, scored: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Novel and key masks [scored - 1] of the last scored - 1 targets. `cut`: exact on the
    prompt's last rows only (the filled region removed)."""
    n = len(ids)
    rise = cut.nll[-(scored - 1) :] - exact.nll[-(scored - 1) :]
    return novel_mask(ids)[n - scored + 1 :], rise > KEY_RISE


def arm_dnll(arm: ArmRun, exact: ArmRun, novel: torch.Tensor, key: torch.Tensor) -> dict:
    d = arm.nll[-len(novel) :] - exact.nll[-len(novel) :]  # [scored - 1]
    return {
        "dnll_novel": float(d[novel].mean()) if novel.any() else None,
        "dnll_key": float(d[key].mean()) if key.any() else None,
    }


def prompt_record(model, tokenizer, prompt: CodePrompt, arms: list[Arm], scored: int = SCORED) -> dict:
    """Everything measured on one prompt: the answer lines, the comparisons and the ΔNLLs over
    the last `scored` tokens (which every arm's exact tail must cover)."""
    ids = list(prompt.ids)
    tails = {a.fill.tail for a in arms}
    if len(tails) != 1 or scored > min(tails) or min(tails) >= len(ids):
        raise ValueError(f"scored {scored} needs one arm tail, >= it and < the prompt ({tails}, {len(ids)} tokens)")
    tail = tails.pop()
    exact = run_arm(model, tokenizer, FillConfig(), None, ids)
    cut = run_arm(model, tokenizer, FillConfig(), None, ids[len(ids) - tail :], max_new=0)
    novel, key = dnll_masks(ids, exact, cut, scored)
    record = {
        "package": prompt.package,
        "length": prompt.length,
        "target": prompt.target,
        "function": prompt.function,
        "cut_line": prompt.cut_line,
        "name": prompt.name,
        "defined_in": prompt.defined_in,
        "distance": prompt.distance,
        "tokens": len(ids),
        "source_line": prompt.next_line,
        "exact_line": exact.line,
        "exact_vs_source": Comparison.of(exact.line, prompt.next_line).__dict__,
        "novel": int(novel.sum()),
        "key": int(key.sum()),
    }
    for arm in arms:
        run = run_arm(model, tokenizer, arm.fill, arm.maps, ids)
        record[arm.name] = {"line": run.line, **Comparison.of(run.line, exact.line).__dict__}
        record[arm.name].update(arm_dnll(run, exact, novel, key))
    return record


def summarize(records: list[dict], names: list[str], length_of) -> dict:
    """{length: {arm: {measure: (mean, lo, hi, n)}}}; length_of(record) says a record's length."""
    out: dict = {}
    for length in sorted({length_of(r) for r in records}):
        rows = [r for r in records if length_of(r) == length]
        out[length] = {}
        for name in names:
            s = {}
            for m in MEASURES:
                vals = [r[name][m] for r in rows if name in r and r[name][m] is not None]
                s[m] = paired_bootstrap(vals) + (len(vals),)
            out[length][name] = s
        exact_em = [r["exact_vs_source"]["exact_match"] for r in rows]
        out[length]["exact_vs_source"] = paired_bootstrap(exact_em) + (len(exact_em),)
    return out


def markdown(summary: dict, names: list[str]) -> str:
    def cell(t, signed: bool) -> str:
        if t[0] != t[0]:
            return "n/a"
        f = "{:+.3f}" if signed else "{:.3f}"
        return f"{f.format(t[0])} [{f.format(t[1])}, {f.format(t[2])}] (n={t[3]})"

    lines = [
        "| length | arm | exact match vs exact | edit similarity vs exact | ΔNLL novel | ΔNLL key |",
        "|---|---|---|---|---|---|",
    ]
    for length, arms in summary.items():
        for name in names:
            s = arms[name]
            lines.append(
                f"| {length} | {name} | {cell(s['exact_match'], False)} | {cell(s['edit_similarity'], False)} "
                f"| {cell(s['dnll_novel'], True)} | {cell(s['dnll_key'], True)} |"
            )
    return "\n".join(lines)
