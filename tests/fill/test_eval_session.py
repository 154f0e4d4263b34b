"""The evaluation's shared lower sweep (eval/sessions.py): every selection run from the snapshot
equals a fresh two-sweep prefill with that selection, in any order; greedy answers equal the
engine's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.eval.sessions import PromptSession, exact_answer
from ridgefill_runtime.fill.select import RowSelector
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.dense import DenseLM
from ridgefill_runtime.offline import PromptLogits
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny

SPLIT, TAIL, N = 1, 40, 150


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_tiny("llama_gqa_untied", folder)
    ckpt = load_hf_folder(folder)
    torch.manual_seed(4)
    return DenseLM(ckpt.config, ckpt.tensors), torch.randint(0, ckpt.config.vocab_size, (N,)).tolist()


class Fixed(RowSelector):
    """Rows by name of the selection: lets the test choose scattered rows without a tokenizer."""

    def __init__(self):
        super().__init__(None)

    def __call__(self, seq):
        return {(): [], ("special",): [0], ("special", "digits"): [0, 9, 33, 34, 80]}[seq.fill.rows.selectors]


def test_session_runs_equal_fresh_prefills_in_any_order(tiny):
    model, ids = tiny
    fill = FillConfig(arm="identity", split=SPLIT, tail=TAIL, rows=RowsConfig(selectors=("special",)))
    session = PromptSession(model, fill, None, Fixed(), ids, chunk=64)
    for sel in [("special", "digits"), (), ("special", "digits"), ("special",)]:
        rows = fill.rows.replace(selectors=sel)
        got = session.run(rows, score=True).tail_logits
        want = PromptLogits(model, dataclasses.replace(fill, rows=rows), chunk=64, selector=Fixed())(ids)[1]
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), sel


def test_session_and_exact_answers_equal_the_engine(tiny):
    model, ids = tiny
    rows = RowsConfig(selectors=("special", "digits"))
    fill = FillConfig(arm="identity", split=SPLIT, tail=TAIL, rows=rows)
    eng = Engine(
        model, None, EngineConfig(cache=CacheConfig(num_blocks=32), fill=fill, scheduler=SchedulerConfig(chunk_size=64))
    )
    eng.scheduler.select = Fixed()
    seq = eng.add_request(ids, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    session = PromptSession(model, fill, None, Fixed(), ids, max_new=7, chunk=64)
    session.run(rows.replace(selectors=()), max_new=7)  # another selection first: the snapshot must hold
    assert session.run(rows, max_new=7).output_ids == seq.output_ids
    exact = Engine(model, None, EngineConfig(cache=CacheConfig(num_blocks=32)))
    ref = exact.add_request(ids, SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))
    while exact.has_unfinished():
        exact.step()
    assert exact_answer(model, ids, 7) == ref.output_ids
