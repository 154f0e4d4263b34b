"""benchmarks/llama_server_side_by_side.py's pure parts: stream statistics over synthetic event
streams, exact-length prompts, the alternating arm order, SSE parsing. No servers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "llama_server_side_by_side.py"
_spec = importlib.util.spec_from_file_location("llama_server_side_by_side", _PATH)
sbs = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = sbs  # NOTE: dataclasses look their module up there
_spec.loader.exec_module(sbs)


def _record(arm, sent, times, completion=None, done=None):
    return sbs.StreamRecord(arm=arm, sent=sent, content_times=list(times), completion_tokens=completion, done=done)


def test_percentile_interpolates_like_numpy():
    assert sbs.percentile([], 50) is None
    assert sbs.percentile([5.0], 99) == 5.0
    assert sbs.percentile([1, 2, 3, 4], 50) == 2.5
    assert sbs.percentile([0, 10], 90) == pytest.approx(9.0)
    assert sbs.percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_ttft_and_itl_of_one_stream():
    r = _record("a", 10.0, [10.5, 10.6, 10.8, 11.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.tokens_out == 4  # no usage: content chunks
    r.completion_tokens = 7
    assert r.tokens_out == 7  # usage wins (a chunk may carry several tokens' text)


def test_summary_pools_streams_and_uses_the_batch_wall_time():
    a = _record("x", 0.0, [1.0, 1.1, 1.2], completion=3, done=1.25)
    b = _record("x", 0.0, [2.0, 2.3], completion=2, done=2.5)
    failed = sbs.StreamRecord(arm="x", sent=0.0, error="HTTP 500")
    s = sbs.summarize([a, b, failed], wall=2.5)
    assert s["requests"] == 3 and s["errors"] == 1
    assert s["tokens_out"] == 5
    assert s["out_tok_s"] == pytest.approx(2.0)
    assert s["ttft_p50_s"] == pytest.approx(1.5)
    # gaps 0.1, 0.1, 0.3 -> p50 0.1 s
    assert s["itl_samples"] == 3
    assert s["itl_p50_ms"] == pytest.approx(100.0)
    assert s["itl_p99_ms"] == pytest.approx(100 + 0.98 * 200, rel=1e-6)
    # without a wall time: first send to last finish
    assert sbs.summarize([a, b])["wall_s"] == pytest.approx(2.5)


def test_pooled_rounds_average_the_rounds_throughput():
    r1 = {"records": [_record("x", 0.0, [1.0], completion=10, done=1.0)], "summary": {"out_tok_s": 10.0}}
    r2 = {"records": [_record("x", 0.0, [3.0], completion=10, done=2.0)], "summary": {"out_tok_s": 5.0}}
    p = sbs.pooled([r1, r2])
    assert p["out_tok_s"] == pytest.approx(7.5)
    assert p["ttft_p50_s"] == pytest.approx(2.0)
    assert p["requests"] == 2


@pytest.mark.parametrize("length", [1, 2, 17, 300])
def test_prompt_has_exactly_the_length_asked(length):
    corpus = list(range(100, 150))  # shorter than some lengths: wraps around
    ids = sbs.build_prompt_ids(corpus, length, offset=45, bos=2)
    assert len(ids) == length
    assert ids[0] == 2
    if length > 1:
        assert ids[1:6] == [145, 146, 147, 148, 149][: length - 1]
    if length > 6:
        assert ids[6] == 100  # wrapped
    no_bos = sbs.build_prompt_ids(corpus, length, offset=0, bos=None)
    assert len(no_bos) == length and no_bos[0] == 100


def test_prompt_building_refuses_nonsense():
    with pytest.raises(ValueError):
        sbs.build_prompt_ids([1, 2], 0, 0, None)
    with pytest.raises(ValueError):
        sbs.build_prompt_ids([], 5, 0, None)


def test_different_offsets_share_nothing_past_bos():
    corpus = list(range(1000))
    a = sbs.build_prompt_ids(corpus, 64, 7919 % 1000, 1)
    b = sbs.build_prompt_ids(corpus, 64, 2 * 7919 % 1000, 1)
    assert a[0] == b[0] == 1 and a[1] != b[1]


def test_arm_order_alternates():
    arms = ["llama", "off", "on"]
    assert sbs.arm_order(arms, 0) == arms
    assert sbs.arm_order(arms, 1) == ["on", "off", "llama"]
    assert sbs.arm_order(arms, 2) == arms
    firsts = [sbs.arm_order(arms, r)[0] for r in range(4)]
    assert firsts.count("llama") == firsts.count("on") == 2


def test_sse_chunks_fold_into_a_record():
    rec = sbs.StreamRecord(arm="x", sent=0.0)
    lines = [
        ": keep-alive",
        "data: " + json.dumps({"choices": [{"text": "Hel"}]}),
        "data: " + json.dumps({"choices": [{"text": ""}]}),  # an empty piece is no content token
        "data: " + json.dumps({"choices": [{"text": "lo"}], "timings": {"cache_n": 12}}),
        "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3}}),
        "data: [DONE]",
    ]
    for i, line in enumerate(lines):
        msg = sbs.parse_sse_line(line)
        if msg == "done":
            break
        if isinstance(msg, dict):
            sbs.apply_chunk(rec, msg, float(i))
    assert rec.content_times == [1.0, 3.0]
    assert rec.prompt_tokens == 40 and rec.completion_tokens == 3 and rec.cached_tokens == 12
    assert sbs.parse_sse_line("data: [DONE]") == "done" and sbs.parse_sse_line("event: x") is None
    err = sbs.StreamRecord(arm="x", sent=0.0)
    sbs.apply_chunk(err, {"error": {"message": "too long"}}, 1.0)
    assert err.error and "too long" in err.error


def test_markdown_table_states_ratio_and_machine():
    s_llama = {"ttft_p50_s": 2.0}
    s_ours = {"ttft_p50_s": 1.0}
    result = {
        "model": "m",
        "threads": 2,
        "rounds": 2,
        "machine": {
            "cpu": "CPU X",
            "cores": 2,
            "avx2": True,
            "avx512f": False,
            "load_start": [0.1, 0.1, 0.1],
            "load_end": [0.2, 0.2, 0.2],
        },
        "versions": {"llama-server": "version: 1", "ridgefill": "0.1"},
        "phases": {
            "ttft": {
                "arms": [sbs.LLAMA, sbs.OURS_OFF],
                "rows": [{"tokens": 1024, "arms": {sbs.LLAMA: s_llama, sbs.OURS_OFF: s_ours}}],
            }
        },
    }
    md = sbs.markdown_tables(result)
    assert "CPU X" in md and "threads 2" in md
    assert "| 1024 | 2.000 | 1.000 | 2.00x |" in md
