"""Log-probabilities the engine records (SamplingParams.logprobs, prompt_top_logprobs) against
transformers on the same GGUF: the raw distribution (log_softmax of the logits before
temperature, top-k and top-p) of each generated token and of each prompt row, with the top
alternatives; one entry per token through speculative runs, stop strings and preemption."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, SpeculativeConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.loader.gguf import default_model_path
from ridgefill_runtime.sequence import SamplingParams, Sequence

TOL = 1e-4
PROMPTS = [
    "The three most useful kitchen tools are",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a city by the sea,",
]
NGRAM = SpeculativeConfig(method="ngram", num_tokens=4, max_ngram=3, min_ngram=2)


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(2)
    return build_engine(EngineConfig(cache=CacheConfig(num_blocks=128)))


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[Sequence]:
    seqs = [engine.add_request(ids, params) for ids, params in requests]
    while engine.has_unfinished():
        engine.step()
    return seqs


def _ref_logp(ref, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: transformers' log_softmax of its raw logits after each position."""
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _check_top(got: tuple[tuple[int, float], ...], want: torch.Tensor, k: int) -> None:
    """got's (id, logprob) pairs against the reference row's top-k; ids are compared where the
    reference's neighbours are more than TOL apart (a near-tie may order either way)."""
    best = want.topk(k)
    assert len(got) == k
    ids, values = [i for i, _ in got], torch.tensor([v for _, v in got])
    assert (values - best.values).abs().max() < TOL
    gaps = best.values[:-1] - best.values[1:]
    for j in range(k):
        clear = (j == 0 or gaps[j - 1] > TOL) and (j == k - 1 or gaps[j] > TOL)
        if clear:
            assert ids[j] == int(best.indices[j]), f"top {j}"


def test_generated_logprobs_are_the_raw_distribution_of_transformers(engine, ref):
    encoded = [engine.tokenizer.encode(p) for p in PROMPTS]
    # NOTE: one step batches all three: a greedy one with 5 alternatives, a hot top-k sampled
    # one with 2 (its values must not see temperature or top-k), and one asking none.
    params = [
        SamplingParams(max_tokens=10, temperature=0, logprobs=5),
        SamplingParams(max_tokens=10, temperature=1.7, top_k=5, seed=7, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0),
    ]
    seqs = _run(engine, list(zip(encoded, params)))
    assert seqs[2].logprobs.output == []
    for seq, k in zip(seqs[:2], (5, 2)):
        assert len(seq.logprobs.output) == len(seq.output_ids) == 10
        logp = _ref_logp(ref, seq.prompt_ids + seq.output_ids)[len(seq.prompt_ids) - 1 : -1]  # [10, V]
        for i, (entry, token) in enumerate(zip(seq.logprobs.output, seq.output_ids)):
            assert entry.token == token
            assert abs(entry.logprob - float(logp[i, token])) < TOL, f"token {i}"
            _check_top(entry.top, logp[i], k)
    # the hot request sampled tokens away from the argmax: its values are not the tempered ones
    assert any(e.logprob < e.top[0][1] - 1e-3 for e in seqs[1].logprobs.output)


def test_prompt_logprobs_with_top_alternatives_equal_transformers(engine, ref):
    ids = engine.tokenizer.encode(PROMPTS[2] + " a lighthouse keeper counted the ships")
    (seq,) = _run(engine, [(ids, SamplingParams(max_tokens=0, prompt_logprobs=True, prompt_top_logprobs=4))])
    logp = _ref_logp(ref, ids)[:-1]
    want = logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(seq.logprobs.prompt) == len(seq.logprobs.prompt_top) == len(ids) - 1
    assert (torch.tensor(seq.logprobs.prompt) - want).abs().max() < TOL
    for row, top in enumerate(seq.logprobs.prompt_top):
        _check_top(top, logp[row], 4)


def test_speculative_runs_carry_one_entry_per_accepted_token(engine):
    spec = Engine(engine.model, engine.tokenizer, EngineConfig(cache=CacheConfig(num_blocks=128), speculative=NGRAM))
    code = "def add(a, b):\n    total = a + b\n    return total\n"
    chat = [{"role": "user", "content": f"Repeat this code exactly, but rename the function:\n\n{code}"}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(chat), add_special_tokens=False)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=3)
    (plain,) = _run(engine, [(prompt, params)])
    (fast,) = _run(spec, [(prompt, params)])
    assert spec.stats().spec_accepted_tokens_total > 0, "drafts must be accepted, or this proves nothing"
    assert fast.output_ids == plain.output_ids
    assert len(fast.logprobs.output) == len(plain.logprobs.output) == 30
    for a, b in zip(fast.logprobs.output, plain.logprobs.output):
        assert a.token == b.token and abs(a.logprob - b.logprob) < TOL
        assert [i for i, _ in a.top] == [i for i, _ in b.top]
    # a stop string met inside an accepted run drops the run's later tokens and their entries
    text = engine.tokenizer.decode(plain.output_ids, skip_special_tokens=True)
    stop = dataclasses.replace(params, stop=(text[20:24],))
    (cut,) = _run(spec, [(prompt, stop)])
    assert cut.finish_reason == "stop" and len(cut.logprobs.output) == len(cut.output_ids) < 30
    assert [e.token for e in cut.logprobs.output] == cut.output_ids


def test_logprobs_survive_preemption_in_a_tiny_pool(engine):
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=1)
    want = _run(engine, [(p, params) for p in prompts])
    small = Engine(engine.model, engine.tokenizer, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=8)))
    got = _run(small, [(p, params) for p in prompts])
    assert small.stats().preemptions_total > 0
    for a, b in zip(got, want):
        assert a.output_ids == b.output_ids and len(a.logprobs.output) == 40
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs.output, b.logprobs.output)) < TOL


@pytest.mark.parametrize("field, value", [("logprobs", 21), ("logprobs", -1), ("prompt_top_logprobs", 21)])
def test_out_of_range_counts_are_refused_by_name(field, value):
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value})
