"""Decode steps replayed from static buffers (decode_graphs.py) against the eager engine.

On the CPU the graphs are captured with `eager` (the forward runs over the static buffers at every
replay), which tests everything but CUDA's capture itself: the padding to a captured size, the
static block tables and row owners, padding rows kept to the scratch slot, and padding reset when
the batch shrinks. The `gpu` test captures real CUDA graphs and compares them with eager CUDA.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ridgefill_runtime import decode_graphs

from ridgefill_runtime.config import CacheConfig, EngineConfig, FamilyConfig, SchedulerConfig
from ridgefill_runtime.decode_graphs import DecodeGraphs, capture_sizes, engine_decode_graphs
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny

PROMPT_LENS = (9, 23, 40, 17, 31)
MAX_TOKENS = (3, 6, 9, 12, 15)  # the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1: sizes 8, 4, 4, 2, 1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_gqa_untied")
    build_tiny("llama_gqa_untied", path)
    return path


def _engine(folder, device="cpu", cuda_graphs=True, monkeypatch=None):
    if monkeypatch is not None:  # NOTE: a CPU engine keeps no scratch slot: ask for one as a CUDA engine would
        monkeypatch.setattr("ridgefill_runtime.engine.wants_decode_graphs", lambda config: True)
    config = EngineConfig(
        model=str(folder),
        device=device,
        cuda_graphs=cuda_graphs,
        cache=CacheConfig(block_size=4, num_blocks=96, prefix_caching="off"),
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    engine = build_engine(config)
    for slabs in (engine.kv.k, engine.kv.v):  # NOTE: zeroed, so untouched slots compare equal
        for t in slabs.values():
            t.zero_()
    return engine


def _generate(engine):
    g = torch.Generator().manual_seed(3)
    seqs = [
        engine.add_request(
            torch.randint(0, 320, (n,), generator=g).tolist(),
            SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=0),
        )
        for n, m in zip(PROMPT_LENS, MAX_TOKENS)
    ]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs], [[t.logprob for t in s.logprobs.output] for s in seqs]


def _counting(replayed: list[int]):
    def capture(forward):
        def replay():
            logits = forward()
            replayed.append(logits.shape[0])
            return logits

        return replay

    return capture


def test_replayed_decode_equals_the_eager_engine(folder, monkeypatch):
    eager_engine = _engine(folder)
    graphed = _engine(folder, monkeypatch=monkeypatch)
    replayed: list[int] = []
    max_blocks = -(-graphed.max_model_len // graphed.caches.block_size)
    graphed.runner.graphs = DecodeGraphs(graphed.model, graphed.caches, max_blocks, (1, 2, 4, 8), _counting(replayed))

    want_ids, want_lp = _generate(eager_engine)
    got_ids, got_lp = _generate(graphed)

    assert got_ids == want_ids
    err = max(abs(a - b) for got, want in zip(got_lp, want_lp) for a, b in zip(got, want))
    assert err < 1e-4, err  # float32: the padded GEMMs may sum in another order
    # every decode step replayed, padded up to the captured size: 5 rows in the 8-row graph, 3 in the 4-row one
    assert replayed[0] == 8 and {8, 4, 2, 1} <= set(replayed)
    assert len(replayed) == max(MAX_TOKENS) - 1  # the first token comes from the prefill step

    kv, ref = graphed.kv, eager_engine.kv
    n = kv.num_slots
    for layer in kv.layers:  # padding rows wrote the scratch slot and nothing else
        assert torch.allclose(kv.k[layer][:n], ref.k[layer][:n], atol=1e-5)
        assert torch.allclose(kv.v[layer][:n], ref.v[layer][:n], atol=1e-5)
        assert kv.k[layer][kv.scratch_slot].abs().sum() > 0
    assert ref.scratch_slot is None and ref.k[0].shape[0] == n  # no scratch slot where no graphs are wanted


def test_steps_the_graphs_do_not_cover_run_eagerly(folder, monkeypatch):
    """Wider tables than the graphs hold, or more sequences than the largest size: eager, same result."""
    eager_engine = _engine(folder)
    graphed = _engine(folder, monkeypatch=monkeypatch)
    replayed: list[int] = []
    graphed.runner.graphs = DecodeGraphs(graphed.model, graphed.caches, 10, (1, 2), _counting(replayed))
    want_ids, _ = _generate(eager_engine)
    got_ids, _ = _generate(graphed)
    assert got_ids == want_ids
    # replayed only once three have finished (2 left), until the 31-token prompt passes 40 tokens (10 blocks of 4)
    assert replayed and all(size <= 2 for size in replayed)
    assert len(replayed) < max(MAX_TOKENS) - 1


def test_capture_sizes():
    assert capture_sizes(1) == (1,)
    assert capture_sizes(16) == (1, 2, 4, 8, 16)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)


def test_a_forward_that_cannot_be_captured_decodes_eagerly(monkeypatch, caplog):
    """A capture error costs speed, not the server: no graphs, and a warning naming the error."""

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs, "DecodeGraphs", refuse)
    monkeypatch.setattr(decode_graphs, "cuda_capture", lambda: None)
    model = SimpleNamespace(device=torch.device("cuda"), config=SimpleNamespace(family_config=FamilyConfig()))
    caches = SimpleNamespace(
        spec=SimpleNamespace(recurrent_layers=()), kv=SimpleNamespace(scratch_slot=64), block_size=16
    )
    with caplog.at_level("WARNING", logger="ridgefill.engine"):
        assert engine_decode_graphs(model, caches, EngineConfig(device="cuda"), 1024) is None
    assert "decoding eagerly" in caplog.text and "not permitted when stream is capturing" in caplog.text


def test_cpu_engine_builds_no_graphs(folder):
    assert _engine(folder).runner.graphs is None


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_cuda(folder):
    graphed = _engine(folder, "cuda", cuda_graphs=True)
    eager_cuda = _engine(folder, "cuda", cuda_graphs=False)
    assert graphed.runner.graphs is not None and eager_cuda.runner.graphs is None
    got_ids, got_lp = _generate(graphed)
    want_ids, want_lp = _generate(eager_cuda)
    assert got_ids == want_ids
    err = max(abs(a - b) for got, want in zip(got_lp, want_lp) for a, b in zip(got, want))
    assert err < 1e-3, err
    n = graphed.kv.num_slots
    for layer in graphed.kv.layers:
        assert torch.allclose(graphed.kv.k[layer][:n], eager_cuda.kv.k[layer][:n], atol=1e-4)
