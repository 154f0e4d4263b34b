"""Per-request deadlines over HTTP: a request's `timeout` (capped by server.request_timeout_s)
ends it with finish_reason "timeout" and frees its blocks; the access log line carries the
request's token counts, streamed or not."""

from __future__ import annotations

import json
import logging
import time

import httpx
import pytest

from served_app import app_server, embedded_engine

LONG = {"prompt": "Count slowly:", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return embedded_engine(tmp_path_factory, num_blocks=512, threads=2)


@pytest.fixture(scope="module")
def served(engine):
    with app_server(lambda: engine, request_timeout_s=3.0) as srv:
        srv.wait_ready()
        srv.engine = engine
        yield srv


def _wait_free(engine, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while engine.blocks.num_free != engine.blocks.num_blocks and time.monotonic() < deadline:
        time.sleep(0.02)
    return engine.blocks.num_free == engine.blocks.num_blocks


def test_a_request_past_its_timeout_ends_with_finish_reason_timeout(served):
    t0 = time.monotonic()
    r = httpx.post(served.url + "/v1/completions", json={**LONG, "timeout": 0.5}, timeout=60)
    took = time.monotonic() - t0
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["choices"][0]["finish_reason"] == "timeout"
    assert 0 < reply["usage"]["completion_tokens"] < 4000
    assert took < 3.0  # its own timeout, well before the server's cap
    assert _wait_free(served.engine)


def test_a_scoring_request_stops_computing_its_prompt_at_its_deadline(served):
    """echo + logprobs on a long prompt: the deadline is checked between prefill chunks (512 rows),
    so the request ends with the rows computed by then scored, not after its whole prompt."""
    prompt = " ".join(f"w{i % 500}" for i in range(1500))  # ~5,600 tokens: 11 chunks
    body = {"prompt": prompt, "max_tokens": 1, "echo": True, "logprobs": 5, "timeout": 0.5}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    assert choice["finish_reason"] == "timeout"
    scored = sum(lp is not None for lp in choice["logprobs"]["token_logprobs"])
    assert usage["prompt_tokens"] > 5000 and 0 < scored < usage["prompt_tokens"] // 2
    assert _wait_free(served.engine)


def test_the_server_cap_bounds_a_request_without_timeout_and_a_stream(served):
    finish = None
    with httpx.stream("POST", served.url + "/v1/completions", json={**LONG, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
    assert finish == "timeout"
    assert _wait_free(served.engine)


@pytest.mark.parametrize("value", [0, -1])
def test_a_timeout_that_is_not_positive_is_400(served, value):
    r = httpx.post(served.url + "/v1/completions", json={"prompt": "hi", "timeout": value}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout"


@pytest.mark.parametrize("stream", [False, True])
def test_the_access_line_has_the_token_counts(served, caplog, stream):
    caplog.set_level(logging.INFO, logger="ridgefill.access")
    body = {
        "prompt": "The capital of France is",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    r = httpx.post(served.url + "/v1/completions", json=body, headers={"x-request-id": f"counts-{stream}"}, timeout=60)
    assert r.status_code == 200
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        lines = [rec for rec in caplog.records if getattr(rec, "access", {}).get("request_id") == f"counts-{stream}"]
        if lines:
            break
        time.sleep(0.02)
    assert len(lines) == 1
    fields = lines[0].access
    assert fields["prompt_tokens"] == 5 and fields["completion_tokens"] == 5 and fields["status"] == 200
