"""`ridgefill fit` + `ridgefill eval` on a tiny random hybrid, end to end: maps and ΔM fitted
through the fit driver, every arm (quality mode included) and every splice (keys, values, GDN
state, all) measured. A mechanics check, not a quality claim: random weights and random tokens
teach a map nothing. What it can check exactly: splicing everything the filled prefix leaves
behind (late K/V and the late GDN states at the prefix's end) gives the exact model back."""

from __future__ import annotations

import math

import pytest
import torch

from ridgefill_runtime.config import FillConfig
from ridgefill_runtime.eval.run import HYBRID_SPLICES, Arm, document_measures
from ridgefill_runtime.fill.fit_cli import fit_terminal_into
from ridgefill_runtime.fill.fitting import Document, fit_maps
from ridgefill_runtime.fill.maps import FillMaps
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.hybrid import HybridLM
from tiny_models import HYBRID_CONFIGS, build_tiny_hybrid

SPLIT, TAIL, LENGTH = 2, 24, 160


@pytest.fixture(scope="module", params=sorted(HYBRID_CONFIGS))
def fitted(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    build_tiny_hybrid(request.param, folder)
    ckpt = load_hf_folder(folder)
    model = HybridLM(ckpt.config, ckpt.tensors)
    g = torch.Generator().manual_seed(4)
    docs = [Document(f"d{i}", tuple(torch.randint(0, 320, (LENGTH,), generator=g).tolist())) for i in range(6)]
    out = tmp_path_factory.mktemp(f"fit-{request.param}")
    report = fit_maps(
        model, "tiny", docs[:3], docs[3:4], [SPLIT], out, frozenset(), grid=(1e-3, 0.1), log=lambda *_: None
    )
    path = out / report["splits"][SPLIT]["maps"]
    # NOTE: the ΔM prompts are kept apart from the maps' calibration and the evaluated document
    states = fit_terminal_into(model, path, list(docs[4:5]), SPLIT, every=64, log=lambda *_: None)
    return model, FillMaps(path, "resident", model.dtype, model.device), path, states, list(docs[5].ids)


def test_fit_then_eval_every_arm_and_splice(fitted):
    model, maps, path, states, ids = fitted
    assert states == LENGTH // 64 and sorted(maps.terminal) == [2]  # layer 2: the one GDN layer above the split
    arms = [
        Arm("nofill", FillConfig(arm="nofill", split=SPLIT, tail=TAIL)),
        Arm("identity", FillConfig(arm="identity", split=SPLIT, tail=TAIL)),
        Arm("ridgefill", FillConfig(arm="ridgefill", split=SPLIT, tail=TAIL, maps=str(path)), maps),
        Arm(
            "ridgefill+terminal",
            FillConfig(arm="ridgefill", split=SPLIT, tail=TAIL, maps=str(path), terminal_state=True),
            maps,
        ),
    ]
    result = document_measures(model, ids, arms, TAIL, "ridgefill")
    names = [a.name for a in arms] + [f"ridgefill+exact_{w}" for w in HYBRID_SPLICES]
    for name in names:
        assert all(math.isfinite(result[name][m]) for m in ("dnll_all", "kl", "agree")), name
    # Everything the fill leaves behind, spliced exact, is the exact model (row 0, the only
    # exact prefix row, depends on nothing before it, so its recomputed K/V are exact too).
    everything = result["ridgefill+exact_all"]
    assert abs(everything["dnll_all"]) < 1e-4 and everything["kl"] < 1e-5 and everything["agree"] == 1.0
    # Each component alone changes what the fill scores (the splice reaches the cache).
    base = result["ridgefill"]["dnll_all"]
    for what in ("keys", "values", "state"):
        assert abs(result[f"ridgefill+exact_{what}"]["dnll_all"] - base) > 1e-6, what
    assert result["ridgefill+terminal"]["dnll_all"] != base  # quality mode adds ρ·ΔM


def test_fit_command_with_terminal_state_stores_the_shift_with_the_maps(tmp_path, capsys):
    """`ridgefill fit --terminal-state` on a hybrid folder: maps per split, then ΔM from the
    separate prompts, in the same file; a dense model's fit refuses the flag by name."""
    import tokenizers

    from ridgefill_runtime.cli import main

    folder = tmp_path / "model"
    build_tiny_hybrid("qwen3_5_text", folder)
    words = [f"w{i}" for i in range(300)]
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(["<unk>"] + words)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))
    g = torch.Generator().manual_seed(8)
    texts = {}
    for name in ("calib", "held", "terminal"):
        texts[name] = tmp_path / f"{name}.txt"
        texts[name].write_text(" ".join(words[i] for i in torch.randint(0, 300, (200,), generator=g).tolist()))
    out = tmp_path / "maps"
    assert (
        main(
            [
                "fit",
                "--model",
                str(folder),
                "--calib",
                str(texts["calib"]),
                "--heldout",
                str(texts["held"]),
                "--splits",
                "2",
                "--out",
                str(out),
                "--terminal-state",
                str(texts["terminal"]),
                "--terminal-every",
                "64",
                "--threads",
                "2",
            ]
        )
        == 0
    )
    maps = FillMaps(out / "maps-split2.safetensors", "resident", torch.float32, torch.device("cpu"))
    assert sorted(maps.terminal) == [2] and maps.terminal[2].shape == (4, 8, 12)
    assert (
        main(
            [
                "fit",
                "--calib",
                str(texts["calib"]),
                "--heldout",
                str(texts["held"]),
                "--splits",
                "11",
                "--out",
                str(tmp_path / "dense"),
                "--terminal-state",
                str(texts["terminal"]),
            ]
        )
        == 1
    )
    assert (
        capsys.readouterr().err.strip().endswith("--terminal-state: the model has no Gated DeltaNet layers to correct")
    )
