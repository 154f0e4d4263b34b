"""The code-completion workload (eval/code_completion.py, eval/code_completion_run.py): the prompt
builder's rule checked independently on the prompts it makes, Levenshtein against the textbook
recursion, the summaries, and one prompt measured end to end on a tiny model."""

from __future__ import annotations

import ast
import functools
import random
import re

import pytest
import torch

from ridgefill_runtime.config import FillConfig
from ridgefill_runtime.eval.code_completion import CodePrompt, PromptBuilder
from ridgefill_runtime.eval.code_completion_run import (
    Comparison,
    answer_line,
    edit_similarity,
    levenshtein,
    markdown,
    prompt_record,
    run_arm,
    summarize,
)
from ridgefill_runtime.eval.measures import novel_mask, target_nll
from ridgefill_runtime.eval.run import Arm
from ridgefill_runtime.fill.corpus import stdlib_root
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.dense import DenseLM
from ridgefill_runtime.offline import PromptLogits
from tiny_models import build_tiny


class ByteTokenizer:
    """One token per UTF-8 byte: fits a tiny model's 320-row vocabulary, and a prompt's token
    count is its byte count, so the builder's arithmetic is checked without a real tokenizer."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TOK = ByteTokenizer()
LENGTH = 6000


@pytest.fixture(scope="module")
def asyncio_prompts() -> list[CodePrompt]:
    builder = PromptBuilder("asyncio", TOK.encode)
    return [builder.prompt(LENGTH, i) for i in range(2)]


def _word(name: str) -> re.Pattern:
    return re.compile(rf"(?<![A-Za-z0-9_]){re.escape(name)}(?![A-Za-z0-9_])")


def test_prompts_follow_the_rule_checked_independently(asyncio_prompts):
    for p in asyncio_prompts:
        assert abs(len(p.ids) - LENGTH) <= 0.03 * LENGTH and list(p.ids) == TOK.encode(p.text)
        source = (stdlib_root() / p.target).read_text()
        lines = source.splitlines(keepends=True)
        # the prompt ends with the target file, from its first line, up to the cut
        assert p.text.endswith(f"# file: {p.target}\n" + "".join(lines[: p.cut_line]))
        # the cut lies inside a function, and the next line is the source's own
        funcs = [n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        assert any(f.lineno <= p.cut_line < f.end_lineno for f in funcs)
        assert lines[p.cut_line].rstrip("\n") == p.next_line and _word(p.name).search(p.next_line)
        # the name never occurs in the target file before the next line, and is defined in the prompt
        assert not _word(p.name).search("".join(lines[: p.cut_line]))
        defined = re.compile(
            rf"^\s*((async\s+)?def|class)\s+{re.escape(p.name)}\b|^\s*{re.escape(p.name)}\s*[:=]", re.M
        )
        assert defined.search(p.text)
        # its nearest occurrence starts at least L/2 tokens before the end
        last = [m.start() for m in _word(p.name).finditer(p.text)][-1]
        line_start = p.text.rfind("\n", 0, last) + 1
        assert len(TOK.encode(p.text)) - len(TOK.encode(p.text[:line_start])) >= LENGTH // 2
    assert asyncio_prompts[0].target != asyncio_prompts[1].target


def test_prompts_are_deterministic(asyncio_prompts):
    again = PromptBuilder("asyncio", TOK.encode).prompt(LENGTH, 1)
    assert again == asyncio_prompts[1]


def test_levenshtein_equals_the_recursive_definition():
    @functools.cache
    def naive(a: str, b: str) -> int:
        if not a or not b:
            return len(a) + len(b)
        return min(naive(a[1:], b) + 1, naive(a, b[1:]) + 1, naive(a[1:], b[1:]) + (a[0] != b[0]))

    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("ab(x) ") for _ in range(rng.randint(0, 9)))
        b = "".join(rng.choice("ab(x) ") for _ in range(rng.randint(0, 9)))
        assert levenshtein(a, b) == naive(a, b) == levenshtein(b, a), (a, b)
    assert levenshtein("kitten", "sitting") == 3
    assert edit_similarity("", "") == 1.0 and edit_similarity("abcd", "") == 0.0
    assert edit_similarity("kitten", "sitting") == pytest.approx(1 - 3 / 7)


def test_answer_line_and_comparison():
    assert answer_line("\n  \n    foo(x)  \nbar") == "    foo(x)"
    assert answer_line("    unfinished(") == "    unfinished("
    assert Comparison.of("    a = f(x)", "    a = f(x)") == Comparison(1.0, 1.0)
    c = Comparison.of("    a = g(x)", "    a = f(x)")
    assert c.exact_match == 0.0 and c.edit_similarity == pytest.approx(1 - 1 / 12)


def test_summary_means_per_length_and_arm():
    records = [
        {"length": 4096, "exact_vs_source": {"exact_match": e}, "a": {"exact_match": m, "edit_similarity": s}}
        for e, m, s in ((1.0, 1.0, 1.0), (0.0, 0.0, 0.5), (0.0, 1.0, 1.0))
    ]
    for r, (dn, dk) in zip(records, ((0.1, None), (0.3, 2.0), (0.2, 1.0))):
        r["a"].update(dnll_novel=dn, dnll_key=dk)
    records.append({**records[0], "length": 8192})
    s = summarize(records, ["a"], lambda r: r["length"])
    assert list(s) == [4096, 8192]
    em, sim, key = s[4096]["a"]["exact_match"], s[4096]["a"]["edit_similarity"], s[4096]["a"]["dnll_key"]
    assert em[0] == pytest.approx(2 / 3) and em[3] == 3 and em[1] <= em[0] <= em[2]
    assert sim[0] == pytest.approx(2.5 / 3) and key[0] == pytest.approx(1.5) and key[3] == 2
    assert s[4096]["exact_vs_source"][0] == pytest.approx(1 / 3) and s[8192]["a"]["exact_match"][3] == 1
    assert "| 4096 | a | 0.667 [" in markdown(s, ["a"])


SPLIT, TAIL, SCORED = 1, 96, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_tiny("llama_gqa_untied", folder)
    ckpt = load_hf_folder(folder)
    torch.manual_seed(0)
    return DenseLM(ckpt.config, ckpt.tensors)


def _tiny_prompt() -> CodePrompt:
    text = "# file: h.py\ndef helper(x):\n    return x * 2\n" + "# filler line\n" * 30
    text += "# file: t.py\ndef f(x):\n    y = x + 1\n"
    return CodePrompt(
        "asyncio", 500, "t.py", "f", 2, "    return helper(y)", "helper", "h.py", 450, text, tuple(TOK.encode(text))
    )


def test_end_to_end_record_on_a_tiny_model(tiny):
    p, ids = _tiny_prompt(), list(_tiny_prompt().ids)
    again = Arm("exact_again", FillConfig(split=SPLIT, tail=TAIL))
    nofill = Arm("nofill", FillConfig(arm="nofill", split=SPLIT, tail=TAIL))
    record = prompt_record(tiny, TOK, p, [again, nofill], scored=SCORED)
    # exact against itself: the same line, no loss difference
    assert record["exact_again"]["exact_match"] == 1.0 and record["exact_again"]["edit_similarity"] == 1.0
    assert abs(record["exact_again"]["dnll_novel"]) < 1e-9
    # the filled arm's figures equal a direct recomputation (logits through PromptLogits)
    line = run_arm(tiny, TOK, nofill.fill, None, ids).line
    want = Comparison.of(line, record["exact_line"])
    assert (record["nofill"]["exact_match"], record["nofill"]["edit_similarity"]) == (
        want.exact_match,
        want.edit_similarity,
    )
    assert 0.0 <= want.edit_similarity <= 1.0
    b, targets = len(ids) - SCORED, torch.tensor(ids[len(ids) - SCORED + 1 :])
    exact = target_nll(PromptLogits(tiny)(ids, logits_from=b)[1][:-1], targets)
    arm = target_nll(PromptLogits(tiny, nofill.fill)(ids, logits_from=b)[1][:-1], targets)
    novel = novel_mask(ids)[b + 1 :]
    assert record["novel"] == int(novel.sum()) > 0
    assert record["nofill"]["dnll_novel"] == pytest.approx(float((arm - exact)[novel].mean()), abs=1e-4)
    assert record["nofill"]["dnll_novel"] != 0.0  # the late layers never saw the prefix
    with pytest.raises(ValueError, match="scored"):
        prompt_record(tiny, TOK, p, [nofill], scored=TAIL + 1)
