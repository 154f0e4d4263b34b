"""Write a served model's tokenizer as a Hugging Face tokenizer folder.

Evaluation tools that count tokens on the client side (lm-eval's `local-completions` with
`tokenizer_backend=huggingface`) need the served model's tokenizer as a folder `transformers`
loads; a GGUF model has none. The folder holds the very backend ridgefill encodes with
(tokenizer.json, special tokens and post-processor included), so the client's token ids are the
server's, and tokenizer_config.json adds the special-token spellings and the chat template.

    ridgefill-export-tokenizer [--model PATH|NAME] DIR
    python -m ridgefill_runtime.loader.export_tokenizer [--model PATH|NAME] DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import RidgefillError
from .tokenizer import Tokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def write_hf_tokenizer(tokenizer: Tokenizer, folder: Path, model_max_length: int) -> None:
    """tokenizer.json (the backend itself), tokenizer_config.json and special_tokens_map.json."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    special = {
        name: tokenizer.template_tokens[name] for name in SPECIAL_TOKEN_NAMES if name in tokenizer.template_tokens
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        # NOTE: tokenizer.json's post-processor already adds what the model wants (a BOS or
        # nothing); flags here would make transformers rebuild it.
        **special,
    }
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False), encoding="utf-8")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=1, ensure_ascii=False), encoding="utf-8")


def export_model_tokenizer(model: str | None, folder: Path) -> None:
    """The tokenizer of `model` (a path, a packaged or embedded model's name, None for the
    default), as `ridgefill serve --model` would load it."""
    from .load import load_checkpoint

    checkpoint = load_checkpoint(model)
    if checkpoint.tokenizer is None:
        raise RidgefillError(f"{checkpoint.source}: this model has no tokenizer to export")
    write_hf_tokenizer(checkpoint.tokenizer, folder, checkpoint.config.max_position_embeddings)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ridgefill-export-tokenizer",
        description="write a model's tokenizer as a Hugging Face tokenizer folder (for lm-eval and transformers)",
    )
    parser.add_argument("--model", default=None, help="as `ridgefill serve --model`; default: the embedded model")
    parser.add_argument("folder", type=Path, help="the folder to write (created if missing)")
    args = parser.parse_args(argv)
    try:
        export_model_tokenizer(args.model, args.folder)
    except RidgefillError as e:
        print(f"ridgefill-export-tokenizer: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.folder}/tokenizer.json, tokenizer_config.json, special_tokens_map.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
