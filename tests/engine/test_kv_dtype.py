"""cache.kv_dtype: the K/V slabs hold bfloat16 / float16 while the model computes in float32.

References: a stored value is the float32 value rounded once to the slab's dtype (torch's own
conversion); the pool it sizes holds twice the positions in the same memory; and whole runs stay
near transformers' float32 log-probs (the rounding of keys, values and, in the batched kernel,
queries is all that differs), with the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.cache.build import CacheBudget, build_caches
from ridgefill_runtime.cache.spec import CacheSpec
from ridgefill_runtime.config import CacheConfig, EngineConfig, FamilyConfig, SchedulerConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pool_stores_rounded_and_reads_back_the_model_dtype(dtype):
    spec = CacheSpec.dense(
        type("C", (), dict(num_kv_heads=2, head_dim=8, num_layers=2, hidden_size=16, family_config=FamilyConfig()))(),
        torch.float32,
    )
    caches = build_caches(spec, CacheBudget(block_size=4, num_blocks=4, kv_dtype=dtype), "cpu")
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    slots = torch.tensor([3, 0, 9, 15, 4, 7])
    caches.kv.write(1, slots, k, v)
    assert caches.kv.k[1].dtype == dtype
    k_back, v_back = caches.kv.read(1, slots)
    assert k_back.dtype == torch.float32
    assert torch.equal(k_back, k.to(dtype).float()) and torch.equal(v_back, v.to(dtype).float())


def test_pool_holds_twice_the_positions_in_the_same_memory():
    spec = CacheSpec.dense(
        type("C", (), dict(num_kv_heads=2, head_dim=8, num_layers=3, hidden_size=16, family_config=FamilyConfig()))(),
        torch.float32,
    )
    wide = build_caches(spec, CacheBudget(kv_cache_gib=0.001), "cpu")
    narrow = build_caches(spec, CacheBudget(kv_cache_gib=0.001, kv_dtype=torch.bfloat16), "cpu")
    assert narrow.num_blocks // 2 == wide.num_blocks  # (flooring: one more block may fit)
    assert narrow.kv.bytes_per_token() * narrow.num_blocks <= 0.001 * 2**30


@pytest.fixture(scope="module", params=["llama_gqa_untied", "gemma3_sliding"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, build_tiny(request.param, folder)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16"])
def test_narrow_cache_stays_near_float32_transformers(tiny, kv_dtype):
    folder, ref = tiny
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (70, 33)]
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=128, kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(chunk_size=16),
    )
    engine = build_engine(config)
    assert engine.kv.k[0].dtype == getattr(torch, kv_dtype)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    for seq, prompt in zip(seqs, prompts):
        ids = prompt + seq.output_ids
        with torch.no_grad():
            logp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [L, V]
        want = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(seq.output_ids)]
        got = [t.logprob for t in seq.logprobs.output]
        err = max(abs(a - b) for a, b in zip(got, want))
        # rounded, not lost (a float32 cache agrees to ~1e-5); bfloat16 keeps 8 bits to float16's 11
        assert 0 < err < {"bfloat16": 0.1, "float16": 0.02}[kv_dtype], err
        greedy = [int(logp[len(prompt) - 1 + j].argmax()) for j in range(len(seq.output_ids))]
        assert seq.output_ids == greedy
