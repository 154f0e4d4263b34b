"""Structured outputs: a request's grammar (JSON Schema, regex, choice list, Lark grammar)
turned into a token mask for each sampled row.

spec.py: what a request asks for, as plain data (travels in SamplingParams). book.py: the
grammar engine (llguidance) bound to the model's tokenizer, and the compiled grammars kept by
schema. masks.py: the engine's bitmasks as a boolean mask over the model's rows, with a plain
reference. constrain.py: the runner's per-sequence matchers: mask a step's rows, advance on the
chosen tokens, say when a grammar ended a sequence.
"""
