"""Ridge sums and solve against a direct least-squares solve; int8 map format; refusals."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.errors import ModelLoadError
from ridgefill_runtime.fill.fit import RidgeSums
from ridgefill_runtime.fill.maps import FillMaps, MapMeta, check_maps_fit, save_maps
from ridgefill_runtime.fill.quant import dequantize_int8_groupwise, quantize_int8_groupwise

D = 24


def documents(seed=0, sizes=(50, 13, 90, 7)):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(D, D, dtype=torch.float64, generator=g)
    docs = []
    for n in sizes:
        x = torch.randn(n, D, dtype=torch.float64, generator=g) * 3 + 1
        ys = {l: x @ (mix * l).T + 0.5 * l + 0.1 * torch.randn(n, D, dtype=torch.float64, generator=g) for l in (2, 3)}
        docs.append((x, ys))
    return docs


def summed(docs) -> RidgeSums:
    s = RidgeSums(D, 1, [2, 3])
    for x, ys in docs:
        s.add_split_rows(x)
        for l, y in ys.items():
            s.add_layer_rows(l, y)
    return s


def direct_ridge(x, y, lam):
    """Stacked rows, centred, the penalty as extra rows: min ||Xc Aᵀ - Yc||² + α||A||²."""
    mx, my = x.mean(0), y.mean(0)
    xc, yc = x - mx, y - my
    alpha = lam * torch.trace(xc.T @ xc) / x.shape[1]
    aug_x = torch.cat([xc, alpha.sqrt() * torch.eye(x.shape[1], dtype=torch.float64)])
    aug_y = torch.cat([yc, torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64)])
    a = torch.linalg.lstsq(aug_x, aug_y).solution.T
    return a, my - a @ mx


@pytest.mark.parametrize("lam", [1e-4, 0.03, 1.0])
def test_streamed_fit_equals_direct_least_squares(lam):
    docs = documents()
    maps = summed(docs).solve(lam)
    x = torch.cat([d[0] for d in docs])
    for l in (2, 3):
        a_ref, b_ref = direct_ridge(x, torch.cat([d[1][l] for d in docs]), lam)
        a, b = maps[l]
        assert (a - a_ref).abs().max() < 1e-6 and (b - b_ref).abs().max() < 1e-6


def test_sums_across_documents_equal_one_pass():
    docs = documents()
    per_doc = summed(docs)
    one = summed([(torch.cat([d[0] for d in docs]), {l: torch.cat([d[1][l] for d in docs]) for l in (2, 3)})])
    halves = summed(docs[:2])
    halves.merge(summed(docs[2:]))
    for s in (per_doc, halves):
        assert s.n == one.n
        assert torch.allclose(s.sxx, one.sxx, rtol=1e-12) and torch.allclose(s.sxy[3], one.sxy[3], rtol=1e-12)


def test_sums_round_trip_through_disk(tmp_path):
    s = summed(documents())
    s.save(tmp_path / "s.safetensors")
    t = RidgeSums.load(tmp_path / "s.safetensors", 1, [2, 3])
    assert t.n == s.n and torch.equal(t.sxy[2], s.sxy[2])
    a1, _ = s.solve(0.03)[2]
    a2, _ = t.solve(0.03)[2]
    assert torch.equal(a1, a2)


@pytest.mark.parametrize("d_in", [128, 576, 300, 5])
def test_int8_round_trip_error_bound(d_in):
    g = torch.Generator().manual_seed(d_in)
    w = torch.randn(33, d_in, generator=g) * torch.logspace(-3, 1, 33)[:, None]
    w[3, : min(d_in, 128)] = 0  # an all-zero group
    q, s = quantize_int8_groupwise(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and s.shape == (33, -(-d_in // 128))
    back = dequantize_int8_groupwise(q, s)
    exact_scale = torch.zeros(33, s.shape[1] * 128)
    exact_scale[:, :d_in] = w.abs()
    per_group = exact_scale.view(33, -1, 128).amax(-1) / 127  # the unrounded s
    bound = (per_group * (0.5 + 127 * 2.0**-8)).repeat_interleave(128, 1)[:, :d_in] + 1e-12
    assert torch.all((back - w).abs() <= bound)
    assert torch.all(back[3, : min(d_in, 128)] == 0)


def meta(**kw):
    base = dict(
        model_identity="abc",
        architecture="llama",
        num_layers=4,
        hidden_size=D,
        split=1,
        lam=0.03,
        calibration_rows=10,
        calibration_hash="h",
    )
    base.update(kw)
    return MapMeta(**base)


class Cfg:
    architecture, num_layers, hidden_size = "llama", 4, D


def test_maps_for_another_model_or_split_are_refused(tmp_path):
    path = tmp_path / "m.safetensors"
    save_maps(path, meta(), {l: (torch.eye(D), torch.zeros(D)) for l in (1, 2, 3)})
    maps = FillMaps(path, "resident", torch.float32, torch.device("cpu"))
    check_maps_fit(maps.meta, "abc", Cfg, 1, str(path))  # fits
    with pytest.raises(ModelLoadError, match="model_identity is 'abc' in the map file, 'zzz' for the model"):
        check_maps_fit(maps.meta, "zzz", Cfg, 1, str(path))
    with pytest.raises(ModelLoadError, match="split is 1 in the map file, 2 for the model"):
        check_maps_fit(maps.meta, "abc", Cfg, 2, str(path))
    (tmp_path / "bad.safetensors").write_bytes(b"not a map")
    with pytest.raises(ModelLoadError, match="bad.safetensors"):
        FillMaps(tmp_path / "bad.safetensors", "resident", torch.float32, torch.device("cpu"))


def test_map_predicts_the_dequantized_affine_map(tmp_path):
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(D, D, generator=g), torch.randn(D, generator=g)
    path = tmp_path / "m.safetensors"
    save_maps(path, meta(), {2: (a, b)})
    x = torch.randn(5, D, generator=g)
    q, s = quantize_int8_groupwise(a)
    want = x @ dequantize_int8_groupwise(q, s).T + b.to(torch.bfloat16).float()
    for placement in ("resident", "streamed"):
        got = FillMaps(path, placement, torch.float32, torch.device("cpu")).predict(2, x)
        assert torch.allclose(got, want, atol=1e-5)
