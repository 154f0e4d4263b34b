"""The operator config file: every key read, bad keys and types named with the file, flags
override the file; and `serve` as a real process (config logged, loopback, API key)."""

from __future__ import annotations

import re
import runpy
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from ridgefill_server.background import free_port
from ridgefill_server.config import ConfigError, load_config

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ridgefill.toml"


def _write(tmp_path, text: str) -> Path:
    f = tmp_path / "rf.toml"
    f.write_text(text)
    return f


def test_example_documents_every_key_and_loads():
    engine, server, fill = load_config(EXAMPLE)
    assert (engine.dtype, engine.scheduler.chunk_size, server.host, fill.mode) == ("float32", 512, "127.0.0.1", "off")
    from ridgefill_server.config import _SCHEMA

    text = EXAMPLE.read_text()
    for section, keys in _SCHEMA.items():
        assert f"[{section}]" in text
        for key in keys:
            table, _, leaf = key.rpartition(".")  # "corrections.key_rescale" sits in [fill.corrections]
            assert not table or f"[{section}.{table}]" in text, f"[{section}.{table}] is not documented"
            assert re.search(rf"^#? ?{leaf} = |: {leaf} = ", text, re.M), f"{section}.{key} is not documented"


def test_example_is_generated_from_the_dataclasses():
    script = runpy.run_path(str(EXAMPLE.parents[1] / "scripts" / "write_example_config.py"))
    assert EXAMPLE.read_text(encoding="utf-8") == script["render"](), (
        "examples/ridgefill.toml is not current: run python scripts/write_example_config.py"
    )


def test_every_flag_sets_a_key_of_the_file():
    from ridgefill_server.cli_serve import _FLAG_KEYS
    from ridgefill_server.config import _SCHEMA

    keys = {f"{section}.{key}" for section, table in _SCHEMA.items() for key in table}
    assert set(_FLAG_KEYS.values()) <= keys and len(set(_FLAG_KEYS.values())) == len(_FLAG_KEYS)


def test_values_reach_their_dataclasses(tmp_path):
    f = _write(
        tmp_path,
        '[model]\ndtype = "bfloat16"\n[cache]\nkv_cache_gib = 2\nnum_blocks = 64\n'
        '[scheduler]\nchunk_size = 128\n[server]\nport = 9001\napi_key = "k"\nthreads = 2\n',
    )
    engine, server, _ = load_config(f)
    assert engine.dtype == "bfloat16" and engine.cache.kv_cache_gib == 2.0 and engine.cache.num_blocks == 64
    assert engine.scheduler.chunk_size == 128 and (server.port, server.api_key, server.threads) == (9001, "k", 2)
    assert "k" not in str(server.redacted().values())


def test_a_recipe_alone_turns_the_fill_on(tmp_path):
    engine, _, fill = load_config(_write(tmp_path, '[fill]\nrecipe = "flash-next"\n'))
    assert (engine.fill.arm, engine.fill.tail, fill.mode, fill.recipe) == ("ridgefill", 2048, "plain", "flash-next")


def test_flags_override_the_file(tmp_path):
    f = _write(tmp_path, "[server]\nport = 9001\n[scheduler]\nmax_num_seqs = 4\n")
    engine, server, _ = load_config(f, {"server.port": 9002, "scheduler.max_num_seqs": None})
    assert server.port == 9002 and engine.scheduler.max_num_seqs == 4


def test_graph_and_prefill_budget_flags_reach_the_engine_config(tmp_path):
    from ridgefill_server.cli_serve import _FLAG_KEYS
    from ridgefill_server.main import build_parser

    def flags(*argv):
        args = build_parser().parse_args(["serve", *argv])
        return {key: getattr(args, dest, None) for dest, key in _FLAG_KEYS.items()}

    engine = load_config(None, flags())[0]
    assert engine.cuda_graphs and engine.scheduler.prefill_budget_with_decodes == 512
    engine = load_config(None, flags("--enforce-eager", "--prefill-budget-with-decodes", "0"))[0]
    assert not engine.cuda_graphs and engine.scheduler.prefill_budget_with_decodes == 0
    f = _write(tmp_path, "[model]\ncuda_graphs = false\n[scheduler]\nprefill_budget_with_decodes = 128\n")
    engine = load_config(f, flags())[0]
    assert not engine.cuda_graphs and engine.scheduler.prefill_budget_with_decodes == 128


@pytest.mark.parametrize(
    "text, words",
    [
        ("[scheduler]\nprefill_budget_with_decodes = -1\n", ["prefill_budget_with_decodes must be >= 0"]),
        ('[model]\ncuda_graphs = "yes"\n', ["'model.cuda_graphs' must be bool"]),
        ("[server]\nprot = 1\n", ["unknown key 'server.prot'"]),
        ("[nope]\nx = 1\n", ["unknown key 'nope.x'"]),
        ("top = 1\n", ["unknown key 'top'"]),
        ('[server]\nport = "80"\n', ["'server.port' must be int", "str"]),
        ("[server]\nport = true\n", ["'server.port' must be int", "bool"]),
        ('[cache]\nkv_cache_gib = "lots"\n', ["'cache.kv_cache_gib' must be int or float"]),
        ("[server]\nport = 0\n", ["server.port must be in 1..65535"]),
        ("[scheduler]\nchunk_size = -1\n", ["scheduler.chunk_size must be positive"]),
        ('[model]\ndtype = "int3"\n', ["dtype must be"]),
        ('[fill]\nmode = "fast"\n', ["fill.mode must be one of", "'fast'"]),
        ("[fill]\nsplitt = 12\n", ["unknown key 'fill.splitt'"]),
        ("[server\n", ["cannot read config"]),
    ],
)
def test_bad_config_names_key_and_file(tmp_path, text, words):
    f = _write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(f) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.toml: config file not found"):
        load_config(tmp_path / "nope.toml")


def test_bad_config_stops_serve_with_one_line(tmp_path):
    f = _write(tmp_path, "[server]\nprot = 1\n")
    p = subprocess.run(
        [sys.executable, "-m", "ridgefill_server", "serve", "--config", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == f"ridgefill: error: {f}: unknown key 'server.prot'"


def test_serve_process_logs_config_binds_loopback_and_enforces_key(tmp_path, tmp_path_factory):
    port = free_port()
    f = _write(tmp_path, f'[server]\nport = {port}\napi_key = "k1"\nthreads = 1\n[cache]\nnum_blocks = 64\n')
    env = {**__import__("os").environ, "RIDGEFILL_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "rf-cache")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ridgefill_server", "serve", "--config", str(f), "--log-level", "info"],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        log = []
        for line in proc.stderr:  # wait on the server's own log line, not a timer
            log.append(line)
            if "model ready" in line:
                break
        text = "".join(log)
        assert "effective config (torch threads: 1)" in text and "'api_key': '***'" in text and "k1" not in text
        assert f"127.0.0.1:{port}" in text
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}).status_code == 401
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": 2},
            headers={"Authorization": "Bearer k1"},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(30)
