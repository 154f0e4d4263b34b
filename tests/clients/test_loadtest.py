"""ridgefill-loadtest against the real server: both modes produce sane JSON and a PNG."""

from __future__ import annotations

import json

import pytest
import torch

from ridgefill_clients.loadtest import main, percentile
from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.llm import build_engine
from ridgefill_server.app import create_app
from ridgefill_server.background import BackgroundServer
from ridgefill_server.config import load_config


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
    torch.set_num_threads(2)
    engine = build_engine(EngineConfig(cache=CacheConfig(num_blocks=128)))
    engine_cfg, server_cfg, fill = load_config(None, {})
    with BackgroundServer(create_app(engine_cfg, server_cfg, fill, build=lambda: engine)) as srv:
        srv.wait_ready()
        yield srv.url
    mp.undo()


def test_percentile_interpolates():
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5 and percentile([0, 10], 90) == 9


def test_mixed_mode_reports_ttft_throughput_and_stalls(url, tmp_path, capsys):
    out, png = tmp_path / "mixed.json", tmp_path / "mixed.png"
    rc = main(
        [
            "mixed",
            "--url",
            url,
            "--concurrency",
            "1",
            "3",
            "--reps",
            "1",
            "--new-prompt-tokens",
            "300",
            "--other-prompt-tokens",
            "16",
            "--decode-tokens",
            "12",
            "--out",
            str(out),
            "--png",
            str(png),
        ]
    )
    assert rc == 0
    result = json.loads(out.read_text())
    c1, c3 = result["summary"]
    assert c1["users"] == 1 and "itl_p50_s" not in c1 and c1["new_ttft_s"] > 0
    assert c3["others_throughput_tok_s"] > 0 and 0 < c3["itl_p50_s"] <= c3["itl_p99_s"] <= c3["itl_max_s"]
    cell = next(c for c in result["cells"] if c["users"] == 3)
    assert cell["others_tokens"] == 2 * 12 and cell["errors"] == []
    assert png.read_bytes()[:4] == b"\x89PNG" and "| 3 |" in capsys.readouterr().out
    assert cell["new_filled_rows"] == 0 and cell["new_fill"] is None  # this server runs fill off
    assert main(["compare", str(out), str(out)]) == 0  # mixed results compare side by side, one row per C
    table = capsys.readouterr().out
    assert "new TTFT (s) mixed | new TTFT (s) mixed |" in table and table.count("\n| 3 | ") == 1


def test_plain_mode_reports_percentiles_and_compare_renders(url, tmp_path, capsys):
    out = tmp_path / "plain.json"
    rc = main(
        [
            "plain",
            "--url",
            url,
            "--num-prompts",
            "4",
            "--prompt-tokens",
            "32",
            "--output-tokens",
            "6",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 4 and s["failed"] == 0 and s["output_throughput_tok_s"] > 0
    assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and 0 < s["itl_p50_s"] <= s["itl_p99_s"] and s["tpot_mean_s"] > 0
    capsys.readouterr()
    assert main(["compare", str(out), str(out), "--png", str(tmp_path / "cmp.png")]) == 0
    assert capsys.readouterr().out.count("| TTFT |") == 2 and (tmp_path / "cmp.png").exists()


def test_chat_mode_shares_the_system_prompt_and_reports_cached_tokens(url, tmp_path, capsys):
    out = tmp_path / "chat.json"
    rc = main(
        [
            "chat",
            "--url",
            url,
            "--num-prompts",
            "3",
            "--system-tokens",
            "200",
            "--user-tokens",
            "8",
            "--output-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    s = json.loads(out.read_text())["summary"]
    assert s["completed"] == 3 and s["failed"] == 0 and 0 < s["ttft_p50_s"] <= s["ttft_p99_s"]
    # the embedded model's engine caches prefixes: the later two find the system prompt's blocks
    assert s["cached_tokens_total"] >= 2 * 160
    assert "prompt tokens cached" in capsys.readouterr().out
