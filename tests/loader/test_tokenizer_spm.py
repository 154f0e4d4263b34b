"""llama.cpp's SentencePiece tokenizer kind (`tokenizer.ggml.model == "llama"`), checked on the real
Gemma 3 270M GGUF against two independent references: llama.cpp itself (through llama-cpp-python,
the runtime the file was made for) and transformers' GGUF tokenizer converter."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import gguf
import pytest

from ridgefill_runtime.errors import UnsupportedError
from ridgefill_runtime.loader.tokenizer import (
    GEMMA_CHAT_TEMPLATE,
    DetokenizerState,
    Tokenizer,
    detokenize_incrementally,
)

# A few KB of real text: the start of a stdlib module (prose docstrings, indented code, blank lines).
LONG_DOCUMENT = Path(textwrap.__file__).read_text(encoding="utf-8")[:6000]

# Texts without special tokens: they must also decode back to themselves.
PLAIN_TEXTS = [
    "The quick brown fox jumps over the lazy dog. It wasn't the dog's fault, was it?",
    "def f(x):\n\tif x:  \n\t\treturn x * 2\n\n\n    else:\n        pass  # four spaces\n",
    "multiple  spaces   between    words     and\t\ttabs \t mixed",
    "   leading and trailing   ",
    " one leading space",
    "\n\nnewlines\nat\n\n\nboth ends\n",
    "\r\n\r\nwindows\r\nlines",
    " " * 40 + "x" + "\n" * 40 + "y" + "\t" * 35,  # runs longer than the 31-long whitespace tokens
    "日本語のテキストと中文字符, 한국어 텍스트",
    "emoji 🤖🚀 family 👩‍👩‍👧 flag 🇫🇷",
    # Characters the vocabulary lacks: spelled with <0xXX> byte tokens.
    "byte fallback: 🌁 𠀀 丌 ☈ 💱 Ŧƀ",
    "naïve café, Ünïcödé façade — “quotes” …½ ñ Ελληνικά Русский",
    "numbers 0 12 345 6789 3.14159 1,000,000 -42 v2 2025-01-31",
    "html the vocabulary knows whole: <table><tr><td>x</td></tr></table> <b>bold</b>",
    "looks like a byte token: <0x41> and half a tag <start_of_turn",
    "x",
    "",
    LONG_DOCUMENT,
]
# Texts with control tokens written in them: matched whole, as llama.cpp does with special=True.
SPECIAL_TEXTS = [
    "<start_of_turn>user\nhi<end_of_turn>",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n4<end_of_turn>\n",
    "<bos>text<eos><pad><unk><mask> <unused0>[multimodal]<start_of_image><end_of_image>",
    "no space<end_of_turn>after",
]
ALL_TEXTS = PLAIN_TEXTS + SPECIAL_TEXTS
# SentencePiece reads U+2581 in the input as a space, so such text encodes like llama.cpp but
# decodes with spaces (llama.cpp does the same).
SPACE_SYMBOL_TEXT = "a\u2581b \u2581\u2581c"


# transformers' GGUF converter makes Gemma's user-defined whitespace tokens ordinary pieces spelled
# with U+2581, reached by merges rather than matched whole in the text. So a run of more than 31
# spaces (the longest such token) splits differently ([16, 24] spaces for 40, where llama.cpp and
# SentencePiece's longest match give [31, 9]), and so does U+2581 written in the text next to a
# space. transformers sees those texts with the long runs cut to 31 spaces.
def transformers_diverges(text: str) -> bool:
    return re.search(" {32,}", text) is not None or "\u2581" in text


TRANSFORMERS_TEXTS = [t for t in ALL_TEXTS if not transformers_diverges(t)] + [
    re.sub(" {32,}", " " * 31, LONG_DOCUMENT)
]


def text_id(text: str) -> str:
    return repr(text[:30]) + (f"...({len(text)} chars)" if len(text) > 30 else "")


# -- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reader(gemma3_gguf):
    return gguf.GGUFReader(str(gemma3_gguf))


@pytest.fixture(scope="module")
def ours(reader):
    return Tokenizer.from_gguf_metadata(reader)


@pytest.fixture(scope="module")
def llama_cpp_vocab(gemma3_gguf):
    import llama_cpp  # installed by install.sh --test; a missing one fails here, loudly

    return llama_cpp.Llama(model_path=str(gemma3_gguf), vocab_only=True, verbose=False)


@pytest.fixture(scope="module")
def transformers_tokenizer(gemma3_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name)


def llama_cpp_ids(vocab, text: str, add_bos: bool = True) -> list[int]:
    return vocab.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)


def llama_cpp_text(llm, ids: list[int], special: bool = False) -> str:
    """llama.cpp's whole-sequence detokenizer (`llama_detokenize`); `special` renders control tokens."""
    import ctypes

    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    size = 64 + 32 * len(ids)
    buffer = ctypes.create_string_buffer(size)
    n = llama_cpp.llama_detokenize(
        vocab, (llama_cpp.llama_token * len(ids))(*ids), len(ids), buffer, size, False, special
    )
    assert 0 <= n <= size
    return buffer.raw[:n].decode("utf-8")


# -- what the file holds ---------------------------------------------------------------------


def test_gemma_gguf_tokenizer_metadata(reader):
    """The facts the SentencePiece path relies on, as this file states them."""

    def value(key):
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    assert value("tokenizer.ggml.model") == "llama"
    assert value("tokenizer.ggml.pre") == "default"
    assert len(value("tokenizer.ggml.tokens")) == 262144
    assert len(value("tokenizer.ggml.scores")) == 262144
    assert value("tokenizer.ggml.merges") is None  # merge order comes from the scores
    assert value("tokenizer.chat_template") is None  # the base model
    assert (
        value("tokenizer.ggml.bos_token_id"),
        value("tokenizer.ggml.eos_token_id"),
        value("tokenizer.ggml.unknown_token_id"),
        value("tokenizer.ggml.padding_token_id"),
    ) == (2, 1, 3, 0)
    assert value("tokenizer.ggml.add_bos_token") is True
    assert value("tokenizer.ggml.add_eos_token") is False
    assert value("tokenizer.ggml.add_space_prefix") is False


def test_special_ids_and_token_types(ours, transformers_tokenizer):
    assert ours.vocab_size == 262144
    assert (ours.bos_token_id, ours.unk_token_id, ours.pad_token_id) == (2, 3, 0)
    assert ours.bos_token_id == transformers_tokenizer.bos_token_id
    # <eos>, then <end_of_turn>: a chat turn's end stops generation too.
    assert ours.eos_token_ids == (1, 106)
    assert ours.id_to_token(105) == "<start_of_turn>" and ours.id_to_token(106) == "<end_of_turn>"
    assert ours.token_type(105) == "control" and 105 in ours.special_ids
    assert ours.token_type(107) == "user_defined" and 107 not in ours.special_ids  # "\n"
    assert ours.token_type(238) == "byte" and ours.id_to_token(238) == "<0x00>"
    assert ours.token_type(9259) == "normal"
    assert sum(kind == "control" for kind in ours.token_types) == 6249
    assert sum(kind == "user_defined" for kind in ours.token_types) == 165
    assert sum(kind == "byte" for kind in ours.token_types) == 256


def test_end_of_turn_is_end_of_generation_for_llama_cpp(llama_cpp_vocab, ours):
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llama_cpp_vocab.model)
    eog = {i for i in range(ours.vocab_size) if llama_cpp.llama_vocab_is_eog(vocab, i)}
    # llama.cpp also stops on any token spelled "</s>" (a rule for another model); in Gemma's
    # vocabulary that is the user-defined HTML tag (id 212), which a model may well write.
    assert ours.id_to_token(212) == "</s>" and ours.token_type(212) == "user_defined"
    assert eog - {212} == set(ours.eos_token_ids)


# -- encoding --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ALL_TEXTS + [SPACE_SYMBOL_TEXT], ids=text_id)
def test_encoding_matches_llama_cpp(ours, llama_cpp_vocab, text):
    assert ours.encode(text) == llama_cpp_ids(llama_cpp_vocab, text)
    assert ours.encode(text, add_special_tokens=False) == llama_cpp_ids(llama_cpp_vocab, text, add_bos=False)


@pytest.mark.parametrize("text", TRANSFORMERS_TEXTS, ids=text_id)
def test_encoding_matches_transformers(ours, transformers_tokenizer, text):
    assert ours.encode(text) == transformers_tokenizer.encode(text)


def test_transformers_comparison_keeps_most_texts():
    assert len(TRANSFORMERS_TEXTS) >= len(ALL_TEXTS) - 1
    assert max(len(run) for run in re.findall(" +", TRANSFORMERS_TEXTS[-1])) == 31


def test_bos_follows_the_gguf_flag(ours):
    assert ours.encode("hi") == [2] + ours.encode("hi", add_special_tokens=False)
    assert ours.encode("") == [2]
    assert ours.encode("", add_special_tokens=False) == []


def test_byte_fallback_spells_missing_characters_in_bytes(ours):
    ids = ours.encode("🌁", add_special_tokens=False)  # F0 9F 8C 81, no piece in the vocabulary
    assert [ours.id_to_token(i) for i in ids] == ["<0xF0>", "<0x9F>", "<0x8C>", "<0x81>"]
    assert all(ours.token_type(i) == "byte" for i in ids)


def test_long_whitespace_runs_use_the_whole_tokens(ours):
    # Gemma's user-defined tokens: runs of 2..31 spaces, 1..31 newlines and 1..31 tabs.
    ids = ours.encode(" " * 40, add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids] == [" " * 31, " " * 9]


# -- decoding --------------------------------------------------------------------------------


@pytest.mark.parametrize("text", PLAIN_TEXTS, ids=text_id)
def test_decode_round_trips_and_matches_references(ours, llama_cpp_vocab, transformers_tokenizer, text):
    ids = ours.encode(text)
    assert ids[0] == 2
    assert ours.decode(ids[1:]) == text
    assert ours.decode(ids, skip_special_tokens=True) == text
    assert ours.decode(ids) == "<bos>" + text
    # llama.cpp's own detokenizer leaves control tokens out of its text unless asked for them.
    assert llama_cpp_text(llama_cpp_vocab, ids) == text
    assert llama_cpp_text(llama_cpp_vocab, ids, special=True) == "<bos>" + text
    # The binding's piece-by-piece detokenize drops a leading space after BOS (a Llama 1
    # habit of llama-cpp-python, not llama.cpp's), so it gets the ids without BOS.
    assert llama_cpp_vocab.detokenize(ids[1:]).decode("utf-8") == text
    assert transformers_tokenizer.decode(ids) == ours.decode(ids)
    assert transformers_tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("text", SPECIAL_TEXTS + [SPACE_SYMBOL_TEXT], ids=text_id)
def test_decode_with_special_tokens_matches_llama_cpp(ours, llama_cpp_vocab, text):
    ids = ours.encode(text, add_special_tokens=False)
    expected = llama_cpp_text(llama_cpp_vocab, ids, special=True)
    assert ours.decode(ids) == expected == llama_cpp_vocab.detokenize(ids, special=True).decode("utf-8")
    if text != SPACE_SYMBOL_TEXT:
        assert expected == text
    assert ours.decode(ids, skip_special_tokens=True) == llama_cpp_text(llama_cpp_vocab, ids)


def test_skip_special_tokens_keeps_user_defined_tokens(ours):
    ids = ours.encode("<start_of_turn>user\n<b>hi</b>\n\n<end_of_turn>", add_special_tokens=False)
    assert ours.decode(ids, skip_special_tokens=True) == "user\n<b>hi</b>\n\n"


# -- streaming -------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ALL_TEXTS, ids=text_id)
def test_streamed_text_equals_whole_decode(ours, text):
    ids = ours.encode(text)
    deltas = detokenize_incrementally(ours, ids)
    assert "".join(deltas) == ours.decode(ids)
    assert not any("\ufffd" in delta for delta in deltas)


def test_stream_holds_a_character_split_over_byte_tokens(ours):
    ids = ours.encode("a🌁b", add_special_tokens=False)
    assert [ours.id_to_token(i) for i in ids[1:5]] == ["<0xF0>", "<0x9F>", "<0x8C>", "<0x81>"]
    state = DetokenizerState(ours, prompt_ids=ours.encode("<start_of_turn>model\n"))
    deltas = [state.add(i) for i in ids]
    assert deltas == ["a", "", "", "", "🌁", "b"]
    assert state.flush() == ""


def test_stream_keeps_spaces_between_pieces(ours):
    text = "Hello there,   world!\n\tok  ☈ 日本"
    ids = ours.encode(text, add_special_tokens=False)
    state = DetokenizerState(ours)
    assert "".join(state.add(i) for i in ids) + state.flush() == text


# -- chat template ---------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime, ünïcode 🙂."},
    {"role": "assistant", "content": "7"},
    {"role": "user", "content": "Another one?"},
]
EXPECTED_PROMPT = (
    "<bos><start_of_turn>user\nYou are terse.\n\nName a prime, ünïcode 🙂.<end_of_turn>\n"
    "<start_of_turn>model\n7<end_of_turn>\n"
    "<start_of_turn>user\nAnother one?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


def test_gemma_turn_template_is_used_without_a_gguf_template(ours):
    assert ours.chat_template == GEMMA_CHAT_TEMPLATE


def test_chat_template_renders_gemma_turns(ours, llama_cpp_vocab):
    prompt = ours.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    assert prompt == EXPECTED_PROMPT
    # The template writes BOS itself, so the prompt is encoded without adding another.
    ids = ours.encode(prompt, add_special_tokens=False)
    assert ids == llama_cpp_ids(llama_cpp_vocab, prompt, add_bos=False)
    assert ids[:3] == [2, 105, 2364]  # <bos> <start_of_turn> user
    assert ids[-3:] == [105, 4368, 107]  # <start_of_turn> model \n
    assert ids.count(106) == 3


def test_chat_template_without_generation_prompt_or_system(ours):
    messages = CONVERSATION[1:3]
    assert ours.apply_chat_template(messages, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nName a prime, ünïcode 🙂.<end_of_turn>\n<start_of_turn>model\n7<end_of_turn>\n"
    )


def test_chat_template_system_without_user_turn(ours):
    assert ours.apply_chat_template([{"role": "system", "content": "Be brief."}]) == (
        "<bos><start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n"
    )


def test_chat_template_refuses_a_late_system_message(ours):
    from ridgefill_runtime.errors import InputError

    with pytest.raises(InputError, match="system"):
        ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}])


# -- the conversion cache --------------------------------------------------------------------


def test_serialized_tokenizer_behaves_the_same(ours):
    loaded = Tokenizer.from_json_str(ours.to_json_str())
    for text in ALL_TEXTS:
        assert loaded.encode(text) == ours.encode(text), text_id(text)
        assert loaded.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert loaded.apply_chat_template(CONVERSATION) == EXPECTED_PROMPT
    assert (loaded.special_ids, loaded.eos_token_ids, loaded.token_types, loaded.bos_token_id) == (
        ours.special_ids,
        ours.eos_token_ids,
        ours.token_types,
        ours.bos_token_id,
    )


# -- small SentencePiece vocabularies: the choices the real file does not exercise -------------


def spm_metadata(pieces: dict[str, float], extra: dict | None = None) -> dict:
    """A SentencePiece GGUF tokenizer: <unk> <s> </s>, the 256 byte tokens, then `pieces`
    (normal tokens with their scores)."""
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": specials + byte_tokens + list(pieces),
        "tokenizer.ggml.scores": [0.0] * (3 + 256) + list(pieces.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
    }
    metadata.update(extra or {})
    return metadata


def spm_pieces(tokenizer: Tokenizer, text: str, **kwargs) -> list[str]:
    return [tokenizer.id_to_token(i) for i in tokenizer.encode(text, **kwargs)]


@pytest.mark.parametrize(
    "scores, expected",
    [
        # SentencePiece joins the pair whose joined piece scores highest, whatever the ids.
        ({"▁h": -2.0, "hi": -1.0}, ["▁", "hi"]),
        ({"▁h": -1.0, "hi": -2.0}, ["▁h", "i"]),
    ],
)
def test_merge_order_follows_scores(scores, expected):
    pieces = {"▁": -5.0, "h": -5.0, "i": -5.0, **scores}
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata(pieces))
    assert spm_pieces(tokenizer, "hi", add_special_tokens=False) == expected


def test_llama_cpp_defaults_space_prefix_and_bos():
    # Without the keys llama.cpp adds a space before the text (SentencePiece's dummy prefix),
    # adds BOS, and takes <unk> <s> </s> as ids 0 1 2.
    pieces = {"▁": -1.0, "h": -1.0, "i": -1.0, "▁hi": -0.5, "▁h": -0.7}
    tokenizer = Tokenizer.from_gguf_metadata(spm_metadata(pieces))
    assert spm_pieces(tokenizer, "hi hi") == ["<s>", "▁hi", "▁hi"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.unk_token_id) == (1, (2,), 0)
    assert tokenizer.decode(tokenizer.encode("hi hi"), skip_special_tokens=True) == "hi hi"
    # After a special token the dummy prefix comes again, as in llama.cpp.
    assert spm_pieces(tokenizer, "hi</s>hi", add_special_tokens=False) == ["▁hi", "</s>", "▁hi"]
    assert tokenizer.chat_template is None  # not Gemma's vocabulary, and the file has none

    no_prefix = Tokenizer.from_gguf_metadata(
        spm_metadata(pieces, {"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    )
    assert spm_pieces(no_prefix, "hi hi") == ["h", "i", "▁hi"]
    assert no_prefix.decode(no_prefix.encode(" hi")) == " hi"


def test_gguf_merges_are_used_when_present():
    pieces = {"▁": -1.0, "h": -1.0, "i": -1.0, "▁h": -0.1, "hi": -0.2}
    by_score = Tokenizer.from_gguf_metadata(spm_metadata(pieces))
    assert spm_pieces(by_score, "hi", add_special_tokens=False) == ["▁h", "i"]
    by_merges = Tokenizer.from_gguf_metadata(spm_metadata(pieces, {"tokenizer.ggml.merges": ["h i", "▁ h"]}))
    assert spm_pieces(by_merges, "hi", add_special_tokens=False) == ["▁", "hi"]


def test_sentencepiece_without_scores_is_refused_by_name():
    metadata = spm_metadata({"▁": -1.0})
    del metadata["tokenizer.ggml.scores"]
    with pytest.raises(UnsupportedError, match="'llama'.*scores"):
        Tokenizer.from_gguf_metadata(metadata)


@pytest.mark.parametrize("model", ["t5", "bert", "rwkv", "ugm"])
def test_other_tokenizer_kinds_are_refused_by_name(model):
    with pytest.raises(UnsupportedError, match=f"tokenizer model {model!r} is not supported"):
        Tokenizer.from_gguf_metadata(spm_metadata({"▁": -1.0}, {"tokenizer.ggml.model": model}))
