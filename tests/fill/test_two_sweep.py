"""The two-sweep prefill (seed 000, Figure 5) against a reference assembled from transformers'
modules: exact prefix rows, the probe's late-layer attention and the lower-layer attention
selector's scores, batching and chunking."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.fill.select import top_rows
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models.registry import family
from ridgefill_runtime.offline import PromptLogits
from ridgefill_runtime.sequence import SamplingParams
from fill_reference import reference_tail_logits
from tiny_models import build_tiny

SPLIT, TAIL, N = 1, 40, 150
EXACT = [0, 3, 17, 18, 64, 109]  # scattered, adjacent, first position


@pytest.fixture(scope="module", params=["llama_gqa_untied", "qwen3_qk_norm", "gemma3_sliding"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_tiny(request.param, folder)
    hf.config._attn_implementation = "eager"
    ckpt = load_hf_folder(folder)
    torch.manual_seed(3)
    ids = torch.randint(0, ckpt.config.vocab_size, (N,)).tolist()
    return dict(hf=hf, ckpt=ckpt, model=build(ckpt), ids=ids)


def build(ckpt, tensors=None, device="cpu"):
    """Our model through the registry: Gemma 3 is a DenseLM subclass with its own norms, RoPE
    bases, embedding scale and windows, which a bare DenseLM would silently drop."""
    return family(ckpt.config.architecture).build_model(
        ckpt.config, ckpt.tensors if tensors is None else tensors, torch.float32, device
    )


def rel_err(a, b):
    return float((a - b).abs().max() / b.abs().max())


def fill(arm, **rows):
    return FillConfig(arm=arm, split=SPLIT, tail=TAIL, rows=RowsConfig(**rows))


def fixed(rows):
    return lambda seq: list(rows)


@pytest.mark.parametrize("arm", ["identity", "nofill"])
@pytest.mark.parametrize("chunk", [512, 23])
def test_exact_rows_match_reference(tiny, arm, chunk):
    run = PromptLogits(tiny["model"], fill(arm, selectors=("special",)), chunk=chunk, selector=fixed(EXACT))
    first, logits, _, seq = run(tiny["ids"])
    ref, _ = reference_tail_logits(
        tiny["hf"], tiny["ids"], SPLIT, TAIL, predict=lambda l, x: x, nofill=arm == "nofill", exact_rows=EXACT
    )
    assert seq.fill.exact_rows == EXACT and first == N - TAIL
    assert rel_err(logits, ref) < 1e-4
    plain, _ = reference_tail_logits(
        tiny["hf"], tiny["ids"], SPLIT, TAIL, predict=lambda l, x: x, nofill=arm == "nofill"
    )
    assert rel_err(logits, plain) > 1e-3  # the rows made a difference the test can see


def test_every_prefix_row_exact_is_exact_prefill(tiny):
    exact = PromptLogits(tiny["model"])(tiny["ids"], logits_from=N - TAIL)[1]
    every = fixed(range(N - TAIL))
    logits = PromptLogits(tiny["model"], fill("identity", selectors=("special",)), chunk=37, selector=every)(
        tiny["ids"]
    )[1]
    assert rel_err(logits, exact) < 1e-5


def test_probe_scores_equal_late_layer_attention(tiny):
    """With the probe rows = the tail, the probe reads exactly what the reference's tail reads;
    its ranking's first row is the row the reference's late layers attend to most."""
    cfg = fill("identity", selectors=("probe",), probe_window=TAIL)
    captured = {}

    def select(seq):
        captured.update(seq.fill.row_scores)
        return []

    PromptLogits(tiny["model"], cfg, chunk=50, selector=select)(tiny["ids"])
    _, _, mass = reference_tail_logits(tiny["hf"], tiny["ids"], SPLIT, TAIL, predict=lambda l, x: x, want_mass=True)
    probe = torch.tensor(captured["probe"])
    assert probe.shape == mass.shape
    assert rel_err(probe, mass) < 1e-4
    assert top_rows(captured["probe"], 1, set()) == {int(mass.argmax())}


def planted_model(tiny, needle_token: int):
    """A copy of the tiny model whose late layers attend to `needle_token` above all: in the
    lowest-frequency RoPE pair (it barely rotates over 150 positions) every late query reads a
    feature all tokens carry and every late key reads a feature only the needle token has."""
    ckpt = tiny["ckpt"]
    model = build(ckpt, {k: v.clone() for k, v in ckpt.tensors.items()})
    cfg, w = model.config, model.weights
    carried, marked = 0, 1  # residual features
    w.embed[:, carried] += 1.0
    w.embed[needle_token, marked] = 8.0
    hd, lo = cfg.head_dim, cfg.head_dim // 2 - 1  # lo and lo + D/2: the slowest pair
    q_dim = cfg.num_heads * hd
    for layer in range(SPLIT, cfg.num_layers):
        qkv = w.layers[layer].qkv
        for h in range(cfg.num_heads):
            qkv[h * hd + lo] = 0
            qkv[h * hd + lo, carried] = 4.0
            qkv[h * hd + lo + hd // 2] = 0
        for g in range(cfg.num_kv_heads):
            row = q_dim + g * hd
            qkv[row + lo] = 0
            qkv[row + lo, marked] = 4.0
            qkv[row + lo + hd // 2] = 0
    return model


def test_probe_ranks_a_planted_needle_row_first(tiny):
    ids, needle = list(tiny["ids"]), 61
    ids[needle] = 5
    ids = [5 if (t == 5 and p != needle) else t for p, t in enumerate(ids)]  # the token occurs once
    cfg = fill("identity", selectors=("probe",), probe_window=16)
    captured = {}
    PromptLogits(planted_model(tiny, 5), cfg, selector=lambda seq: captured.update(seq.fill.row_scores) or [])(ids)
    # (on Gemma only global layer 1 can: local layer 2's 16-key window ends far after the needle)
    assert top_rows(captured["probe"], 1, set()) == {needle}
    captured.clear()  # control: the unmodified model has no reason to prefer it
    PromptLogits(tiny["model"], cfg, selector=lambda seq: captured.update(seq.fill.row_scores) or [])(ids)
    assert top_rows(captured["probe"], 1, set()) != {needle}


def reached_rows(hf, first_query: int) -> torch.Tensor:
    """Prefix rows [P] that layer 0 lets query rows first_query.. see: all of them on a global
    layer; on a local one (Gemma's layer 0, 16 keys) only j > first_query - window."""
    types = getattr(hf.config, "layer_types", None)
    start = first_query - hf.config.sliding_window + 1 if types and types[0] == "sliding_attention" else 0
    return torch.arange(N - TAIL) >= start


def assert_scores_match(got, ref, reached):
    """Same support as the window allows (a selector ignoring it would score unreachable rows),
    then the values; an all-zero ref (nothing in reach) must be matched exactly."""
    assert torch.equal(ref > 0, reached) and torch.equal(got > 0, reached)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


# Gemma's layer 0 is local (16 keys): the last 16 query rows reach no prefix row (every score 0,
# ours and transformers'), the last 48 only the prefix's last 23 rows (87..109); Llama and Qwen3
# reach all of it either way
@pytest.mark.parametrize("window", [16, 48])
def test_lower_attention_scores_equal_transformers(tiny, window):
    cfg = fill("identity", selectors=("attention",), attention_layers=(0,), window=window)
    captured = {}
    PromptLogits(tiny["model"], cfg, chunk=29, selector=lambda seq: captured.update(seq.fill.row_scores) or [])(
        tiny["ids"]
    )
    with torch.no_grad():
        out = tiny["hf"](torch.tensor([tiny["ids"]]), output_attentions=True)
    att = out.attentions[0][0]  # [H, N, N] layer 0
    ref = att[:, N - window :, : N - TAIL].sum(dim=(0, 1))
    assert_scores_match(torch.tensor(captured["attention"]), ref, reached_rows(tiny["hf"], N - window))


@pytest.mark.parametrize("window", [16, 48])
def test_question_hidden_window_ends_at_hide_from(tiny, window):
    hide = N - 10
    cfg = fill("identity", selectors=("attention",), attention_layers=(0,), window=window)
    captured = {}
    run = PromptLogits(tiny["model"], cfg, selector=lambda seq: captured.update(seq.fill.row_scores) or [])
    run(tiny["ids"], hide_from=hide)
    with torch.no_grad():
        att = tiny["hf"](torch.tensor([tiny["ids"]]), output_attentions=True).attentions[0][0]
    ref = att[:, hide - window : hide, : N - TAIL].sum(dim=(0, 1))
    assert_scores_match(torch.tensor(captured["attention"]), ref, reached_rows(tiny["hf"], hide - window))


def engine(tiny, fill_config, selector=None):
    eng = Engine(
        tiny["model"],
        None,
        EngineConfig(
            cache=CacheConfig(num_blocks=64),
            fill=fill_config,
            scheduler=SchedulerConfig(chunk_size=48, max_num_batched_tokens=64),
        ),
    )
    if selector is not None:
        eng.scheduler.select = selector
    return eng


def generate(eng, ids, n=6, **kw):
    seq = eng.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True), **kw)
    while eng.has_unfinished():
        eng.step()
    return seq


def test_engine_two_sweep_batched_with_others_equals_alone(tiny):
    """Two filled requests with exact rows and an exact one share steps (budget 64, chunks 48):
    each produces what it produces alone, and the filled one's first token matches the reference."""
    cfg = fill("identity", selectors=("special",))
    ids2, ids3 = tiny["ids"][::-1], tiny["ids"][5:]
    eng = engine(tiny, cfg, fixed(EXACT))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    a = eng.add_request(tiny["ids"], params)
    b = eng.add_request(ids2, params, fill=False)
    c = eng.add_request(ids3, params)
    while eng.has_unfinished():
        eng.step()
    assert a.fill.exact_rows == EXACT and c.fill.exact_rows == EXACT and b.fill.boundary == 0
    assert a.output_ids == generate(engine(tiny, cfg, fixed(EXACT)), tiny["ids"]).output_ids
    assert b.output_ids == generate(engine(tiny, FillConfig()), ids2).output_ids
    assert c.output_ids == generate(engine(tiny, cfg, fixed(EXACT)), ids3).output_ids
    ref, _ = reference_tail_logits(tiny["hf"], tiny["ids"], SPLIT, TAIL, predict=lambda l, x: x, exact_rows=EXACT)
    assert a.output_ids[0] == int(ref[-1].argmax())


def test_special_rows_default_makes_position_zero_exact(tiny):
    seq = generate(engine(tiny, fill("identity")), tiny["ids"], n=1)
    assert seq.fill.exact_rows == [0]


@pytest.mark.gpu
def test_exact_rows_on_cuda_match_the_cpu_run(tiny):
    """On CUDA the late sweep's scattered rows go through the scattered_rows_attention kernel
    (on Gemma also its sliding-window path: layer 2 is local)."""
    ckpt = tiny["ckpt"]
    gpu = build(ckpt, device="cuda")
    cfg = fill("identity", selectors=("special",))
    cpu_logits = PromptLogits(tiny["model"], cfg, chunk=23, selector=fixed(EXACT))(tiny["ids"])[1]
    gpu_logits = PromptLogits(gpu, cfg, chunk=23, selector=fixed(EXACT))(tiny["ids"])[1]
    assert rel_err(gpu_logits.cpu(), cpu_logits) < 1e-3
