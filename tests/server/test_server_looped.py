"""A looped model through the server: the [looped] table reaches the engine, the per-request
"ridgefill" loop fields change what runs, self-speculative decoding keeps greedy output and reports
its tokens per verification in usage, and bad values are a 400 naming the field (startup errors
one line naming the key)."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))

from looped_reference import write_tiny_huginn  # noqa: E402
from ridgefill_server.app import create_app  # noqa: E402
from ridgefill_server.background import BackgroundServer  # noqa: E402
from ridgefill_server.config import ConfigError, load_config  # noqa: E402

PROMPT = [5, 7, 9, 11, 3, 40, 22, 17]
GREEDY = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    torch.set_num_threads(2)
    root = tmp_path_factory.mktemp("looped")
    write_tiny_huginn(root / "model", tokenizer=True)
    table = (
        f'[model]\npath = "{root / "model"}"\n[cache]\nnum_blocks = 64\n'
        '[looped]\ncache = "ripe"\nwindow = 8\nblock = 4\ndraft_loops = 2\n'
    )
    (root / "rf.toml").write_text(table)
    engine_cfg, server_cfg, fill = load_config(root / "rf.toml")
    with BackgroundServer(create_app(engine_cfg, server_cfg, fill)) as bg:
        bg.wait_ready()
        yield bg.url, bg.app.state.ridgefill.engine.engine


def _complete(url: str, ridgefill: dict | None = None, **body) -> httpx.Response:
    payload = {"prompt": PROMPT, **GREEDY, **body}
    if ridgefill is not None:
        payload["ridgefill"] = ridgefill
    return httpx.post(url + "/v1/completions", json=payload, timeout=120)


def test_looped_table_reaches_the_engine(server):
    _, engine = server
    store = engine.loop_store
    assert (store.kind, store.window, store.loops) == ("ripe", 8, 4)
    assert engine.config.looped.block == 4 and engine.config.looped.draft_loops == 2


def test_self_speculation_keeps_greedy_output_and_reports_tokens_per_verification(server):
    url, _ = server
    sequential = _complete(url, {"block": 0}).json()
    spec = _complete(url).json()
    assert spec["choices"][0]["text"] == sequential["choices"][0]["text"]
    assert len(sequential["choices"][0]["text"].split()) == GREEDY["max_tokens"]
    assert "speculation" not in sequential["usage"]
    use = spec["usage"]["speculation"]
    assert use["verifications"] > 0 and 1 <= use["tokens_per_verification"] <= 5


def test_request_loops_change_the_output(server):
    url, _ = server
    four = _complete(url, {"block": 0}).json()["choices"][0]["text"]
    one = _complete(url, {"block": 0, "loops": 1}).json()["choices"][0]["text"]
    assert four != one


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"loops": 0}, "ridgefill.loops"),
        ({"loops": -2}, "ridgefill.loops"),
        ({"draft_loops": 4}, "ridgefill.draft_loops"),
        ({"draft_loops": 6, "loops": 3}, "ridgefill.draft_loops"),
        ({"block": 4, "window": 2}, "ridgefill.window"),
        ({"block": 1000000}, "ridgefill.block"),  # past looped.block: was blamed on the window
        ({"cache": "sliding"}, "ridgefill.cache"),
        ({"cache": "full"}, "ridgefill.cache"),
    ],
)
def test_bad_loop_fields_are_a_400_naming_the_field(server, fields, name):
    url, _ = server
    r = _complete(url, fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and name in error["message"]
    assert _complete(url, {"block": 0}).status_code == 200  # the server keeps serving


@pytest.mark.parametrize(
    "text,words",
    [
        ('[looped]\ncache = "half"\n', "looped.cache must be one of full, deepest, ripe, got 'half'"),
        ("[looped]\nwindow = 2\nblock = 4\n", "looped.window 2 < block 4"),
        ("[looped]\nloops = 0\n", "looped.loops must be >= 1, got 0"),
        ('[looped]\nblock = "4"\n', "key 'looped.block' must be int, got str '4'"),
    ],
)
def test_bad_looped_table_is_one_line_naming_the_key(tmp_path, text, words):
    f = tmp_path / "rf.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
