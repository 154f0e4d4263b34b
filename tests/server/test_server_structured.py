"""Structured outputs on the real server (embedded SmolLM2): response_format json_object and
json_schema on chat and completions, streamed and not, through the official openai client too;
vLLM's structured_outputs (regex, choice, Lark grammar); and a 400 naming the field for each
kind of bad constraint, after which the server still serves."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from served_app import serve_embedded

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_embedded(tmp_path_factory)


def post(served, path: str, **body) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=120)


def stream_text(served, path: str, **body) -> tuple[str, str | None]:
    text, reason = "", None
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice.get("delta", {}).get("content") if "delta" in choice else choice.get("text")
                text += delta or ""
                reason = choice.get("finish_reason") or reason
    return text, reason


def test_chat_json_schema_validates(served):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = post(served, "/v1/chat/completions", messages=ASK, max_tokens=80, temperature=0, response_format=fmt)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_streamed_completion_json_object_is_one_object(served):
    text, reason = stream_text(
        served,
        "/v1/completions",
        prompt="A JSON object describing a cat:",
        max_tokens=120,
        temperature=0.7,
        seed=3,
        response_format={"type": "json_object"},
    )
    assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_streamed_chat_equals_plain(served):
    body = {
        "messages": ASK,
        "max_tokens": 80,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    plain = post(served, "/v1/chat/completions", **body).json()["choices"][0]["message"]["content"]
    assert stream_text(served, "/v1/chat/completions", **body) == (plain, "stop")


def test_openai_client_with_a_schema_and_n(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model="ridgefill",
        messages=ASK,
        max_tokens=80,
        temperature=0.9,
        seed=5,
        n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    assert len(out.choices) == 3
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


@pytest.mark.parametrize(
    "constraint, check",
    [
        ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-" and t.replace("-", "").isdigit()),
        ({"choice": ["sunny", "rainy", "snowy"]}, lambda t: t in ("sunny", "rainy", "snowy")),
        ({"grammar": 'start: "[" WORD ("," WORD)* "]"\nWORD: /[a-z]{1,6}/\n'}, lambda t: t[0] == "[" and t[-1] == "]"),
        ({"json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ],
)
def test_structured_outputs_vllm_names(served, constraint, check):
    r = post(served, "/v1/completions", prompt="Answer:", max_tokens=40, temperature=0, structured_outputs=constraint)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice["text"]


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}},
            "structured_outputs.regex",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "start: nowhere\n"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": {"type": "object", "description": "x" * 70000}}}, "structured_outputs.json"),
    ],
)
def test_bad_constraints_are_400_naming_the_field(served, body, param):
    r = post(served, "/v1/completions", prompt="Answer:", max_tokens=8, **body)
    assert r.status_code in (400, 422), r.text
    err = r.json()["error"]
    assert param in (err.get("param") or "") + err["message"], err
    ok = post(served, "/v1/completions", prompt="Hello", max_tokens=4, temperature=0)
    assert ok.status_code == 200


def test_metrics_count_structured_requests_by_kind(served):
    def count(kind: str) -> float:
        text = httpx.get(served.url + "/metrics", timeout=30).text
        line = next(
            (x for x in text.splitlines() if x.startswith(f'ridgefill_structured_requests_total{{kind="{kind}"}}')),
            None,
        )
        return 0.0 if line is None else float(line.split()[-1])

    before = count("regex")
    assert (
        post(served, "/v1/completions", prompt="A:", max_tokens=4, structured_outputs={"regex": "[0-9]+"}).status_code
        == 200
    )
    assert count("regex") == before + 1
