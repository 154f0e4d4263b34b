"""GET /tokenizer_info as lm-eval's remote tokenizer backend uses it (lm_eval.utils.RemoteTokenizer,
0.4.13): the special tokens' spellings, which /tokenize turns back into the model's ids, and a chat
template that jinja2 renders to what the server itself sends the model."""

from __future__ import annotations

import httpx
import jinja2
import pytest

from served_app import serve_embedded


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_embedded(tmp_path_factory)


def test_tokenizer_info_is_what_a_remote_tokenizer_needs(served):
    tok = served.engine.tokenizer
    info = httpx.get(served.url + "/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert info["model_max_length"] == served.engine.max_model_len and info["vocab_size"] == tok.vocab_size
    # RemoteTokenizer.eos_token_id: /tokenize of the spelling, without special tokens added
    ids = httpx.post(
        served.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}, timeout=30
    ).json()["tokens"]
    assert ids == [tok.eos_token_ids[0]]
    # RemoteTokenizer.apply_chat_template: jinja2 on the template string
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    rendered = (
        jinja2.Environment()
        .from_string(info["chat_template"])
        .render(messages=messages, add_generation_prompt=True, bos_token=info["bos_token"], eos_token=info["eos_token"])
    )
    assert rendered == tok.apply_chat_template(messages, add_generation_prompt=True)
    served_ids = httpx.post(served.url + "/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert tok.encode(rendered, add_special_tokens=False) == served_ids
