"""Write examples/ridgefill.toml from the config dataclasses: every setting's key, its default
(or, commented out, an example where the default is unset) and its help as the comment.

  python scripts/write_example_config.py          # rewrite the file
  python scripts/write_example_config.py --check  # exit 1 when it is not current

tests/server/test_server_config.py checks the file is current, so a setting added to a config
dataclass (ridgefill_runtime/config.py, server/config.py) reaches the example by running this.
What is not a setting's own lives here: the file's header and each table's introduction.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ridgefill_runtime.config import EngineConfig  # noqa: E402
from ridgefill_runtime.fill.settings import FillSettings  # noqa: E402
from ridgefill_runtime.settings_file import key_name, operator_tables, settings_fields  # noqa: E402
from ridgefill_server.config import ServerConfig  # noqa: E402

EXAMPLE = ROOT / "examples" / "ridgefill.toml"
COMMENT_COLUMN = 30  # where a key's comment starts
WIDTH = 118

HEADER = """\
# ridgefill operator config: `ridgefill serve --config examples/ridgefill.toml`.
# `ridgefill generate | score | eval | fit | tune --config FILE` read the same file, all but
# its [server] table. Every key is optional; the values below are the defaults. Command-line
# flags override this file. An unknown key or a value of the wrong type stops startup with an
# error naming the key and this file.
#
# Generated from the config dataclasses by scripts/write_example_config.py: edit the fields'
# help there, not here.
"""

# Each table's introduction (the keys' own comments are their fields' help).
INTROS = {
    "structured": """\
Structured outputs: a request's response_format ({"type": "json_object"} or {"type":
"json_schema", "json_schema": {"name": ..., "schema": {...}}}) or vLLM's structured_outputs
({"json": ...}, {"regex": ...}, {"choice": [...]}, {"grammar": <Lark>}) constrains every
sampled token (llguidance); speculative drafts are verified under the grammar.""",
    "speculative": """\
Speculative decoding for greedy requests (temperature 0): "ngram" drafts up to num_tokens
tokens per decode step from an earlier occurrence of the sequence's last min_ngram..max_ngram
tokens (prompt lookup), verified in one step; output is identical to plain greedy decoding.
A request may lower it or turn it off: "ridgefill": {"speculative": "off"} or {"num_tokens": 2}.""",
    "looped": """\
Looped (recurrent-depth) models only, e.g. --model looped (seed 001): which K/V planes the core
layers store and how greedy requests self-speculate. A request may override each key under
"ridgefill" ({"loops": 16, "cache": "deepest", "window": 16, "block": 2, "draft_loops": 2})
within what is stored: a full store serves any policy, a ripe store ripe (W' <= W) or deepest.""",
    "fill": """\
RidgeFill prefill: layers below `split` run exactly for every prompt row; the prefix rows
(all but the last `tail`) get their late-layer K/V from x̂ = A x_S + b (the maps). Prompts
no longer than `tail` are never filled. A request may ask for exact prefill with
"ridgefill": {"mode": "off"} in its body.
`ridgefill generate | score` read it too, where --arm replaces `mode`; `ridgefill eval` takes
its split, tail and maps for every arm it compares.""",
    "fill.rows": """\
Exact prefix rows: prefix rows the selectors pick run through the late layers exactly
instead of being filled. Without this table, a fill mode (plain, nofill, identity) uses the
shipped selection (SHIPPED_ROWS in ridgefill_runtime/fill/settings.py); with it, only the keys given here
change RowsConfig's defaults (shown below). A request may replace the selectors with
"ridgefill": {"selectors": ["special", "lexical"]} in its body.""",
}
# NOTE: giving [fill.rows] at all replaces the shipped selection, so the example shows it commented out.
COMMENTED_OUT = {"fill.rows"}


def tables() -> list[tuple[str, list[type]]]:
    """(TOML table, the dataclasses whose settings it holds), in the file's order."""
    out: list[tuple[str, list[type]]] = [(table, [cls]) for cls, table in operator_tables(EngineConfig)]
    for table, classes in out:
        if table == "fill":
            classes.append(FillSettings)  # the recipe key
    return [*out, ("server", [ServerConfig])]


def render() -> str:
    parts = [HEADER]
    for table, classes in tables():
        parts.append("\n".join(_table(table, classes, table in COMMENTED_OUT)) + "\n")
    return "\n".join(parts)


def _table(table: str, classes: list[type], commented: bool) -> list[str]:
    """The table's lines; `commented`: the header and every key commented out."""
    mark = "# " if commented else ""
    lines = [f"{mark}[{table}]"]
    lines += [f"# {line}".rstrip() for line in INTROS.get(table, "").splitlines()]
    groups: dict[str, list[str]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f, s in settings_fields(cls):
            entry = _entry(key_name(f, s).rpartition(".")[2], f.default, s, mark)
            if s.table is None:
                lines += entry
                continue
            if s.table not in groups:
                switch = next(g.name for g, gs in settings_fields(cls) if gs.table == s.table and hints[g.name] is bool)
                groups[s.table] = _commented(
                    f"{mark}[{table}.{s.table}]",
                    f"or a list of the booleans to switch on: {s.table} = [{_toml(switch)}]",
                )
            groups[s.table] += entry
    for group in groups.values():
        lines += ["", *group]
    return lines


def _entry(key: str, default, s, mark: str) -> list[str]:
    """`key = default  # help` (wrapped), or the example commented out where the default is unset."""
    if default is None:
        if s.example is None:
            raise ValueError(f"setting {key!r} has no default: give it an example")
        return _commented(f"# {key} = {s.example}", s.help)
    if s.values is not None:
        default = next(word for word, value in s.values.items() if value == default)
    return _commented(f"{mark}{key} = {_toml(default)}", s.help)


def _commented(text: str, comment: str) -> list[str]:
    """`text`, then `comment` from COMMENT_COLUMN on (or one space after a longer text), wrapped."""
    head = f"{text.ljust(COMMENT_COLUMN - 1)} # "
    overhang = " " * (len(head) - COMMENT_COLUMN - 2)  # NOTE: a long first line leaves less room for the comment
    wrapped = textwrap.wrap(comment, WIDTH - COMMENT_COLUMN - 2, initial_indent=overhang, break_on_hyphens=False)
    return [head + wrapped[0].removeprefix(overhang)] + [f"{'':{COMMENT_COLUMN}}# {line}" for line in wrapped[1:]]


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 when the example is not current")
    args = parser.parse_args()
    text = render()
    if args.check:
        if EXAMPLE.read_text(encoding="utf-8") != text:
            print(f"{EXAMPLE} is not current: run python scripts/write_example_config.py", file=sys.stderr)
            return 1
        return 0
    EXAMPLE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
