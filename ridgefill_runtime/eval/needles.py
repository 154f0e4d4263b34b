"""RULER-style needle prompts generated locally (single, multikey, multivalue, multiquery).

Built at the token level so each needle's position is known exactly; a sample counts for
filled-region retrieval only when every needle lies in the prefix (before the exact tail).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

WORDS = (
    "amber",
    "basalt",
    "cobalt",
    "dune",
    "ember",
    "fjord",
    "garnet",
    "harbor",
    "indigo",
    "juniper",
    "kestrel",
    "lagoon",
    "meadow",
    "nickel",
    "orchid",
    "pewter",
    "quartz",
    "russet",
    "saffron",
    "tundra",
    "umber",
    "violet",
    "willow",
    "yarrow",
    "zephyr",
    "alder",
    "birch",
    "cedar",
    "delta",
    "falcon",
)
TASKS = ("single", "multikey", "multivalue", "multiquery")


@dataclass(frozen=True)
class NeedlePrompt:
    task: str
    ids: tuple[int, ...]
    answers: tuple[str, ...]  # every one must appear in the output
    needle_positions: tuple[int, ...]  # first token of each needle sentence
    question_start: int = 0  # first token of the question (the question-hidden control hides it on)
    needles: tuple[tuple[str, str, int, int], ...] = ()  # (key, value, first token, tokens) of each, in order

    def in_prefix(self, tail: int) -> bool:
        return max(self.needle_positions) < len(self.ids) - tail


def _sentences(text: str) -> list[str]:
    flat = re.sub(r"\s+", " ", re.sub(r"[`*=#~^_\-]{2,}|\.\. \w+::", " ", text))
    return [s.strip() + " " for s in re.split(r"(?<=[.!?]) ", flat) if len(s.split()) >= 4]


def make_prompt(
    task: str, tokenizer, haystack_text: str, length: int, rng: random.Random, prefix_limit: int | None = None
) -> NeedlePrompt:
    """A prompt of about `length` tokens; with prefix_limit, needles start before that token."""
    key_words = rng.sample(WORDS, 8)
    keys = [f"{key_words[2 * i]}-{key_words[2 * i + 1]}" for i in range(4)]
    value = lambda: str(rng.randint(1_000_000, 9_999_999))  # noqa: E731
    if task == "single":
        needles, asked = [(keys[0], value())], [keys[0]]
    elif task == "multikey":
        needles, asked = [(k, value()) for k in keys], [keys[0]]
    elif task == "multivalue":
        needles, asked = [(keys[0], value()) for _ in range(3)], [keys[0]]
    else:
        needles, asked = [(k, value()) for k in keys[:3]], keys[:3]
    rng.shuffle(needles)
    answers = tuple(v for k, v in needles if k in asked)
    if len(asked) == 1:
        question = (
            f"What are all the special magic numbers for {asked[0]} mentioned in the text above? "
            if task == "multivalue"
            else f"What is the special magic number for {asked[0]} mentioned in the text above? "
        )
    else:
        question = f"What are the special magic numbers for {', '.join(asked[:-1])} and {asked[-1]} mentioned in the text above? "
    question += "Answer with the numbers only."
    head = tokenizer.apply_chat_template([{"role": "user", "content": "@@"}], add_generation_prompt=True)
    pre, post = head.split("@@")
    pre_ids = tokenizer.encode(pre + "Read the text and answer the question.\n\n")
    post_ids = tokenizer.encode("\n\n" + question + post)
    budget = length - len(pre_ids) - len(post_ids)
    sents = [tokenizer.encode(s) for s in _sentences(haystack_text)]
    body: list[list[int]] = []
    total = 0
    for s in sents:
        if total + len(s) > budget - 30 * len(needles):
            break
        body.append(s)
        total += len(s)
    # NOTE: needles go at random sentence boundaries before prefix_limit (default: 80% in).
    limit = prefix_limit if prefix_limit is not None else int(0.8 * length)
    offsets, at = [], len(pre_ids)
    for piece in body:
        offsets.append(at)
        at += len(piece)
    room = limit - 30 * len(needles)
    candidates = [i for i in range(1, len(body)) if offsets[i] < room] or [1]
    slots = sorted(rng.sample(candidates, min(len(needles), len(candidates))))
    slots += [slots[-1]] * (len(needles) - len(slots))
    for (k, v), at in sorted(zip(needles, slots), key=lambda x: -x[1]):
        body.insert(at, tokenizer.encode(f" One of the special magic numbers for {k} is: {v}. "))
    ids, positions, placed = list(pre_ids), [], []
    needle_texts = {
        tuple(tokenizer.encode(f" One of the special magic numbers for {k} is: {v}. ")): (k, v) for k, v in needles
    }
    for piece in body:
        if tuple(piece) in needle_texts:
            positions.append(len(ids))
            placed.append((*needle_texts[tuple(piece)], len(ids), len(piece)))
        ids += piece
    question_start = len(ids)
    ids += post_ids
    return NeedlePrompt(task, tuple(ids), answers, tuple(positions), question_start, tuple(placed))


def solved(prompt: NeedlePrompt, output_text: str) -> bool:
    return all(a in output_text for a in prompt.answers)
