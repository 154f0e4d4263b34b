"""RidgeFill through the server: the [fill] and [fill.rows] config, the per-request exact
opt-out and selectors, the usage `ridgefill` object and the fill counters, against real servers
on the embedded SmolLM2.

Two servers share one loaded model: one with fill plain (tail 64, maps written here for this
model), one with fill off. The maps are A = I + noise, b = noise: deliberately not the exact
hidden state, so a filled prompt generates measurably different text from an exact one and
the tests can tell which path a request took.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from ridgefill_runtime.config import SELECTORS, CacheConfig, EngineConfig, RowsConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.fill.maps import MapMeta, save_maps
from ridgefill_runtime.fill.settings import SHIPPED_ROWS, shipped_unigram
from ridgefill_runtime.llm import build_engine, load_fill_maps
from ridgefill_server.app import create_app
from ridgefill_server.background import BackgroundServer
from ridgefill_server.config import ConfigError, load_config

SPLIT, TAIL = 15, 64
GREEDY = {"temperature": 0, "max_tokens": 8}
# ~300 tokens: long enough that the first ~236 rows are filled with TAIL = 64.
LONG = (
    "Ledger of the mill. " + "The river ran past the old mill, where the miller kept a ledger of every "
    "sack of grain, and in autumn the village gathered to count the harvest. "
    * 9
    + "Question: what did the miller keep? Answer:"
)
COUNTERS = (
    "ridgefill_fill_filled_rows_total",
    "ridgefill_fill_exact_prefix_rows_total",
    "ridgefill_fill_tail_rows_total",
)


def write_maps(path, model, split: int, noise: float = 0.05) -> None:
    """Maps for every late layer of `model`, fitted to nothing: a perturbed identity."""
    cfg, d = model.config, model.config.hidden_size
    gen = torch.Generator().manual_seed(7)
    maps = {
        l: (torch.eye(d) + noise * torch.randn(d, d, generator=gen) / d**0.5, noise * torch.randn(d, generator=gen))
        for l in range(split, cfg.num_layers)
    }
    meta = MapMeta(
        model_identity=model.identity,
        architecture=cfg.architecture,
        num_layers=cfg.num_layers,
        hidden_size=d,
        split=split,
        lam=0.0,
        calibration_rows=0,
        calibration_hash="test",
    )
    save_maps(path, meta, maps)


@pytest.fixture(scope="module")
def model_and_maps(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
    torch.set_num_threads(2)
    base = build_engine(EngineConfig(cache=CacheConfig(num_blocks=64)))
    folder = tmp_path_factory.mktemp("maps")
    maps = {split: folder / f"split{split}.safetensors" for split in (SPLIT, 11)}
    for split, path in maps.items():
        write_maps(path, base.model, split)
    yield base, maps
    mp.undo()


def _config(tmp_path, text: str):
    f = tmp_path / "rf.toml"
    f.write_text(text)
    return f


@pytest.fixture(scope="module")
def servers(model_and_maps, tmp_path_factory):
    """(fill-plain server, fill-off server); the fill one is configured through a TOML file."""
    base, maps = model_and_maps
    # NOTE: prefix caching off: these tests repeat one prompt and check how each request's own
    # prefill made its rows (tests/engine/test_prefix_caching.py covers requests that share them)
    f = _config(
        tmp_path_factory.mktemp("cfg"),
        f'[cache]\nnum_blocks = 64\nprefix_caching = "off"\n[fill]\nmode = "plain"\nsplit = {SPLIT}\n'
        f'tail = {TAIL}\nmaps = "{maps[SPLIT]}"\n',
    )
    fill_cfg, fill_server_cfg, fill_settings = load_config(f)
    assert fill_cfg.fill.arm == "ridgefill" and fill_settings.mode == "plain"
    # NOTE: same weights as `base`, own KV pool and fill settings, built as build_engine would.
    filled = Engine(base.model, base.tokenizer, fill_cfg, load_fill_maps(fill_cfg, base.model))
    off_cfg, off_server_cfg, off_settings = load_config(None, {"cache.num_blocks": 64})
    with (
        BackgroundServer(create_app(fill_cfg, fill_server_cfg, fill_settings, build=lambda: filled)) as on,
        BackgroundServer(create_app(off_cfg, off_server_cfg, off_settings, build=lambda: base)) as off,
    ):
        on.wait_ready()
        off.wait_ready()
        yield on.url, off.url


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTERS:
            out[name] = float(value)
    assert set(out) == set(COUNTERS), text
    return out


def _complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": LONG, **GREEDY, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _check_rows(usage: dict) -> int:
    """The usage's rows partition the prompt: filled + exact prefix + tail; returns the exact count."""
    fill = usage["ridgefill"]
    exact = fill["exact_prefix_rows"]
    assert 1 <= exact < usage["prompt_tokens"] - TAIL  # position 0 is always exact
    assert fill == {
        "filled_rows": usage["prompt_tokens"] - TAIL - exact,
        "exact_prefix_rows": exact,
        "tail_rows": TAIL,
        "split": SPLIT,
        "cached_filled_rows": 0,
        "remade_exact_rows": 0,
    }
    return exact


def test_filled_request_reports_its_rows_and_moves_the_counters(servers):
    on, _ = servers
    before = _counters(on)
    out = _complete(on)
    n = out["usage"]["prompt_tokens"]
    assert 280 <= n <= 340  # the prompt is really long enough to fill most of it
    exact = _check_rows(out["usage"])  # the shipped selectors (SHIPPED_ROWS) chose these
    after = _counters(on)
    assert after["ridgefill_fill_filled_rows_total"] - before["ridgefill_fill_filled_rows_total"] == n - TAIL - exact
    assert after["ridgefill_fill_tail_rows_total"] - before["ridgefill_fill_tail_rows_total"] == TAIL
    assert after["ridgefill_fill_exact_prefix_rows_total"] - before["ridgefill_fill_exact_prefix_rows_total"] == exact


def test_request_selectors_replace_the_servers_while_others_are_served(servers):
    on, _ = servers
    # Three requests in flight together: the server's selectors, only "special", and none.
    with ThreadPoolExecutor(3) as pool:
        default, special, none = pool.map(
            lambda fill: _complete(on, **fill),
            [{}, {"ridgefill": {"selectors": ["special"]}}, {"ridgefill": {"mode": "plain", "selectors": []}}],
        )
    shipped, first = _check_rows(default["usage"]), _check_rows(special["usage"])
    assert first <= shipped  # "special" rows are a part of every selection
    # No selector: no exact prefix row, the whole prefix is filled.
    n = none["usage"]["prompt_tokens"]
    assert none["usage"]["ridgefill"] == {
        "filled_rows": n - TAIL,
        "exact_prefix_rows": 0,
        "tail_rows": TAIL,
        "split": SPLIT,
        "cached_filled_rows": 0,
        "remade_exact_rows": 0,
    }


def test_unknown_request_selector_is_400_and_the_server_keeps_serving(servers):
    on, off = servers
    for url in (on, off):  # refused whether or not the server fills
        r = httpx.post(
            url + "/v1/completions",
            json={"prompt": LONG, "max_tokens": 2, "ridgefill": {"selectors": ["special", "rare"]}},
        )
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "ridgefill.selectors", err
        assert err["message"] == f"ridgefill.selectors: unknown selector 'rare' (known: {', '.join(SELECTORS)})"
    r = httpx.post(
        on + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "ridgefill": {"selectors": ["digit"]}},
    )
    assert r.status_code == 400 and "unknown selector 'digit'" in r.json()["error"]["message"]
    _check_rows(_complete(on)["usage"])
    assert httpx.get(on + "/health").json() == {"status": "ok"}


def test_exact_request_on_a_fill_server_equals_a_fill_off_server(servers):
    on, off = servers
    reference = _complete(off)
    assert "ridgefill" not in reference["usage"]
    before = _counters(on)
    exact = _complete(on, ridgefill={"mode": "off"})
    assert "ridgefill" not in exact["usage"]
    assert exact["choices"][0]["text"] == reference["choices"][0]["text"] and reference["choices"][0]["text"].strip()
    assert _counters(on) == before  # an exact request fills no rows
    # "plain" means the server's default; with these off-target maps the text shows the fill ran.
    filled = _complete(on, ridgefill={"mode": "plain"})
    assert filled["usage"]["ridgefill"]["filled_rows"] > 0
    assert filled["choices"][0]["text"] != reference["choices"][0]["text"]


def test_streamed_chat_usage_chunk_carries_the_fill(servers):
    on, _ = servers
    body = {
        "messages": [{"role": "user", "content": LONG}],
        "temperature": 0,
        "max_completion_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", on + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    usage = json.loads(events[-2])["usage"]
    _check_rows(usage)


def test_prompt_within_the_tail_is_not_filled(servers):
    on, _ = servers
    before = _counters(on)
    out = _complete(on, prompt="A short prompt")
    assert out["usage"]["prompt_tokens"] <= TAIL and "ridgefill" not in out["usage"]
    assert _counters(on) == before


@pytest.mark.parametrize(
    "fill, words",
    [
        ({"mode": "fast"}, 'ridgefill.mode must be "off" (exact prefill) or "plain"'),
        ({"mode": "exact"}, "got 'exact'"),  # the runtime's arm names are not request modes
        ({"mode": "off", "split": 3}, "ridgefill"),  # nothing else may be set per request
        ({"selectors": ["probes"]}, "ridgefill.selectors: unknown selector 'probes'"),
        ({"selectors": "special"}, "ridgefill"),  # a list of names, not one name
    ],
)
def test_bad_request_mode_is_400_naming_the_field(servers, fill, words):
    on, _ = servers
    r = httpx.post(on + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "ridgefill": fill})
    err = r.json()["error"]
    assert r.status_code == 400 and words in err["message"] and err["param"].startswith("ridgefill"), err


# -- the [fill] config -------------------------------------------------------------------------


def test_every_fill_key_reaches_the_fill_config(model_and_maps, tmp_path):
    _, maps = model_and_maps
    f = _config(
        tmp_path,
        f'[fill]\nmode = "plain"\nsplit = 11\ntail = 128\nmaps = "{maps[11]}"\n'
        'placement = "streamed"\n[fill.corrections]\nvalue_rescale = true\n'
        "key_rescale = true\nrescale_rows = 32\n",
    )
    engine, _, settings = load_config(f)
    fc = engine.fill
    assert settings.mode == "plain" and (fc.arm, fc.split, fc.tail, fc.maps, fc.placement) == (
        "ridgefill",
        11,
        128,
        str(maps[11]),
        "streamed",
    )
    assert (fc.value_rescale, fc.key_rescale, fc.rescale_rows) == (True, True, 32)
    # The list form switches corrections on by name; flags override the file.
    f = _config(tmp_path, '[fill]\nmode = "identity"\ncorrections = ["key_rescale"]\n')
    fc = load_config(f, {"fill.tail": 256, "fill.placement": None})[0].fill
    assert (fc.arm, fc.tail, fc.key_rescale, fc.value_rescale, fc.maps) == ("identity", 256, True, False, None)
    assert load_config(None, {"fill.mode": "nofill"})[0].fill.arm == "nofill"
    assert load_config(None)[0].fill.arm == "exact"


def test_fill_rows_table_round_trips_into_the_engine_config(model_and_maps, tmp_path):
    _, maps = model_and_maps
    from ridgefill_server.config import _SCHEMA

    assert {k[len("rows.") :] for k in _SCHEMA["fill"] if k.startswith("rows.")} == set(RowsConfig.__dataclass_fields__)
    counts = tmp_path / "counts.json"
    counts.write_text("{}")  # only its existence is checked at startup
    f = _config(
        tmp_path,
        f'[fill]\nmode = "plain"\nmaps = "{maps[SPLIT]}"\n[fill.rows]\n'
        'selectors = ["special", "attention", "digits"]\nattention_share = 0.2\n'
        "attention_layers = [1, 5]\nwindow = 32\nprobe_window = 128\nbudget_factor = 2\n"
        "base_attention_share = 0.3\nprotected_share = 0.5\nlexical_cap = 0.1\n"
        f'lexical_sentence_rows = 40\nunigram = "{counts}"\ncontrol = "random"\nseed = 9\n',
    )
    rows = load_config(f)[0].fill.rows
    assert rows == RowsConfig(
        selectors=("special", "attention", "digits"),
        attention_share=0.2,
        attention_layers=(1, 5),
        window=32,
        probe_window=128,
        budget_factor=2.0,
        base_attention_share=0.3,
        protected_share=0.5,
        lexical_cap=0.1,
        lexical_sentence_rows=40,
        unigram=str(counts),
        control="random",
        seed=9,
    )
    # A table replaces the shipped selection: keys it leaves out take RowsConfig's defaults, and
    # the embedded model still gets the shipped counts. Flags override the file.
    f = _config(tmp_path, f'[fill]\nmode = "plain"\nmaps = "{maps[SPLIT]}"\n[fill.rows]\nwindow = 16\n')
    rows = load_config(f, {"fill.rows.selectors": ["special", "lexical"]})[0].fill.rows
    assert rows == RowsConfig(selectors=("special", "lexical"), window=16, unigram=str(shipped_unigram()))


def test_plain_without_a_rows_table_takes_the_shipped_rows(model_and_maps):
    _, maps = model_and_maps
    rows = load_config(None, {"fill.mode": "plain", "fill.maps": str(maps[SPLIT])})[0].fill.rows
    assert rows == RowsConfig(**{**SHIPPED_ROWS, "unigram": str(shipped_unigram())})
    assert shipped_unigram().is_file()
    # The serve flag sets the selectors only.
    from ridgefill_server.cli_serve import _FLAG_KEYS
    from ridgefill_server.main import build_parser

    args = build_parser().parse_args(
        ["serve", "--fill", "plain", "--fill-maps", str(maps[SPLIT]), "--fill-selectors", "special, digits"]
    )
    rows = load_config(None, {key: getattr(args, dest, None) for dest, key in _FLAG_KEYS.items()})[0].fill.rows
    assert rows == RowsConfig(selectors=("special", "digits"), unigram=str(shipped_unigram()))
    # Fill off: the selectors never run, and no counts are loaded.
    assert load_config(None)[0].fill.rows == RowsConfig()


def test_plain_on_the_embedded_model_defaults_to_the_shipped_maps(model_and_maps, monkeypatch):
    _, maps = model_and_maps
    # NOTE: the shipped file is stood in for by this test's maps, so the test does not depend
    # on which map files the checkout holds; what is tested is that the split picks the file.
    monkeypatch.setattr("ridgefill_runtime.fill.settings.shipped_maps", lambda split: maps[split])
    assert load_config(None, {"fill.mode": "plain"})[0].fill.maps == str(maps[SPLIT])
    assert load_config(None, {"fill.mode": "plain", "fill.split": 11})[0].fill.maps == str(maps[11])


@pytest.mark.parametrize(
    "text, words",
    [
        ("[fill]\nsplitt = 12\n", "unknown key 'fill.splitt'"),
        ("[fill.corrections]\nvalue_rescal = true\n", "unknown key 'fill.corrections.value_rescal'"),
        ('[fill]\ntail = "64"\n', "key 'fill.tail' must be int, got str '64'"),
        ("[fill]\nsplit = true\n", "key 'fill.split' must be int, got bool"),
        ("[fill]\nmaps = 3\n", "key 'fill.maps' must be str"),
        ("[fill.corrections]\nkey_rescale = 1\n", "key 'fill.corrections.key_rescale' must be bool, got int"),
        ("[fill]\ncorrections = true\n", "key 'fill.corrections' must be list or table"),
        ('[fill]\ncorrections = ["rescale_rows"]\n', "unknown correction 'rescale_rows'"),
        ('[fill]\nmode = "fast"\n', "fill.mode must be one of off, plain, nofill, identity, got 'fast'"),
        ('[fill]\nplacement = "disk"\n', "fill.placement must be resident or streamed"),
        ("[fill]\ntail = 0\n", "fill.tail must be >= 1"),
        (
            '[model]\npath = "/m"\n[fill]\nmode = "plain"\n',
            "key 'fill.maps' is required when fill.mode = \"plain\" and model.path is set",
        ),
        (
            '[fill]\nmode = "plain"\nmaps = "/nope.safetensors"\n',
            "key 'fill.maps': map file /nope.safetensors not found",
        ),
        ('[fill.rows]\nselector = ["special"]\n', "unknown key 'fill.rows.selector'"),
        (
            '[fill.rows]\nselectors = ["special", "rare"]\n',
            f"key 'fill.rows.selectors': unknown selector 'rare' (known: {', '.join(SELECTORS)})",
        ),
        ('[fill.rows]\nselectors = "special"\n', "key 'fill.rows.selectors' must be a list of str, got str"),
        (
            '[fill.rows]\nattention_layers = [3, "7"]\n',
            "key 'fill.rows.attention_layers' must be a list of int, got str '7'",
        ),
        ("[fill.rows]\nwindow = 1.5\n", "key 'fill.rows.window' must be int, got float"),
        ("[fill.rows]\nprotected_share = 2\n", "fill.rows.protected_share must be in [0, 1], got 2.0"),
        ('[fill.rows]\ncontrol = "shuffle"\n', "fill.rows.control must be one of none, random, tail"),
        ('[fill]\nrows = ["special"]\n', "key 'fill.rows' must be"),
        (
            '[model]\npath = "/m"\n[fill]\nmode = "plain"\nmaps = "/m.safetensors"\n[fill.rows]\nselectors = ["probe"]\n',
            "key 'fill.rows.unigram' is required when fill.rows.selectors include probe and model.path is set",
        ),
        (
            '[fill]\nmode = "plain"\n[fill.rows]\nunigram = "/nope.json"\n',
            "key 'fill.rows.unigram': counts file /nope.json not found",
        ),
    ],
)
def test_bad_fill_config_names_key_and_file(tmp_path, text, words):
    f = _config(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert str(e.value).startswith(f"{f}: ") and words in str(e.value), str(e.value)


def test_not_a_map_file_is_refused(tmp_path):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors")
    f = _config(tmp_path, f'[fill]\nmode = "plain"\nmaps = "{junk}"\n')
    with pytest.raises(ConfigError, match=rf"^{f}: key 'fill.maps': {junk}: unreadable map file"):
        load_config(f)


def test_maps_for_another_split_stop_serve_with_one_line(model_and_maps, tmp_path):
    _, maps = model_and_maps
    f = _config(tmp_path, f'[fill]\nmode = "plain"\nsplit = {SPLIT}\nmaps = "{maps[11]}"\n')
    p = subprocess.run(
        [sys.executable, "-m", "ridgefill_server", "serve", "--config", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr
    assert p.stderr.strip() == (
        f"ridgefill: error: {f}: key 'fill.maps': {maps[11]} holds maps fitted for split 11, but fill.split is {SPLIT}"
    )
    # The same from flags: the error names the command line.
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ridgefill_server",
            "serve",
            "--fill",
            "plain",
            "--fill-split",
            "11",
            "--fill-maps",
            str(maps[SPLIT]),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 1 and p.stderr.strip() == (
        f"ridgefill: error: command line: key 'fill.maps': {maps[SPLIT]} holds maps fitted for split {SPLIT}, "
        f"but fill.split is 11"
    )


def test_request_recipe_sets_the_rows_and_refuses_what_the_server_cannot_do(servers):
    """ridgefill.recipe per request: its exact-row selectors (and its correction, where the maps
    allow it); the split, tail and maps stay the server's."""
    from ridgefill_runtime.fill.recipes import RECIPES

    on, _ = servers
    plain = _complete(on, ridgefill={"recipe": "flash-next"})  # Flash-Next's plain mode: no exact prefix row
    n = plain["usage"]["prompt_tokens"]
    assert plain["usage"]["ridgefill"] == {
        "filled_rows": n - TAIL,
        "exact_prefix_rows": 0,
        "tail_rows": TAIL,
        "split": SPLIT,
        "cached_filled_rows": 0,
        "remade_exact_rows": 0,
    }
    _check_rows(_complete(on, ridgefill={"recipe": "qwen3.8-27b"})["usage"])  # its selectors chose some rows
    both = _complete(on, ridgefill={"recipe": "flash-next", "selectors": ["special"]})  # selectors win
    assert both["usage"]["ridgefill"]["exact_prefix_rows"] >= 1
    for recipe, words in (
        ("flash", f"ridgefill.recipe: unknown recipe 'flash' (known: {', '.join(RECIPES)})"),
        ("flash-next-quality", "maps holding ΔM"),
    ):
        r = httpx.post(on + "/v1/completions", json={"prompt": LONG, "max_tokens": 2, "ridgefill": {"recipe": recipe}})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "ridgefill.recipe" and words in err["message"], err
    _check_rows(_complete(on)["usage"])


def test_echo_with_logprobs_on_a_fill_server_runs_an_exact_prefill(servers):
    """Filled rows have no logits, so a request asking the prompt's logprobs is prefilled
    exactly: every row scored, the same values as a fill-off server's, no fill in its usage."""
    on, off = servers
    body = {"prompt": LONG, "echo": True, "logprobs": 1, "max_tokens": 0}
    before = _counters(on)
    got, want = (httpx.post(url + "/v1/completions", json=body, timeout=120).json() for url in (on, off))
    assert "ridgefill" not in got["usage"] and _counters(on) == before
    values, ref = got["choices"][0]["logprobs"]["token_logprobs"], want["choices"][0]["logprobs"]["token_logprobs"]
    assert len(values) == got["usage"]["prompt_tokens"] > TAIL and values[0] is None
    assert None not in values[1:] and max(abs(a - b) for a, b in zip(values[1:], ref[1:])) < 1e-4


def test_a_second_question_on_a_cached_filled_document_reports_its_rows(model_and_maps, tmp_path):
    """Prefix caching on a fill server: the second question's usage says how many prompt tokens
    came from the cache and how many of its filled rows; as-is remakes none; a bad policy is a 400."""
    base, maps = model_and_maps
    f = _config(
        tmp_path,
        f'[cache]\nnum_blocks = 64\n[fill]\nmode = "plain"\nsplit = {SPLIT}\ntail = {TAIL}\nmaps = "{maps[SPLIT]}"\n',
    )
    cfg, server_cfg, settings = load_config(f)
    engine = Engine(base.model, base.tokenizer, cfg, load_fill_maps(cfg, base.model))
    with BackgroundServer(create_app(cfg, server_cfg, settings, build=lambda: engine)) as srv:
        srv.wait_ready()
        first = _complete(srv.url, ridgefill={"reuse_filled": "as-is"})
        second = httpx.post(
            srv.url + "/v1/completions",
            timeout=120,
            json={"prompt": LONG + " And once more?", **GREEDY, "ridgefill": {"reuse_filled": "as-is"}},
        ).json()
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "ridgefill": {"reuse_filled": "often"}})
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    fill = second["usage"]["ridgefill"]
    boundary = first["usage"]["prompt_tokens"] - TAIL
    assert cached >= boundary // 16 * 16 > 0  # the whole filled document, in full blocks
    assert 0 < fill["cached_filled_rows"] <= first["usage"]["ridgefill"]["filled_rows"]
    assert fill["remade_exact_rows"] == 0
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "ridgefill.reuse_filled"
