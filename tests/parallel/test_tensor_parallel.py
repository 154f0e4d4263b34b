"""Tensor parallelism over gloo on this CPU against one rank, in the same run: log-probs within 1e-4
(the chunked-prefill tests' bound), the same greedy and seeded-sampled tokens, the fill's same exact
rows, late K/V and outputs, the prefix cache and n-gram speculation's same tokens.

Every engine here with tensor_parallel_size > 1 starts its other ranks as processes (spawned, so
each imports torch afresh) and stops them at close()."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import (
    CacheConfig,
    EngineConfig,
    FillConfig,
    LoopConfig,
    ParallelConfig,
    RowsConfig,
    SpeculativeConfig,
)
from ridgefill_runtime.fill.maps import MapMeta, save_maps
from ridgefill_runtime.layers.attention import kv_slots
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import HYBRID_TP_CONFIGS, build_tiny, build_tiny_hybrid

BOUND = 1e-4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7)


def engine_config(folder, tp: int, **kw) -> EngineConfig:
    kw.setdefault("cache", CacheConfig(num_blocks=96, block_size=16))
    return EngineConfig(model=str(folder), parallel=ParallelConfig(tensor_parallel_size=tp), **kw)


def run(config: EngineConfig, fn):
    llm = LLM(config)
    try:
        return fn(llm)
    finally:
        llm.close()


def outputs(llm: LLM, ids: list[int]) -> dict:
    """What the parity tests compare: prompt log-probs, and greedy and sampled tokens of a batch."""
    scored = llm.score(ids)
    prompts = [ids[:23], ids[:41], ids[5:60]]
    return {
        "logprobs": torch.tensor(scored["target_logprobs"]),
        "argmax": scored["argmax"],
        "greedy": [c.token_ids for c in llm.generate(prompts, GREEDY)],
        "sampled": [c.token_ids for c in llm.generate(prompts, SAMPLED)],
    }


def assert_same(one: dict, many: dict) -> None:
    assert (one["logprobs"] - many["logprobs"]).abs().max() < BOUND
    assert one["argmax"] == many["argmax"]
    assert one["greedy"] == many["greedy"]
    assert one["sampled"] == many["sampled"]


def word_tokenizer(folder, vocab: int) -> None:
    """A word-level tokenizer.json whose token i is the word "w{i}"."""
    import tokenizers

    words = {f"w{i}": i for i in range(vocab)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def folder(name: str):
        if name not in made:
            made[name] = tmp_path_factory.mktemp(name)
            if name in HYBRID_TP_CONFIGS:
                build_tiny_hybrid(name, made[name])
                word_tokenizer(made[name], 320)  # NOTE: the fill's row selectors read its token table
            else:
                build_tiny(name, made[name])
        return made[name]

    return folder


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    torch.manual_seed(11)
    return torch.randint(0, 300, (90,)).tolist()  # NOTE: Gemma's 16-key window is passed many times


@pytest.mark.parametrize(
    "name,tp",
    [
        ("llama_tp_mha", 2),
        ("llama_tp_mha", 3),
        ("qwen3_tp_one_kv", 2),  # one K/V head, copied to both ranks
        ("qwen3_tp_one_kv", 3),
        ("gemma3_tp_window", 2),  # sliding-window layers and a global one
        ("gemma3_tp_window", 3),
        ("qwen2_tp_bias", 2),  # q/k/v biases cut by head
        ("qwen3_5_tp", 2),  # Gated DeltaNet by key head with its value heads; gated attention's K/V split
        ("qwen3_next_tp", 2),  # fused GDN projections, MoE within experts, one K/V head copied
        ("qwen3_next_tp", 3),
    ],
)
def test_tensor_parallel_equals_one_rank(folders, prompt, name, tp):
    folder = folders(name)
    one = run(engine_config(folder, 1), lambda llm: outputs(llm, prompt))
    many = run(engine_config(folder, tp), lambda llm: outputs(llm, prompt))
    assert_same(one, many)


# -- the fill ------------------------------------------------------------------------------------

SPLIT, TAIL = 1, 24


def random_maps(folder) -> str:
    """Maps near the identity for every late layer (what they predict matters less than that
    every rank applies the same ones)."""
    ckpt = load_hf_folder(folder)
    d, layers = ckpt.config.hidden_size, ckpt.config.num_layers
    gen = torch.Generator().manual_seed(5)
    maps = {
        layer: (torch.eye(d) + 0.05 * torch.randn(d, d, generator=gen), 0.1 * torch.randn(d, generator=gen))
        for layer in range(SPLIT, layers)
    }
    meta = MapMeta(ckpt.identity, ckpt.config.architecture, layers, d, SPLIT, 0.03, 0, "none")
    path = folder.parent / f"{folder.name}-maps.safetensors"  # NOTE: a file in the folder changes its identity
    save_maps(path, meta, maps)
    return str(path)


def filled(llm: LLM, ids: list[int], split: int = SPLIT) -> dict:
    """A filled prompt's exact rows, selector scores, tail log-probs, greedy tokens, and rank 0's
    K/V heads of every filled row at the global late layers."""
    engine = llm.engine
    seq = engine.add_request(ids, SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=True))
    table = None
    while engine.has_unfinished():
        engine.step()
        table = list(seq.block_table) or table
    positions = torch.arange(seq.fill.boundary)
    slots = kv_slots(torch.tensor(table), positions, engine.caches.block_size)
    # NOTE: global layers only: a sliding-window layer's pages of old positions have been given back
    model = engine.model
    late_global = [l for l in range(split, model.config.num_layers) if model.keeps_kv(l) and not model.window(l)]
    late = [engine.kv.read(layer, slots) for layer in late_global]
    return {
        "boundary": seq.fill.boundary,
        "exact_rows": list(seq.fill.exact_rows),
        "scores": {k: torch.tensor(v) for k, v in seq.fill.row_scores.items()},
        "logprobs": torch.tensor(seq.logprobs.prompt),
        "tokens": list(seq.output_ids),
        "late_kv": late,
        "kv_heads": engine.model.config.num_kv_heads,
    }


def test_fill_at_two_ranks_equals_one(folders):
    """The plain fill (no exact prefix rows: the selectors need a tokenizer's token table, which a
    tiny model lacks; tests/parallel/test_tensor_parallel_real.py selects rows on Gemma 3)."""
    folder = folders("llama_tp_mha")
    fill = FillConfig(arm="ridgefill", split=SPLIT, tail=TAIL, maps=random_maps(folder), rows=RowsConfig(selectors=()))
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (120,)).tolist()
    # NOTE: the prefix cache is off: a finished request's blocks would be reused by nobody here, and
    # its cached blocks would keep the late K/V read below from being freed and overwritten
    cache = CacheConfig(num_blocks=96, block_size=16, prefix_caching="off")
    one = run(engine_config(folder, 1, fill=fill, cache=cache), lambda llm: filled(llm, ids))
    many = run(engine_config(folder, 2, fill=fill, cache=cache), lambda llm: filled(llm, ids))
    assert one["boundary"] == many["boundary"] == len(ids) - TAIL
    assert (one["logprobs"] - many["logprobs"]).abs().max() < BOUND
    assert one["tokens"] == many["tokens"]
    heads = many["kv_heads"]  # rank 0 holds the first `heads` of the model's K/V heads
    assert heads == one["kv_heads"] // 2
    for (k1, v1), (kn, vn) in zip(one["late_kv"], many["late_kv"]):
        assert torch.allclose(k1[:, :heads], kn, atol=1e-5) and torch.allclose(v1[:, :heads], vn, atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_5_tp", "qwen3_next_tp"])
def test_hybrid_fill_with_rows_and_the_terminal_correction_at_two_ranks_equals_one(folders, name):
    """The two-sweep prefill on a hybrid: filled rows carry each rank's GDN heads from x̂, the
    attention selector's mass is summed over the ranks' heads, and at the prefix's end each rank
    adds ρ·ΔM of its own value heads (ρ from its heads' gates)."""
    from ridgefill_runtime.fill.maps import add_terminal_shift

    folder = folders(name)
    hy = load_hf_folder(folder).config.family_config
    path = random_maps(folder)
    gen = torch.Generator().manual_seed(6)
    late_gdn = [l for l in range(SPLIT, len(hy.layer_types)) if hy.is_linear(l)]
    shift = (hy.value_heads, hy.key_head_dim, hy.value_head_dim)
    add_terminal_shift(path, {l: 0.5 * torch.randn(shift, generator=gen) for l in late_gdn}, every=64, states=1)
    rows = RowsConfig(selectors=("attention",), attention_layers=(3,), attention_share=0.1, window=8)
    cache = CacheConfig(num_blocks=96, block_size=16, prefix_caching="off")
    torch.manual_seed(3)
    ids = torch.randint(0, 300, (120,)).tolist()

    def fill(terminal: bool) -> FillConfig:
        return FillConfig(arm="ridgefill", split=SPLIT, tail=TAIL, maps=path, rows=rows, terminal_state=terminal)

    one = run(engine_config(folder, 1, fill=fill(True), cache=cache), lambda llm: filled(llm, ids))
    many = run(engine_config(folder, 2, fill=fill(True), cache=cache), lambda llm: filled(llm, ids))
    plain = run(engine_config(folder, 1, fill=fill(False), cache=cache), lambda llm: filled(llm, ids))
    assert late_gdn and (one["logprobs"] - plain["logprobs"]).abs().max() > 1e-2  # the correction acts
    assert one["boundary"] == many["boundary"] == len(ids) - TAIL
    assert len(one["exact_rows"]) > 3 and one["exact_rows"] == many["exact_rows"]
    assert torch.allclose(one["scores"]["attention"], many["scores"]["attention"], rtol=1e-4, atol=1e-6)
    assert (one["logprobs"] - many["logprobs"]).abs().max() < BOUND
    assert one["tokens"] == many["tokens"]
    heads, kv_heads = many["kv_heads"], one["kv_heads"]
    for (k1, v1), (kn, vn) in zip(one["late_kv"], many["late_kv"], strict=True):
        first = slice(0, heads) if kv_heads > 1 else slice(None)  # rank 0's heads (one head: copied)
        assert torch.allclose(k1[:, first], kn, atol=1e-5) and torch.allclose(v1[:, first], vn, atol=1e-5)


# -- the prefix cache and n-gram speculation -------------------------------------------------------


def cached_then_spoken(llm: LLM, ids: list[int]) -> dict:
    """Two requests sharing a prefix, one after the other (the second's first blocks come from the
    cache), then a repetitive prompt that n-gram drafts pay on."""
    first = llm.generate([ids[:70]], GREEDY)[0].token_ids
    second = llm.generate([ids[:64] + ids[80:90]], GREEDY)[0].token_ids
    loop = (ids[:12] * 6)[:70]
    spoken = llm.generate([loop], SamplingParams(max_tokens=16, temperature=0.0))[0].token_ids
    stats = llm.engine.stats()
    return {
        "tokens": (first, second, spoken),
        "hits": stats.prefix_hit_tokens_total,
        "accepted": stats.spec_accepted_tokens_total,
    }


def test_prefix_cache_and_ngram_speculation_at_two_ranks_give_one_ranks_tokens(folders, prompt):
    folder = folders("qwen3_tp_one_kv")
    kw = dict(
        cache=CacheConfig(num_blocks=96, block_size=16, prefix_caching="on"),
        speculative=SpeculativeConfig(method="ngram", num_tokens=4),
    )
    one = run(engine_config(folder, 1, **kw), lambda llm: cached_then_spoken(llm, prompt))
    many = run(engine_config(folder, 2, **kw), lambda llm: cached_then_spoken(llm, prompt))
    assert one["hits"] >= 64 and one["hits"] == many["hits"]
    assert one["accepted"] > 0 and one["accepted"] == many["accepted"]
    assert one["tokens"] == many["tokens"]


def test_ngram_speculation_on_a_hybrid_at_two_ranks_gives_one_ranks_tokens(folders, prompt):
    """Drafts verified row by row over each rank's GDN heads; a rejected draft rolls every rank's
    states back to the same row (the rollback reaches the other ranks as relayed pool events)."""
    folder = folders("qwen3_next_tp")

    def spoken(llm: LLM) -> dict:
        # NOTE: a random model rarely repeats itself; its own greedy run, replayed after the prompt
        # again, gives drafts it partly accepts (7 of the 20 tokens follow the first run)
        p = prompt[:30]
        g = llm.generate([p], SamplingParams(max_tokens=40, temperature=0))[0].token_ids
        tokens = [c.token_ids for c in llm.generate([p + g + p + g[:20]], SamplingParams(max_tokens=20, temperature=0))]
        stats = llm.engine.stats()
        return {
            "tokens": (g, tokens),
            "accepted": stats.spec_accepted_tokens_total,
            "drafted": stats.spec_draft_tokens_total,
        }

    kw = dict(speculative=SpeculativeConfig(method="ngram", num_tokens=4))
    one = run(engine_config(folder, 1, **kw), spoken)
    many = run(engine_config(folder, 2, **kw), spoken)
    assert 0 < one["accepted"] < one["drafted"]  # some drafts accepted, some rolled back
    assert (one["accepted"], one["drafted"]) == (many["accepted"], many["drafted"])
    assert one["tokens"] == many["tokens"]


# -- real models -------------------------------------------------------------------------------------

TEXT = "/usr/share/common-licenses/GPL-3"


def text_ids(model: str | None, n: int) -> list[int]:
    llm = LLM(EngineConfig(model=model, cache=CacheConfig(num_blocks=8)))
    return llm.tokenizer.encode(open(TEXT).read())[:n]


def real_config(model: str | None, tp: int, **kw) -> EngineConfig:
    kw.setdefault("cache", CacheConfig(num_blocks=128, block_size=16))
    return EngineConfig(model=model, parallel=ParallelConfig(tensor_parallel_size=tp), **kw)


def test_smollm2_at_three_ranks_equals_one():
    """SmolLM2-135M (packed Q4_1 weights): 9 heads and 3 K/V heads, one K/V head per rank."""
    ids = text_ids(None, 160)
    one = run(real_config(None, 1), lambda llm: outputs(llm, ids))
    many = run(real_config(None, 3), lambda llm: outputs(llm, ids))
    assert_same(one, many)


def test_gemma3_at_two_ranks_equals_one(gemma3_gguf):
    """Gemma 3 270M (packed Q8_0): 4 heads and one K/V head, copied to both ranks."""
    ids = text_ids("gemma3-270m", 160)
    one = run(real_config("gemma3-270m", 1), lambda llm: outputs(llm, ids))
    many = run(real_config("gemma3-270m", 2), lambda llm: outputs(llm, ids))
    assert_same(one, many)


def test_gemma3_fill_with_selected_rows_at_two_ranks_equals_one(gemma3_gguf):
    """The shipped maps with the attention and lexical selectors: every rank sums its heads'
    attention into the same scores, so both pick rank 0's exact rows."""
    from ridgefill_runtime.fill.settings import PACKAGED_MAPS, shipped_maps

    split = PACKAGED_MAPS["gemma3-270m"][1]
    rows = RowsConfig(selectors=("special", "attention", "lexical"), attention_layers=(3, 7), attention_share=0.05)
    fill = FillConfig(arm="ridgefill", split=split, tail=128, maps=str(shipped_maps(split, "gemma3-270m")), rows=rows)
    ids = text_ids("gemma3-270m", 700)
    # NOTE: not window-bounded: the slots read below are the block table's, which that pool pages apart
    cache = CacheConfig(num_blocks=128, block_size=16, prefix_caching="off", window_bounded=False)
    one = run(real_config("gemma3-270m", 1, fill=fill, cache=cache), lambda llm: filled(llm, ids, split))
    many = run(real_config("gemma3-270m", 2, fill=fill, cache=cache), lambda llm: filled(llm, ids, split))
    assert one["boundary"] == many["boundary"] == len(ids) - 128
    assert len(one["exact_rows"]) > 10 and one["exact_rows"] == many["exact_rows"]
    assert one["scores"].keys() == many["scores"].keys() == {"attention"}
    assert torch.allclose(one["scores"]["attention"], many["scores"]["attention"], rtol=1e-4, atol=1e-5)
    assert (one["logprobs"] - many["logprobs"]).abs().max() < BOUND
    assert one["tokens"] == many["tokens"]
    assert one["kv_heads"] == many["kv_heads"] == 1  # copied: rank 0 holds the whole of it
    assert len(one["late_kv"]) == 2  # Gemma 3 270M's global layers above the split: 11 and 17
    for (k1, v1), (kn, vn) in zip(one["late_kv"], many["late_kv"]):
        assert torch.allclose(k1, kn, atol=1e-4) and torch.allclose(v1, vn, atol=1e-4)


# -- looped models ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 3])
def test_looped_model_with_self_speculation_at_several_ranks_equals_one(tmp_path, tp):
    """A tiny Huginn-layout model (6 heads, MLP 48): the prelude, core and coda blocks sharded alike;
    the RIPE cache and the model's own drafts (looped.block = 4) on every rank. NOTE: float64: in
    float32 this random model's loops amplify rounding until one rank with 1 or 2 threads differs
    by 0.014 in log p over 40 tokens (and either from float64 by 0.16); TP = 2 fell in that noise
    (0.028), which would hide a wrong shard no better than a 1e-4 bound fails a right one."""
    from looped_reference import TINY_HUGINN, write_tiny_huginn

    write_tiny_huginn(tmp_path, dict(TINY_HUGINN, n_embd=48, n_heads=6, num_key_value_heads=6))
    torch.manual_seed(4)
    ids = torch.randint(3, 61, (40,)).tolist()

    def looped(llm: LLM) -> dict:
        scored = llm.score(ids)
        tokens = [c.token_ids for c in llm.generate([ids[:9], ids[:17]], SamplingParams(max_tokens=12, temperature=0))]
        return {
            "logprobs": torch.tensor(scored["target_logprobs"]),
            "tokens": tokens,
            "accepted": llm.engine.stats().spec_accepted_tokens_total,
        }

    loops = LoopConfig(draft_loops=2, window=16)  # the tiny model runs 4 loops
    one = run(engine_config(tmp_path, 1, looped=loops, dtype="float64"), looped)
    many = run(engine_config(tmp_path, tp, looped=loops, dtype="float64"), looped)
    assert (one["logprobs"] - many["logprobs"]).abs().max() < BOUND
    assert one["tokens"] == many["tokens"]
    assert one["accepted"] > 0 and one["accepted"] == many["accepted"]
