"""The model-family registry: one list of supported architectures for both loaders and the
engine, and a family added at run time is loaded and built like a built-in one."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from ridgefill_runtime.config import EngineConfig, CacheConfig, ModelConfig
from ridgefill_runtime.errors import UnsupportedError
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models import decoder_config, registry
from ridgefill_runtime.models.dense import DenseLM
from ridgefill_runtime.models.family import GGUFFormat, ModelFamily
from tiny_models import build_tiny


def _config(architecture: str) -> ModelConfig:
    return ModelConfig(
        architecture=architecture,
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=16,
        tie_word_embeddings=True,
    )


class RecordingLM(DenseLM):
    """The dense model, marked so a test can tell the registry chose this class."""


@pytest.fixture
def tiny_family():
    family = ModelFamily(
        name="tiny-test",
        model_class=RecordingLM,
        parse_hf_config=decoder_config.config_from_hf,
        weight_names=decoder_config.weight_names,
    )
    registry.register(family)
    yield family
    registry.unregister(family.name)


def test_one_list_names_the_built_in_families():
    assert registry.supported() == (
        "llama",
        "qwen2",
        "qwen3",
        "qwen3_5_text",
        "qwen3_5",
        "qwen3_next",
        "huginn_raven",
        "gemma3_text",
    )
    # no GGUF reader for the hybrids or looped models
    assert registry.gguf_architectures() == ("llama", "qwen2", "qwen3", "gemma3")
    assert registry.family("qwen3").qk_norm and not registry.family("llama").qk_norm
    assert (
        registry.family("llama").gguf.interleaved_rope_rows and not registry.family("qwen3").gguf.interleaved_rope_rows
    )


def test_unsupported_architecture_messages_name_the_supported_list():
    every = "llama, qwen2, qwen3, qwen3_5_text, qwen3_5, qwen3_next, huginn_raven, gemma3_text"
    with pytest.raises(UnsupportedError, match=rf"unsupported architecture 'mamba' \(supported: {every}\)"):
        registry.family(_config("mamba").architecture)
    with pytest.raises(
        UnsupportedError,
        match=r"^cfg.json: unsupported architecture model_type='mamba' "
        rf"\(supported: {every}\)$",
    ):
        registry.family_for_model_type("mamba", "cfg.json")
    with pytest.raises(
        UnsupportedError,
        match=r"^x.gguf: GGUF architecture 'mamba' is not supported "
        r"\(supported: llama, qwen2, qwen3, gemma3\)$",
    ):
        registry.family_for_gguf("mamba", "x.gguf")


def test_gguf_names_are_per_family():
    llama, qwen3 = registry.family("llama").gguf, registry.family("qwen3").gguf
    assert (
        llama.hf_name("blk.3.attn_q.weight")
        == qwen3.hf_name("blk.3.attn_q.weight")
        == "model.layers.3.self_attn.q_proj.weight"
    )
    assert llama.hf_name("output.weight") == "lm_head.weight"
    # QK-norm is Qwen3's: a llama file holding it has a tensor with no place in the model.
    assert qwen3.hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert llama.hf_name("blk.0.attn_k_norm.weight") is None and llama.hf_name("blk.x.attn_q.weight") is None


def test_register_refuses_a_taken_name_and_families_are_frozen(tiny_family):
    with pytest.raises(ValueError, match="already registered"):
        registry.register(dataclasses.replace(tiny_family))
    gguf = GGUFFormat(
        architecture="llama", parse_config=decoder_config.config_from_gguf, top_level_names={}, layer_part_names={}
    )
    with pytest.raises(ValueError, match="GGUF architecture 'llama' is already registered"):
        registry.register(dataclasses.replace(tiny_family, name="other", gguf=gguf))
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_family.qk_norm = True
    with pytest.raises(TypeError):
        registry.family("qwen3").gguf.layer_part_names["attn_q"] = "x"  # shared tables are read-only
    with pytest.raises(ValueError, match="model_class must be callable"):
        ModelFamily(
            name="bad",
            model_class=None,
            parse_hf_config=decoder_config.config_from_hf,
            weight_names=decoder_config.weight_names,
        )


def test_a_registered_family_validates_loads_and_builds(tiny_family, tmp_path_factory):
    assert _config("tiny-test").architecture == "tiny-test"
    assert "tiny-test" in registry.supported()
    folder = tmp_path_factory.mktemp("tiny-test")
    build_tiny("llama_gqa_untied", folder / "src")
    shutil.copytree(folder / "src", folder / "m")
    cfg = json.loads((folder / "m" / "config.json").read_text())
    (folder / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "tiny-test"}))
    assert load_hf_folder(folder / "m").config.architecture == "tiny-test"
    engine = build_engine(EngineConfig(model=str(folder / "m"), cache=CacheConfig(num_blocks=8)))
    assert type(engine.model) is RecordingLM
    # Unregistered, the same folder is refused by name.
    registry.unregister("tiny-test")
    with pytest.raises(UnsupportedError, match="model_type='tiny-test'"):
        load_hf_folder(folder / "m")
    registry.register(tiny_family)  # for the fixture's teardown
