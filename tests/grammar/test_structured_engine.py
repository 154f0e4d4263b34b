"""Structured outputs through the engine on the embedded SmolLM2: every output of 32 JSON
Schemas, greedy and sampled, parses and validates (jsonschema, an independent validator);
unconstrained requests batched with them give exactly what they give alone; a grammar that
allows no token ends its sequence with "grammar_error" and no token; n-gram and looped
self-speculation verify their drafts under the grammar and keep the greedy output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, LoopConfig, LoopOverrides, SpeculativeConfig
from ridgefill_runtime.grammar.spec import GrammarSpec, json_schema_spec
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams

from schemas import SCHEMAS

PLAIN = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
        torch.set_num_threads(2)
        return build_engine(EngineConfig(cache=CacheConfig(num_blocks=512)))


def chat(engine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def run(engine, requests: list[tuple[list[int], SamplingParams]]):
    seqs = [engine.add_request(ids, params) for ids, params in requests]
    while engine.has_unfinished():
        engine.step()
    return seqs


def test_every_output_of_32_schemas_keeps_to_its_schema_greedy_and_sampled(engine):
    """Every output is in its grammar's language so far (a fresh matcher takes all its tokens);
    every one that ended validates (jsonschema). Cut ones are where the model itself runs on
    inside an unbounded construct (a number's digits, a string's characters) until max_tokens:
    no grammar can end those; at least 58 of the 64 must end on their own (59 measured)."""
    assert len(SCHEMAS) >= 30
    requests = []
    for i, (what, schema) in enumerate(SCHEMAS):
        prompt = chat(engine, f"Reply with {what} as JSON.")
        spec = json_schema_spec(schema, "response_format")
        engine.grammars.compile(spec)
        requests.append((prompt, SamplingParams(max_tokens=160, temperature=0, grammar=spec)))
        requests.append((prompt, SamplingParams(max_tokens=160, temperature=0.8, seed=i, grammar=spec)))
    seqs = run(engine, requests)
    ended = 0
    for (_, params), seq in zip(requests, seqs):
        schema = json.loads(params.grammar.source)
        text = engine.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        ids = [t for t in seq.output_ids if t not in engine.eos_ids]
        assert engine.grammars.matcher(params.grammar).try_consume_tokens(ids) == len(ids), text
        assert seq.finish_reason in ("stop", "length"), seq.finish_reason
        if seq.finish_reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            ended += 1
    assert ended >= 58, ended
    # the schema's own order: properties come out in the order declared, not sorted
    person = next(s for (_, p), s in zip(requests, seqs) if json.loads(p.grammar.source) == SCHEMAS[0][1])
    assert list(json.loads(engine.tokenizer.decode(person.output_ids, skip_special_tokens=True))) == ["name", "age"]


def test_unconstrained_requests_batched_with_constrained_ones_are_unchanged(engine):
    greedy = SamplingParams(max_tokens=24, temperature=0)
    alone = [run(engine, [(chat(engine, p), greedy)])[0].output_ids for p in PLAIN]
    spec = json_schema_spec(SCHEMAS[0][1], "response_format")
    mixed = []
    for p in PLAIN:
        mixed.append((chat(engine, p), greedy))
        mixed.append(
            (
                chat(engine, "Reply with a person as JSON."),
                SamplingParams(max_tokens=60, temperature=0.7, seed=1, grammar=spec),
            )
        )
    seqs = run(engine, mixed)
    assert [s.output_ids for s in seqs[::2]] == alone
    for s in seqs[1::2]:
        jsonschema.validate(json.loads(engine.tokenizer.decode(s.output_ids, skip_special_tokens=True)), SCHEMAS[0][1])


def test_regex_choice_and_lark_outputs_match(engine):
    cases = [
        (GrammarSpec("regex", r"[0-9]{4}-[0-9]{2}-[0-9]{2}"), lambda t: len(t) == 10 and t[4] == t[7] == "-"),
        (GrammarSpec("choice", json.dumps(["positive", "negative"])), lambda t: t in ("positive", "negative")),
        (
            GrammarSpec("lark", 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,3}/\n'),
            lambda t: t[0] == "(" and t[-1] == ")",
        ),
    ]
    requests = [
        (chat(engine, "Answer briefly."), SamplingParams(max_tokens=40, temperature=0, grammar=s)) for s, _ in cases
    ]
    for seq, (_, check) in zip(run(engine, requests), cases):
        text = engine.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        assert seq.finish_reason == "stop" and check(text), text


def test_a_grammar_that_allows_nothing_ends_the_sequence(engine):
    """A matcher in its error state allows no token: the sequence ends "grammar_error" with no new token."""
    spec = GrammarSpec("regex", "ab+")
    seq = engine.add_request(chat(engine, "x"), SamplingParams(max_tokens=20, temperature=0, grammar=spec))
    while not seq.output_ids:
        engine.step()
    had = list(seq.output_ids)
    matcher = engine.runner.constrainer._matchers[seq.seq_id]
    matcher.consume_token(engine.tokenizer.encode("zzz", add_special_tokens=False)[0])  # not in the language
    assert matcher.is_error()
    while engine.has_unfinished():
        engine.step()
    assert seq.finish_reason == "grammar_error" and seq.output_ids == had
    assert seq.seq_id not in engine.runner.constrainer._matchers  # forgotten with the sequence


def test_ngram_speculation_under_a_grammar_keeps_the_greedy_output(engine, tmp_path_factory):
    """Drafts are verified under the grammar (row i masked after draft[:i]): the output equals
    the non-speculating engine's, and drafts were accepted."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
        spec_engine = build_engine(
            EngineConfig(cache=CacheConfig(num_blocks=256), speculative=SpeculativeConfig(method="ngram"))
        )
    schema = {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 6, "maxItems": 12}
    spec = json_schema_spec(schema, "response_format")
    prompt = chat(engine, "List colours as a JSON array, repeating red, green, blue.")
    params = SamplingParams(max_tokens=80, temperature=0, grammar=spec)
    plain = run(engine, [(prompt, params)])[0]
    fast = run(spec_engine, [(prompt, params)])[0]
    assert fast.output_ids == plain.output_ids and fast.finish_reason == plain.finish_reason == "stop"
    assert fast.spec.verifications > 0 and fast.spec.verified_tokens > fast.spec.verifications  # drafts accepted
    jsonschema.validate(json.loads(spec_engine.tokenizer.decode(fast.output_ids, skip_special_tokens=True)), schema)


def test_looped_self_speculation_under_a_grammar_keeps_the_greedy_output():
    """The trained looped model drafts with its own first loops; verified under a regex, block 4
    gives block 0's tokens, and the output keeps to the regex. The drafts are written under the
    grammar too (constrain.DraftGuide): unguided, the draft loops wrote what the regex refuses
    and 30 tokens took 28 verifications; guided, as many as without a grammar."""
    eng = build_engine(
        EngineConfig(
            model="looped",
            looped=LoopConfig(loops=16, cache="ripe", window=32, block=4, draft_loops=4),
            cache=CacheConfig(num_blocks=64),
        )
    )
    regex = "[a-z ,]{1,200}"
    spec = GrammarSpec("regex", regex, "structured_outputs.regex")
    prompt = eng.tokenizer.encode("The kernel keeps a list of the devices it has found, and each driver")
    outs = {}
    for block in (0, 4):
        params = SamplingParams(max_tokens=32, temperature=0, grammar=spec, looped=LoopOverrides(block=block))
        outs[block] = run(eng, [(prompt, params)])[0]
    assert outs[4].output_ids == outs[0].output_ids
    assert outs[4].spec.verifications > 0 and outs[4].spec.verified_tokens > 3 * outs[4].spec.verifications
    text = eng.tokenizer.decode(outs[4].output_ids, skip_special_tokens=True)
    assert re.fullmatch("[a-z ,]*", text), text
    # a grammar that allows everything changes nothing: the same tokens, the same verifications
    free = GrammarSpec("regex", "(.|\\n){1,400}", "structured_outputs.regex")
    runs = [
        run(eng, [(prompt, SamplingParams(max_tokens=32, temperature=0, grammar=g, looped=LoopOverrides(block=4)))])[0]
        for g in (None, free)
    ]
    assert runs[1].output_ids == runs[0].output_ids
    assert runs[1].spec.verifications == runs[0].spec.verifications


def _all_schema_requests(engine, prompt_of, max_tokens: int, **overrides):
    requests = []
    for what, schema in SCHEMAS:
        spec = json_schema_spec(schema, "response_format")
        engine.grammars.compile(spec)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, grammar=spec, **overrides)
        requests.append((prompt_of(what), params))
    return requests


def _keeps_to_schemas(engine, requests, seqs) -> int:
    """Each output is in its grammar's language so far; each that ended validates. Returns how many ended."""
    ended = 0
    for (_, params), seq in zip(requests, seqs):
        ids = [t for t in seq.output_ids if t not in engine.eos_ids]
        assert engine.grammars.matcher(params.grammar).try_consume_tokens(ids) == len(ids)
        if seq.finish_reason == "stop":
            text = engine.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            jsonschema.validate(json.loads(text), json.loads(params.grammar.source))
            ended += 1
    return ended


def test_all_32_schemas_under_ngram_speculation_equal_the_plain_engine(engine, tmp_path_factory):
    """Every schema's greedy output, batched, with n-gram drafts verified under the grammar:
    the same tokens as without speculation, so the same valid JSON."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
        spec_engine = build_engine(
            EngineConfig(cache=CacheConfig(num_blocks=512), speculative=SpeculativeConfig(method="ngram"))
        )
    requests = _all_schema_requests(engine, lambda what: chat(engine, f"Reply with {what} as JSON."), 120)
    plain = run(engine, requests)
    fast = run(spec_engine, requests)
    assert [s.output_ids for s in fast] == [s.output_ids for s in plain]
    assert sum(s.spec.verifications for s in fast) > 0
    assert _keeps_to_schemas(spec_engine, requests, fast) >= 28


def test_all_32_schemas_on_the_looped_model_with_self_speculation():
    """The trained looped model (a tiny one: its JSON is the grammar's, not the model's, doing)
    under each schema, batched: block 4 (drafts guided by the grammar, verified under it) gives
    block 0's tokens; every output keeps to its schema so far, every ended one validates."""
    eng = build_engine(
        EngineConfig(
            model="looped",
            looped=LoopConfig(loops=8, cache="ripe", window=32, block=4, draft_loops=2),
            cache=CacheConfig(num_blocks=512),
        )
    )
    prompt = eng.tokenizer.encode("The kernel keeps a list of the devices it has found")
    outs = {}
    for block in (0, 4):
        requests = _all_schema_requests(eng, lambda what: prompt, 48, looped=LoopOverrides(block=block))
        outs[block] = (requests, run(eng, requests))
    assert [s.output_ids for s in outs[4][1]] == [s.output_ids for s in outs[0][1]]
    assert sum(s.spec.verifications for s in outs[4][1]) > 0
    _keeps_to_schemas(eng, *outs[4])
