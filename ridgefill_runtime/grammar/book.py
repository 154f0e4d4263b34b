"""The grammar engine bound to the model's tokenizer, and the compiled grammars kept by schema.

llguidance (PyPI `llguidance`, the engine behind llama.cpp's and vLLM's `guidance` backend) is
used rather than a hand-written matcher: it compiles JSON Schema, regexes and Lark grammars
lazily (a schema costs well under a millisecond before its first mask), computes a token mask
in tens of microseconds on the CPU from a token trie, rolls back tokens, and has no
dependencies beyond its own wheel (xgrammar needs triton and transformers at install).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import llguidance

from ..config import StructuredConfig
from ..errors import InputError
from .spec import GrammarSpec

# NOTE: compact separators with one space, and no free whitespace between JSON tokens: with
# free whitespace a small model can emit newlines until max_tokens (a known failure of
# grammar-constrained JSON); this way the JSON is what json.dumps writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# the parser's own bounds on work per grammar and per token (llguidance's defaults otherwise);
# short errors: the schema came from the request, and its text need not come back in full
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarBook:
    """Compiles a GrammarSpec once (an LLMatcher kept as the template, least recently used
    dropped past structured.cached_grammars) and hands each sequence a fresh copy. Thread-safe:
    the server compiles in worker threads while the engine's thread takes copies."""

    def __init__(self, tokenizer, config: StructuredConfig):
        self.config = config
        self.vocab_size: int = tokenizer.vocab_size  # mask bits: the tokens the tokenizer spells
        self._tokenizer = tokenizer
        self._engine_tokenizer: llguidance.LLTokenizer | None = None  # built on first use: ~0.4 s at 49K tokens
        self._templates: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec) -> None:
        """Check spec and keep its compiled grammar; an InputError names spec.param."""
        self._template(spec)

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, for one sequence."""
        return self._template(spec).deep_copy()

    def _template(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        with self._lock:
            template = self._templates.get(spec)
            if template is not None:
                self._templates.move_to_end(spec)
                return template
        if spec.size > self.config.max_schema_bytes:
            raise InputError(
                f"{spec.param}: {spec.size} bytes is more than structured.max_schema_bytes ({self.config.max_schema_bytes})"
            )
        template = llguidance.LLMatcher(self._llm_tokenizer(), grammar_text(spec), log_level=0, limits=LIMITS)
        if template.is_error():
            raise InputError(f"{spec.param}: {_first_line(template.get_error())}")
        with self._lock:
            self._templates[spec] = template
            while len(self._templates) > self.config.cached_grammars:
                self._templates.popitem(last=False)
        return template

    def _llm_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._engine_tokenizer is None:
                tok = self._tokenizer
                if not hasattr(tok, "backend") or not tok.eos_token_ids:
                    raise InputError(
                        "structured outputs need a tokenizer with a Hugging Face tokenizers backend and an "
                        "end-of-sequence token; this model's has not"
                    )
                self._engine_tokenizer = llguidance.LLTokenizer(
                    tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=list(tok.eos_token_ids)
                )
            return self._engine_tokenizer


def grammar_text(spec: GrammarSpec) -> str:
    """The spec as llguidance's grammar; InputError for a schema that is not JSON."""
    if spec.kind == "json_schema":
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, overrides=JSON_OPTIONS)
        except ValueError as e:
            raise InputError(f"{spec.param}: {_first_line(str(e))}") from None
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "choice":
        # NOTE: a JSON string literal is a Lark string literal: quotes and escapes are the same
        alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
    return llguidance.LLMatcher.grammar_from_lark(spec.source)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "invalid grammar"
