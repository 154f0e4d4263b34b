"""Speculative decoding through the server, on the embedded SmolLM2: the [speculative] table and
the serve flags reach the engine, bad values stop startup with one line naming the key; the
per-request option (`ridgefill.speculative` / `ridgefill.num_tokens`) gives greedy output
identical to a server that does not speculate, and a bad one is a 400 naming the field.

Two servers share one loaded model: one loaded by the app itself from a config file with
[speculative] method = "ngram" (as `serve` does), one with speculation off, the reference.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import torch

from ridgefill_runtime.config import SpeculativeConfig
from ridgefill_runtime.engine import Engine
from ridgefill_server.app import create_app
from ridgefill_server.background import BackgroundServer
from ridgefill_server.cli_serve import _FLAG_KEYS
from ridgefill_server.config import ConfigError, load_config
from ridgefill_server.main import build_parser

SPEC = SpeculativeConfig(method="ngram", num_tokens=3, max_ngram=2)
TABLE = '[cache]\nnum_blocks = 64\n[speculative]\nmethod = "ngram"\nnum_tokens = 3\nmax_ngram = 2\n'
# A prompt whose greedy continuation repeats it: n-gram drafts are proposed and accepted.
COPY = "The cat sat on the mat. The cat sat on the mat. The cat"
GREEDY = {"temperature": 0, "max_tokens": 12}
SPEC_COUNTERS = ("ridgefill_spec_verify_steps", "ridgefill_spec_draft_tokens", "ridgefill_spec_accepted_tokens")


@dataclass
class Servers:
    spec: str  # url of the server configured by TABLE
    off: str  # url of the server without speculation
    engine: Engine  # the spec server's engine, as the app loaded it
    config_file: Path


def _write(tmp_path, text: str) -> Path:
    f = tmp_path / "rf.toml"
    f.write_text(text)
    return f


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
    torch.set_num_threads(2)
    f = _write(tmp_path_factory.mktemp("cfg"), TABLE)
    spec_cfg, spec_server_cfg, spec_fill = load_config(f)
    # NOTE: no build callable: the app builds the engine from the file's config, as `serve` does
    with BackgroundServer(create_app(spec_cfg, spec_server_cfg, spec_fill)) as spec:
        spec.wait_ready()
        loaded = spec.app.state.ridgefill.engine.engine
        off_cfg, off_server_cfg, off_fill = load_config(None, {"cache.num_blocks": 64})
        # same weights, its own KV pool and no speculation
        plain = Engine(loaded.model, loaded.tokenizer, off_cfg)
        with BackgroundServer(create_app(off_cfg, off_server_cfg, off_fill, build=lambda: plain)) as off:
            off.wait_ready()
            yield Servers(spec.url, off.url, loaded, f)
    mp.undo()


def _spec_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.removesuffix("_total") in SPEC_COUNTERS:
            out[name.removesuffix("_total")] = float(value)
    assert set(out) == set(SPEC_COUNTERS), text
    return out


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": COPY, **GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _answer(out: dict) -> tuple[str, str, int]:
    choice = out["choices"][0]
    return choice["text"], choice["finish_reason"], out["usage"]["completion_tokens"]


@pytest.fixture(scope="module")
def reference(servers) -> tuple[str, str, int]:
    """The copy prompt's greedy answer from the server that never speculates."""
    before = _spec_counters(servers.off)
    answer = _answer(_complete(servers.off))
    assert _spec_counters(servers.off) == before == dict.fromkeys(SPEC_COUNTERS, 0.0)
    assert answer[0].strip() and answer[2] == GREEDY["max_tokens"]
    return answer


# -- the [speculative] table and the flags --------------------------------------------------


def test_speculative_table_reaches_the_engine(servers, reference):
    assert load_config(servers.config_file)[0].speculative == SPEC
    assert servers.engine.speculative == SPEC
    before = _spec_counters(servers.spec)
    assert _answer(_complete(servers.spec)) == reference
    after = _spec_counters(servers.spec)
    # the engine really speculated: drafts were verified and some accepted
    assert after["ridgefill_spec_verify_steps"] > before["ridgefill_spec_verify_steps"]
    accepted = after["ridgefill_spec_accepted_tokens"] - before["ridgefill_spec_accepted_tokens"]
    assert 0 < accepted <= after["ridgefill_spec_draft_tokens"] - before["ridgefill_spec_draft_tokens"]


@pytest.mark.parametrize(
    "text, words",
    [
        ('[speculative]\nmethod = "beam"\n', "speculative.method must be one of off, ngram, got 'beam'"),
        ('[speculative]\nmethod = "ngram"\nnum_tokens = 0\n', "speculative.num_tokens must be >= 1, got 0"),
        ('[speculative]\nnum_tokens = "4"\n', "key 'speculative.num_tokens' must be int, got str '4'"),
        ("[speculative]\nmax_ngram = 0\n", "speculative.max_ngram must be >= 1, got 0"),
        ("[speculative]\nmin_ngram = 4\n", "speculative.min_ngram (4) must be <= max_ngram (3)"),
        ("[speculative]\nnum_token = 4\n", "unknown key 'speculative.num_token'"),
    ],
)
def test_bad_speculative_config_is_one_line_naming_the_key(tmp_path, text, words):
    f = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    message = str(e.value)
    assert message.startswith(f"{f}: ") and words in message and "\n" not in message, message


def _flags(*argv: str) -> dict:
    args = build_parser().parse_args(["serve", *argv])
    return {key: getattr(args, dest, None) for dest, key in _FLAG_KEYS.items()}


def test_serve_flags_set_the_speculative_config_over_the_file(tmp_path):
    assert load_config(None, _flags("--speculative", "ngram", "--speculative-tokens", "2"))[
        0
    ].speculative == SpeculativeConfig(method="ngram", num_tokens=2)
    assert load_config(None, _flags())[0].speculative == SpeculativeConfig()  # off by default
    f = _write(tmp_path, TABLE)
    assert load_config(f, _flags())[0].speculative == SPEC  # flags not given leave the file's values
    assert load_config(f, _flags("--speculative-tokens", "1"))[0].speculative == SpeculativeConfig("ngram", 1, 2)
    assert load_config(f, _flags("--speculative", "off"))[0].speculative == SpeculativeConfig("off", 3, 2)


def test_bad_speculative_flag_or_file_stops_serve_with_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--speculative", "beam"])
    assert e.value.code == 2 and "argument --speculative: invalid choice: 'beam'" in capsys.readouterr().err
    serve = [sys.executable, "-m", "ridgefill_server", "serve"]
    p = subprocess.run(
        [*serve, "--speculative", "ngram", "--speculative-tokens", "0"], capture_output=True, text=True, timeout=60
    )
    assert (
        p.returncode == 1
        and p.stderr.strip() == "ridgefill: error: command line: speculative.num_tokens must be >= 1, got 0"
    ), p.stderr
    f = _write(tmp_path, '[speculative]\nmethod = "tree"\n')
    p = subprocess.run([*serve, "--config", str(f)], capture_output=True, text=True, timeout=60)
    assert (
        p.returncode == 1
        and p.stderr.strip() == f"ridgefill: error: {f}: speculative.method must be one of off, ngram, got 'tree'"
    ), p.stderr


# -- the per-request option -----------------------------------------------------------------


@pytest.mark.parametrize(
    "option, speculates",
    [
        (None, True),  # the server's setting
        ({"speculative": "ngram"}, True),
        ({"num_tokens": 2}, True),
        ({"speculative": "ngram", "num_tokens": 1}, True),
        ({"num_tokens": 0}, False),
        ({"speculative": "off"}, False),
    ],
)
def test_request_option_gives_the_output_of_a_server_that_does_not_speculate(servers, reference, option, speculates):
    before = _spec_counters(servers.spec)
    out = _complete(servers.spec, **({"ridgefill": option} if option is not None else {}))
    assert _answer(out) == reference
    after = _spec_counters(servers.spec)
    # NOTE: the counters tell whether this request took the speculative path at all
    assert (after["ridgefill_spec_verify_steps"] > before["ridgefill_spec_verify_steps"]) is speculates, after


def test_speculating_chat_equals_the_chat_of_a_server_that_does_not(servers):
    body = {
        "messages": [{"role": "user", "content": "Repeat exactly: red green blue, red green blue."}],
        "temperature": 0,
        "max_completion_tokens": 10,
    }
    answers = []
    before = _spec_counters(servers.spec)
    for url, extra in ((servers.off, {}), (servers.spec, {"ridgefill": {"num_tokens": 3}})):
        r = httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=120)
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1] and answers[0].strip()
    after = _spec_counters(servers.spec)
    assert after["ridgefill_spec_accepted_tokens"] > before["ridgefill_spec_accepted_tokens"]  # it speculated


@pytest.mark.parametrize(
    "which, option, param, words",
    [
        (
            "spec",
            {"speculative": "beam"},
            "ridgefill.speculative",
            'ridgefill.speculative must be "off" or "ngram", got \'beam\'',
        ),
        (
            "spec",
            {"num_tokens": 4},
            "ridgefill.num_tokens",
            "ridgefill.num_tokens must be in 0..3 (speculative.num_tokens), got 4",
        ),
        ("spec", {"num_tokens": -1}, "ridgefill.num_tokens", "got -1"),
        ("spec", {"num_tokens": "two"}, "ridgefill.num_tokens", 'ridgefill.num_tokens must be an integer, got "two"'),
        (
            "off",
            {"speculative": "ngram"},
            "ridgefill.speculative",
            "ridgefill.speculative: this server's speculative decoding is 'off' (speculative.method)",
        ),
        ("off", {"num_tokens": 2}, "ridgefill.speculative", "this server's speculative decoding is 'off'"),
    ],
)
def test_bad_request_option_is_400_naming_the_field_and_the_server_keeps_serving(
    servers, reference, which, option, param, words
):
    url = getattr(servers, which)
    r = httpx.post(url + "/v1/completions", json={"prompt": COPY, **GREEDY, "ridgefill": option}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], err
    assert "\n" not in err["message"]
    assert _answer(_complete(url)) == reference
    assert httpx.get(url + "/health").json() == {"status": "ok"}
