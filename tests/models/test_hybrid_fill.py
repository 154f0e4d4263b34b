"""RidgeFill's two-sweep prefill on the hybrids through the engine, against the reference built
from transformers' own layers (hybrid_fill_reference.py), on tiny random Qwen3.5 / Qwen3-Next
checkpoints in float32. The identity fill (x̂_l = x_S, seed 000's POP baseline) needs no maps,
so these test the mechanics, not a map's quality."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.hybrid import HybridLM
from ridgefill_runtime.sequence import SamplingParams
from ridgefill_runtime.stages import Stage
from hybrid_fill_reference import reference_decode, reference_two_sweep
from tiny_models import HYBRID_CONFIGS, build_tiny_hybrid

PROMPT, TAIL, NEW = 70, 12, 6
EXACT_ROWS = [0, 9, 10, 33, 57]  # prefix rows run exactly (fixed: the selectors are not under test)


@pytest.fixture(scope="module", params=sorted(HYBRID_CONFIGS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    ref = build_tiny_hybrid(request.param, folder)
    ckpt = load_hf_folder(folder)
    ids = torch.randint(0, ckpt.config.vocab_size, (PROMPT,), generator=torch.Generator().manual_seed(3)).tolist()
    return dict(name=request.param, ref=ref, model=HybridLM(ckpt.config, ckpt.tensors), ids=ids)


def fill_config(split: int, selectors=("special",)) -> FillConfig:
    return FillConfig(arm="identity", split=split, tail=TAIL, rows=RowsConfig(selectors=selectors, probe_window=6))


def engine(model, fill: FillConfig, chunk: int = 512) -> Engine:
    eng = Engine(
        model,
        None,
        EngineConfig(
            cache=CacheConfig(num_blocks=64),
            fill=fill,
            scheduler=SchedulerConfig(chunk_size=chunk, max_num_batched_tokens=512),
        ),
    )
    eng.scheduler.select = lambda seq: list(EXACT_ROWS)
    return eng


def filled_mask() -> torch.Tensor:
    mask = torch.arange(PROMPT) < PROMPT - TAIL
    mask[EXACT_ROWS] = False
    return mask


def run_to_first_token(eng: Engine, ids, new: int = NEW):
    """Step until the prefill is over and the first token sampled: the caches then hold the
    prefilled prompt (and nothing of any decode)."""
    seq = eng.add_request(ids, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    stages = set()
    while not seq.output_ids:
        stages.add(seq.fill.stage)
        eng.step()
    return seq, stages


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def tail_logprobs(ref_logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """log p(next prompt token) of the tail rows (those the fill's scores cover) [T - 1]."""
    boundary = PROMPT - TAIL
    return ref_logits[boundary:-1].log_softmax(-1).gather(1, torch.tensor(ids[boundary + 1 :])[:, None])[:, 0]


def engine_scores(model, fill: FillConfig, maps, ids: list[int], chunk: int) -> torch.Tensor:
    """The prompt's tail scores through an engine with these fill settings and fixed exact rows."""
    eng = Engine(
        model,
        None,
        EngineConfig(cache=CacheConfig(num_blocks=64), fill=fill, scheduler=SchedulerConfig(chunk_size=chunk)),
        maps,
    )
    eng.scheduler.select = lambda seq: list(EXACT_ROWS)
    seq = eng.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True))
    while eng.has_unfinished():
        eng.step()
    return torch.tensor(seq.logprobs.prompt)


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("chunk", [512, 16])
def test_two_sweep_state_cache_and_output_equal_the_reference(tiny, split, chunk):
    """After the prefill: every late GDN state, every late attention K/V (filled rows' from x̂,
    exact rows' from their input) and the first logits equal the reference; the greedy
    continuation decoding over that cache is the reference's."""
    model, ids = tiny["model"], tiny["ids"]
    ref_logits, ref_cache = reference_two_sweep(tiny["ref"], ids, split, filled_mask(), lambda layer, x: x)
    eng = engine(model, fill_config(split), chunk)
    seq, stages = run_to_first_token(eng, ids)
    assert Stage.LOWER in stages and Stage.LATE in stages
    assert seq.output_ids[0] == int(ref_logits[-1].argmax())
    slot, hybrid = seq.state_slot, model.config.family_config
    for layer in range(split, model.config.num_layers):
        if hybrid.is_linear(layer):
            ours = eng.caches.states.state(layer)["ssm"][slot]
            assert rel_err(ours, ref_cache.get_recurrent_state(layer)[0]) < 1e-4, layer
        else:
            slots = eng.runner._seq_slots(seq, 0, PROMPT)
            k, v = eng.kv.read(layer, slots)  # [n, Hkv, D]
            ref_k, ref_v = (
                t[0].transpose(0, 1) for t in (ref_cache.layers[layer].keys, ref_cache.layers[layer].values)
            )
            assert rel_err(k, ref_k) < 1e-4 and rel_err(v, ref_v) < 1e-4, layer
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == [seq.output_ids[0]] + reference_decode(
        tiny["ref"], ref_cache, seq.output_ids[0], PROMPT, NEW - 1
    )


def test_scores_of_the_tail_equal_the_reference(tiny):
    model, ids = tiny["model"], tiny["ids"]
    ref_logits, _ = reference_two_sweep(tiny["ref"], ids, 2, filled_mask(), lambda layer, x: x)
    eng = engine(model, fill_config(2), chunk=16)
    seq = eng.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True))
    while eng.has_unfinished():
        eng.step()
    boundary = PROMPT - TAIL
    want = tail_logprobs(ref_logits, ids)
    assert seq.fill.boundary == boundary
    assert torch.allclose(torch.tensor(seq.logprobs.prompt), want, atol=1e-4)


def test_the_probe_runs_on_a_scratch_state_that_leaves_the_real_one_alone(tiny):
    """With the probe selector on, the probe runs the late layers (GDN from an empty state) before
    the late sweep; with the same exact rows chosen, states and output equal a run with no probe."""
    model, ids = tiny["model"], tiny["ids"]
    results = []
    for selectors in (("special",), ("special", "probe")):
        eng = engine(model, fill_config(1, selectors), chunk=4)
        seq, stages = run_to_first_token(eng, ids)
        assert (Stage.PROBE in stages) == ("probe" in selectors)
        states = {layer: eng.caches.states.state(layer)["ssm"][seq.state_slot].clone() for layer in (1, 2)}
        while eng.has_unfinished():
            eng.step()
        results.append((states, list(seq.output_ids), len(seq.fill.row_scores.get("probe", []))))
    (plain, plain_out, _), (probed, probed_out, scored) = results
    assert scored == PROMPT - TAIL  # the probe did score every prefix row
    assert all(torch.equal(plain[layer], probed[layer]) for layer in plain) and plain_out == probed_out


def test_a_filled_prompt_batched_with_exact_traffic_equals_it_alone(tiny):
    model, ids = tiny["model"], tiny["ids"]
    alone = engine(model, fill_config(1), chunk=8)
    seq_alone, _ = run_to_first_token(alone, ids)
    while alone.has_unfinished():
        alone.step()
    eng = engine(model, fill_config(1), chunk=8)
    short = eng.add_request(ids[:9], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))  # under the tail
    other = eng.add_request(ids[5:50], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), fill=False)
    seq = eng.add_request(ids, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert seq.output_ids == seq_alone.output_ids and short.fill.boundary == other.fill.boundary == 0
    assert eng.stats().state_slots_used == 0 and eng.stats().stash_bytes == 0


def test_fill_off_is_the_exact_model_bitwise(tiny):
    model, ids = tiny["model"], tiny["ids"]
    outs = []
    for fill in (FillConfig(), FillConfig(arm="exact", split=1, tail=TAIL)):
        eng = Engine(model, None, EngineConfig(cache=CacheConfig(num_blocks=64), fill=fill))
        seq = eng.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True))
        while eng.has_unfinished():
            eng.step()
        outs.append(torch.tensor(seq.logprobs.prompt))
    assert torch.equal(outs[0], outs[1])


@pytest.fixture(scope="module")
def fitted(tiny, tmp_path_factory):
    """Maps fitted by `ridgefill fit`'s driver on random-token documents (a mechanics check:
    random text teaches a map nothing worth measuring)."""
    from ridgefill_runtime.fill.fitting import Document, fit_maps

    out = tmp_path_factory.mktemp(f"maps-{tiny['name']}")
    g = torch.Generator().manual_seed(9)
    docs = [Document(f"d{i}", tuple(torch.randint(0, 320, (200,), generator=g).tolist())) for i in range(4)]
    report = fit_maps(
        tiny["model"], "tiny", docs[:3], docs[3:], [2], out, frozenset(), grid=(1e-3, 0.1), log=lambda *_: None
    )
    return out / report["splits"][2]["maps"]


def test_fitted_maps_fill_resident_equals_streamed_and_the_reference(tiny, fitted):
    from ridgefill_runtime.fill.maps import FillMaps

    model, ids = tiny["model"], tiny["ids"]
    fill = FillConfig(arm="ridgefill", split=2, tail=TAIL, maps=str(fitted), rows=RowsConfig(selectors=("special",)))
    outs = {}
    for placement in ("resident", "streamed"):
        maps = FillMaps(fitted, placement, model.dtype, model.device)
        eng = Engine(
            model,
            None,
            EngineConfig(cache=CacheConfig(num_blocks=64), fill=fill, scheduler=SchedulerConfig(chunk_size=16)),
            maps,
        )
        eng.scheduler.select = lambda seq: list(EXACT_ROWS)
        seq = eng.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True))
        while eng.has_unfinished():
            eng.step()
        outs[placement] = torch.tensor(seq.logprobs.prompt)
    assert torch.equal(outs["resident"], outs["streamed"])
    ref_maps = FillMaps(fitted, "resident", model.dtype, model.device)
    ref_logits, _ = reference_two_sweep(tiny["ref"], ids, 2, filled_mask(), ref_maps.predict)
    boundary = PROMPT - TAIL
    want = tail_logprobs(ref_logits, ids)
    assert torch.allclose(outs["resident"], want, atol=1e-4)
    identity, _ = reference_two_sweep(tiny["ref"], ids, 2, filled_mask(), lambda layer, x: x)
    assert not torch.allclose(ref_logits[boundary:], identity[boundary:], atol=1e-3)  # the maps did act


def test_terminal_state_correction_equals_the_reference(tiny, fitted, tmp_path):
    """ΔM stored with the maps; at the prefix's end each late GDN state gets ρ·ΔM, ρ read from
    the gates the fill computed. The reference adds it with ρ from a float64 loop over
    transformers' own gates; whole-prompt and 16-row chunks (the prefix end mid-chunk) agree."""
    import shutil

    from ridgefill_runtime.fill.maps import FillMaps, add_terminal_shift

    model, ids, hy = tiny["model"], tiny["ids"], tiny["model"].config.family_config
    path = tmp_path / "maps.safetensors"
    shutil.copy(fitted, path)
    gen = torch.Generator().manual_seed(12)
    # NOTE: a ΔM of visible size, so the test sees whether and how it is added (the fit has its own test)
    shifts = {2: 0.5 * torch.randn(hy.value_heads, hy.key_head_dim, hy.value_head_dim, generator=gen)}
    add_terminal_shift(path, shifts, every=64, states=1)
    maps = FillMaps(path, "resident", model.dtype, model.device)
    boundary = PROMPT - TAIL
    ref_logits, _ = reference_two_sweep(tiny["ref"], ids, 2, filled_mask(), maps.predict, shifts, boundary)
    want = tail_logprobs(ref_logits, ids)
    plain, _ = reference_two_sweep(tiny["ref"], ids, 2, filled_mask(), maps.predict)
    assert not torch.allclose(ref_logits[boundary:], plain[boundary:], atol=1e-3)  # the correction acts
    fill = FillConfig(
        arm="ridgefill",
        split=2,
        tail=TAIL,
        maps=str(path),
        terminal_state=True,
        rows=RowsConfig(selectors=("special",)),
    )
    for chunk in (512, 13):
        assert torch.allclose(engine_scores(model, fill, maps, ids, chunk), want, atol=1e-4), chunk


def test_the_correction_needs_a_shift_for_every_late_gdn_layer(tiny, fitted):
    from ridgefill_runtime.fill.maps import FillMaps

    fill = FillConfig(arm="ridgefill", split=2, tail=TAIL, maps=str(fitted), terminal_state=True)
    maps = FillMaps(fitted, "resident", torch.float32, torch.device("cpu"))
    with pytest.raises(
        ValueError, match=r"holds no ΔM for layers \[2\] \(fit it with `ridgefill fit --terminal-state`\)"
    ):
        Engine(tiny["model"], None, EngineConfig(cache=CacheConfig(num_blocks=64), fill=fill), maps)


@torch.no_grad()
def test_terminal_shift_fit_equals_transformers_states(tiny, fitted):
    """ΔM = mean over checkpoints t of S_exact(t) − S_filled(t), here recomputed with
    transformers' own GDN module from its own hidden states."""
    from transformers import DynamicCache

    from ridgefill_runtime.fill.maps import FillMaps
    from ridgefill_runtime.fill.terminal_fit import fit_terminal_shift

    model, ref = tiny["model"], tiny["ref"]
    maps = FillMaps(fitted, "resident", model.dtype, model.device)
    g = torch.Generator().manual_seed(21)
    docs = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (130, 64, 40)]  # 2 + 1 + 0 checkpoints
    shifts, count = fit_terminal_shift(model, maps, docs, split=2, every=64)
    assert count == 3 and sorted(shifts) == [2]
    layer = ref.model.layers[2]
    total = 0
    for ids in docs:
        hidden = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i]: layer i's input
        x_true, x_hat = hidden[2][0], maps.predict(2, hidden[2][0])
        for t in range(64, len(ids) + 1, 64):
            states = []
            for x in (x_true, x_hat):
                cache = DynamicCache(config=ref.config)
                layer.linear_attn(layer.input_layernorm(x[None, :t]), cache=cache)
                states.append(cache.get_recurrent_state(2)[0])
            total = total + (states[0] - states[1])
    want = total / 3
    assert float((shifts[2] - want).abs().max() / want.abs().max()) < 1e-4


@pytest.mark.parametrize("chunk", [512, 5])
def test_value_rescale_measured_on_the_first_tail_rows_equals_the_reference(tiny, fitted, chunk):
    """The 27B recipe's correction on a hybrid: the first c tail rows measure, per KV head, the
    exact / predicted value-norm ratio at each late attention layer, and the filled rows' values
    (not the exact prefix rows') are scaled before the tail reads them."""
    from ridgefill_runtime.fill.maps import FillMaps

    model, ids = tiny["model"], tiny["ids"]
    maps = FillMaps(fitted, "resident", model.dtype, model.device)
    boundary, c = PROMPT - TAIL, 4
    ref_logits, _ = reference_two_sweep(
        tiny["ref"], ids, 2, filled_mask(), maps.predict, boundary=boundary, rescale_rows=c
    )
    plain, _ = reference_two_sweep(tiny["ref"], ids, 2, filled_mask(), maps.predict)
    assert not torch.allclose(ref_logits[boundary:], plain[boundary:], atol=1e-3)  # the rescale acts
    want = tail_logprobs(ref_logits, ids)
    fill = FillConfig(
        arm="ridgefill",
        split=2,
        tail=TAIL,
        maps=str(fitted),
        value_rescale=True,
        rescale_rows=c,
        rows=RowsConfig(selectors=("special",)),
    )
    assert torch.allclose(engine_scores(model, fill, maps, ids, chunk), want, atol=1e-4)


def test_a_request_turns_the_correction_on_or_off(tiny, fitted, tmp_path):
    """With maps holding ΔM, each request chooses (Engine.add_request terminal_state): on gives
    the corrected reference, off the plain one, in the same engine and batch."""
    import shutil

    from ridgefill_runtime.errors import InputError
    from ridgefill_runtime.fill.maps import FillMaps, add_terminal_shift

    model, ids, hy = tiny["model"], tiny["ids"], tiny["model"].config.family_config
    path = tmp_path / "maps.safetensors"
    shutil.copy(fitted, path)
    shifts = {
        2: 0.5
        * torch.randn(hy.value_heads, hy.key_head_dim, hy.value_head_dim, generator=torch.Generator().manual_seed(12))
    }
    add_terminal_shift(path, shifts, every=64, states=1)
    maps = FillMaps(path, "resident", model.dtype, model.device)
    boundary = PROMPT - TAIL
    refs = {}
    for on in (True, False):
        logits, _ = reference_two_sweep(
            tiny["ref"], ids, 2, filled_mask(), maps.predict, shifts if on else None, boundary
        )
        refs[on] = tail_logprobs(logits, ids)
    fill = FillConfig(arm="ridgefill", split=2, tail=TAIL, maps=str(path), rows=RowsConfig(selectors=("special",)))
    eng = Engine(
        model,
        None,
        EngineConfig(cache=CacheConfig(num_blocks=96), fill=fill, scheduler=SchedulerConfig(chunk_size=16)),
        maps,
    )
    eng.scheduler.select = lambda seq: list(EXACT_ROWS)
    seqs = {
        on: eng.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True), terminal_state=on)
        for on in (True, False)
    }
    default = eng.add_request(ids, SamplingParams(max_tokens=0, prompt_logprobs=True))  # the config's: off
    while eng.has_unfinished():
        eng.step()
    for on, seq in seqs.items():
        assert torch.allclose(torch.tensor(seq.logprobs.prompt), refs[on], atol=1e-4), on
    assert torch.allclose(torch.tensor(default.logprobs.prompt), refs[False], atol=1e-4)
    plain = Engine(
        model,
        None,
        EngineConfig(cache=CacheConfig(num_blocks=64), fill=fill),
        FillMaps(fitted, "resident", model.dtype, model.device),
    )  # maps without ΔM
    with pytest.raises(InputError, match="the terminal-state correction needs .* maps holding ΔM"):
        plain.add_request(ids, SamplingParams(max_tokens=1), terminal_state=True)
