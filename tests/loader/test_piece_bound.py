"""The tokenizer's longest piece (loader/piece_bound.py) bounds the tokens of real text from
below, and no bound is claimed for tokenizers that can drop text."""

from __future__ import annotations

import random

import pytest
import tokenizers
from tokenizers import models, normalizers, pre_tokenizers

from ridgefill_runtime.loader.gguf import default_model_path, load_gguf
from ridgefill_runtime.loader.piece_bound import fewest_tokens, longest_piece_bytes


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "rf-cache"))
        return load_gguf(default_model_path()).tokenizer


def test_smollm2_longest_piece_is_its_longest_byte_level_token(smollm2):
    # the byte-level token "\n" + 80 spaces: 81 bytes of input
    assert smollm2.longest_piece_bytes == 81
    assert smollm2.encode("x\n" + " " * 80, add_special_tokens=False)[1:] == [smollm2.token_to_id("Ċ" + "Ġ" * 80)]


@pytest.mark.parametrize("seed", range(4))
def test_real_text_never_has_fewer_tokens_than_the_bound(smollm2, seed):
    rng = random.Random(seed)
    parts = [
        "Hello world. ",
        "\n" + " " * rng.randrange(100),
        "<|im_start|>",
        "日本語のテキスト",
        "ﬁ",
        "🙂",
        "0123456789",
    ]
    text = "".join(rng.choice(parts) for _ in range(400))
    tokens = len(smollm2.encode(text, add_special_tokens=False))
    assert tokens >= fewest_tokens(len(text.encode()), smollm2.longest_piece_bytes)


def _bpe(**model_kwargs) -> tokenizers.Tokenizer:
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}
    return tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], **model_kwargs))


def test_tokenizers_that_can_drop_text_get_no_bound():
    dropping = _bpe(unk_token="[UNK]")
    dropping.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces vanish: any number of them is 0 tokens
    assert dropping.encode("ab" + " " * 1000 + "ab").ids == [3, 3]
    assert longest_piece_bytes(dropping) is None
    stripping = _bpe(unk_token="[UNK]")
    stripping.normalizer = normalizers.Strip()
    assert longest_piece_bytes(stripping) is None
    assert longest_piece_bytes(_bpe()) is None  # no unknown token: characters it lacks are dropped
    assert longest_piece_bytes(tokenizers.Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))) is None


def test_a_kept_bpe_is_bounded_and_nfc_widens_the_bound():
    plain = _bpe(unk_token="[UNK]")
    assert longest_piece_bytes(plain) == 5  # "[UNK]" is the longest spelling
    composed = _bpe(unk_token="[UNK]")
    composed.normalizer = normalizers.NFC()
    assert longest_piece_bytes(composed) == 5 * 4
