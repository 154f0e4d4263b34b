"""weights = "packed" against weights = "dequantized" on the embedded SmolLM2 (Q4_1 GGUF): the
same weights, float32, so greedy tokens match and log-probabilities agree to float32 rounding;
and "packed" on a model with nothing to pack is refused."""

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from ridgefill_runtime.errors import UnsupportedError
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.ops.packed_linear import PackedWeight
from ridgefill_runtime.sequence import SamplingParams

PROMPTS = ["The history of the printing press begins", "def fibonacci(n):\n    \"\"\"Return the n-th"]
NEW = 40
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: one thread keeps it fast on a busy machine (no oversubscription)
    cache = CacheConfig(kv_cache_gib=0.05)
    steps = SchedulerConfig(max_num_batched_tokens=32, chunk_size=16)  # several prefill steps per prompt
    yield (LLM(EngineConfig(weights="packed", dtype="float32", cache=cache, scheduler=steps)),
           LLM(EngineConfig(weights="dequantized", dtype="float32", cache=cache, scheduler=steps)))
    torch.set_num_threads(threads)
    mp.undo()


@pytest.fixture(scope="module")
def greedy(engines):
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    return [llm.generate(PROMPTS, params) for llm in engines]


def test_packed_engine_holds_packed_weights(engines):
    packed, dense = engines
    layer = packed.engine.model.weights.layers[0]
    assert all(isinstance(w, PackedWeight) for w in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert not isinstance(dense.engine.model.weights.layers[0].qkv, PackedWeight)


def test_packed_and_dequantized_give_the_same_greedy_tokens(greedy):
    packed, dense = greedy
    for p, d in zip(packed, dense):
        assert len(d.token_ids) == NEW
        assert p.token_ids == d.token_ids


def test_packed_and_dequantized_prompt_logprobs_agree(engines, greedy):
    packed, dense = engines
    for completion in greedy[1]:
        ids = completion.prompt_ids + completion.token_ids
        sp, sd = packed.score(ids), dense.score(ids)
        assert len(sp["target_logprobs"]) == len(sd["target_logprobs"]) == len(ids) - 1
        worst = max(abs(a - b) for a, b in zip(sp["target_logprobs"], sd["target_logprobs"]))
        assert worst <= LOGPROB_TOLERANCE, f"max |Δ logprob| {worst:.3g}"
        assert sp["argmax"] == sd["argmax"]


def test_packed_on_a_model_with_nothing_to_pack_is_refused():
    with pytest.raises(UnsupportedError, match="packed"):
        LLM(EngineConfig(model="looped", weights="packed", cache=CacheConfig(kv_cache_gib=0.05)))
