"""`ridgefill-export-tokenizer` (python -m ridgefill_runtime.loader.export_tokenizer) writes the
served model's tokenizer as a folder transformers loads: the same ids on real text, the same
special tokens and chat template (issue 31, round three, finding 4)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ridgefill_runtime.loader.gguf import default_model_path, load_gguf

ROOT = Path(__file__).resolve().parents[2]
transformers = pytest.importorskip("transformers")

# Real text of several kinds: prose, code, digits, CJK, emoji, special tokens written in the text.
SAMPLES = [
    "The capital of France is Paris. It lies on the Seine, and 2,148,271 people lived there in 2020.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nprint(fib(30))\n",
    "日本語のテキストと emoji 🙂👍🏽, and   several    spaces\t\ttabs\n\n\nnewlines.",
    "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "rf-cache"
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    env = {**os.environ, "RIDGEFILL_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    p = subprocess.run(
        [sys.executable, "-m", "ridgefill_runtime.loader.export_tokenizer", str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RIDGEFILL_CACHE_DIR", str(cache))
        ours = load_gguf(default_model_path()).tokenizer
    return transformers.AutoTokenizer.from_pretrained(str(folder)), ours


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_transformers_encodes_real_text_to_our_ids(exported, add_special_tokens):
    theirs, ours = exported
    for text in SAMPLES:
        assert theirs.encode(text, add_special_tokens=add_special_tokens) == ours.encode(
            text, add_special_tokens=add_special_tokens
        ), text
        ids = ours.encode(text, add_special_tokens=False)
        assert theirs.decode(ids) == ours.decode(ids)


def test_special_tokens_and_chat_template_are_ours(exported):
    theirs, ours = exported
    assert theirs.bos_token_id == ours.bos_token_id and theirs.eos_token_id == ours.eos_token_ids[0]
    assert theirs.unk_token_id == ours.unk_token_id and theirs.pad_token_id == ours.pad_token_id
    assert set(theirs.all_special_ids) <= set(ours.special_ids)
    assert theirs.chat_template == ours.chat_template
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime above 100."},
    ]
    rendered = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ours.apply_chat_template(messages, add_generation_prompt=True)


def test_a_model_that_cannot_load_is_one_line_and_status_1(tmp_path):
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "ridgefill_runtime.loader.export_tokenizer",
            "--model",
            str(tmp_path / "nope.gguf"),
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.strip().startswith("ridgefill-export-tokenizer: error:") and "nope.gguf" in p.stderr
    assert not (tmp_path / "out").exists()
