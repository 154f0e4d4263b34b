"""Tool calling on the real server with Qwen2.5-Coder-0.5B-Instruct (its chat template writes
Hermes `<tool_call>` JSON): a scripted conversation through the official openai client, streamed
and not (a call, the tool's answer fed back through the template, the final message);
`required` and a named function always give calls that validate against their function's
schema (jsonschema), greedy and sampled; and a 400 naming the field for each bad tool request."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from ridgefill_runtime.llm import build_engine
from ridgefill_server.app import create_app
from ridgefill_server.background import BackgroundServer
from ridgefill_server.config import load_config
from ridgefill_server.errors import HTTPError
from ridgefill_server.tools import tool_format_of

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "maxLength": 40},
        "limit": {"type": "integer", "minimum": 1, "maximum": 10},
    },
    "required": ["query", "limit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "search_web", "description": "Search the web", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search_web": SEARCH}
ASKS = [
    "What is the weather in Paris today?",
    "Find me recent news about the Rust language.",
    "Is it raining in Tokyo? Use fahrenheit.",
    "Look up three recipes for pancakes.",
]


@pytest.fixture(scope="module")
def served(qwen2_gguf, tmp_path_factory):
    torch.set_num_threads(2)
    engine_cfg, server_cfg, fill = load_config(None, {"model.path": "qwen2.5-coder-0.5b", "cache.kv_cache_gib": 0.2})
    engine = build_engine(engine_cfg)
    with BackgroundServer(create_app(engine_cfg, server_cfg, fill, build=lambda: engine)) as srv:
        srv.wait_ready()
        srv.model = server_cfg.served_model_name
        yield srv


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)


def post(served, **body) -> httpx.Response:
    return httpx.post(served.url + "/v1/chat/completions", json={"model": served.model, **body}, timeout=300)


def assert_valid_calls(calls, names=SCHEMAS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed(client, model, **body):
    """The streamed answer gathered the way the openai client's users do: content joined, each
    call from its deltas (first: id, type and name; then arguments pieces)."""
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(model=model, stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_scripted_conversation_plain(served, client):
    messages = [{"role": "user", "content": ASKS[0]}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=served.model, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=60, temperature=0
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert len(choice.message.tool_calls) == 1  # a named function: one call
    assert_valid_calls(choice.message.tool_calls, {"get_weather"})
    call = choice.message.tool_calls[0]
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'},
    ]
    final = client.chat.completions.create(
        model=served.model, messages=messages, tools=TOOLS, max_tokens=40, temperature=0
    )
    answer = final.choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.finish_reason in ("stop", "length")
    # NOTE: the tool's answer reached the model through the template's tool-response block
    rendered = httpx.post(
        served.url + "/tokenize", json={"messages": messages, "tools": TOOLS, "add_special_tokens": False}, timeout=60
    ).json()["tokens"]
    text = httpx.post(served.url + "/detokenize", json={"tokens": rendered}, timeout=60).json()["prompt"]
    assert '<tool_response>\n{"temperature": 18, "sky": "clear"}\n</tool_response>' in text
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {call.function.arguments}}}\n</tool_call>' in text
    assert '"name": "search_web"' in text  # the tools are in the system prompt


def test_scripted_conversation_streamed_equals_plain(served, client):
    body = dict(
        messages=[{"role": "user", "content": ASKS[1]}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    body["parallel_tool_calls"] = False
    plain = client.chat.completions.create(model=served.model, **body).choices[0]
    content, calls, reason = streamed(client, served.model, **body)
    assert reason == plain.finish_reason == "tool_calls"
    assert content == "" and plain.message.content is None
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in plain.message.tool_calls
    ]
    assert all(c["id"].startswith("call_") for c in calls)
    # the conversation goes on from the streamed call
    messages = body["messages"] + [
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": calls[0]["id"],
                    "type": "function",
                    "function": {"name": calls[0]["name"], "arguments": calls[0]["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "1. Rust 2.0 released"},
    ]
    content, calls, reason = streamed(
        client, served.model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=30, temperature=0
    )
    assert content and not calls and reason in ("stop", "length")


@pytest.mark.parametrize("ask", ASKS)
def test_required_always_gives_valid_calls_greedy_and_sampled(served, client, ask):
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7, "n": 3}):
        r = client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": ask}],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=80,
            **sampling,
        )
        for choice in r.choices:
            assert choice.finish_reason == "tool_calls", choice
            assert len(choice.message.tool_calls) == 1
            assert_valid_calls(choice.message.tool_calls)


@pytest.mark.parametrize("name", ["get_weather", "search_web"])
def test_named_function_always_gives_a_valid_call_to_it(served, client, name):
    for ask in ASKS[:2]:
        r = client.chat.completions.create(
            model=served.model,
            messages=[{"role": "user", "content": ask}],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            max_tokens=80,
            temperature=0.8,
            seed=3,
        )
        calls = r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
        assert_valid_calls(calls, {name})


def test_parallel_required_calls_are_each_valid(served, client):
    r = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Weather in Paris and in Rome?"}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    choice = r.choices[0]
    complete = choice.message.tool_calls
    assert_valid_calls(complete)
    # NOTE: with parallel calls allowed the model may go on calling until max_tokens; a call cut off there is content
    assert choice.finish_reason == "tool_calls" or (
        choice.finish_reason == "length" and "<tool_call>" in choice.message.content
    )


def test_auto_without_a_call_is_plain_content(served, client):
    r = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        max_tokens=12,
        temperature=0,
    )
    choice = r.choices[0]
    plain = client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": "Say hello."}],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=12,
        temperature=0,
    )
    assert choice.message.tool_calls is None and choice.message.content
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "rm_rf"}}}, "tool_choice.function.name"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS + [TOOLS[0]]}, "tools[2].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
        (
            {
                "tool_choice": "required",
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"x": {"type": "no-such-type"}}},
                        },
                    }
                ],
            },
            "tools",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "x"},
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": "{not json"},
                            }
                        ],
                    },
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": "x",
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    }
                ]
            },
            "messages[0].tool_calls",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(served, body, param):
    full = {"messages": [{"role": "user", "content": ASKS[0]}], "tools": TOOLS, "max_tokens": 4, **body}
    r = post(served, **full)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = post(served, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.status_code == 200  # the server still serves


def test_metric_counts_tool_constraints(served, client):
    client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": ASKS[0]}],
        tools=TOOLS,
        tool_choice="required",
        max_tokens=60,
    )
    metrics = httpx.get(served.url + "/metrics", timeout=30).text
    line = next(
        line for line in metrics.splitlines() if line.startswith('ridgefill_structured_requests_total{kind="tools"}')
    )
    assert float(line.split()[-1]) >= 1


class _Templated:
    def __init__(self, chat_template):
        self.chat_template = chat_template


@pytest.mark.parametrize(
    ("template", "why"),
    [
        (None, "has no tool format"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "has no tool format"),
        ("{% if tools %}[TOOL_CALLS]{{ tools | tojson }}{% endif %}", "does not parse"),
    ],
)
def test_a_template_without_hermes_tools_is_refused(template, why):
    with pytest.raises(HTTPError) as e:
        tool_format_of(_Templated(template))
    assert e.value.status == 400 and e.value.param == "tools" and why in str(e.value)
