"""weights = "packed" against weights = "dequantized" on the embedded SmolLM2 (Q4_1 GGUF): the
same weights, float32, so greedy tokens match and log-probabilities agree to float32 rounding;
"packed" on a model with nothing to pack is refused, and on a GPU only where the build has the
CUDA kernel."""

import pytest
import torch

from ridgefill_runtime import llm as llm_module
from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from ridgefill_runtime.errors import UnsupportedError
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.ops.packed_linear import PackedWeight, compiled_for
from ridgefill_runtime.sequence import SamplingParams

PROMPTS = ["The history of the printing press begins", 'def fibonacci(n):\n    """Return the n-th']
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
    yield (
        LLM(EngineConfig(weights="packed", dtype="float32", cache=cache, scheduler=steps)),
        LLM(EngineConfig(weights="dequantized", dtype="float32", cache=cache, scheduler=steps)),
    )
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


@pytest.mark.gpu
def test_packed_on_cuda_gives_the_dequantized_greedy_tokens(tmp_path, monkeypatch):
    """The engine on CUDA with the packed kernel (csrc/packed_linear.cu) against dense weights."""
    monkeypatch.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path / "rf-cache"))
    cache = CacheConfig(kv_cache_gib=0.05)
    steps = SchedulerConfig(max_num_batched_tokens=32, chunk_size=16)
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    llms = [
        LLM(EngineConfig(device="cuda", weights=mode, dtype="float32", cache=cache, scheduler=steps))
        for mode in ("packed", "dequantized")
    ]
    assert isinstance(llms[0].engine.model.weights.layers[0].qkv, PackedWeight)
    packed, dense = (llm.generate(PROMPTS, params) for llm in llms)
    for p, d in zip(packed, dense):
        assert len(d.token_ids) == NEW
        assert p.token_ids == d.token_ids


def test_packed_on_a_model_with_nothing_to_pack_is_refused():
    with pytest.raises(UnsupportedError, match="packed"):
        LLM(EngineConfig(model="looped", weights="packed", cache=CacheConfig(kv_cache_gib=0.05)))


@pytest.mark.parametrize("cuda_kernel", [False, True])
def test_packed_on_cuda_follows_the_cuda_kernel(monkeypatch, cuda_kernel):
    """Explicit "packed" runs on CUDA where the build has the CUDA kernel and is refused otherwise (a
    ROCm or CPU-only build, no extension); "auto" stays dense on a GPU (unmeasured there)."""
    monkeypatch.setattr(llm_module, "packed_compiled_for", lambda device: device.type == "cuda" and cuda_kernel)
    for device in ("cuda", "cuda:0"):
        packed = EngineConfig(device=device, weights="packed")
        if cuda_kernel:
            assert llm_module._wants_packed(packed)
        else:
            with pytest.raises(UnsupportedError, match=f"needs the packed kernel, which this build for {device}"):
                llm_module._wants_packed(packed)
        assert not llm_module._wants_packed(EngineConfig(device=device, weights="auto"))
        assert not llm_module._wants_packed(EngineConfig(device=device, weights="dequantized"))
    # the CPU keeps its own answer: this patch says no CPU kernel, so "packed" there is refused
    with pytest.raises(UnsupportedError, match="compiled extension is not loaded"):
        llm_module._wants_packed(EngineConfig(device="cpu", weights="packed"))
    assert not llm_module._wants_packed(EngineConfig(device="cpu", weights="auto"))


def test_packed_on_cuda_matches_this_build():
    """Unpatched: the decision follows the dispatcher's CUDA kernel for packed_linear."""
    config = EngineConfig(device="cuda", weights="packed")
    if compiled_for(torch.device("cuda")):
        assert llm_module._wants_packed(config)
    else:
        with pytest.raises(UnsupportedError, match="needs the packed kernel"):
            llm_module._wants_packed(config)
    assert llm_module._wants_packed(EngineConfig(device="cpu", weights="auto")) == compiled_for(torch.device("cpu"))
