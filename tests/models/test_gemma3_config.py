"""Gemma 3's config.json parsing (both transformers layouts), its refusals, and the GGUF's norm
convention (llama.cpp stores 1 + w; the loader hands the model Hugging Face's w)."""

from __future__ import annotations

import pytest

from ridgefill_runtime.errors import ModelLoadError, UnsupportedError
from ridgefill_runtime.models.registry import family

GEMMA = family("gemma3_text")
V4 = dict(
    model_type="gemma3_text",
    hidden_size=640,
    intermediate_size=2048,
    num_hidden_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    vocab_size=262144,
    sliding_window=512,
    sliding_window_pattern=6,
    rope_theta=1_000_000.0,
    rope_local_base_freq=10_000.0,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-6,
    eos_token_id=[1, 106],
)


def test_v4_keys_give_the_pattern_bases_and_scale():
    cfg = GEMMA.config_from_hf(V4, {}, "config.json")
    assert cfg.family_config.local_layers == tuple(i for i in range(18) if i not in (5, 11, 17))
    assert (cfg.rope_theta, cfg.family_config.local_rope_theta, cfg.family_config.window) == (1e6, 1e4, 512)
    assert cfg.attention_scale == 256**-0.5 and cfg.qk_norm and cfg.tie_word_embeddings
    assert (
        cfg.eos_token_ids == (1, 106) and cfg.family_config.window_of(4) == 512 and cfg.family_config.window_of(5) == 0
    )


def test_v5_rope_parameters_and_layer_types():
    raw = {k: v for k, v in V4.items() if k not in ("rope_theta", "rope_local_base_freq")}
    raw.update(
        layer_types=["full_attention", "sliding_attention"] * 9,
        query_pre_attn_scalar=144,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 5e5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 2e4},
        },
    )
    cfg = GEMMA.config_from_hf(raw, {}, "config.json")
    assert cfg.family_config.local_layers == tuple(range(1, 18, 2))
    assert (cfg.rope_theta, cfg.family_config.local_rope_theta, cfg.attention_scale) == (5e5, 2e4, 144**-0.5)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 8.0}}, "rope scaling"),
    ],
)
def test_what_we_lack_is_refused_by_name(change, words):
    with pytest.raises(UnsupportedError, match=words):
        GEMMA.config_from_hf({**V4, **change}, {}, "config.json")


def test_bad_layer_types_and_missing_keys_are_named():
    with pytest.raises(ModelLoadError, match="layer_types"):
        GEMMA.config_from_hf({**V4, "layer_types": ["sliding_attention"] * 3}, {}, "config.json")
    with pytest.raises(ModelLoadError, match="'sliding_window'"):
        GEMMA.config_from_hf({k: v for k, v in V4.items() if k != "sliding_window"}, {}, "config.json")


def test_gguf_norms_lose_llama_cpps_one(gemma3_gguf):
    from gguf import GGUFReader

    from ridgefill_runtime.loader.gguf import convert_gguf, dequantize_tensor

    raw = {t.name: t for t in GGUFReader(str(gemma3_gguf)).tensors}
    _, tensors, _ = convert_gguf(gemma3_gguf)
    for gguf_name, hf_name in (
        ("output_norm.weight", "model.norm.weight"),
        ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
        ("blk.5.attn_k_norm.weight", "model.layers.5.self_attn.k_norm.weight"),
    ):
        stored = dequantize_tensor(raw[gguf_name])
        assert (tensors[hf_name] + 1 == stored).all()  # NOTE: exact: the stored values lie in [0.5, 2]
