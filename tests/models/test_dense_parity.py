"""Our dense models (Llama, Qwen3, Gemma 3 with a sliding window) against transformers on tiny random
checkpoints (float32, 300 tokens)."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.registry import family
from ridgefill_runtime.scheduler import ScheduledSeq
from ridgefill_runtime.sequence import SamplingParams
from harness import Harness, rel_err
from tiny_models import TINY_CONFIGS, build_tiny

SEQ_LEN = 300


@pytest.fixture(scope="module", params=sorted(TINY_CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = build_tiny(request.param, folder)
    ckpt = load_hf_folder(folder)
    ours = family(ckpt.config.architecture).build_model(ckpt.config, ckpt.tensors, torch.float32, "cpu")
    torch.manual_seed(1)
    ids = torch.randint(0, ckpt.config.vocab_size, (SEQ_LEN,)).tolist()
    with torch.no_grad():
        ref_logits = ref(torch.tensor([ids])).logits[0].float()  # [L, V]
    return dict(name=request.param, folder=folder, ref=ref, ours=ours, ids=ids, ref_logits=ref_logits)


def test_one_prefill_matches(tiny):
    h = Harness(tiny["ours"])
    (logits,) = h.step([(h.new_seq(tiny["ids"]), SEQ_LEN)])
    assert rel_err(logits, tiny["ref_logits"]) < 1e-4


def test_chunked_prefill_matches(tiny):
    h = Harness(tiny["ours"])
    seq = h.new_seq(tiny["ids"])
    parts = [h.step([(seq, n)])[0] for n in (97, 111, 92)]  # three chunks, not block-aligned
    assert rel_err(torch.cat(parts), tiny["ref_logits"]) < 1e-4


def test_prefill_then_decode_matches(tiny):
    h = Harness(tiny["ours"])
    seq = h.new_seq(tiny["ids"])
    parts = [h.step([(seq, SEQ_LEN - 32)])[0]]
    parts += [h.step([(seq, 1)])[0] for _ in range(32)]
    assert rel_err(torch.cat(parts), tiny["ref_logits"]) < 1e-4


def test_batch_of_three_lengths_equals_alone(tiny):
    lens = (300, 173, 41)
    rng = torch.Generator().manual_seed(7)
    vocab = tiny["ours"].config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in lens]
    h = Harness(tiny["ours"])
    seqs = [h.new_seq(p) for p in prompts]
    together = h.step([(s, n) for s, n in zip(seqs, lens)])
    # then a batched decode step over all three, teacher-forced with the next token 5
    for s in seqs:
        s.prompt_ids.append(5)
    together_dec = h.step([(s, 1) for s in seqs])
    for p, got, got_dec in zip(prompts, together, together_dec):
        solo = Harness(tiny["ours"])
        s = solo.new_seq(p)
        alone = solo.step([(s, len(p))])[0]
        s.prompt_ids.append(5)
        alone_dec = solo.step([(s, 1)])[0]
        assert rel_err(got, alone) < 1e-5
        assert rel_err(got_dec, alone_dec) < 1e-5
        with torch.no_grad():
            ref = tiny["ref"](torch.tensor([p + [5]])).logits[0].float()
        assert rel_err(torch.cat([got, got_dec]), ref) < 1e-4


def test_greedy_continuation_identical(tiny):
    prompt = tiny["ids"][:100]
    with torch.no_grad():
        ref = tiny["ref"].generate(
            torch.tensor([prompt]),
            max_new_tokens=32,
            do_sample=False,
            min_new_tokens=32,
            eos_token_id=None,
            pad_token_id=0,
        )
    expected = ref[0, len(prompt) :].tolist()
    llm = LLM(EngineConfig(model=str(tiny["folder"]), cache=CacheConfig(num_blocks=64)))
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert out.token_ids == expected


def test_last_layer_on_chosen_rows_equals_full(tiny):
    """The pruned final layer (logits for some rows only) equals the full forward's rows,
    in a batch mixing a fresh prefill, a later chunk, a decode and a chunk with no rows."""
    vocab = tiny["ours"].config.vocab_size
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=rng).tolist() for n in (120, 90, 60, 50)]
    results = {}
    for mode in ("full", "rows"):
        h = Harness(tiny["ours"])
        seqs = [h.new_seq(p) for p in prompts]
        h.step([(seqs[1], 40), (seqs[2], 59), (seqs[3], 20)])  # earlier context for three of them
        spans = [(seqs[0], 120), (seqs[1], 50), (seqs[2], 1), (seqs[3], 10)]
        items = h.items(spans)
        ids, pos, batch = h.runner.prepare(items)
        wanted = torch.tensor([5, 119, 120 + 49, 120 + 50])  # two rows of seq 0, last of 1, the decode
        if mode == "full":
            results[mode] = h.model.forward(ids, pos, batch, h.caches)[wanted]
        else:
            results[mode] = h.model.forward(ids, pos, batch, h.caches, wanted)
    assert rel_err(results["rows"], results["full"]) < 1e-5


def test_chunk_without_logit_rows_still_writes_last_layer_kv(tiny):
    h = Harness(tiny["ours"])
    seq = h.new_seq(tiny["ids"])
    h.blocks.grow(seq.block_table, 200)
    ids, pos, batch = h.runner.prepare([ScheduledSeq(seq, 0, 200)])
    out = h.model.forward(ids, pos, batch, h.caches, torch.empty(0, dtype=torch.int64))
    assert out.shape == (0, tiny["ours"].config.vocab_size)
    seq.num_computed = 200
    rest = h.step([(seq, SEQ_LEN - 200)])[0]
    assert rel_err(rest, tiny["ref_logits"][200:]) < 1e-4


def test_bfloat16_error_is_within_twice_transformers_own(tiny):
    """bf16 has no exact reference: our bf16 error against the fp32 logits must be at most
    2x (plus a small floor) what transformers' own bf16 run makes on the same input."""
    ckpt = load_hf_folder(tiny["folder"])
    ours = family(ckpt.config.architecture).build_model(ckpt.config, ckpt.tensors, torch.bfloat16, "cpu")
    h = Harness(ours)
    seq = h.new_seq(tiny["ids"])
    parts = [h.step([(seq, SEQ_LEN - 16)])[0]] + [h.step([(seq, 1)])[0] for _ in range(16)]
    ours_err = rel_err(torch.cat(parts).float(), tiny["ref_logits"])
    ref16 = tiny["ref"].to(torch.bfloat16)
    try:
        with torch.no_grad():
            theirs = ref16(torch.tensor([tiny["ids"]])).logits[0].float()
    finally:
        tiny["ref"].to(torch.float32)
    theirs_err = rel_err(theirs, tiny["ref_logits"])
    assert ours_err <= 2 * theirs_err + 1e-3, (ours_err, theirs_err)
