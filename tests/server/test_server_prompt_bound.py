"""A prompt far longer than the context is refused before it is tokenized (issue 31, round three,
finding 3): its bytes against max_model_len x the tokenizer's longest piece. A prompt under that
bound is still tokenized and judged by its token count."""

from __future__ import annotations

import time

import httpx
import pytest

from served_app import app_server, embedded_engine

# Prose, so that tokenizing it is the ordinary slow path (about 4-5 bytes a token).
PROSE = "The quick brown fox jumps over the lazy dog, and then it runs back home again. "


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = embedded_engine(tmp_path_factory, num_blocks=64, threads=2)
    with app_server(lambda: engine, max_body_bytes=8 * 2**20) as srv:
        srv.wait_ready()
        srv.engine = engine
        yield srv


def _text_of(size: int) -> str:
    return (PROSE * (size // len(PROSE) + 1))[:size]


def test_a_3mb_prompt_is_refused_before_tokenizing_naming_the_limit(served):
    limit = served.engine.max_model_len
    longest = served.engine.tokenizer.longest_piece_bytes
    prompt = _text_of(3_000_000)
    started = time.monotonic()
    r = httpx.post(served.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    seconds = time.monotonic() - started
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert f"context length of {limit} tokens" in error["message"] and "3000000 bytes" in error["message"]
    assert f"{longest} bytes" in error["message"]
    # NOTE: tokenizing it whole takes ~18 s of CPU here; the refusal reads only its length
    assert seconds < 5, seconds

    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    r = httpx.post(served.url + "/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert f"context length of {limit} tokens" in r.json()["error"]["message"]


def test_a_prompt_under_the_byte_bound_is_tokenized_and_judged_by_its_tokens(served):
    limit = served.engine.max_model_len
    bound = limit * served.engine.tokenizer.longest_piece_bytes
    r = httpx.post(served.url + "/v1/completions", json={"prompt": _text_of(bound), "max_tokens": 1}, timeout=120)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "bytes" not in message and "tokens) + max_tokens (1)" in message, message  # counted, not bounded
    tokens = len(served.engine.tokenizer.encode(_text_of(bound)))
    assert f"prompt ({tokens} tokens)" in message

    fits = _text_of(200)
    r = httpx.post(served.url + "/v1/completions", json={"prompt": fits, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(served.engine.tokenizer.encode(fits))
