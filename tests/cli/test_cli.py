"""`ridgefill generate|score` on the embedded model, and one-line errors from a real process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ridgefill_runtime.cli import main
from ridgefill_runtime.config import SELECTORS, RowsConfig
from ridgefill_runtime.errors import ConfigError, InputError
from ridgefill_runtime.fill.settings import SHIPPED_ROWS, fill_for_arm, shipped_unigram


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
    return subprocess.run(
        [sys.executable, "-m", "ridgefill_runtime.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_missing_model_is_one_line_error(tmp_path):
    p = run_cli("generate", "--model", str(tmp_path / "nope"), "--prompt", "hi")
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip().count("\n") == 0 and f"key 'model.path': {tmp_path / 'nope'} not found" in p.stderr


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
    assert gap(exact["target_logprobs"][-k:]) < gap(exact["target_logprobs"][-k - 1 : -1])
    assert arm["target_logprobs"] != exact["target_logprobs"][-k:]  # the fill changed something


def test_bad_fill_config_is_one_line_error(tmp_path):
    f = tmp_path / "t.txt"
    f.write_text("hello there " * 20)
    cfg = tmp_path / "fill.toml"
    cfg.write_text("[fill]\nsplitt = 15\n")
    p = run_cli("score", "--text-file", str(f), "--json", "--arm", "identity", "--fill-config", str(cfg))
    assert p.returncode == 1 and "Traceback" not in p.stderr and "fill.splitt" in p.stderr


# -- exact prefix rows: [fill.rows] in --fill-config, --selectors ------------------------------


def test_fill_rows_table_and_selectors_reach_the_fill_config(tmp_path):
    # No table: the shipped selection, with the shipped counts on the embedded model.
    assert fill_for_arm("identity", None).rows == RowsConfig(**{**SHIPPED_ROWS, "unigram": str(shipped_unigram())})
    assert fill_for_arm("exact", None).rows.unigram is None  # nothing runs the selectors
    cfg = tmp_path / "fill.toml"
    cfg.write_text(
        '[fill]\ntail = 40\n[fill.rows]\nselectors = ["special", "attention"]\n'
        "attention_share = 0.3\nattention_layers = [2, 4]\nwindow = 16\nprobe_window = 32\n"
        "budget_factor = 0.5\nbase_attention_share = 0.1\nprotected_share = 0.4\nlexical_cap = 0.2\n"
        'lexical_sentence_rows = 8\nunigram = "/counts.json"\ncontrol = "tail"\nseed = 3\n'
    )
    fill = fill_for_arm("ridgefill", cfg)
    assert fill.tail == 40 and fill.rows == RowsConfig(
        selectors=("special", "attention"),
        attention_share=0.3,
        attention_layers=(2, 4),
        window=16,
        probe_window=32,
        budget_factor=0.5,
        base_attention_share=0.1,
        protected_share=0.4,
        lexical_cap=0.2,
        lexical_sentence_rows=8,
        unigram="/counts.json",
        control="tail",
        seed=3,
    )
    # --selectors replaces only the selectors.
    assert fill_for_arm("ridgefill", cfg, selectors=["digits"]).rows == fill.rows.replace(selectors=("digits",))
    # Another model has no shipped counts: the selectors that read them need its own.
    with pytest.raises(ConfigError, match="key 'fill.rows.unigram' is required when fill.rows.selectors include probe"):
        fill_for_arm("identity", None, model="/models/other", selectors=["special", "probe"])
    rows = fill_for_arm("identity", None, model="/models/other", selectors=["special", "lexical"]).rows
    assert rows.selectors == ("special", "lexical") and rows.unigram is None


def test_selectors_flag_reaches_score_and_generate(tmp_path, monkeypatch):
    seen = []

    class FakeLLM:  # records the config instead of loading the model
        def __init__(self, config):
            seen.append(config)
            raise InputError("stop here")

    monkeypatch.setattr("ridgefill_runtime.llm.LLM", FakeLLM)
    f = tmp_path / "t.txt"
    f.write_text("hello")
    assert main(["score", "--text-file", str(f), "--arm", "identity", "--selectors", "special, digits"]) == 1
    assert main(["generate", "--prompt", "hi", "--arm", "nofill", "--selectors", "lexical"]) == 1
    assert main(["generate", "--prompt", "hi"]) == 1
    assert [c.fill.arm for c in seen] == ["identity", "nofill", "exact"]
    assert seen[0].fill.rows.selectors == ("special", "digits") and seen[1].fill.rows.selectors == ("lexical",)
    assert seen[2].fill.rows == RowsConfig()  # fill off: no selection, as `serve` with fill.mode = "off"


@pytest.mark.parametrize(
    "args, toml, words",
    [
        (
            ["--selectors", "special,rare"],
            None,
            f"--selectors: unknown selector 'rare' (known: {', '.join(SELECTORS)})",
        ),
        # --fill-config is read with the server's [fill] schema, so the words are `serve --config`'s.
        ([], "[fill.rows]\nwindoww = 3\n", "unknown key 'fill.rows.windoww'"),
        ([], '[fill.rows]\nselectors = ["rare"]\n', "key 'fill.rows.selectors': unknown selector 'rare'"),
        ([], '[fill.rows]\nselectors = "special"\n', "key 'fill.rows.selectors' must be a list of str, got str"),
        ([], "[fill]\nrows = 3\n", "key 'fill.rows' must be a table ([fill.rows]), got int"),
        ([], "[fill]\nvalue_rescale = true\n", "unknown key 'fill.value_rescale' (use fill.corrections.value_rescale)"),
    ],
)
def test_bad_selectors_or_rows_key_is_one_line_error(tmp_path, capsys, args, toml, words):
    f = tmp_path / "t.txt"
    f.write_text("hello there " * 20)
    if toml is not None:
        cfg = tmp_path / "fill.toml"
        cfg.write_text(toml)
        args = [*args, "--fill-config", str(cfg)]
    for command in (["score", "--text-file", str(f)], ["generate", "--prompt", "hi"]):
        assert main([*command, "--arm", "identity", *args]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ridgefill: error: ") and err.count("\n") == 1 and words in err, err


def test_generate_with_a_fill_arm_and_selectors(tmp_path, capsys):
    cfg = tmp_path / "fill.toml"
    cfg.write_text("[fill]\ntail = 16\n")
    prompt = "The lighthouse keeper wrote the date 1893 in the log. " * 6 + "What did the keeper write?"
    assert (
        main(
            [
                "generate",
                "--chat",
                "--prompt",
                prompt,
                "--max-tokens",
                "8",
                "--arm",
                "identity",
                "--fill-config",
                str(cfg),
                "--selectors",
                "special,digits,lexical",
                "--threads",
                "2",
            ]
        )
        == 0
    )
    assert "keeper" in capsys.readouterr().out


# -- one [fill] schema: --fill-config reads what `serve --config` reads -------------------------


def test_fill_config_takes_the_server_keys(tmp_path):
    cfg = tmp_path / "fill.toml"
    cfg.write_text(
        '[fill]\nmode = "plain"\ntail = 40\nplacement = "streamed"\n'
        "[fill.corrections]\nvalue_rescale = true\nrescale_rows = 8\n[server]\nport = 1\n"
    )
    fill = fill_for_arm(None, cfg)  # no --arm: the file's mode
    assert (fill.arm, fill.tail, fill.placement, fill.value_rescale, fill.key_rescale, fill.rescale_rows) == (
        "ridgefill",
        40,
        "streamed",
        True,
        False,
        8,
    )
    assert fill.maps is not None and fill.rows.selectors == tuple(SHIPPED_ROWS["selectors"])
    assert fill_for_arm("identity", cfg).arm == "identity"  # --arm replaces fill.mode
    cfg.write_text('[fill]\ncorrections = ["key_rescale"]\n')
    assert fill_for_arm("nofill", cfg).key_rescale and fill_for_arm(None, cfg).arm == "exact"


def test_fill_config_and_serve_config_give_the_same_fill(tmp_path):
    from ridgefill_server.config import load_config

    counts = tmp_path / "counts.json"
    counts.write_text("{}")
    cfg = tmp_path / "rf.toml"
    cfg.write_text(
        f'[fill]\nmode = "identity"\nsplit = 11\ntail = 64\ncorrections = ["value_rescale"]\n'
        f'[fill.rows]\nselectors = ["special", "probe"]\nwindow = 32\nunigram = "{counts}"\n'
    )
    assert load_config(cfg)[0].fill == fill_for_arm(None, cfg)
    for mode, arm in (("off", "exact"), ("nofill", "nofill")):
        cfg.write_text(f'[fill]\nmode = "{mode}"\n')
        assert load_config(cfg)[0].fill == fill_for_arm(None, cfg) == fill_for_arm(arm, None)


def test_fill_config_refusals_name_the_file(tmp_path):
    cfg = tmp_path / "fill.toml"
    cfg.write_text('[fill]\narm = "identity"\n')
    with pytest.raises(ConfigError, match=rf"^{cfg}: unknown key 'fill.arm' \(use fill.mode"):
        fill_for_arm(None, cfg)
    cfg.write_text('[fill]\nmode = "plain"\n')
    with pytest.raises(
        ConfigError, match="key 'fill.maps' is required when fill.mode = \"plain\" and model.path is set"
    ):
        fill_for_arm(None, cfg, model="/models/other")
    with pytest.raises(ConfigError, match="nope.toml: config file not found"):
        fill_for_arm("identity", tmp_path / "nope.toml")


# -- the console command: server/main.py dispatches, the runtime never imports the server -------


def test_the_runtime_imports_no_server_module():
    code = (
        "import sys, ridgefill_runtime.cli, ridgefill_runtime.llm, ridgefill_runtime.fill.settings; "
        "bad = [m for m in sys.modules if m == 'ridgefill_server' or m.startswith('ridgefill_server.')]; "
        "assert not bad, bad; ridgefill_runtime.cli.build_parser()"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "ridgefill_runtime"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            assert not any(n == "ridgefill_server" or n.startswith("ridgefill_server.") for n in names), (
                f"{path} imports {names}"
            )


def test_the_ridgefill_command_lists_and_dispatches_every_command(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "ridgefill_server", "--help"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0 and all(c in p.stdout for c in ("generate", "score", "fit", "eval", "tune", "serve")), (
        p.stdout
    )
    p = subprocess.run(
        [sys.executable, "-m", "ridgefill_server", "generate", "--model", str(tmp_path / "nope"), "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 1
    assert p.stderr.strip() == f"ridgefill: error: command line: key 'model.path': {tmp_path / 'nope'} not found"
    p = subprocess.run(
        [sys.executable, "-m", "ridgefill_server", "serve", "--port", "0"], capture_output=True, text=True, timeout=60
    )
    assert p.returncode == 1 and "server.port must be in 1..65535" in p.stderr and "Traceback" not in p.stderr


def test_score_of_several_files_prints_one_line_each_equal_to_scoring_each_alone(tmp_path, capsys):
    texts = ["The capital of France is Paris.", "Two plus two is four, and three plus three is six."]
    files = []
    for i, text in enumerate(texts):
        files.append(tmp_path / f"t{i}.txt")
        files[-1].write_text(text)
    assert main(["score", "--text-file", *map(str, files), "--json", "--threads", "2"]) == 0
    together = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    alone = []
    for f in files:
        assert main(["score", "--text-file", str(f), "--json", "--threads", "2"]) == 0
        alone.append(json.loads(capsys.readouterr().out))
    assert len(together) == 2 and [r["token_ids"] for r in together] == [r["token_ids"] for r in alone]
    for a, b in zip(together, alone):
        assert max(abs(x - y) for x, y in zip(a["target_logprobs"], b["target_logprobs"])) < 1e-5
    assert together[0]["token_ids"] != together[1]["token_ids"]
