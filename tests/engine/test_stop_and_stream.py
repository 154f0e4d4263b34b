"""Stop strings, EOS and streamed deltas on the embedded model (greedy, so reproducible)."""

import pytest

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.sequence import SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
    yield LLM(EngineConfig(cache=CacheConfig(kv_cache_gib=0.05)))
    mp.undo()


def stream(llm, prompt, params):
    seq = llm.engine.add_request(llm.encode(prompt, chat=True), params)
    deltas = []
    while llm.engine.has_unfinished():
        deltas += [o.delta_text for o in llm.engine.step() if o.seq is seq]
    return seq, "".join(deltas)


def test_stop_string_cuts_text_and_streamed_deltas_add_up(llm):
    prompt = "List five fruits, one per line."
    free, free_text = stream(llm, prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert free_text == free.text and len(free.text) > 20
    stop = free.text[12:16]
    cut, cut_text = stream(llm, prompt, SamplingParams(max_tokens=40, temperature=0, stop=(stop,), ignore_eos=True))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.find(stop)] == cut_text
    assert len(cut.output_ids) < len(free.output_ids)


def test_eos_ends_generation(llm):
    seq, _ = stream(llm, "Say hi.", SamplingParams(max_tokens=200, temperature=0))
    assert seq.finish_reason == "stop" and seq.output_ids[-1] in llm.engine.eos_ids
    assert len(seq.output_ids) < 200


def test_seeded_sampling_reproducible(llm):
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    a = llm.generate(["Tell me a joke."], p, chat=True)[0].token_ids
    b = llm.generate(["Tell me a joke."], p, chat=True)[0].token_ids
    assert a == b
