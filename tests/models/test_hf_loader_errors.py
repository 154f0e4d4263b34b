"""Broken or unsupported HF folders give one ModelLoadError line naming the cause."""

import json
import shutil

import pytest

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.errors import InputError, ModelLoadError, UnsupportedError
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    build_tiny("llama_gqa_untied", folder)
    return folder


def copy(good, tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(good, dst)
    return dst


def one_line(err) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_missing_safetensors(good, tmp_path):
    m = copy(good, tmp_path)
    (m / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_hf_folder(m)
    assert "no *.safetensors" in one_line(e)


def test_corrupt_safetensors(good, tmp_path):
    m = copy(good, tmp_path)
    f = m / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated download
    with pytest.raises(ModelLoadError) as e:
        load_hf_folder(m)
    assert "model.safetensors" in one_line(e) and "corrupt" in one_line(e)


def test_missing_shard_named_in_index(good, tmp_path):
    m = copy(good, tmp_path)
    (m / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ModelLoadError) as e:
        load_hf_folder(m)
    assert "model-00002-of-00002.safetensors" in one_line(e)


def test_unknown_architecture(good, tmp_path):
    m = copy(good, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["model_type"] = "mamba"
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedError) as e:
        load_hf_folder(m)
    assert "mamba" in one_line(e)


def test_missing_tensor_named(good, tmp_path):
    from safetensors.torch import load_file, save_file

    m = copy(good, tmp_path)
    tensors = load_file(str(m / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(m / "model.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        LLM(EngineConfig(model=str(m)))
    assert "model.layers.1.mlp.up_proj.weight" in one_line(e)


def test_prompt_longer_than_context(good):
    llm = LLM(EngineConfig(model=str(good), cache=CacheConfig(num_blocks=256)))
    too_long = [1] * 1020
    with pytest.raises(InputError) as e:
        llm.generate([too_long], SamplingParams(max_tokens=10))
    assert "exceeds the context length of 1024" in one_line(e)
    with pytest.raises(InputError) as e:
        llm.generate([[5, 99999]], SamplingParams(max_tokens=1))
    assert "99999" in one_line(e)
    # the engine keeps serving after refusing
    (ok,) = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
    assert len(ok.token_ids) == 2
