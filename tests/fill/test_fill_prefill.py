"""The fill arms against an independent reference built from transformers' modules."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import RowsConfig, CacheConfig, EngineConfig, FillConfig, SchedulerConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.fill.maps import FillMaps, MapMeta, save_maps
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.registry import family
from ridgefill_runtime.offline import PromptLogits
from ridgefill_runtime.sequence import SamplingParams
from fill_reference import reference_tail_logits
from tiny_models import build_tiny

SPLIT, TAIL, N = 1, 40, 150


@pytest.fixture(scope="module", params=["llama_gqa_untied", "qwen3_qk_norm", "gemma3_sliding"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(request.param, folder)
    ckpt = load_hf_folder(folder)
    # through the registry: Gemma 3 is a DenseLM subclass (its norms, RoPE bases, windows)
    model = family(ckpt.config.architecture).build_model(ckpt.config, ckpt.tensors, torch.float32, "cpu")
    model.identity = ckpt.identity
    torch.manual_seed(2)
    ids = torch.randint(0, ckpt.config.vocab_size, (N,)).tolist()
    d = ckpt.config.hidden_size
    gen = torch.Generator().manual_seed(5)
    maps = {
        l: (torch.eye(d) + 0.05 * torch.randn(d, d, generator=gen), 0.1 * torch.randn(d, generator=gen))
        for l in range(SPLIT, ckpt.config.num_layers)
    }
    path = folder / "maps.safetensors"
    meta = MapMeta(
        model_identity=ckpt.identity,
        architecture=ckpt.config.architecture,
        num_layers=ckpt.config.num_layers,
        hidden_size=d,
        split=SPLIT,
        lam=0.03,
        calibration_rows=0,
        calibration_hash="none",
    )
    save_maps(path, meta, maps)
    return dict(hf=hf, model=model, ids=ids, maps_path=path)


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def fill(arm, **kw):
    """Plain fill (no exact prefix rows) unless the test names its selectors."""
    kw.setdefault("rows", RowsConfig(selectors=()))
    return FillConfig(arm=arm, split=SPLIT, tail=TAIL, **kw)


def test_identity_arm_equals_pop_reference(tiny):
    first, logits, _, _ = PromptLogits(tiny["model"], fill("identity"), chunk=37)(tiny["ids"])
    ref, _ = reference_tail_logits(tiny["hf"], tiny["ids"], SPLIT, TAIL, predict=lambda l, x: x)
    assert first == N - TAIL
    assert len(logits) == TAIL and rel_err(logits, ref) < 1e-4


def test_nofill_late_layers_see_only_the_tail(tiny):
    _, logits, _, _ = PromptLogits(tiny["model"], fill("nofill"), chunk=64)(tiny["ids"])
    ref, _ = reference_tail_logits(tiny["hf"], tiny["ids"], SPLIT, TAIL, nofill=True)
    assert rel_err(logits, ref) < 1e-4


@pytest.mark.parametrize("placement", ["resident", "streamed"])
def test_ridgefill_rows_write_the_layers_own_kv_of_x_hat(tiny, placement):
    maps = FillMaps(tiny["maps_path"], placement, torch.float32, torch.device("cpu"))
    first, logits, runner, seq = PromptLogits(tiny["model"], fill("ridgefill", maps="m"), maps, chunk=50)(tiny["ids"])
    ref, filled = reference_tail_logits(tiny["hf"], tiny["ids"], SPLIT, TAIL, predict=maps.predict)
    assert rel_err(logits, ref) < 1e-4
    for layer, (k_ref, v_ref) in filled.items():
        rows = reached(tiny["model"], layer, first)
        slots = runner.kv.physical(layer, runner._seq_slots_at(seq, rows))
        assert rel_err(runner.kv.k[layer][slots], k_ref[rows]) < 1e-5
        assert rel_err(runner.kv.v[layer][slots], v_ref[rows]) < 1e-5


def reached(model, layer: int, first: int) -> torch.Tensor:
    """The filled rows (no exact prefix rows) whose K/V the fill writes at `layer`: all of them, or at
    a sliding-window layer those the tail reaches (fewer than `window` positions before it)."""
    window = model.config.family_config.window_of(layer)
    return torch.arange(max(0, first - window + 1) if window else 0, first)


def test_resident_and_streamed_maps_are_bitwise_equal(tiny):
    outs = []
    for placement in ("resident", "streamed"):
        maps = FillMaps(tiny["maps_path"], placement, torch.float32, torch.device("cpu"))
        outs.append(PromptLogits(tiny["model"], fill("ridgefill", maps="m"), maps)(tiny["ids"])[1])
    assert torch.equal(outs[0], outs[1])


def test_chunking_does_not_change_the_fill(tiny):
    a = PromptLogits(tiny["model"], fill("identity"), chunk=512)(tiny["ids"])[1]
    b = PromptLogits(tiny["model"], fill("identity"), chunk=16)(tiny["ids"])[1]
    assert rel_err(b, a) < 1e-5


def engine(tiny, fill_config):
    return Engine(
        tiny["model"],
        None,
        EngineConfig(cache=CacheConfig(num_blocks=64), fill=fill_config, scheduler=SchedulerConfig(chunk_size=48)),
    )


def generate(eng, ids, use_fill=True, n=8):
    seq = eng.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), fill=use_fill)
    while eng.has_unfinished():
        eng.step()
    return seq


def test_fill_off_is_bitwise_exact(tiny):
    exact = PromptLogits(tiny["model"])(tiny["ids"])[1]
    off = PromptLogits(tiny["model"], FillConfig(arm="exact", split=SPLIT, tail=TAIL))(tiny["ids"])[1]
    assert torch.equal(exact, off)
    eng = engine(tiny, fill("identity"))
    opted_out = generate(eng, tiny["ids"], use_fill=False)
    assert opted_out.fill.boundary == 0
    assert opted_out.output_ids == generate(engine(tiny, FillConfig()), tiny["ids"]).output_ids


def test_batched_fill_and_exact_requests_equal_each_alone(tiny):
    ids2 = tiny["ids"][::-1]
    eng = engine(tiny, fill("identity"))
    a = eng.add_request(tiny["ids"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    b = eng.add_request(ids2, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True), fill=False)
    while eng.has_unfinished():
        eng.step()
    assert a.output_ids == generate(engine(tiny, fill("identity")), tiny["ids"], n=6).output_ids
    assert b.output_ids == generate(engine(tiny, FillConfig()), ids2, n=6).output_ids


def test_value_rescale_multiplies_filled_values_by_measured_ratio(tiny):
    c = 8
    _, _, r0, seq0 = PromptLogits(tiny["model"], fill("identity"))(tiny["ids"])
    _, _, r1, seq1 = PromptLogits(tiny["model"], fill("identity", value_rescale=True, rescale_rows=c))(tiny["ids"])
    model, p = tiny["model"], N - TAIL
    layer = tiny["model"].config.num_layers - 1
    rows = reached(model, layer, p)  # NOTE: with the rescale every filled row is written; without, these
    s0, s1 = r0._seq_slots_at(seq0, rows), r1._seq_slots_at(seq1, rows)
    # by hand: exact V of the first c tail rows vs V predicted from their x_S (identity: x̂ = x_S)
    t0 = r0._seq_slots(seq0, p, p + c)
    v_exact = r0.kv.v[layer][t0]
    xs = {}
    from ridgefill_runtime.fill.capture import run_layer_inputs

    run_layer_inputs(model, tiny["ids"], lambda l, h: xs.__setitem__(l, h[p : p + c].clone()))
    _, v_pred = model.kv_only(layer, xs[SPLIT], model.rope(torch.arange(p, p + c)))
    ratio = (v_exact.norm(dim=-1) / v_pred.norm(dim=-1)).mean(0)  # [Hkv]
    assert torch.allclose(r1.kv.v[layer][s1], r0.kv.v[layer][s0] * ratio[None, :, None], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(ratio, torch.ones_like(ratio), atol=1e-3)
    # keys untouched when only the value rescale is on
    assert torch.equal(r1.kv.k[layer][s1], r0.kv.k[layer][s0])


def test_logits_from_returns_the_same_rows_as_a_full_run(tiny):
    full = PromptLogits(tiny["model"], chunk=64)(tiny["ids"])[1]
    first, part, _, _ = PromptLogits(tiny["model"], chunk=64)(tiny["ids"], logits_from=100)
    assert first == 100 and part.shape[0] == N - 100
    assert rel_err(part, full[100:]) < 1e-5
