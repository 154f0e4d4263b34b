"""Gemma 3 270M (real GGUF, Q4_K_M) through our loader and runtime vs transformers on the same
file: target log-probs over 1,100 tokens (past the 512-key window of its 15 local layers, in
512-row chunks), greedy continuation, and a batch equal to each sequence alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.sequence import SamplingParams

TEXT = Path("/usr/share/common-licenses/Apache-2.0")
WINDOW = 512


@pytest.fixture(scope="module")
def models(gemma3_gguf):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name, dtype=torch.float32
    ).eval()
    ours = LLM(
        EngineConfig(
            model=str(gemma3_gguf),
            cache=CacheConfig(kv_cache_gib=0.2),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, chunk_size=512),
        )
    )
    return ref, ours


def _ref_logprobs(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [L, V]


def test_config_is_gemma3_with_its_window(models):
    _, ours = models
    cfg = ours.engine.model.config
    assert cfg.architecture == "gemma3_text" and cfg.family_config.window == WINDOW
    assert cfg.family_config.local_layers == tuple(i for i in range(18) if i not in (5, 11, 17))
    assert ours.engine.model.weights.layers[0].qkv.__class__.__name__ == "PackedWeight"


def test_target_logprobs_of_real_text_match(models):
    ref, ours = models
    ids = ours.tokenizer.encode(TEXT.read_text())[:1100]
    assert len(ids) == 1100 > 2 * WINDOW
    got = ours.score(ids)
    logp = _ref_logprobs(ref, ids)
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    diff = (torch.tensor(got["target_logprobs"]) - want).abs()
    assert diff.max() < 1e-3, float(diff.max())
    top2 = logp[:-1].topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # NOTE: near-ties may flip either way
    assert torch.equal(torch.tensor(got["argmax"])[clear], logp[:-1].argmax(-1)[clear])


def test_greedy_continuation_identical_past_the_window(models):
    ref, ours = models
    ids = ours.tokenizer.encode(TEXT.read_text())[:700]  # decode rows reach past the window
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=48, min_new_tokens=48, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    (got,) = ours.generate([ids], SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    assert got.token_ids == expected


def _run(engine, prompts, params):
    seqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [(list(s.output_ids), torch.tensor([e.logprob for e in s.logprobs.output])) for s in seqs]


def test_batched_decode_equals_each_alone(models):
    """Three sequences (one past the window) prefilled and decoded together equal each run alone."""
    _, ours = models
    text = TEXT.read_text()
    prompts = [ours.tokenizer.encode(text[i : i + n]) for i, n in ((0, 3000), (4000, 900), (9000, 200))]
    assert len(prompts[0]) > WINDOW
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=0)
    together = _run(ours.engine, prompts, params)
    for prompt, (ids, lp) in zip(prompts, together):
        ((alone_ids, alone_lp),) = _run(ours.engine, [prompt], params)
        assert ids == alone_ids
        assert (lp - alone_lp).abs().max() < 1e-4


def test_long_chunk_takes_the_banded_window_path_and_still_matches(models, gemma3_gguf, monkeypatch):
    """One 2,000-row chunk: the local layers' attention runs in bands (layers/window_attention.py)
    and the target log-probs still equal transformers'."""
    from ridgefill_runtime.layers import attention

    ref, short = models
    ids = short.tokenizer.encode(TEXT.read_text())[:2000]
    assert len(ids) == 2000
    banded = []
    real = attention.banded_window_attention
    monkeypatch.setattr(attention, "banded_window_attention", lambda *a, **kw: banded.append(1) or real(*a, **kw))
    ours = LLM(
        EngineConfig(
            model=str(gemma3_gguf),
            cache=CacheConfig(kv_cache_gib=0.2),
            scheduler=SchedulerConfig(max_num_batched_tokens=2048, chunk_size=2048),
        )
    )
    got = torch.tensor(ours.score(ids)["target_logprobs"])
    assert len(banded) == 15  # each local layer once
    want = _ref_logprobs(ref, ids)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert (got - want).abs().max() < 1e-3, float((got - want).abs().max())
