"""The real server (uvicorn on a loopback port, embedded SmolLM2) against real clients.

One model and one server for the module; every request is greedy and short.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from served_app import serve_embedded

PROMPT = "The three most useful kitchen tools are"
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_embedded(tmp_path_factory)


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_streams_a_completion_equal_to_the_plain_one(client):
    whole = client.completions.create(model="ridgefill", prompt=PROMPT, **GREEDY)
    parts, finish = [], None
    for chunk in client.completions.create(model="ridgefill", prompt=PROMPT, stream=True, **GREEDY):
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert len(parts) > 3  # it really streamed, token by token
    assert "".join(parts) == whole.choices[0].text and whole.choices[0].text.strip()
    assert finish == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 5


def test_openai_client_streams_a_chat_completion_equal_to_the_plain_one(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(
        model="ridgefill", messages=messages, temperature=0, max_completion_tokens=10
    )
    stream = client.chat.completions.create(
        model="ridgefill",
        messages=messages,
        temperature=0,
        max_completion_tokens=10,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and "Paris" in text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def _raw_events(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    events = raw.split("\n\n")
    assert events[-1] == ""  # every event, the last included, ends with a blank line
    return events[:-1]


def test_sse_framing_is_exact(served):
    events = _raw_events(
        served.url, {"prompt": PROMPT, "stream": True, **GREEDY, "stream_options": {"include_usage": True}}
    )
    assert all(e.startswith("data: ") and "\n" not in e for e in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e[len("data: ") :]) for e in events[:-1]]
    text_chunks, usage_chunk = payloads[:-1], payloads[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 12
    assert "ridgefill" not in usage_chunk["usage"]  # the fill did not run
    reasons = [c["choices"][0]["finish_reason"] for c in text_chunks]
    assert reasons[:-1] == [None] * (len(reasons) - 1) and reasons[-1] == "length"
    assert len({c["id"] for c in payloads}) == 1 and payloads[0]["object"] == "text_completion"


def test_streamed_text_with_unicode_line_separators_reads_as_whole_events(served):
    # CI once failed on a generated token holding U+2028: httpx's iter_lines broke the event
    # there. An echoed prompt puts such characters in the stream on purpose.
    prompt = "one\u2028two\u2029three\x85four"
    body = {"prompt": prompt, "stream": True, "echo": True, "max_tokens": 2, "temperature": 0}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[len("data: ") :])["choices"][0]["text"] for line in lines[:-1]]
    assert texts[0] == prompt, texts


def test_stop_string_ends_the_request_without_the_stop_text(served):
    r = httpx.post(
        served.url + "/v1/completions",
        timeout=60,
        json={"prompt": "Count: 1, 2, 3, 4,", "temperature": 0, "max_tokens": 20, "stop": ["7"]},
    )
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and choice["finish_reason"] == "stop"
    assert "5" in choice["text"] and "7" not in choice["text"]


def test_token_id_prompt_and_tokenize_agree(served):
    ids = httpx.post(served.url + "/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    by_text = httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60).json()
    by_ids = httpx.post(served.url + "/v1/completions", json={"prompt": ids, **GREEDY}, timeout=60).json()
    assert by_ids["choices"][0]["text"] == by_text["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


def test_health_and_models(served):
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    models = httpx.get(served.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["ridgefill"] and models["data"][0][
        "max_model_len"
    ] == served.engine.max_model_len == 4096  # 256 blocks x 16


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics_move_as_requests_run(served):
    before = httpx.get(served.url + "/metrics").text
    httpx.post(served.url + "/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60)
    after = httpx.get(served.url + "/metrics").text
    assert (
        _metric(after, "ridgefill_generation_tokens_total") - _metric(before, "ridgefill_generation_tokens_total") == 12
    )
    assert (
        _metric(after, "ridgefill_time_to_first_token_seconds_count")
        == _metric(before, "ridgefill_time_to_first_token_seconds_count") + 1
    )
    assert (
        _metric(after, "ridgefill_inter_token_latency_seconds_count")
        >= _metric(before, "ridgefill_inter_token_latency_seconds_count") + 11
    )
    assert _metric(after, "ridgefill_prompt_tokens_total") > _metric(before, "ridgefill_prompt_tokens_total")
    for name in (
        "ridgefill_fill_filled_rows_total",
        "ridgefill_fill_exact_prefix_rows_total",
        "ridgefill_fill_tail_rows_total",
    ):
        assert _metric(after, name) == 0
    assert _metric(after, "ridgefill_kv_cache_usage_ratio") == 0  # nothing running now
    assert _metric(after, "ridgefill_kv_cache_touched_bytes") > 0  # the request's blocks were written
    for name in (
        "ridgefill_e2e_request_latency_seconds_count",
        "ridgefill_request_queue_time_seconds_count",
        "ridgefill_request_prefill_time_seconds_count",
        "ridgefill_request_decode_time_seconds_count",
    ):
        assert _metric(after, name) == _metric(before, name) + 1


async def _stream_text(client: httpx.AsyncClient, prompt: str, start: asyncio.Event) -> str:
    await start.wait()
    parts = []
    body = {"prompt": prompt, "stream": True, "temperature": 0, "max_tokens": 10, "ignore_eos": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(parts)


def test_sixteen_concurrent_greedy_streams_match_each_run_alone(served):
    prompts = [
        f"Story {i}: once upon a time, a {w}"
        for i, w in enumerate(["cat", "dog", "king", "ship", "tree", "robot", "child", "river"] * 2)
    ]

    async def main():
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            go = asyncio.Event()
            go.set()
            alone = [await _stream_text(client, p, go) for p in prompts]
            start = asyncio.Event()
            tasks = [asyncio.create_task(_stream_text(client, p, start)) for p in prompts]
            start.set()
            return alone, await asyncio.gather(*tasks)

    alone, together = asyncio.run(main())
    assert all(alone) and together == alone


def test_client_disconnect_mid_stream_frees_kv_blocks(served):
    blocks = served.engine.blocks
    free_before = blocks.num_free
    body = {"prompt": PROMPT * 20, "stream": True, "temperature": 0, "max_tokens": 2000, "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens arrived: it is decoding
        assert blocks.num_free < free_before  # the request holds blocks while it streams
        steps_at_close = _steps(served)
    # The response is closed: the server sees the disconnect and aborts within a few steps.
    deadline = time.monotonic() + 10
    while blocks.num_free != free_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert blocks.num_free == free_before and got
    assert _steps(served) - steps_at_close <= 5, "abort should land within a few engine steps"


def _steps(served) -> float:
    return _metric(httpx.get(served.url + "/metrics").text, "ridgefill_engine_step_seconds_count")


def test_a_repeated_prompt_reports_cached_tokens_and_the_prefix_cache_metrics(served):
    body = {"prompt": PROMPT + " Tell me more about it, in detail, please.", **GREEDY}
    before = httpx.get(served.url + "/metrics").text
    first = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
    again = httpx.post(served.url + "/v1/completions", json=body, timeout=60).json()
    after = httpx.get(served.url + "/metrics").text
    n = first["usage"]["prompt_tokens"]
    assert again["choices"][0]["text"] == first["choices"][0]["text"]
    # every full block before the prompt's last token: this very prompt's, or an earlier test's
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": (n - 1) // 16 * 16}
    hits = _metric(after, "ridgefill_prefix_cache_hits_total") - _metric(before, "ridgefill_prefix_cache_hits_total")
    queries = _metric(after, "ridgefill_prefix_cache_queries_total") - _metric(
        before, "ridgefill_prefix_cache_queries_total"
    )
    assert queries == 2 * n and hits == first["usage"]["prompt_tokens_details"]["cached_tokens"] + (n - 1) // 16 * 16
    assert _metric(after, "ridgefill_prefix_cache_blocks") >= (n - 1) // 16
