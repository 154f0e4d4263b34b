"""A new dense family with a setting of its own, added the way a plugin would add it: this one
module defines its settings (a FamilyConfig), its config.json parser and its model class, and one
register() call adds it. No runtime file names it, yet config.json folders of it load, the
conversion cache's config reader rebuilds its settings, and the engine serves it."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass

import pytest
import torch
from safetensors.torch import load_file, save_file

from ridgefill_runtime.config import CacheConfig, EngineConfig, FamilyConfig, ModelConfig
from ridgefill_runtime.errors import ModelLoadError
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.loader.checkpoint import model_config_from_dict, model_config_to_dict
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.models import decoder_config, registry
from ridgefill_runtime.models.dense import DenseLM
from ridgefill_runtime.models.family import ModelFamily
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny

NAME = "scaled-embedding"
MULTIPLIER = 2.0  # a power of two: scaling the embedding rows instead gives the same floats


# -- the family: all of it -------------------------------------------------------------------


@dataclass(frozen=True)
class ScaledEmbedding(FamilyConfig):
    """The family's own setting: its input embeddings are multiplied by `embed_multiplier`."""

    embed_multiplier: float

    def __post_init__(self) -> None:
        if not self.embed_multiplier > 0:
            raise ModelLoadError(f"model config: embed_multiplier must be positive, got {self.embed_multiplier}")


def config_from_hf(family: ModelFamily, raw: dict, generation: dict, where: str) -> ModelConfig:
    base = decoder_config.config_from_hf(family, raw, generation, where)
    return base.replace(family_config=ScaledEmbedding(float(raw["embed_multiplier"])))


class ScaledEmbeddingLM(DenseLM):
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.family_config.embed_multiplier  # [N, d]


SCALED_EMBEDDING = ModelFamily(
    name=NAME,
    model_class=ScaledEmbeddingLM,
    parse_hf_config=config_from_hf,
    weight_names=decoder_config.weight_names,
    config_class=ScaledEmbedding,
)


# -- the tests -------------------------------------------------------------------------------


@pytest.fixture
def scaled_family():
    registry.register(SCALED_EMBEDDING)
    yield SCALED_EMBEDDING
    registry.unregister(NAME)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The same random llama three ways: as it is, as the new family (multiplier 2), and as a
    llama whose embedding rows are already doubled (what the new family must compute)."""
    root = tmp_path_factory.mktemp("new-family")
    build_tiny("llama_gqa_untied", root / "llama")
    config = json.loads((root / "llama" / "config.json").read_text())
    shutil.copytree(root / "llama", root / "scaled")
    (root / "scaled" / "config.json").write_text(
        json.dumps({**config, "model_type": NAME, "embed_multiplier": MULTIPLIER})
    )
    shutil.copytree(root / "llama", root / "doubled")
    tensors = load_file(str(root / "llama" / "model.safetensors"))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"] * MULTIPLIER
    save_file(tensors, str(root / "doubled" / "model.safetensors"))
    return root


def _greedy(folder) -> tuple[list[list[int]], list[list[float]]]:
    engine = build_engine(EngineConfig(model=str(folder), cache=CacheConfig(block_size=4, num_blocks=64)))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(p, params) for p in ([5, 17, 3, 99, 42, 8, 250], [1, 2, 3])]
    while engine.has_unfinished():
        engine.step()
    return [s.output_ids for s in seqs], [[t.logprob for t in s.logprobs.output] for s in seqs]


def test_its_config_json_loads_with_its_own_setting(scaled_family, folders):
    config = load_hf_folder(folders / "scaled").config
    assert config.architecture == NAME and config.family_config == ScaledEmbedding(MULTIPLIER)
    # the conversion cache's reader: the family names the class its settings rebuild into
    stored = json.loads(json.dumps(model_config_to_dict(config)))
    assert stored["family_config"] == {"embed_multiplier": MULTIPLIER}
    assert model_config_from_dict(stored) == config
    with pytest.raises(ModelLoadError, match="embed_multiplier must be positive"):
        model_config_from_dict({**stored, "family_config": {"embed_multiplier": 0.0}})


def test_the_engine_serves_it(scaled_family, folders):
    ids, logprobs = _greedy(folders / "scaled")
    assert (ids, logprobs) == _greedy(folders / "doubled")  # bit for bit: the same floats throughout
    assert logprobs != _greedy(folders / "llama")[1]  # and the setting is not ignored


def test_the_registry_checks_its_settings(scaled_family, folders):
    llama = load_hf_folder(folders / "llama").config
    with pytest.raises(ModelLoadError, match="needs a ScaledEmbedding family_config"):
        scaled_family.build_model(llama.replace(architecture=NAME), {}, torch.float32, "cpu")
    with pytest.raises(ModelLoadError, match="architecture 'llama' is not 'scaled-embedding'"):
        scaled_family.build_model(llama.replace(family_config=ScaledEmbedding(MULTIPLIER)), {}, torch.float32, "cpu")
