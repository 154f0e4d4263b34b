"""Hostile and odd request bodies: each gets one 400 (or 413) naming the field, never a 500, and
the engine never sees a value that makes sampling produce NaN or overflows a seed. Long prompts
are tokenized off the event loop, so /health answers meanwhile. Against the embedded SmolLM2
over real HTTP; bodies that `json=` cannot write (lone surrogates, Infinity, chunked) go as bytes.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.sampling import sample_token
from ridgefill_runtime.sequence import SamplingParams
from ridgefill_server import requests as rq
from served_app import app_server, embedded_engine
from ridgefill_server.config import ServerConfig
from ridgefill_server.protocol import ChatCompletionRequest

JSON = {"content-type": "application/json"}
USER = '"messages": [{"role": "user", "content": "hi"}]'
MAX_STOP_STRINGS = ServerConfig().max_stop_strings  # the default server.max_stop_strings


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return embedded_engine(tmp_path_factory, num_blocks=128, threads=1)


@pytest.fixture(scope="module")
def client(engine):
    with app_server(lambda: engine) as srv:  # the default 4 MiB body limit
        srv.wait_ready()
        with httpx.Client(base_url=srv.url, timeout=120) as c:
            yield c


def _post_raw(c: httpx.Client, path: str, raw: str | bytes, **kw) -> httpx.Response:
    return c.post(path, content=raw.encode() if isinstance(raw, str) else raw, headers=JSON, **kw)


def _assert_error(r: httpx.Response, status: int, *words: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["type"] == "invalid_request_error"
    assert all(w in err["message"] for w in words), err["message"]
    assert err["param"] == param, err
    return err


# -- lone surrogates (a "\ud800" JSON escape is valid JSON, but no character) ------------------


@pytest.mark.parametrize(
    "path, raw, param",
    [
        ("/v1/completions", r'{"prompt": "a\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", r'{"prompt": ["\udfff"], "max_tokens": 1}', "prompt[0]"),
        ("/v1/completions", r'{"prompt": "hi", "max_tokens": 1, "stop": ["\ud800"]}', "stop"),
        ("/v1/chat/completions", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
        (
            "/v1/chat/completions",
            r'{"messages": [{"role": "user", "content": "ok"}, '
            r'{"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]}',
            "messages[1].content",
        ),
        ("/tokenize", r'{"prompt": "\ud800"}', "prompt"),
        ("/tokenize", r'{"messages": [{"role": "user", "content": "\ud800"}]}', "messages[0].content"),
    ],
)
def test_lone_surrogate_is_400(client, path, raw, param):
    _assert_error(_post_raw(client, path, raw), 400, "surrogate", param=param)


def test_surrogate_echoed_in_an_error_is_escaped(client):
    r = _post_raw(client, "/v1/completions", r'{"prompt": "hi", "model": "\ud800"}')
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = _post_raw(client, "/v1/completions", r'{"prompt": "hi", "ridgefill": {"\ud800": 1}}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "ridgefill"


# -- floats: tiny temperatures are greedy, Infinity and NaN are refused --------------------------


@pytest.mark.parametrize("temperature", ["1e-39", "5e-324", "1.11e-308", "1e-6"])
def test_tiny_temperature_samples_greedily(client, temperature):
    greedy = client.post(
        "/v1/completions",
        json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True},
    )
    r = _post_raw(
        client,
        "/v1/completions",
        f'{{"prompt": "The capital of France is", "max_tokens": 6, "ignore_eos": true, "temperature": {temperature}}}',
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


@pytest.mark.parametrize("field", ["temperature", "top_p"])
@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e400"])
@pytest.mark.parametrize("path, base", [("/v1/completions", '"prompt": "hi"'), ("/v1/chat/completions", USER)])
def test_non_finite_float_is_400(client, field, value, path, base):
    r = _post_raw(client, path, f'{{{base}, "max_tokens": 1, "{field}": {value}}}')
    _assert_error(r, 400, field, "finite", param=field)


def test_engine_refuses_non_finite_and_greedy_below_epsilon():
    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(InputError, match="temperature"):
            SamplingParams(temperature=bad)
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy
    logits = torch.tensor([1.0, 30.0, 2.0])
    assert sample_token(logits, SamplingParams(temperature=1e-39), None) == 1
    # the smallest sampled temperature keeps the probabilities finite (multinomial refuses NaN)
    assert sample_token(logits, SamplingParams(temperature=1e-5), torch.Generator().manual_seed(0)) == 1


# -- seed: what torch.Generator.manual_seed accepts --------------------------------------------


@pytest.mark.parametrize(
    "seed, ok", [(2**64 - 1, True), (-(2**63), True), (0, True), (2**64, False), (-(2**63) - 1, False), (10**40, False)]
)
def test_seed_range(client, seed, ok):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 1, "seed": seed})
    if ok:
        assert r.status_code == 200, r.text
    else:
        _assert_error(r, 400, "seed", str(2**64 - 1), param="seed")


# -- chat messages -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, words, param",
    [
        ('{"messages": []}', ["messages is empty"], "messages"),
        ('{"messages": [{"role": "bogus", "content": "x"}]}', ["'user'", "'tool'", '"bogus"'], "messages[0].role"),
        ('{"messages": [{"content": "x"}]}', ["role is required"], "messages[0].role"),
        (
            '{"messages": [{"role": "user", "content": 5}]}',
            ["string or a list of content parts"],
            "messages[0].content",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            ["text", "image_url"],
            "messages[0].content[0].type",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
            ["text is required"],
            "messages[0].content[0].text",
        ),
        (
            '{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
            ["must be a string", "got 5"],
            "messages[0].content[0].text",
        ),
        ("{" + USER + ', "max_completion_tokens": -1}', ["max_completion_tokens", ">= 0"], "max_completion_tokens"),
    ],
)
def test_bad_chat_message_is_400(client, raw, words, param):
    _assert_error(_post_raw(client, "/v1/chat/completions", raw), 400, *words, param=param)


@pytest.mark.parametrize("role", ["system", "user", "assistant", "developer", "tool"])
def test_every_openai_role_is_accepted(client, role):
    messages = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_too_many_messages_is_400(client):
    messages = [{"role": "user", "content": "x"}] * (rq.MAX_MESSAGES + 1)
    r = client.post("/v1/chat/completions", json={"messages": messages})
    _assert_error(r, 400, str(rq.MAX_MESSAGES + 1), f"at most {rq.MAX_MESSAGES}", param="messages")
    r = client.post("/tokenize", json={"messages": messages})
    _assert_error(r, 400, f"at most {rq.MAX_MESSAGES}", param="messages")


# -- stop strings: capped in number and length -------------------------------------------------


@pytest.mark.parametrize(
    "stop, words",
    [
        (["x"] * (MAX_STOP_STRINGS + 1), [str(MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS}"]),
        ([f"s{i}" for i in range(50_000)], ["50000", f"at most {MAX_STOP_STRINGS}", "server.max_stop_strings"]),
        ("y" * (rq.MAX_STOP_CHARS + 1), [f"at most {rq.MAX_STOP_CHARS} characters"]),
    ],
)
def test_stop_caps_are_400(client, stop, words):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stop": stop})
    _assert_error(r, 400, *words, param="stop")


def test_stop_at_the_caps_is_accepted(client):
    stop = [chr(ord("a") + i) * rq.MAX_STOP_CHARS for i in range(MAX_STOP_STRINGS)]
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "stop": stop})
    assert r.status_code == 200, r.text


# -- the body itself ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize(
    "raw, words",
    [
        (b"", ["request body is empty", "JSON object"]),
        (b"[1, 2]", ["request body must be a JSON object", "[1, 2]"]),
        (b"{not json", ["not valid JSON", "character 1"]),
    ],
)
def test_bad_body_is_400(client, path, raw, words):
    _assert_error(_post_raw(client, path, raw), 400, *words, param=None)


def test_body_not_sent_as_json_is_400(client):
    r = client.post("/v1/completions", content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    _assert_error(r, 400, "Content-Type: application/json", param=None)


def test_chunked_body_over_the_limit_is_413(client):
    def five_megabytes():
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"x" * 65536
        yield b'"}'

    r = client.post("/v1/completions", content=five_megabytes(), headers=JSON)
    assert "content-length" not in r.request.headers  # really chunked
    _assert_error(r, 413, "exceeds the limit of 4194304 bytes", param=None)


@pytest.mark.parametrize(
    "ridgefill, words, param",
    [
        (5, ["ridgefill must be a JSON object", "got 5"], "ridgefill"),
        ({"selectors": "abc"}, ["ridgefill.selectors must be a list", '"abc"'], "ridgefill.selectors"),
        ({"selectors": [1]}, ["must be a string"], "ridgefill.selectors[0]"),
        ({"mode": 3}, ["ridgefill.mode must be a string", "got 3"], "ridgefill.mode"),
        ({"speed": "max"}, ["ridgefill.speed is not a known field"], "ridgefill.speed"),
    ],
)
def test_wrong_typed_ridgefill_field_is_400(client, ridgefill, words, param):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "ridgefill": ridgefill})
    _assert_error(r, 400, *words, param=param)


@pytest.mark.parametrize(
    "body, words, param",
    [
        ({"prompt": []}, ["prompt is empty"], "prompt"),
        ({"prompt": [1.5]}, ["string or a list of token ids"], "prompt"),
        ({"prompt": "hi", "stop": 5}, ["string or a list of strings"], "stop"),
        ({"prompt": "hi", "temperature": "hot"}, ["temperature must be a number", '"hot"'], "temperature"),
        ({"prompt": "hi", "top_k": 10**30, "max_tokens": 1}, [], None),  # larger than the vocabulary: off
        ({"prompt": "hi", "top_k": -1, "max_tokens": 1}, [], None),  # off, as vLLM and llama.cpp read it
        ({"prompt": "hi", "max_tokens": 10**30}, ["exceeds the context length"], "prompt"),
        ({"prompt": [2**70]}, ["outside the vocabulary"], "prompt"),
        ({"prompt": [1] * 2049}, ["2049 token ids", "exceeds the context length of 2048"], "prompt"),
        ({"prompt": [[1] * 2049]}, ["2049 token ids", "exceeds the context length of 2048"], "prompt"),
    ],
)
def test_odd_completion_field_is_refused_or_served(client, body, words, param):
    r = client.post("/v1/completions", json=body)
    if not words:
        assert r.status_code == 200, r.text
    else:
        _assert_error(r, 400, *words, param=param)


# -- the default chat limit --------------------------------------------------------------------


def test_chat_without_a_limit_gets_the_configured_default(engine):
    chat = {"messages": [{"role": "user", "content": "Count to 100."}], "ignore_eos": True, "temperature": 0}
    with (
        app_server(lambda: engine, default_chat_max_tokens=3, max_stop_strings=1) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
    ):
        srv.wait_ready()
        r = c.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
        r = c.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        _assert_error(c.post("/v1/chat/completions", json={**chat, "stop": ["a", "b"]}), 400, "at most 1", param="stop")


def test_default_chat_limit_is_clipped_to_the_context():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    default = ServerConfig().default_chat_max_tokens
    params = rq.chat_sampling_params(req, default, MAX_STOP_STRINGS)
    assert params.max_tokens == default == 1024
    assert rq.fit_default_limit(req, params, 2000, 2048).max_tokens == 48
    assert rq.fit_default_limit(req, params, 10, 2048).max_tokens == 1024
    asked = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=2000)
    assert (
        rq.fit_default_limit(asked, rq.chat_sampling_params(asked, default, MAX_STOP_STRINGS), 2000, 2048).max_tokens
        == 2000
    )


# -- tokenizing off the event loop -------------------------------------------------------------


class _BlockingTokenizer:
    """The real tokenizer, except that encoding a text holding MARK waits for `release`."""

    MARK = "<<block>>"

    def __init__(self, real):
        self._real, self.entered, self.release = real, threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self._real, name)

    def encode(self, text, add_special_tokens=True):
        if self.MARK in text:
            self.entered.set()
            self.release.wait(30)
        return self._real.encode(text, add_special_tokens=add_special_tokens)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "hi " + _BlockingTokenizer.MARK, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": _BlockingTokenizer.MARK}], "max_tokens": 1}),
        ("/tokenize", {"prompt": _BlockingTokenizer.MARK}),
    ],
)
def test_health_answers_while_a_prompt_tokenizes(engine, path, body):
    tok = _BlockingTokenizer(engine.tokenizer)
    small = Engine(engine.model, tok, EngineConfig(cache=CacheConfig(num_blocks=16)))
    with (
        app_server(lambda: small) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as c,
        ThreadPoolExecutor(1) as pool,
    ):
        srv.wait_ready()
        pending = pool.submit(c.post, path, json=body)
        try:
            assert tok.entered.wait(30), "the tokenizer was never called"
            health = httpx.get(srv.url + "/health", timeout=5)  # raises if the loop is blocked
            assert health.status_code == 200
            assert not pending.done()
        finally:
            tok.release.set()
        assert pending.result().status_code == 200, pending.result().text


def test_a_long_real_prompt_does_not_stall_health(client):
    """The real tokenizer must let go of the GIL while it works: a worker thread alone is not
    enough. The polls run in this process too, so a stall shows as a long gap between them."""
    prompt = "hello world, " * 240_000  # 3 MB, about 720,000 tokens: seconds to tokenize
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(client.post, "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
        last, longest = time.monotonic(), 0.0
        while not pending.done():
            assert client.get("/health").status_code == 200
            now = time.monotonic()
            longest, last = max(longest, now - last), now
            time.sleep(0.05)
        _assert_error(pending.result(), 400, "exceeds the context length", param="prompt")
    assert longest < 1.0, f"/health went {longest:.2f} s unanswered while a prompt tokenized"


def test_server_still_serves_after_all_that(client):
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# -- strict types (issue 31, finding 4) ----------------------------------------------------------

HUGE = "9" * 5000  # past Python's own 4,300-digit limit: was "There was an error parsing the body"


@pytest.mark.parametrize(
    "path, raw, words, param",
    [
        (
            "/v1/completions",
            '{"prompt": "hi", "ridgefill": {"allow_short_window": "yes"}}',
            ["ridgefill.allow_short_window must be true or false", '"yes"'],
            "ridgefill.allow_short_window",
        ),
        ("/v1/completions", '{"prompt": "hi", "stream": "yes"}', ["stream must be true or false"], "stream"),
        ("/v1/completions", '{"prompt": "hi", "echo": 1}', ["echo must be true or false"], "echo"),
        ("/v1/completions", '{"prompt": [true, false]}', ["prompt must be a string or a list of token ids"], "prompt"),
        ("/v1/completions", '{"prompt": [[1, true]]}', ["prompt[0][1] must be an integer", "true"], "prompt[0][1]"),
        (
            "/v1/completions",
            '{"prompt": "hi", "max_tokens": "5"}',
            ["max_tokens must be an integer", '"5"'],
            "max_tokens",
        ),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": true}', ["max_tokens must be an integer"], "max_tokens"),
        ("/v1/completions", '{"prompt": "hi", "temperature": "0.5"}', ["temperature must be a number"], "temperature"),
        (
            "/v1/completions",
            '{"prompt": "hi", "max_tokens": ' + HUGE + "}",
            ["max_tokens: an integer of 5000 digits is past the limit of 100 digits"],
            "max_tokens",
        ),
        ("/v1/completions", '{"prompt": [1, -' + HUGE + "]}", ["an integer of 5000 digits"], "prompt[1]"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "seed": ' + HUGE + "}",
            ["seed: an integer of 5000 digits"],
            "seed",
        ),
        ("/detokenize", '{"tokens": [1, true]}', ["tokens[1] must be an integer", "true"], "tokens[1]"),
        (
            "/tokenize",
            '{"prompt": "hi", "add_special_tokens": "no"}',
            ["add_special_tokens must be true or false"],
            "add_special_tokens",
        ),
    ],
)
def test_lax_types_are_refused_naming_the_field(client, path, raw, words, param):
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    _assert_error(r, 400, *words, param=param)


def test_strict_types_still_take_json_numbers_and_a_batch_of_one(client):
    # A float field takes a JSON integer; an int field a JSON integer up to the limit; a token-id
    # batch of one ([[ids]]) stays served, as OpenAI's API and lm-eval's batched requests send it.
    for body in (
        {"prompt": "hi", "max_tokens": 1, "temperature": 0, "top_p": 1},
        {"prompt": [[1, 2, 3]], "max_tokens": 1},
        {"prompt": "hi", "max_tokens": 1, "seed": int("9" * 19)},
        {"prompt": "hi", "max_tokens": 1, "top_k": int("9" * 100)},  # at the limit: a number (off)
    ):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, (body, r.text)
