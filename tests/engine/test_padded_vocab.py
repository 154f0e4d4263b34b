"""A padded vocabulary (issue 31, finding 6): a model whose embedding rows outnumber its
tokenizer's tokens (Huginn's padded_vocab_size, Qwen2.5 and many others) can emit an id no token
spells. Such ids decode to nothing, as in Hugging Face, through the engine's step, the stream and
the logprobs; ids past the model's rows are still refused."""

from __future__ import annotations

import json

import httpx
import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file

from ridgefill_runtime.config import CacheConfig, EngineConfig
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.fill.tokens import TokenTable
from ridgefill_runtime.llm import build_engine
from ridgefill_runtime.sequence import SamplingParams
from ridgefill_server.app import create_app
from ridgefill_server.background import BackgroundServer
from ridgefill_server.config import load_config
from tiny_models import TINY_CONFIGS, build_tiny

TOKENS = 300  # the tokenizer's vocabulary; the model has TINY_CONFIGS' 320 rows
PADDED = (310, 311)  # the rows the model is forced to emit


def write_padded_model(folder, name: str = "llama_gqa_untied") -> None:
    """A tiny llama (or qwen2) with 320 rows, a 300-word tokenizer, and a head that only ever picks row 310
    or 311: the final norm keeps hidden dimension 0 alone, and only those two rows read it
    (+50 and -50), so whatever its sign one of them wins by 50 over every real token."""
    assert TINY_CONFIGS[name]["vocab_size"] == 320 and not TINY_CONFIGS[name]["tie_word_embeddings"]
    build_tiny(name, folder)
    weights = load_file(str(folder / "model.safetensors"))
    norm = torch.zeros_like(weights["model.norm.weight"])
    norm[0] = 1.0
    head = torch.zeros_like(weights["lm_head.weight"])
    head[PADDED[0], 0], head[PADDED[1], 0] = 50.0, -50.0
    weights["model.norm.weight"], weights["lm_head.weight"] = norm, head
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})

    words = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(3, TOKENS))]
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in words[:3]])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False})
    )


# NOTE: qwen2 is the family whose real checkpoints are padded (151,936 rows for 151,665 tokens).
@pytest.fixture(scope="module", params=["llama_gqa_untied", "qwen2_untied"])
def engine_cfg(tmp_path_factory, request):
    folder = tmp_path_factory.mktemp("padded")
    write_padded_model(folder, request.param)
    torch.set_num_threads(2)
    return EngineConfig(model=str(folder), cache=CacheConfig(num_blocks=64))


@pytest.fixture(scope="module")
def engine(engine_cfg):
    return build_engine(engine_cfg)


def test_hugging_face_decodes_ids_without_a_token_to_nothing():
    """The behaviour we follow: tokenizers' decode leaves out ids it has no token for."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    assert backend.decode([0, 5, 1, 1000]) == backend.decode([0, 1])


def test_padded_rows_decode_to_nothing_and_rows_past_the_model_are_refused(engine):
    tok = engine.tokenizer
    assert tok.vocab_size == TOKENS and tok.decodable_ids == 320
    assert tok.decode([5, 310, 6]) == tok.decode([5, 6]) == "w5 w6"
    assert tok.decode([319]) == ""
    assert tok.token_type(310) == "unused"
    with pytest.raises(InputError, match="320"):
        tok.decode([320])
    with pytest.raises(InputError):
        engine.validate([5, 320], SamplingParams(max_tokens=1))
    engine.validate([5, 310], SamplingParams(max_tokens=1))  # a row of the model is a valid prompt id
    # The exact-row rules read prompt ids in the token table: the padded rows are there, unused.
    table = TokenTable.from_tokenizer(tok, counts=[1] * TOKENS)
    assert len(table.pieces) == 320 and table.pieces[310] == "" and 310 in table.special
    assert table.counts[310] == 0


def test_engine_step_emits_padded_ids_as_empty_text(engine):
    seq = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    assert seq.finished and len(seq.output_ids) == 4
    assert set(seq.output_ids) <= set(PADDED)
    assert seq.text == "" and all(out.delta_text == "" for out in outputs)


def test_server_streams_and_scores_padded_ids(engine_cfg, engine):
    _, server_cfg, fill = load_config(None, {})
    with BackgroundServer(create_app(engine_cfg, server_cfg, fill, build=lambda: engine)) as srv:
        srv.wait_ready()
        plain = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": "w5 w6 w7", "max_tokens": 3, "temperature": 0, "logprobs": 5, "echo": True},
            timeout=60,
        )
        assert plain.status_code == 200, plain.text
        choice = plain.json()["choices"][0]
        assert choice["text"] == "w5 w6 w7" and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert lp["tokens"][3:] == ["", "", ""]
        assert all("" in top for top in lp["top_logprobs"][3:])  # the padded alternatives, as ""

        streamed = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": [5, 310, 6], "max_tokens": 3, "stream": True, "logprobs": 2},
            timeout=60,
        )
        assert streamed.status_code == 200, streamed.text
        events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ""

        detok = httpx.post(srv.url + "/detokenize", json={"tokens": [5, 310, 6]}, timeout=60)
        assert detok.status_code == 200 and detok.json()["prompt"] == "w5 w6", detok.text
        past = httpx.post(srv.url + "/detokenize", json={"tokens": [5, 320]}, timeout=60)
        assert past.status_code == 400 and "320" in past.text
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 320], "max_tokens": 1}, timeout=60)
        assert bad.status_code == 400 and "320" in bad.text
