"""`ridgefill generate|score` on the embedded model, and one-line errors from a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ridgefill_runtime.cli import main


@pytest.fixture(autouse=True)
def _cache(monkeypatch, tmp_path_factory):
    # NOTE: one conversion cache for the whole module, not the user's home.
    monkeypatch.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))


def test_score_prints_aligned_json(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    assert main(["score", "--text-file", str(f), "--json", "--threads", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    n = len(out["token_ids"])
    assert n > 50 and len(out["target_logprobs"]) == n - 1 and len(out["argmax"]) == n - 1
    assert all(lp <= 0 for lp in out["target_logprobs"])
    # a repeated sentence is predictable: the last repeat's tokens are mostly the argmax
    tail = range(n - 10, n - 1)
    assert sum(out["argmax"][i] == out["token_ids"][i + 1] for i in tail) >= 8


def test_generate_streams_text(capsys):
    assert main(["generate", "--chat", "--prompt", "What is the capital of France?", "--max-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ridgefill_runtime.cli", *args],
                          capture_output=True, text=True, timeout=300)


def test_missing_model_is_one_line_error(tmp_path):
    p = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "nope: model path not found" in p.stderr


def test_corrupt_gguf_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    p = run_cli("generate", "--model", str(bad), "--prompt", "hi")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "bad.gguf" in p.stderr


def test_prompt_longer_than_context_is_one_line_error(tmp_path):
    f = tmp_path / "long.txt"
    f.write_text("word " * 9000)  # > 8,192 tokens of SmolLM2's context
    p = run_cli("score", "--text-file", str(f), "--json")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and "exceeds the context length of 8192" in p.stderr


def test_score_fill_arm_covers_the_tail_and_lines_up_with_exact(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("Ridge regression has a closed form. " * 30)
    cfg = tmp_path / "fill.toml"
    cfg.write_text("[fill]\nsplit = 15\ntail = 40\n")
    assert main(["score", "--text-file", str(f), "--json"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert main(["score", "--text-file", str(f), "--json", "--arm", "identity", "--fill-config", str(cfg)]) == 0
    arm = json.loads(capsys.readouterr().out)
    n = len(exact["token_ids"])
    assert exact["first_scored"] == 0 and arm["first_scored"] == n - 40
    assert len(arm["target_logprobs"]) == len(arm["argmax"]) == n - 1 - arm["first_scored"]
    # the same positions: the arm's entries sit at the end of exact's arrays, so they are
    # far closer to exact's last k entries than to those one position off
    k = len(arm["target_logprobs"])
    gap = lambda ref: sum(abs(a - b) for a, b in zip(arm["target_logprobs"], ref)) / k  # noqa: E731
    assert gap(exact["target_logprobs"][-k:]) < gap(exact["target_logprobs"][-k - 1:-1])
    assert arm["target_logprobs"] != exact["target_logprobs"][-k:]  # the fill changed something


def test_bad_fill_config_is_one_line_error(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello there " * 20)
    cfg = tmp_path / "fill.toml"
    cfg.write_text("[fill]\nsplitt = 15\n")
    p = run_cli("score", "--text-file", str(f), "--json", "--arm", "identity", "--fill-config", str(cfg))
    assert p.returncode == 1 and "Traceback" not in p.stderr and "fill.splitt" in p.stderr
