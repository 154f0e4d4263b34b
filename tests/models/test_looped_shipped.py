"""The embedded looped demonstration model (ridgefill_runtime/data/looped): it loads by name, its
tokenizer round-trips, it continues a text from its training domain, and self-speculative decoding
under RIPE gives the same greedy tokens as sequential decoding."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, LoopConfig, LoopOverrides
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.loader.load import load_checkpoint
from ridgefill_runtime.sequence import SamplingParams

TEXT = "The kernel keeps a list of the devices it has found, and each driver"


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(2)
    return build_engine(
        EngineConfig(
            model="looped",
            looped=LoopConfig(loops=16, cache="ripe", window=32, block=4, draft_loops=4),
            cache=CacheConfig(num_blocks=64),
        )
    )


def test_loads_by_name_with_its_tokenizer():
    ckpt = load_checkpoint("looped")
    assert ckpt.config.architecture == "huginn_raven" and ckpt.config.family_config.core == 4
    ids = ckpt.tokenizer.encode(TEXT)
    assert ckpt.tokenizer.decode(ids) == TEXT


def test_self_speculation_equals_sequential_on_the_trained_model(engine):
    prompt = engine.tokenizer.encode(TEXT)

    def params(block):
        return SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, looped=LoopOverrides(block=block))

    outs = {}
    for block in (0, 4):
        seq = engine.add_request(prompt, params(block))
        while engine.has_unfinished():
            engine.step()
        outs[block] = seq
    assert outs[4].output_ids == outs[0].output_ids
    assert outs[4].spec.verified_tokens / outs[4].spec.verifications > 1.5  # the trained model's drafts are accepted
    assert engine.tokenizer.decode(outs[0].output_ids).strip()
