"""The fit driver end to end on a tiny model: sums equal a direct capture, resume, map file."""

from __future__ import annotations

import json

import torch

from ridgefill_runtime.fill.capture import run_layer_inputs
from ridgefill_runtime.fill.fitting import Document, fit_maps, kept_rows
from ridgefill_runtime.fill.fit import RidgeSums
from ridgefill_runtime.fill.maps import FillMaps, check_maps_fit
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.dense import DenseLM
from tiny_models import build_tiny


def tiny_model(tmp_path):
    build_tiny("llama_gqa_untied", tmp_path / "m")
    ckpt = load_hf_folder(tmp_path / "m")
    return DenseLM(ckpt.config, ckpt.tensors), ckpt.identity


def docs(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Document(f"d{i}", tuple(torch.randint(0, vocab, (70 + 9 * i,), generator=g).tolist())) for i in range(n)]


def test_fit_resumes_and_matches_a_direct_capture(tmp_path):
    model, ident = tiny_model(tmp_path)
    special = frozenset({3})
    calib, held = docs(4, 320), docs(2, 320, seed=1)
    out = tmp_path / "fit"
    fit_maps(model, ident, calib[:2], held, [1], out, special, grid=(1e-3, 0.1), log=lambda *_: None)
    # a second call with more documents resumes: the first two are not captured again
    seen = []
    import ridgefill_runtime.fill.fitting as fitting

    real = fitting.capture_document
    fitting.capture_document = lambda m, d, s, sp: (seen.append(d.name), real(m, d, s, sp))[1]
    try:
        report = fit_maps(model, ident, calib, held, [1], out, special, grid=(1e-3, 0.1), log=lambda *_: None)
    finally:
        fitting.capture_document = real
    assert seen == ["d2", "d3"]
    # the saved sums equal sums built directly from every document's layer inputs
    direct = RidgeSums(model.config.hidden_size, 1, [1, 2])
    for d in calib:
        xs = {}
        run_layer_inputs(model, list(d.ids), lambda l, h: xs.__setitem__(l, h.clone()))
        rows = kept_rows(d.ids, special)
        direct.add_split_rows(xs[1][rows])
        direct.add_layer_rows(2, xs[2][rows])
    saved = RidgeSums.load(out / "sums-split1.safetensors", 1, [1, 2])
    assert saved.n == direct.n == sum(len(kept_rows(d.ids, special)) for d in calib)
    assert torch.allclose(saved.sxy[2], direct.sxy[2], rtol=1e-10, atol=1e-8)
    # the map file fits this model and predicts with the chosen λ's solve
    lam = report["splits"][1]["lambda"]
    assert lam in (1e-3, 0.1)
    maps = FillMaps(out / "maps-split1.safetensors", "resident", torch.float32, torch.device("cpu"))
    check_maps_fit(maps.meta, ident, model.config, 1, "maps")
    a, b = saved.solve(lam)[2]
    x = torch.randn(4, model.config.hidden_size)
    want = x.double() @ a.T + b
    assert (maps.predict(2, x).double() - want).abs().max() < 0.02 * want.abs().max()
    assert json.loads((out / "fit-report.json").read_text())["calibration_documents"] == 4


def test_first_position_and_special_tokens_stay_out_of_the_sums():
    rows = kept_rows((5, 3, 7, 3, 9), frozenset({3}))
    assert rows.tolist() == [2, 4]
