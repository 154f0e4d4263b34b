"""N-gram (prompt-lookup) speculative decoding: drafting and acceptance as plain functions, the
scheduler's rollback with a fake runner, and, on the embedded SmolLM2 model, greedy output
token for token equal to plain greedy decoding (batched with seeded sampled requests, with stop
tokens, stop strings and max_tokens inside accepted runs, and under preemption); and a model with
recurrent layers (the test-only toy family), which the engine refuses to speculate on."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from ridgefill_runtime.cache.block_manager import BlockManager
from ridgefill_runtime.cache.manager import CacheManager
from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.models import registry
from ridgefill_runtime.scheduler import Scheduler, StepResult
from ridgefill_runtime.sequence import SamplingParams, Sequence
from ridgefill_runtime.speculative import NgramProposer, accept_greedy, ngram_draft

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))  # NOTE: as tests/models/conftest.py does
from toy_recurrent import NAME, TOY_FAMILY, reference_logits, toy_config, toy_weights  # noqa: E402

NGRAM = SpeculativeConfig(method="ngram", num_tokens=4, max_ngram=3, min_ngram=2)
SNIPPETS = [
    "def add(a, b):\n    total = a + b\n    return total\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "def greet(name):\n    message = 'Hello, ' + name\n    print(message)\n    return message\n",
    "numbers = [1, 2, 3, 4, 5]\nsquares = [n * n for n in numbers]\nprint(squares)\n",
    "def is_even(n):\n    return n % 2 == 0\n\nprint(is_even(4))\n",
    "with open('data.txt') as f:\n    lines = f.readlines()\nprint(len(lines))\n",
    "def factorial(n):\n    if n == 0:\n        return 1\n    return n * factorial(n - 1)\n",
    "items = {'a': 1, 'b': 2}\nfor key, value in items.items():\n    print(key, value)\n",
    "def mean(xs):\n    return sum(xs) / len(xs)\n\nprint(mean([1, 2, 3]))\n",
    "x = 0\nwhile x < 5:\n    x = x + 1\n    print(x)\n",
    "def maximum(a, b):\n    if a > b:\n        return a\n    return b\n",
]
EDITS = ["rename the function", "use a different variable name", "add a comment", "change a number"]
CHAT = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea.",
    "What is 2 + 2?",
    "Give me a word that rhymes with cat.",
    "Say hello in Spanish.",
    "Why is the sky blue?",
    "List two fruits.",
    "What day comes after Monday?",
    "Tell me a fun fact.",
]


# -- plain functions ---------------------------------------------------------------------


def test_ngram_draft_takes_the_newest_match_of_the_longest_suffix():
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    assert ngram_draft(tokens, 3, max_ngram=3, min_ngram=1) == [4, 5, 6]  # newest [1, 2, 3] match
    assert ngram_draft(tokens, 10, max_ngram=3, min_ngram=1) == [4, 5, 6, 7, 1, 2, 3]
    assert ngram_draft([5, 6, 7, 8], 4, max_ngram=3, min_ngram=1) == []  # nothing recurs
    assert ngram_draft([4, 5, 9, 5], 4, max_ngram=3, min_ngram=2) == []  # only a 1-gram recurs
    assert ngram_draft([4, 5, 9, 5], 4, max_ngram=3, min_ngram=1) == [9, 5]


def test_accept_greedy_keeps_the_matching_prefix_and_the_bonus_token():
    assert accept_greedy([4, 5, 6], [4, 5, 6, 7]) == [4, 5, 6, 7]  # all accepted + bonus
    assert accept_greedy([4, 5, 6], [4, 9, 6, 7]) == [4, 9]  # the model's choice replaces the miss
    assert accept_greedy([4, 5, 6], [8, 5, 6, 7]) == [8]
    assert accept_greedy([], [3]) == [3]


# -- the scheduler with a fake runner ------------------------------------------------------


def _fake_step(sched: Scheduler, truth: list[int]) -> list:
    """A runner whose greedy choice at position p is truth[p]: drafts equal to it are accepted."""
    items = sched.schedule()
    runs = []
    for it in items:
        if not it.samples:
            runs.append(None)
            continue
        n = it.seq.num_tokens
        choices = [truth[n + i] for i in range(1 + len(it.draft))]
        runs.append(accept_greedy(it.draft, choices))
    sched.postprocess(items, StepResult(next_tokens=runs, prompt_logprobs=[None] * len(items)), eos_ids=(2,))
    return items


def test_scheduler_rolls_back_rejected_positions_and_blocks_and_stops_inside_a_run():
    blocks = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(
        SchedulerConfig(), CacheManager(blocks, SchedulerConfig().max_num_seqs), propose=NgramProposer(NGRAM)
    )
    prompt = [10, 11, 12, 13, 14, 10, 11, 12]
    truth = prompt + [13, 14, 10, 11, 99, 98, 10, 11, 12, 13, 14, 5, 6, 7, 8, 9]
    stop_at = truth.index(8, len(prompt))
    seq = Sequence(prompt_ids=list(prompt), params=SamplingParams(max_tokens=100, temperature=0, stop_token_ids=(8,)))
    seq.spec.max_draft = 4
    sched.add(seq)
    verified = 0
    while sched.has_work():
        items = _fake_step(sched, truth)
        verified += sum(bool(it.draft) for it in items)
        if not seq.finished:
            assert seq.num_computed == seq.num_tokens - 1  # rejected rows are not counted as computed
            assert len(seq.block_table) <= -(-seq.num_tokens // 4)  # blocks past them went back
    assert seq.output_ids == truth[len(prompt) : stop_at + 1] and seq.finish_reason == "stop"
    assert verified and sched.spec.accepted > 0
    assert blocks.num_free == 32


def test_max_tokens_is_never_passed_inside_an_accepted_run():
    blocks = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(
        SchedulerConfig(), CacheManager(blocks, SchedulerConfig().max_num_seqs), propose=NgramProposer(NGRAM)
    )
    prompt = [10, 11, 12, 13, 14, 15, 16, 10, 11, 12]
    truth = prompt + [13, 14, 15, 16, 10, 11, 12, 13]
    for max_tokens in (1, 2, 3, 5):
        seq = Sequence(prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens, temperature=0))
        seq.spec.max_draft = 4
        sched.add(seq)
        while sched.has_work():
            _fake_step(sched, truth)
        assert seq.output_ids == truth[len(prompt) : len(prompt) + max_tokens] and seq.finish_reason == "length"


# -- the embedded model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from ridgefill_runtime.llm import build_engine

    torch.set_num_threads(1)
    return build_engine(EngineConfig(speculative=NGRAM))


def _chat(engine: Engine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return engine.tokenizer.encode(rendered, add_special_tokens=False)


def _copy_prompts(engine: Engine) -> list[list[int]]:
    return [
        _chat(engine, f"Repeat this code exactly, but {EDITS[i % len(EDITS)]}:\n\n{code}")
        for i, code in enumerate(SNIPPETS)
    ]


def _generate(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Sequence]:
    seqs = [engine.add_request(prompt, params) for prompt, params in requests]
    while engine.has_unfinished():
        engine.step()
    return seqs


def _greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


def _plain(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, speculative=0)


def test_greedy_speculation_equals_plain_greedy_batched_with_sampled_requests(engine):
    prompts = _copy_prompts(engine) + [_chat(engine, c) for c in CHAT]
    assert len(prompts) >= 20
    greedy = _greedy(40)
    sampled = [
        (p, SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=100 + i))
        for i, p in enumerate(prompts[:3] + prompts[-2:])
    ]
    plain = _generate(engine, [(p, _plain(greedy)) for p in prompts])
    alone = [_generate(engine, [req])[0].output_ids for req in sampled]
    before = engine.stats()
    mixed = _generate(engine, [(p, greedy) for p in prompts] + sampled)
    after = engine.stats()
    for i, (spec, ref) in enumerate(zip(mixed, plain)):
        assert spec.output_ids == ref.output_ids, f"prompt {i}"
        assert spec.finish_reason == ref.finish_reason
    assert [s.output_ids for s in mixed[len(prompts) :]] == alone
    accepted = after.spec_accepted_tokens_total - before.spec_accepted_tokens_total
    proposed = after.spec_draft_tokens_total - before.spec_draft_tokens_total
    assert 0 < accepted <= proposed, "copy prompts must have drafts accepted, or the test proves nothing"
    assert after.spec_steps_total > before.spec_steps_total


def test_stop_tokens_stop_strings_and_max_tokens_inside_accepted_runs(engine):
    prompt = _copy_prompts(engine)[7]
    ref = _generate(engine, [(prompt, _plain(_greedy(48, ignore_eos=True)))])[0].output_ids
    before = engine.stats().spec_accepted_tokens_total
    for n in (3, 9, 17, 30):
        out = _generate(engine, [(prompt, _greedy(n, ignore_eos=True))])[0]
        assert out.output_ids == ref[:n] and out.finish_reason == "length"
    # a stop token first met in the middle of the output ends it right there
    k = next(i for i in range(12, len(ref)) if ref[i] not in ref[:i])
    out = _generate(engine, [(prompt, _greedy(48, ignore_eos=True, stop_token_ids=(ref[k],)))])[0]
    assert out.output_ids == ref[: k + 1] and out.finish_reason == "stop"
    # stop strings: the same tokens, text and reason as plain decoding
    text = engine.tokenizer.decode(ref, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = _greedy(48, ignore_eos=True, stop=(stop,))
    want, got = _generate(engine, [(prompt, _plain(params)), (prompt, params)])
    assert (got.output_ids, got.text, got.finish_reason) == (want.output_ids, want.text, want.finish_reason)
    assert want.finish_reason == "stop"
    assert engine.stats().spec_accepted_tokens_total > before


def test_speculating_sequences_survive_preemption_in_a_tiny_pool(engine):
    prompts = _copy_prompts(engine)[:4]
    params = _greedy(40, ignore_eos=True)
    ref = [s.output_ids for s in _generate(engine, [(p, _plain(params)) for p in prompts])]
    block_size = 16
    need = max(-(-(len(p) + 40) // block_size) for p in prompts)
    small = Engine(
        engine.model,
        engine.tokenizer,
        EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=need + 4), speculative=NGRAM),
    )
    seqs = [small.add_request(p, params) for p in prompts]
    while small.has_unfinished():
        small.step()
        for s in small.scheduler.running:
            assert len(s.block_table) <= -(-(s.num_tokens + NGRAM.num_tokens) // block_size)
    stats = small.stats()
    assert stats.preemptions_total > 0 and stats.spec_accepted_tokens_total > 0
    assert [s.output_ids for s in seqs] == ref
    assert stats.kv_blocks_used == 0


def test_non_greedy_and_opted_out_requests_never_speculate(engine):
    prompt = _copy_prompts(engine)[0]
    before = engine.stats().spec_steps_total
    _generate(engine, [(prompt, SamplingParams(max_tokens=12, temperature=0.7, seed=1)), (prompt, _plain(_greedy(12)))])
    assert engine.stats().spec_steps_total == before


# -- a model with recurrent layers ------------------------------------------------------------


@pytest.fixture(scope="module")
def toy():
    registry.register(TOY_FAMILY)
    try:
        config = toy_config()
        tensors = toy_weights(config)
        yield registry.family(NAME).build_model(config, tensors, torch.float64, "cpu"), tensors
    finally:
        registry.unregister(NAME)


def _toy_config(speculative: SpeculativeConfig | None = None) -> EngineConfig:
    speculative = speculative or SpeculativeConfig()
    return EngineConfig(cache=CacheConfig(block_size=4, num_blocks=64), speculative=speculative)


def _reference_greedy(tensors, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(reference_logits(tensors, seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_ngram_speculation_on_a_recurrent_model_is_refused_naming_the_cause(toy):
    model, _ = toy
    with pytest.raises(ValueError) as e:
        Engine(model, None, _toy_config(NGRAM))
    message = str(e.value)
    assert "\n" not in message and message.startswith("speculative.method = 'ngram': "), message
    assert "recurrent layers [0]" in message and "cannot be rolled back" in message, message
    assert message.endswith('use speculative.method = "off"'), message


def test_a_request_asking_to_speculate_on_a_recurrent_model_decodes_plainly(toy):
    model, tensors = toy
    eng = Engine(model, None, _toy_config())  # NOTE: speculation off, the only setting it accepts
    prompt = [3, 4, 5, 6, 7] * 4  # repeats: an n-gram proposer would draft here
    assert ngram_draft(prompt, 4, NGRAM.max_ngram, NGRAM.min_ngram)
    seq = eng.add_request(prompt, _greedy(8, ignore_eos=True, speculative=4))
    while eng.has_unfinished():
        eng.step()
    # NOTE: the request's option is ignored, not refused: it may only lower the engine's
    # num_tokens, and the engine's speculation is off (the server answers 400 instead)
    assert seq.spec.max_draft == 0 and eng.stats().spec_steps_total == 0
    assert seq.output_ids == _reference_greedy(tensors, prompt, 8)
