"""Text <-> token ids, the chat template, and streaming detokenization.

A `Tokenizer` is a Hugging Face `tokenizers.Tokenizer` (the fast Rust implementation) plus what that
object does not carry: the chat template, the BOS/EOS/pad ids, and a per-token type (normal,
control, user_defined, unknown, unused, byte) that later features use to treat special tokens
specially.

It is built either from a Hugging Face folder (`tokenizer.json` and friends) or from the metadata of
a GGUF file, which stores the vocabulary under llama.cpp's key names: byte-level BPE with its merges
(`tokenizer.ggml.model` "gpt2") or SentencePiece BPE with scored pieces ("llama", e.g. Gemma 3).
Both end up as the same object, which serializes to one JSON document so a converted GGUF tokenizer
can be cached.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from types import MappingProxyType
from typing import Any
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors

from .piece_bound import longest_piece_bytes
from ..errors import InputError, ModelLoadError, UnsupportedError

SERIALIZED_FORMAT = "ridgefill-tokenizer/1"
SERIALIZED_FILE_NAME = "ridgefill_tokenizer.json"

# Token types, named as llama.cpp's `tokenizer.ggml.token_type` codes (0 = undefined reads as normal).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = (
    "normal",
    "unknown",
    "control",
    "user_defined",
    "unused",
    "byte",
)
_GGUF_TOKEN_TYPE_NAMES = {0: NORMAL, 1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}

# Pre-tokenizer split patterns, one per family of `tokenizer.ggml.pre` names. The merges of a
# byte-level BPE were learned on pieces cut by one of these; cutting differently changes ids.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Same as llama3 but digits one at a time.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_FAMILIES = {
    "gpt2": "gpt2",
    "default": "gpt2",
    "smollm": "smollm",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "qwen2": "qwen2",
}


# ---------------------------------------------------------------------------------------------
# The byte alphabet of byte-level BPE
# ---------------------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def byte_to_unicode_table() -> Mapping[int, str]:
    """GPT-2's reversible spelling of bytes as printable characters.

    Bytes that are already visible Latin-1 characters stand for themselves; every other byte
    (controls, space, and a few invisible ones) is shifted to code points 256, 257, ... in byte
    order, so that a vocabulary of byte strings can be written as ordinary text.
    """
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in visible}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return MappingProxyType(table)  # shared by the cache, so read-only


_BYTE_ALPHABET = frozenset(byte_to_unicode_table().values())


def spell_in_byte_alphabet(text: str) -> str:
    table = byte_to_unicode_table()
    return "".join(table[b] for b in text.encode("utf-8"))


# ---------------------------------------------------------------------------------------------
# Chat templates
# ---------------------------------------------------------------------------------------------


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters (<, >, &), which chat templates do not want.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way Hugging Face renders them: sandboxed, trim/lstrip blocks.

    Templates come from downloaded files, so they are untrusted code: the immutable sandbox stops
    attribute tricks and in-place mutation of the data passed in.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ModelLoadError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerInfo:
    """Everything about a tokenizer that `tokenizers.Tokenizer` does not store itself."""

    vocab_size: int
    token_types: tuple[str, ...]  # one per id
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    chat_template: str | None = None
    # The spellings the chat template sees as bos_token, eos_token, unk_token, pad_token.
    template_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def to_json_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["token_types"] = list(self.token_types)
        data["eos_token_ids"] = list(self.eos_token_ids)
        data["template_tokens"] = dict(self.template_tokens)
        return data

    @classmethod
    def from_json_dict(cls, data: Mapping[str, Any]) -> TokenizerInfo:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - fields
        if unknown:
            raise ModelLoadError(f"tokenizer info has unknown keys {sorted(unknown)}")
        values = dict(data)
        values["token_types"] = tuple(values["token_types"])
        values["eos_token_ids"] = tuple(values.get("eos_token_ids", ()))
        values["template_tokens"] = dict(values.get("template_tokens") or {})
        return cls(**values)


class Tokenizer:
    """Encode, decode and render chats for one model."""

    def __init__(self, backend: tokenizers.Tokenizer, info: TokenizerInfo):
        if len(info.token_types) != info.vocab_size:
            raise ModelLoadError(
                f"tokenizer: {len(info.token_types)} token types for a vocabulary of {info.vocab_size}"
            )
        self._backend = backend
        self._info = info
        self._compiled_template: jinja2.Template | None = None
        # Ids below this decode (those at or past vocab_size to nothing); see `for_model_rows`.
        self._decodable = info.vocab_size

    # -- construction -------------------------------------------------------------------------

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> Tokenizer:
        return _tokenizer_from_hf_folder(Path(path))

    @classmethod
    def from_gguf_metadata(cls, reader_or_fields) -> Tokenizer:
        return _tokenizer_from_gguf(_GgufValues(reader_or_fields))

    @classmethod
    def from_json_str(cls, text: str) -> Tokenizer:
        try:
            document = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"tokenizer document is not JSON: {exc}") from exc
        if document.get("format") != SERIALIZED_FORMAT:
            raise ModelLoadError(
                f"tokenizer document has format {document.get('format')!r}, expected {SERIALIZED_FORMAT!r}"
            )
        backend = tokenizers.Tokenizer.from_str(json.dumps(document["backend"]))
        return cls(backend, TokenizerInfo.from_json_dict(document["info"]))

    def to_json_str(self) -> str:
        return json.dumps(
            {
                "format": SERIALIZED_FORMAT,
                "backend": json.loads(self._backend.to_str()),
                "info": self._info.to_json_dict(),
            },
            ensure_ascii=False,
        )

    def save(self, directory: str | Path) -> Path:
        target = Path(directory) / SERIALIZED_FILE_NAME
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(self.to_json_str(), encoding="utf-8")
        return target

    @classmethod
    def load(cls, directory: str | Path) -> Tokenizer:
        source = Path(directory) / SERIALIZED_FILE_NAME
        try:
            text = source.read_text(encoding="utf-8")
        except OSError as exc:
            raise ModelLoadError(f"cannot read tokenizer {source}: {exc.strerror or exc}") from exc
        return cls.from_json_str(text)

    # -- properties ---------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return self._info.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._info.eos_token_ids

    @property
    def pad_token_id(self) -> int | None:
        return self._info.pad_token_id

    @property
    def unk_token_id(self) -> int | None:
        return self._info.unk_token_id

    @property
    def vocab_size(self) -> int:
        return self._info.vocab_size

    @property
    def chat_template(self) -> str | None:
        return self._info.chat_template

    @property
    def template_tokens(self) -> Mapping[str, str]:
        """The spellings of bos_token, eos_token, unk_token and pad_token (those the model has)."""
        return MappingProxyType(dict(self._info.template_tokens))

    @property
    def token_types(self) -> tuple[str, ...]:
        return self._info.token_types

    @property
    def decodable_ids(self) -> int:
        """Ids 0..decodable_ids-1 decode: the vocabulary, plus a padded model's extra rows."""
        return self._decodable

    def for_model_rows(self, rows: int) -> Tokenizer:
        """This tokenizer for a model with `rows` embedding rows. A padded vocabulary (Huginn's
        padded_vocab_size, Qwen2.5's 151,936 rows over 151,665 tokens) has rows no token spells;
        the model can still emit them, and they decode to nothing. Ids past the rows stay refused."""
        if rows <= self._decodable:
            return self
        padded = copy.copy(self)
        padded._decodable = rows
        return padded

    def token_type(self, token_id: int) -> str:
        if self.vocab_size <= token_id < self._decodable:
            return UNUSED  # a padded row: no token spells it
        return self._info.token_types[token_id]

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Control tokens, tokens the backend marks special, and the bos/eos/unk/pad ids."""
        ids = {i for i, kind in enumerate(self._info.token_types) if kind == CONTROL}
        ids |= {i for i, tok in self._backend.get_added_tokens_decoder().items() if tok.special}
        ids |= {i for i in (self.bos_token_id, self.pad_token_id, self.unk_token_id) if i is not None}
        ids |= set(self.eos_token_ids)
        return frozenset(ids)

    @cached_property
    def longest_piece_bytes(self) -> int | None:
        """The most input bytes one token can stand for (None: no bound holds); a server refuses
        a prompt longer than the context by it before tokenizing (loader/piece_bound.py)."""
        return longest_piece_bytes(self._backend)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    # -- encode / decode ----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. Special tokens written in the text (`<|im_start|>`) map to their
        ids; `add_special_tokens` adds what the model wants around a text (for example BOS)."""
        if not isinstance(text, str):
            raise InputError(f"text to encode must be a string, got {type(text).__name__}")
        # NOTE: encode_batch releases the GIL while it works and encode does not; a server
        # tokenizing a long prompt in a worker thread must not stall its event loop.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`. An id of a padded model's rows past the vocabulary (`for_model_rows`)
        adds nothing, as in Hugging Face: `tokenizers.Tokenizer.decode` (0.23) leaves out every id
        that has no token, so decode([a, 300, b]) over a 300-token vocabulary gives the text of
        [a, b]; transformers' fast tokenizers decode through it."""
        ids = list(ids)
        for token_id in ids:
            if not 0 <= token_id < self._decodable:
                raise InputError(f"token id {token_id} is outside the vocabulary (size {self._decodable})")
        if self._decodable > self.vocab_size:
            ids = [token_id for token_id in ids if token_id < self.vocab_size]
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # -- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
        """Render a conversation to the prompt text the model was trained on."""
        if self._info.chat_template is None:
            raise InputError("this model has no chat template; send a plain prompt instead")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InputError("messages must be a list of objects with 'role' and 'content'")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self._info.chat_template)
        # tools/documents default to None, not undefined: templates test `tools is not none`.
        variables = {"tools": None, "documents": None, **self._info.template_tokens, **template_kwargs}
        try:
            return self._compiled_template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except jinja2.exceptions.TemplateError as exc:
            # raise_exception() in a template reports a conversation it cannot render.
            raise InputError(f"chat template refused the conversation: {exc}") from exc


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


class DetokenizerState:
    """Turns a growing list of generated ids into text deltas for streaming.

    Decoding one token alone is wrong in two ways: a UTF-8 character can be split over several
    byte-level tokens, and some decoders change a token's text depending on what precedes it. So
    we decode a short window twice, with and without the new tokens, and emit the difference, and
    we hold text back while it ends with U+FFFD (an incomplete character).
    """

    # Context tokens kept before the unread ones, so leading-space rules see a real predecessor.
    CONTEXT_TOKENS = 5
    # A character is at most 4 bytes, so more pending tokens than this that still end in U+FFFD
    # means the model really produced invalid bytes; emit them rather than stall forever.
    MAX_HELD_TOKENS = 8

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._read_offset = len(self._ids)  # ids before this have been emitted (or are the prompt)
        self._prefix_offset = max(0, self._read_offset - self.CONTEXT_TOKENS)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)

    def add(self, new_ids: int | Sequence[int]) -> str:
        """Append generated id(s); return the text that became final (possibly '')."""
        self._ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        return self._emit(force=False)

    def flush(self) -> str:
        """At the end of generation: whatever is still held, even an incomplete character."""
        return self._emit(force=True)

    def _emit(self, force: bool) -> str:
        decode = self._tokenizer.decode
        window_before = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special)
        window_after = decode(self._ids[self._prefix_offset :], self._skip_special)
        held = len(self._ids) - self._read_offset
        incomplete = window_after.endswith("\ufffd") and held <= self.MAX_HELD_TOKENS
        if held == 0 or (incomplete and not force):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        # The window before is complete text (it never ends in a held character), so the window
        # after starts with it and the rest is new.
        return window_after[len(window_before) :]


def detokenize_incrementally(tokenizer: Tokenizer, ids: Sequence[int]) -> list[str]:
    """The deltas a stream would send for `ids`, one per id plus a final flush."""
    state = DetokenizerState(tokenizer)
    deltas = [state.add(token_id) for token_id in ids]
    deltas.append(state.flush())
    return deltas


# ---------------------------------------------------------------------------------------------
# Building from a Hugging Face folder
# ---------------------------------------------------------------------------------------------


def _read_json_if_present(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _token_content(value) -> str | None:
    """tokenizer_config writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _choose_chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """chat_template.jinja, else chat_template.json, else tokenizer_config's (newest first)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = _read_json_if_present(folder / "chat_template.json").get("chat_template")
    if template is None:
        template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        # Several named templates: the "default" one is the chat template.
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _bos_eos_post_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None):
    """A post-processor that wraps a text as [BOS] text [EOS], either part optional."""

    def template(sequence: str, type_id: int) -> str:
        parts = [f"{bos[0]}:{type_id}"] if bos else []
        parts.append(f"{sequence}:{type_id}")
        parts += [f"{eos[0]}:{type_id}"] if eos else []
        return " ".join(parts)

    special = list(dict.fromkeys(t for t in (bos, eos) if t is not None))
    return processors.TemplateProcessing(
        single=template("$A", 0), pair=template("$A", 0) + " " + template("$B", 1), special_tokens=special
    )


def _hf_token_types(backend: tokenizers.Tokenizer, vocab_size: int, unk_id: int | None) -> tuple[str, ...]:
    types = [NORMAL] * vocab_size
    model = json.loads(backend.to_str()).get("model", {})
    if model.get("byte_fallback"):
        # sentencepiece-style byte tokens: <0x00> .. <0xFF>
        for byte in range(256):
            token_id = backend.token_to_id(f"<0x{byte:02X}>")
            if token_id is not None and token_id < vocab_size:
                types[token_id] = BYTE
    for token_id, token in backend.get_added_tokens_decoder().items():
        if token_id < vocab_size:
            types[token_id] = CONTROL if token.special else USER_DEFINED
    if unk_id is not None and unk_id < vocab_size:
        types[unk_id] = UNKNOWN
    return tuple(types)


def _tokenizer_from_hf_folder(folder: Path) -> Tokenizer:
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{folder}: no tokenizer.json (only fast-tokenizer folders are supported)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises plain Exception
        raise ModelLoadError(f"cannot read {tokenizer_file}: {exc}") from exc

    config = _read_json_if_present(folder / "tokenizer_config.json")
    special_map = _read_json_if_present(folder / "special_tokens_map.json")
    generation = _read_json_if_present(folder / "generation_config.json")

    template_tokens: dict[str, str] = {}
    ids: dict[str, int | None] = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        content = _token_content(config.get(name)) or _token_content(special_map.get(name))
        ids[name] = backend.token_to_id(content) if content is not None else None
        if content is not None:
            template_tokens[name] = content

    # Like transformers: an explicit add_bos_token/add_eos_token (or no post-processor at all)
    # means the flags decide; otherwise tokenizer.json's own post-processor does.
    if "add_bos_token" in config or "add_eos_token" in config or backend.post_processor is None:

        def wrapping(name: str, flag: str) -> tuple[str, int] | None:
            token_id = ids[name]
            return (template_tokens[name], token_id) if config.get(flag) and token_id is not None else None

        backend.post_processor = _bos_eos_post_processor(
            wrapping("bos_token", "add_bos_token"), wrapping("eos_token", "add_eos_token")
        )

    # generation_config decides when generation stops; the tokenizer's eos is added if missing.
    eos_ids = _as_id_list(generation.get("eos_token_id")) + _as_id_list(ids["eos_token"])
    bos_id = ids["bos_token"] if ids["bos_token"] is not None else generation.get("bos_token_id")

    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    info = TokenizerInfo(
        vocab_size=vocab_size,
        token_types=_hf_token_types(backend, vocab_size, ids["unk_token"]),
        bos_token_id=bos_id,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        pad_token_id=ids["pad_token"],
        unk_token_id=ids["unk_token"],
        chat_template=_choose_chat_template(folder, config),
        template_tokens=template_tokens,
    )
    return Tokenizer(backend, info)


# ---------------------------------------------------------------------------------------------
# Building from GGUF metadata
# ---------------------------------------------------------------------------------------------


class _GgufValues:
    """Plain Python values for GGUF metadata keys, from a GGUFReader, its `fields`, or a dict of
    already-plain values."""

    def __init__(self, source):
        self._fields = getattr(source, "fields", source)
        if not isinstance(self._fields, Mapping):
            raise TypeError("expected a gguf.GGUFReader or a mapping of metadata fields")

    def get(self, key: str, default=None):
        field = self._fields.get(key)
        if field is None:
            return default
        return field.contents() if hasattr(field, "contents") else field

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks {key!r}")
        return value


def _byte_level_pre_tokenizer(pre: str):
    """The normalizer and pre-tokenizer that cut text the way this vocabulary was trained."""
    family = _PRE_TOKENIZER_FAMILIES.get(pre)
    if family is None:
        raise UnsupportedError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZER_FAMILIES))})"
        )
    if family == "gpt2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "smollm":
        # SmolLM's own tokenizer.json (and llama.cpp's "smollm") isolate every digit before the
        # GPT-2 split; without it "   1" would become "  " + " 1" instead of "   " + "1".
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    pattern = _LLAMA3_SPLIT if family == "llama3" else _QWEN2_SPLIT
    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    # Qwen2's tokenizer.json normalizes to NFC before splitting.
    normalizer = normalizers.NFC() if family == "qwen2" else None
    return normalizer, split


def _gguf_vocabulary(tokens: Sequence[str], types: Sequence[str]) -> dict[str, int]:
    """token spelling -> id. Normal tokens must be spelled in the byte alphabet; a normal token
    that is not is a mislabel in the file and gets respelled. Of duplicate spellings the last
    wins, as in llama.cpp's text-to-token map; the earlier ids are then never produced."""
    vocab: dict[str, int] = {}
    for token_id, (token, kind) in enumerate(zip(tokens, types)):
        if kind in (NORMAL, UNUSED, UNKNOWN) and not set(token) <= _BYTE_ALPHABET:
            token = spell_in_byte_alphabet(token)
        vocab[token] = token_id
    return vocab


# The GGUF tokenizer kinds we build, by their `tokenizer.ggml.model` name.
_GGUF_TOKENIZER_MODELS = {"gpt2": "byte-level BPE", "llama": "SentencePiece BPE"}

# SentencePiece spells a space inside its pieces as U+2581 (LOWER ONE EIGHTH BLOCK).
_SPM_SPACE = "\u2581"

# Gemma's turn format, for a GGUF whose vocabulary is Gemma's but which carries no chat template
# (the base models). A leading system message has no turn of its own: its text opens the first
# user turn, followed by a blank line. Gemma calls the assistant "model".
GEMMA_CHAT_TEMPLATE = """\
{%- if bos_token is defined and bos_token -%}{{ bos_token }}{%- endif -%}
{%- set ns = namespace(system=none) -%}
{%- set turns = messages -%}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set ns.system = messages[0]['content'] -%}
    {%- set turns = messages[1:] -%}
    {%- if not (turns | selectattr('role', 'equalto', 'user') | list) -%}
        {#- no user turn to carry it: the system text is a user turn of its own -#}
        {{- '<start_of_turn>user\\n' -}}{{- ns.system -}}{{- '<end_of_turn>\\n' -}}
        {%- set ns.system = none -%}
    {%- endif -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if message['role'] == 'system' -%}
        {{- raise_exception('Gemma has no system turn: a system message must come first') -}}
    {%- endif -%}
    {{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' -}}
    {%- if message['role'] == 'user' and ns.system is not none -%}
        {{- ns.system -}}{{- '\\n\\n' -}}
        {%- set ns.system = none -%}
    {%- endif -%}
    {{- message['content'] -}}{{- '<end_of_turn>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""
_GEMMA_TURN_TOKENS = ("<start_of_turn>", "<end_of_turn>")


def _tokenizer_from_gguf(meta: _GgufValues) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelLoadError("GGUF metadata has no tokenizer (tokenizer.ggml.model is missing)")
    if model not in _GGUF_TOKENIZER_MODELS:
        supported = ", ".join(f"{name!r} ({kind})" for name, kind in _GGUF_TOKENIZER_MODELS.items())
        raise UnsupportedError(f"GGUF tokenizer model {model!r} is not supported (supported: {supported})")

    tokens = list(meta.require("tokenizer.ggml.tokens"))
    raw_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(raw_types) != len(tokens):
        raise ModelLoadError(f"GGUF tokenizer: {len(raw_types)} token types for {len(tokens)} tokens")
    types = [_GGUF_TOKEN_TYPE_NAMES.get(int(code), NORMAL) for code in raw_types]

    if model == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        backend = _byte_level_backend(meta, pre, tokens, types)
        # llama.cpp adds BOS by default for llama3 vocabularies; the file's flag overrides.
        add_bos_default = _PRE_TOKENIZER_FAMILIES[pre] == "llama3"
        default_ids = {}
    else:
        backend = _sentencepiece_backend(meta, tokens, types)
        # llama.cpp's defaults for a SentencePiece vocabulary without these keys.
        add_bos_default = True
        default_ids = {
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
        }
    return _finish_gguf_tokenizer(meta, backend, tokens, types, add_bos_default, default_ids)


def _byte_level_backend(meta: _GgufValues, pre: str, tokens: list[str], types: list[str]) -> tokenizers.Tokenizer:
    normalizer, pre_tokenizer = _byte_level_pre_tokenizer(pre)
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    # llama3's tokenizer looks a whole piece up in the vocabulary before merging.
    try:
        bpe = tokenizers.models.BPE(
            vocab=_gguf_vocabulary(tokens, types), merges=merges, ignore_merges=_PRE_TOKENIZER_FAMILIES[pre] == "llama3"
        )
    except Exception as exc:  # e.g. a merge whose result is not in the vocabulary
        raise ModelLoadError(f"GGUF tokenizer is inconsistent: {exc}") from exc
    backend = tokenizers.Tokenizer(bpe)
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[str], vocab: Mapping[str, int]
) -> list[tuple[str, str]]:
    """A BPE merge list that reproduces SentencePiece's BPE from its scored vocabulary.

    SentencePiece (and llama.cpp after it) keeps no merge list: starting from single characters,
    it repeatedly joins the adjacent pair whose concatenation is the highest-scoring piece of the
    vocabulary. That is BPE with one merge per way of cutting a piece into two pieces, ranked by
    the whole piece's score. Control and byte tokens are never built by merging (control tokens
    are matched whole, byte tokens only stand in for characters the vocabulary lacks).
    """
    buildable = [
        i
        for i, kind in enumerate(types)
        if kind not in (CONTROL, BYTE) and len(tokens[i]) > 1 and vocab.get(tokens[i]) == i
    ]
    buildable.sort(key=lambda i: (-scores[i], i))
    merges = []
    for i in buildable:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _sentencepiece_backend(meta: _GgufValues, tokens: list[str], types: list[str]) -> tokenizers.Tokenizer:
    """llama.cpp's SentencePiece kind ("llama"): a BPE over characters with the spaces written as
    U+2581, no pre-tokenizer (a text between special tokens is one piece), and `<0xXX>` byte
    tokens for characters the vocabulary lacks."""
    vocab: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        vocab[token] = token_id  # of duplicate spellings the last wins, as in llama.cpp
    gguf_merges = meta.get("tokenizer.ggml.merges")
    if gguf_merges:
        merges = [tuple(m.split(" ", 1)) for m in gguf_merges]
    else:
        scores = meta.get("tokenizer.ggml.scores")
        if scores is None:
            raise UnsupportedError(
                "GGUF tokenizer model 'llama' (SentencePiece) without tokenizer.ggml.scores is not "
                "supported: its merge order comes from the scores"
            )
        if len(scores) != len(tokens):
            raise ModelLoadError(f"GGUF tokenizer: {len(scores)} scores for {len(tokens)} tokens")
        merges = _sentencepiece_merges(tokens, [float(s) for s in scores], types, vocab)

    unk_id = meta.get("tokenizer.ggml.unknown_token_id", 0)
    unk = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    try:
        bpe = tokenizers.models.BPE(vocab=vocab, merges=merges, unk_token=unk, byte_fallback=True)
    except Exception as exc:  # e.g. a merge whose result is not in the vocabulary
        raise ModelLoadError(f"GGUF tokenizer is inconsistent: {exc}") from exc
    backend = tokenizers.Tokenizer(bpe)

    # llama.cpp puts a space before every text that follows a special token (or starts the
    # input) when add_space_prefix is set; SentencePiece's "dummy prefix". Gemma does not.
    add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPM_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
        ]
    )
    return backend


def _finish_gguf_tokenizer(
    meta: _GgufValues,
    backend: tokenizers.Tokenizer,
    tokens: list[str],
    types: list[str],
    add_bos_default: bool,
    default_ids: Mapping[str, int],
) -> Tokenizer:
    """What both GGUF kinds share: special tokens, BOS/EOS, the chat template."""
    # Control tokens are matched whole in the text and are special (skipped on request);
    # user-defined ones (like <think>, or Gemma's runs of spaces and newlines) are matched whole
    # but are ordinary text. Both are matched in the text as written, before any normalizer.
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == CONTROL]
    )
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, kind in zip(tokens, types) if kind == USER_DEFINED]
    )

    def token_id(key: str) -> int | None:
        value = meta.get(key, default_ids.get(key))
        return int(value) if value is not None and 0 <= int(value) < len(tokens) else None

    bos_id = token_id("tokenizer.ggml.bos_token_id")
    eos_ids = [
        i
        for i in (
            token_id("tokenizer.ggml.eos_token_id"),
            token_id("tokenizer.ggml.eot_token_id"),
            token_id("tokenizer.ggml.eom_token_id"),
        )
        if i is not None
    ]
    chat_template = meta.get("tokenizer.chat_template")
    turn_ids = [backend.token_to_id(t) for t in _GEMMA_TURN_TOKENS]
    if None not in turn_ids:
        # Gemma's vocabulary: a chat turn ends with <end_of_turn>, so generation stops there too.
        eos_ids.append(turn_ids[1])
        if chat_template is None:
            chat_template = GEMMA_CHAT_TEMPLATE

    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    bos = (tokens[bos_id], bos_id) if add_bos and bos_id is not None else None
    eos = (tokens[eos_ids[0]], eos_ids[0]) if add_eos and eos_ids else None
    backend.post_processor = _bos_eos_post_processor(bos, eos)

    ids = {
        "bos_token": bos_id,
        "eos_token": eos_ids[0] if eos_ids else None,
        "unk_token": token_id("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_id("tokenizer.ggml.padding_token_id"),
    }
    info = TokenizerInfo(
        vocab_size=len(tokens),
        token_types=tuple(types),
        bos_token_id=bos_id,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        pad_token_id=ids["pad_token"],
        unk_token_id=ids["unk_token"],
        chat_template=chat_template,
        template_tokens={name: tokens[i] for name, i in ids.items() if i is not None},
    )
    return Tokenizer(backend, info)
