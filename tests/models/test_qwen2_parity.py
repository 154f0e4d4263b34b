"""Qwen2.5-Coder-0.5B-Instruct (real GGUF, qwen2: q/k/v biases, padded vocabulary) through our
loader and runtime vs transformers on the same file: target log-probs and argmax over 600 tokens
of real code, a greedy continuation, and the tokenizer and chat template read from the GGUF.
The 1,100-token run of both Qwen2.5-Coder models is benchmarks/packaged_parity.py."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from ridgefill_runtime.fill.corpus import stdlib_root
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.sequence import SamplingParams


@pytest.fixture(scope="module")
def models(qwen2_gguf):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    ref = AutoModelForCausalLM.from_pretrained(str(qwen2_gguf.parent), gguf_file=qwen2_gguf.name, dtype=torch.float32)
    ours = LLM(
        EngineConfig(
            model="qwen2.5-coder-0.5b",
            cache=CacheConfig(kv_cache_gib=0.2),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, chunk_size=256),
        )
    )
    return ref.eval(), ours


@pytest.fixture(scope="module")
def code_ids(models):
    _, ours = models
    return ours.tokenizer.encode((stdlib_root() / "asyncio" / "base_events.py").read_text())


def test_config_is_qwen2_with_biases_and_a_padded_vocabulary(models):
    ref, ours = models
    cfg = ours.engine.model.config
    assert cfg.architecture == "qwen2" and cfg.attention_bias and not cfg.qk_norm
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (24, 896, 14, 2)
    assert cfg.vocab_size == ref.config.vocab_size == 151936
    assert cfg.rope_theta == ref.config.rope_parameters["rope_theta"] == 1e6
    assert ours.engine.model.weights.layers[0].qkv_bias is not None


def test_tokenizer_and_chat_template_come_from_the_gguf(models, qwen2_gguf):
    from transformers import AutoTokenizer

    _, ours = models
    ref_tok = AutoTokenizer.from_pretrained(str(qwen2_gguf.parent), gguf_file=qwen2_gguf.name)
    code = (stdlib_root() / "asyncio" / "events.py").read_text()[:6000]
    assert ours.tokenizer.encode(code) == ref_tok.encode(code)
    messages = [{"role": "user", "content": "Write a haiku about tabs."}]
    want = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in want
    assert ours.tokenizer.apply_chat_template(messages) == want


def test_target_logprobs_and_argmax_of_real_code_match(models, code_ids):
    ref, ours = models
    ids = code_ids[:600]
    got = ours.score(ids)
    with torch.no_grad():
        logp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [L, V]
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    diff = (torch.tensor(got["target_logprobs"]) - want).abs()
    assert diff.max() < 1e-3, float(diff.max())
    top2 = logp[:-1].topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # NOTE: near-ties may flip either way
    assert torch.equal(torch.tensor(got["argmax"])[clear], logp[:-1].argmax(-1)[clear])


def test_greedy_continuation_identical(models, code_ids):
    ref, ours = models
    ids = code_ids[:300]
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    (got,) = ours.generate([ids], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    assert got.token_ids == out[0, len(ids) :].tolist()
