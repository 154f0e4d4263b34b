"""The embedded SmolLM2-135M-Instruct through our GGUF loader vs transformers on the same GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, SchedulerConfig
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.loader.gguf import default_model_path
from ridgefill_runtime.sequence import SamplingParams

TEXT = Path("/usr/share/common-licenses/Apache-2.0")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    # NOTE: chunk 512 so the 1,100-token text also crosses chunk boundaries.
    ours = LLM(
        EngineConfig(
            cache=CacheConfig(kv_cache_gib=0.1), scheduler=SchedulerConfig(max_num_batched_tokens=512, chunk_size=512)
        )
    )
    return ref, ours


def test_target_logprobs_of_real_text_match(models):
    ref, ours = models
    ids = ours.tokenizer.encode(TEXT.read_text())[:1100]
    assert len(ids) == 1100
    got = ours.score(ids)
    with torch.no_grad():
        logp = ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [L, V]
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert len(got["target_logprobs"]) == len(ids) - 1
    assert (torch.tensor(got["target_logprobs"]) - want).abs().max() < 1e-3
    top2 = logp[:-1].topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-3  # NOTE: near-ties may flip either way
    assert torch.equal(torch.tensor(got["argmax"])[clear], logp[:-1].argmax(-1)[clear])


def test_greedy_continuation_identical(models):
    ref, ours = models
    ids = ours.encode("Write a short story about a lighthouse keeper.", chat=True)
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=64, min_new_tokens=64, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    (got,) = ours.generate([ids], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
    assert got.token_ids == expected
