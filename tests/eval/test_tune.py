"""`ridgefill tune`: the budget rule on hand-made measurements, the settings' refusals, and the
command end to end on a tiny random model (a mechanics check: random weights teach the maps
nothing, so which candidate wins says nothing about RidgeFill)."""

from __future__ import annotations

import json
import math

import pytest
import tokenizers
import torch

from ridgefill_runtime.cli import main
from ridgefill_runtime.config import EngineConfig, FillConfig, RowsConfig
from ridgefill_runtime.engine import token_table
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.eval.run import Arm, document_measures, summarize
from ridgefill_runtime.eval.tune import (
    Budget,
    BudgetError,
    Candidate,
    Measured,
    TuneSettings,
    budget_of,
    choose,
    frontier,
)
from ridgefill_runtime.fill.maps import FillMaps
from ridgefill_runtime.fill.select import RowSelector
from ridgefill_runtime.fill.settings import fill_for_arm
from tiny_models import build_tiny

NOVEL = Budget("max_novel_dnll", 0.1)


def measured(name: str, speedup: float, novel_hi: float, n: int = 5, retrieval_bound: float | None = None) -> Measured:
    split, tail, rows = name.split("/")
    quality = {"dnll_novel": (novel_hi / 2, 0.0, novel_hi, n), "dnll_key": (math.nan,) * 3 + (0,)}
    if retrieval_bound is not None:
        quality["retrieval"] = {"n": 20, "lower_bound": retrieval_bound}
    return Measured(Candidate(int(split), int(tail), rows), quality, exact_s=speedup, fill_s=1.0)


def test_the_fastest_candidate_inside_the_budget_is_chosen():
    ms = [
        measured("9/256/plain", 2.0, 0.30),  # fastest, outside
        measured("11/512/special", 1.5, 0.08),  # fastest inside
        measured("15/1024/lexical", 1.2, 0.01),
        measured("5/128/plain", 3.0, math.nan, n=0),  # unmeasured: never inside
    ]
    assert choose(ms, NOVEL) is ms[1]
    assert choose(ms, Budget("max_novel_dnll", 0.5)) is ms[0]
    assert choose(ms, Budget("max_novel_dnll", 0.01)) is ms[2]  # the limit itself is inside
    # equal speed: the better quality
    tie = measured("11/512/lexical", 1.5, 0.02)
    assert choose(ms + [tie], NOVEL) is tie


def test_no_candidate_inside_is_one_error_naming_the_best_value():
    ms = [measured("9/256/plain", 2.0, 0.30), measured("15/1024/lexical", 1.2, 0.04)]
    with pytest.raises(BudgetError) as e:
        choose(ms, Budget("max_novel_dnll", 0.02))
    assert "--max-novel-dnll 0.02" in str(e.value) and "0.04 (s15-t1024-lexical)" in str(e.value)
    assert "\n" not in str(e.value)


def test_retrieval_is_a_fraction_of_exact_read_at_its_lower_bound():
    ms = [
        measured("9/256/plain", 2.0, 0.3, retrieval_bound=-30.0),
        measured("15/512/lexical", 1.3, 0.3, retrieval_bound=-5.0),
    ]
    budget = budget_of(None, None, 0.9)
    assert budget.value(ms[0].quality) == pytest.approx(0.70) and budget.value(ms[1].quality) == pytest.approx(0.95)
    assert choose(ms, budget) is ms[1]
    assert choose(ms, budget_of(None, None, 0.7)) is ms[0]


def test_frontier_drops_the_dominated_candidates():
    ms = [
        measured("15/1024/lexical", 1.2, 0.01),
        measured("11/512/special", 1.5, 0.08),
        measured("11/1024/special", 1.1, 0.09),  # slower and worse than 11/512
        measured("9/256/plain", 2.0, 0.30),
    ]
    assert [m.candidate.name for m in frontier(ms, NOVEL)] == ["s15-t1024-lexical", "s11-t512-special", "s9-t256-plain"]


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda: budget_of(0.1, 0.2, None), "exactly one budget"),
        (lambda: budget_of(None, None, None), "exactly one budget"),
        (lambda: budget_of(None, None, 1.5), "--min-retrieval"),
        (lambda: TuneSettings((9,), (0,), ("plain",), NOVEL, 4096), "--tails: 0"),
        (lambda: TuneSettings((9,), (512,), ("nope",), NOVEL, 4096), "unknown policy 'nope'"),
        (lambda: TuneSettings((9,), (4096,), ("plain",), NOVEL, 4096), "must exceed the longest tail"),
        (lambda: TuneSettings((9,), (512,), ("plain",), NOVEL, 4096).check_layers(9), "not a layer in 1..8"),
    ],
)
def test_bad_settings_are_one_clear_error(make, words):
    with pytest.raises(InputError, match=words):
        make()


# -- end to end on a tiny model -------------------------------------------------------------------

SPLITS, TAILS = (1, 2), (24, 48)
WORDS = [f"w{i}" for i in range(300)]


def tiny_folder(folder):
    build_tiny("llama_gqa_untied", folder)
    vocab = {w: i for i, w in enumerate(["<unk>"] + WORDS[:319])}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))


def texts(folder, names, seed, words=160):
    folder.mkdir()
    g = torch.Generator().manual_seed(seed)
    for name in names:
        (folder / f"{name}.txt").write_text(" ".join(WORDS[i] for i in torch.randint(0, 300, (words,), generator=g)))
    return folder


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    tiny_folder(root / "model")
    calib = texts(root / "calib", ["a", "b", "c"], seed=1)
    held = texts(root / "held", ["x", "y"], seed=2)
    args = ["tune", "--model", str(root / "model"), "--threads", "2", "--heldout", str(held)]
    args += ["--splits", ",".join(map(str, SPLITS)), "--tails", ",".join(map(str, TAILS)), "--rows", "special"]
    args += ["--length", "200", "--reps", "1"]
    assert main([*args, "--calib", str(calib), "--max-novel-dnll", "50", "--out", str(root / "out")]) == 0
    return root, args


def test_tune_writes_the_choice_every_measurement_and_the_picture(tuned):
    root, _ = tuned
    out = root / "out"
    record = json.loads((out / "tune.json").read_text())
    assert sorted((c["split"], c["tail"]) for c in record["candidates"]) == [(s, t) for s in SPLITS for t in TAILS]
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    inside = [c for c in record["candidates"] if c["inside_budget"]]
    chosen = next(c for c in record["candidates"] if c["name"] == record["chosen"])
    assert chosen["speedup"] == max(c["speedup"] for c in inside)
    assert chosen["budget_value"] == chosen["quality"]["dnll_novel"][2]  # the interval's upper bound


def test_the_chosen_quality_equals_a_direct_measurement(tuned):
    """Recompute the chosen candidate's novel ΔNLL on the held-out files with eval/run.py alone."""
    from ridgefill_runtime.llm import LLM

    root, _ = tuned
    torch.set_num_threads(2)
    record = json.loads((root / "out" / "tune.json").read_text())
    chosen = next(c for c in record["candidates"] if c["name"] == record["chosen"])
    llm = LLM(EngineConfig(model=str(root / "model")))
    model = llm.engine.model
    maps = FillMaps(chosen["maps"], "resident", model.dtype, model.device)
    rows = RowsConfig(selectors=("special",))
    fill = FillConfig(arm="ridgefill", split=chosen["split"], tail=chosen["tail"], maps=chosen["maps"], rows=rows)
    # NOTE: the selector the server builds (engine.py): special rows from the tokenizer's token table
    arm = Arm(chosen["name"], fill, maps, RowSelector(token_table(llm.tokenizer, rows)))
    docs = [llm.tokenizer.encode((root / "held" / f"{n}.txt").read_text()) for n in ("x", "y")]
    per_doc = [document_measures(model, ids, [arm], chosen["tail"], None) for ids in docs]
    direct = summarize(per_doc, [], [arm.name])[arm.name]
    assert list(direct["dnll_novel"]) == pytest.approx(chosen["quality"]["dnll_novel"], rel=1e-9, abs=1e-12)
    assert direct["dnll_novel"][3] == 2


def test_the_written_file_loads_as_the_server_and_fill_config_read_it(tuned):
    from ridgefill_server.config import load_config

    root, _ = tuned
    path = root / "out" / "fill.toml"
    record = json.loads((root / "out" / "tune.json").read_text())
    chosen = next(c for c in record["candidates"] if c["name"] == record["chosen"])
    engine, _, settings = load_config(path)
    assert settings.mode == "plain" and engine.model == str(root / "model")
    fill = engine.fill
    assert (fill.arm, fill.split, fill.tail) == ("ridgefill", chosen["split"], chosen["tail"])
    assert fill.maps == str((root / "out" / "maps" / f"maps-split{chosen['split']}.safetensors").resolve())
    assert fill.rows.selectors == ("special",)
    assert fill_for_arm(None, path, model=str(root / "model")) == fill  # generate / score --fill-config


def test_out_of_budget_exits_1_with_one_line_and_reuses_fitted_maps(tuned, tmp_path, capsys):
    root, args = tuned
    out = tmp_path / "out"
    capsys.readouterr()
    status = main([*args, "--maps-dir", str(root / "out" / "maps"), "--max-novel-dnll", "-50", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("ridgefill: error:")]
    assert status == 1 and len(errors) == 1 and "no candidate meets --max-novel-dnll -50" in errors[0]
    assert (out / "tune.json").exists() and not (out / "fill.toml").exists() and not (out / "maps").exists()
