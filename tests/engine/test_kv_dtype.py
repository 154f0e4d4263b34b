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


# ---------------------------------------------------------------------------
# int8 (cache/int8_kv.py): one float32 scale per (slot, KV head) beside int8 slabs.


def int8_caches(layers=2, block_size=4, num_blocks=6):
    spec = CacheSpec.dense(
        type(
            "C", (), dict(num_kv_heads=2, head_dim=8, num_layers=layers, hidden_size=16, family_config=FamilyConfig())
        )(),
        torch.float32,
    )
    return build_caches(spec, CacheBudget(block_size=block_size, num_blocks=num_blocks, kv_dtype=torch.int8), "cpu")


def test_int8_pool_stores_quantized_rows_with_their_scales():
    caches = int8_caches()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(6, 2, 8, generator=g), 5 * torch.randn(6, 2, 8, generator=g)
    slots = torch.tensor([3, 0, 9, 15, 4, 7])
    caches.kv.write(1, slots, k, v)
    assert caches.kv.k[1].dtype == torch.int8 and caches.kv.k_scale[1].shape == (24, 2, 1)  # [slots, Hkv, G]
    k_back, v_back = caches.kv.read(1, slots)
    assert k_back.dtype == torch.float32
    for back, x in ((k_back, k), (v_back, v)):
        step = x.abs().amax(-1, keepdim=True) / 127  # [6, 2, 1]
        assert bool(((back - x).abs() <= step / 2 * (1 + 1e-5)).all())
        assert not torch.equal(back, x)
    # 8 int8 values and one float32 scale (one group of up to 32) per (K or V, layer, KV head)
    assert caches.kv.bytes_per_token() == 2 * 2 * 2 * (8 + 4)


def test_int8_pool_fits_the_positions_its_bytes_allow():
    spec = CacheSpec.dense(
        type("C", (), dict(num_kv_heads=2, head_dim=64, num_layers=3, hidden_size=16, family_config=FamilyConfig()))(),
        torch.float32,
    )
    wide = build_caches(spec, CacheBudget(kv_cache_gib=0.001), "cpu")
    narrow = build_caches(spec, CacheBudget(kv_cache_gib=0.001, kv_dtype=torch.int8), "cpu")
    assert narrow.kv.bytes_per_token() == 2 * 3 * 2 * (64 + 2 * 4)  # 72 / 256 of float32's: 2 scales per 64
    assert narrow.num_blocks == int(0.001 * 2**30) // (narrow.kv.bytes_per_token() * 16)
    assert narrow.num_blocks > 3.5 * wide.num_blocks  # 256 / 72 = 3.56


def test_int8_copy_on_write_copies_the_scales():
    """copy_blocks (the prefix cache's copy-on-write) copies each slot's scales with its int8 values: the copy
    reads back the same K/V, and rewriting it leaves the source as it was."""
    caches = int8_caches(num_blocks=4)
    kv, g = caches.kv, torch.Generator().manual_seed(1)
    src = torch.arange(4, 8)  # block 1
    k, v = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g)
    for layer in (0, 1):
        kv.write(layer, src, k * (layer + 1), v * 10 ** (layer - 1))
    before = [kv.read(layer, src) for layer in (0, 1)]
    kv.copy_blocks([(1, 3)], 4)
    dst = torch.arange(12, 16)
    for layer in (0, 1):
        for a, b in zip(kv.read(layer, dst), before[layer]):
            assert torch.equal(a, b)
    kv.write(0, dst, torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g))
    for a, b in zip(kv.read(0, src), before[0]):
        assert torch.equal(a, b)


def test_int8_splice_copies_keys_with_their_scales():
    """KVPool.copy_from (evaluation's exact-K/V splices, eval/run.py) moves another pool's int8 rows with
    their scales: the keys read back as the source's, the values not asked for stay the target's."""
    src, dst = int8_caches().kv, int8_caches().kv
    g = torch.Generator().manual_seed(2)
    at, to = torch.tensor([0, 5, 9]), torch.tensor([3, 4, 20])
    src.write(1, at, 4 * torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g))
    dst.write(1, to, torch.randn(3, 2, 8, generator=g), 0.1 * torch.randn(3, 2, 8, generator=g))
    values_before = dst.read(1, to)[1]
    dst.copy_from(1, to, src, at, parts=("k",))
    k_dst, v_dst = dst.read(1, to)
    assert torch.equal(k_dst, src.read(1, at)[0])
    assert torch.equal(v_dst, values_before)


def test_int8_rescale_scales_the_scales():
    """The fill's rescale (fill/corrections.py) multiplies an int8 row's scale: the same product, no second
    rounding of the stored integers."""
    caches = int8_caches()
    slots = torch.tensor([2, 5])
    caches.kv.write(0, slots, torch.randn(2, 2, 8), torch.randn(2, 2, 8))
    k0, v0 = caches.kv.read(0, slots)
    ints = caches.kv.v[0][slots].clone()
    caches.kv.scale_slots(0, slots, torch.tensor([0.5, 3.0]), keys=False)
    k1, v1 = caches.kv.read(0, slots)
    assert torch.equal(k1, k0) and torch.equal(caches.kv.v[0][slots], ints)
    torch.testing.assert_close(v1, v0 * torch.tensor([0.5, 3.0])[None, :, None], rtol=1e-6, atol=0)


def run_engine(folder, prompts, kv_dtype, prefix_caching="off", max_tokens=12):
    config = EngineConfig(
        model=str(folder),
        cache=CacheConfig(block_size=4, num_blocks=128, kv_dtype=kv_dtype, prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(chunk_size=16),
    )
    engine = build_engine(config)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    seqs = []
    for p in prompts:  # NOTE: one at a time, so a repeated prompt finds the first one's blocks cached
        seqs.append(engine.add_request(p, params))
        while engine.has_unfinished():
            engine.step()
    return engine, seqs


def teacher_forced_logprobs(engine_seq, ref):
    ids = engine_seq.prompt_ids + engine_seq.output_ids
    with torch.no_grad():
        logp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [L, V]
    n = len(engine_seq.prompt_ids)
    want = [float(logp[n - 1 + j, t]) for j, t in enumerate(engine_seq.output_ids)]
    greedy = [int(logp[n - 1 + j].argmax()) for j in range(len(engine_seq.output_ids))]
    return want, greedy


# Measured (12 greedy tokens after prompts of 70 and 33, chunks of 16; max |Δ log p| against transformers' float32
# per prompt): llama_gqa_untied bfloat16 1.1e-3 / 1.6e-3, int8 3.3e-3 / 4.4e-3; gemma3_sliding bfloat16 0.038 /
# 0.014, int8 0.13 / 0.078. int8 costs about 3x bfloat16 on both: its step is max|x| / 127 of the whole row, so the
# small entries of a row keep fewer bits than bfloat16's 8 relative ones. The bounds are about 2.5x the largest
# measured; a cache that dropped the scales (or read int8 as numbers) is off by whole units.
INT8_BOUND = {"llama_gqa_untied": 0.012, "gemma3_sliding": 0.3}


def test_int8_cache_stays_near_float32_transformers(tiny):
    folder, ref = tiny
    bound = INT8_BOUND[folder.name.rstrip("0123456789")]
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (70, 33)]
    engine, seqs = run_engine(folder, prompts, "int8")
    assert engine.kv.k[0].dtype == torch.int8
    for seq in seqs:
        want, top = teacher_forced_logprobs(seq, ref)
        got = [t.logprob for t in seq.logprobs.output]
        err = max(abs(a - b) for a, b in zip(got, want))
        assert 1e-4 < err < bound, err
        # greedy: transformers' argmax, except where its top two are within the error (gemma3_sliding's 70-token
        # prompt picks the second at its 8th and 11th tokens, 0.027 and 0.11 below the first)
        for j, (token, best) in enumerate(zip(seq.output_ids, top)):
            assert token == best or float(top_gap(seq, ref, j, token)) < 2 * bound, j


def top_gap(seq, ref, j: int, token: int) -> torch.Tensor:
    """transformers' log p of its argmax minus that of `token`, at output position j."""
    ids = seq.prompt_ids + seq.output_ids
    with torch.no_grad():
        logp = ref(torch.tensor([ids])).logits[0, len(seq.prompt_ids) - 1 + j].float().log_softmax(-1)  # [V]
    return logp.max() - logp[token]


def test_int8_engine_is_a_float32_cache_of_the_round_trip(tiny, monkeypatch):
    """Every read path (the batched kernel, KVPool.read) attends to float(q) * scale: an int8 run equals a float32
    cache that stores dequantize(quantize(x)) (bitwise on this machine; 1e-5 allows another summation order)."""
    from ridgefill_runtime.cache import int8_kv, kv_pool

    folder, _ = tiny
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (70, 33)]
    _, int8 = run_engine(folder, prompts, "int8")
    write = kv_pool.KVPool.write

    def round_trip(pool, layer, slots, k, v):
        rt = lambda x: int8_kv.dequantize(*int8_kv.quantize(x))  # noqa: E731
        write(pool, layer, slots, rt(k), rt(v))

    monkeypatch.setattr(kv_pool.KVPool, "write", round_trip)
    _, fake = run_engine(folder, prompts, "auto")
    for a, b in zip(int8, fake):
        assert a.output_ids == b.output_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs.output, b.logprobs.output)) < 1e-5


def test_int8_cache_with_prefix_caching_reuses_the_same_keys(tiny):
    """A repeated prompt takes the first run's cached int8 blocks (their scales with them): its tokens and
    log-probs are the first run's."""
    folder, _ = tiny
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, 320, (45,), generator=g).tolist()
    engine, (first, second) = run_engine(folder, [prompt, prompt], "int8", prefix_caching="on")
    assert second.prefix.num_cached >= 40
    assert second.output_ids == first.output_ids
    for a, b in zip(first.logprobs.output, second.logprobs.output):
        assert abs(a.logprob - b.logprob) < 1e-5


def test_int8_is_refused_off_the_cpu():
    with pytest.raises(ValueError, match=r'cache.kv_dtype = "int8" runs on the CPU only'):
        build_caches(int8_caches().spec, CacheBudget(block_size=4, num_blocks=4, kv_dtype=torch.int8), "cuda")


def test_int8_is_refused_for_looped_models(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "models"))
    from looped_reference import write_tiny_huginn

    from ridgefill_runtime.config import LoopConfig

    write_tiny_huginn(tmp_path)
    config = EngineConfig(
        model=str(tmp_path), looped=LoopConfig(cache="full", block=0), cache=CacheConfig(num_blocks=64, kv_dtype="int8")
    )
    with pytest.raises(ValueError, match=r'cache.kv_dtype = "int8" is not supported for looped models'):
        build_engine(config)
