"""Repository-level code completion prompts (issue 29's long-prompt workload).

A prompt of about L tokens is whole source files of one standard-library package
(fill/corpus.py CODE_EVAL_PACKAGES, never calibration text), each after a `# file: <path>` line,
then the start of one file (the target) up to a cut inside one of its functions. The answer
compared between arms is the greedy completion of the next line (eval/code_completion_run.py).

The cut rule, checked with `ast` on the package's own sources:
- the prompt ends just after line k-1 (its newline included) of the target file, where line k
  is the first line of a statement inside a function (not the function's docstring, not
  `pass`/`break`/`continue`), at least MIN_LINE_CHARS long once stripped, and k-1 is at or
  after the `def` line;
- line k names a far identifier X (a Name, or an attribute's name, lying wholly on line k):
  X is defined (def/class anywhere, or an assignment target at module or class level) in
  another file of the package, X is bound nowhere in the target file (no def, class,
  assignment, import, argument or `as` of that name) and does not occur as a word in it before
  line k, X is no builtin nor a method of a builtin type (`join`, `decode`), no dunder, and at
  least MIN_NAME_CHARS long;
- that other file (the definition file) is in the prompt with X's definition, no file between
  it and the target has X as a word, and X's last occurrence in the definition file starts at
  least `min_distance` tokens (default L/2) before the prompt's end. So the nearest place the
  model can read X from is that far back, and X's definition is in the prompt.

Layout: [earlier files, the first one trimmed from its start at a line] [definition file]
[files between, whole, until the distance is reached] [target file up to the cut]. The target
file is never trimmed; only the earliest file is cut (its header then says from which line), so
the total is L within `tolerance`. Files come in content-hash order (corpus.load_docs), and the
candidate cuts in a seeded shuffle, so a (package, L, index) always gives the same prompt.
"""

from __future__ import annotations

import ast
import builtins
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from ..fill.corpus import CODE_EVAL_PACKAGES, code_package_files, stdlib_root

MIN_LINE_CHARS = 12  # a next line shorter than this (`return x`, `else:`) says little
MIN_NAME_CHARS = 4  # shorter names (`os`, `i`, `loop`-like locals) are mostly not far references
BUILTINS = frozenset(dir(builtins))
# NOTE: `x.join(...)`, `b.decode(...)`: a package method of that name is most likely not the one used
BUILTIN_METHODS = frozenset(n for t in (str, bytes, list, dict, set, tuple, int, float, object) for n in dir(t))
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class CodePrompt:
    package: str
    length: int  # the length asked for (tokens); len(ids) is within the builder's tolerance of it
    target: str  # the target file's path, relative to the standard library's root
    function: str  # the function the prompt ends in
    cut_line: int  # 1-based: the prompt ends after this line of the target file
    next_line: str  # the source's own next line (line cut_line + 1), without its newline
    name: str  # the far identifier on the next line
    defined_in: str  # the file defining it
    distance: int  # tokens from the start of the line of its last occurrence before the cut to the prompt's end
    text: str
    ids: tuple[int, ...] = field(repr=False)

    def __post_init__(self) -> None:
        if self.cut_line < 1 or self.distance < 1 or not self.ids:
            raise ValueError(f"not a code prompt: cut {self.cut_line}, distance {self.distance}, {len(self.ids)} ids")
        if self.name not in self.next_line:
            raise ValueError(f"{self.name!r} is not on the next line {self.next_line!r}")


@dataclass(frozen=True)
class Cut:
    """A candidate end of prompt: after line `line` - 1 of `target`, line `line` naming `name`."""

    target: SourceFile
    function: str
    line: int  # 1-based first line of the next statement
    name: str


class SourceFile:
    """One package file: its text, lines, `ast` and what it defines and binds."""

    def __init__(self, rel: str, text: str, tree: ast.Module):
        self.rel, self.text, self.tree = rel, text, tree
        self.lines = text.splitlines(keepends=True)

    @property
    def header(self) -> str:
        return f"# file: {self.rel}\n"

    @cached_property
    def definitions(self) -> dict[str, int]:
        """name -> 1-based line of its first definition: def/class anywhere, assignment targets
        at module or class level."""
        found: dict[str, int] = {}

        def add(name: str, line: int) -> None:
            found[name] = min(line, found.get(name, line))

        def assigned(body: list[ast.stmt]) -> None:
            for s in body:
                targets = s.targets if isinstance(s, ast.Assign) else [s.target] if isinstance(s, ast.AnnAssign) else []
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            add(n.id, s.lineno)

        assigned(self.tree.body)
        for node in ast.walk(self.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                add(node.name, node.lineno)
            if isinstance(node, ast.ClassDef):
                assigned(node.body)
        return found

    @cached_property
    def bound(self) -> frozenset[str]:
        """Every name this file binds anywhere (a use of one may be read from the file itself)."""
        names: set[str] = set(self.definitions)
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.alias):
                names.add(node.asname or node.name.split(".")[0])
                names.add(node.name.split(".")[-1])
            elif isinstance(node, ast.ExceptHandler) and node.name:
                names.add(node.name)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
        return frozenset(names)

    def cuts(self, definers: dict[str, list[SourceFile]]) -> list[Cut]:
        """Every candidate cut in this file (the rule in the module's docstring), in source order."""
        out = []
        for func in (n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            docstring = _docstring_line(func)
            for stmt in (s for s in ast.walk(func) if isinstance(s, ast.stmt) and s is not func):
                k = stmt.lineno
                if k - 1 < func.lineno or k == docstring or isinstance(stmt, (ast.Pass, ast.Break, ast.Continue)):
                    continue
                line = self.lines[k - 1].strip()
                if len(line) < MIN_LINE_CHARS or line.startswith("#"):
                    continue
                for name in _names_on_line(stmt, k):
                    if self._is_far(name, k, definers):
                        out.append(Cut(self, func.name, k, name))
                        break
        return sorted(out, key=lambda c: c.line)

    @cached_property
    def first_use(self) -> dict[str, int]:
        """word -> 1-based line of its first occurrence in the file's text (comments too)."""
        first: dict[str, int] = {}
        for i, line in enumerate(self.lines, 1):
            for w in WORD.findall(line):
                first.setdefault(w, i)
        return first

    def last_line_with(self, name: str) -> int:
        """1-based line of the word's last occurrence (0: none)."""
        return max((i for i, line in enumerate(self.lines, 1) if name in WORD.findall(line)), default=0)

    def _is_far(self, name: str, line: int, definers: dict[str, list[SourceFile]]) -> bool:
        return (
            len(name) >= MIN_NAME_CHARS
            and not name.startswith("__")
            and name not in BUILTINS
            and name not in BUILTIN_METHODS
            and name not in self.bound
            and self.first_use.get(name, 0) >= line
            and any(f is not self for f in definers.get(name, []))
        )


def _docstring_line(func: ast.AST) -> int | None:
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        return body[0].lineno if isinstance(body[0].value.value, str) else None
    return None


def _names_on_line(stmt: ast.stmt, line: int) -> list[str]:
    """Names and attribute names lying wholly on `line` within stmt (a compound statement's
    header only: its body's lines are other lines), in source order."""
    found = []
    for n in ast.walk(stmt):
        if isinstance(n, (ast.Name, ast.Attribute)) and n.lineno == line == n.end_lineno:
            found.append((n.col_offset, n.id if isinstance(n, ast.Name) else n.attr))
    return [name for _, name in sorted(found)]


def package_sources(package: str) -> list[SourceFile]:
    """The package's parseable .py files in content-hash order."""
    root = stdlib_root()
    files = []
    for doc in code_package_files(package):
        try:
            tree = ast.parse(doc.text)
        except SyntaxError:  # NOTE: a test fixture file may be invalid on purpose
            continue
        files.append(SourceFile(Path(doc.path).relative_to(root).as_posix(), doc.text, tree))
    return files


class PromptBuilder:
    """Prompts of one package for one tokenizer; token counts of files are cached."""

    def __init__(self, package: str, encode: Encode, tolerance: float = 0.03):
        if package not in CODE_EVAL_PACKAGES:
            raise ValueError(f"{package!r} is not an evaluation package")
        self.package, self.encode, self.tolerance = package, encode, tolerance
        self.files = package_sources(package)
        self.definers: dict[str, list[SourceFile]] = {}
        for f in self.files:
            for name in f.definitions:
                self.definers.setdefault(name, []).append(f)
        self._tokens: dict[str, int] = {}

    def tokens(self, text: str) -> int:
        if text not in self._tokens:
            self._tokens[text] = len(self.encode(text))
        return self._tokens[text]

    @cached_property
    def cuts(self) -> list[Cut]:
        return [c for f in self.files for c in f.cuts(self.definers)]

    def prompt(self, length: int, index: int = 0, min_distance: int | None = None) -> CodePrompt:
        """The index-th prompt of about `length` tokens (a seeded shuffle of the cuts; each
        prompt of one (package, length) has its own target file)."""
        min_distance = length // 2 if min_distance is None else min_distance
        cuts = list(self.cuts)
        random.Random(f"{self.package}/{length}").shuffle(cuts)
        used: set[str] = set()
        for cut in cuts:
            if cut.target.rel in used:
                continue
            p = self.build(cut, length, min_distance)
            if p is None:
                continue
            if len(used) == index:
                return p
            used.add(cut.target.rel)
        raise ValueError(f"{self.package}: no prompt #{index} of {length} tokens (only {len(used)} target files fit)")

    def build(self, cut: Cut, length: int, min_distance: int) -> CodePrompt | None:
        """The prompt for one cut, or None when the package cannot lay it out at this length."""
        target = cut.target
        tail_text = target.header + "".join(target.lines[: cut.line - 1])
        for home in sorted(self.definers[cut.name], key=lambda f: f.rel):
            if home is target:
                continue
            p = self._layout(cut, home, tail_text, length, min_distance)
            if p is not None:
                return p
        return None

    def _layout(self, cut: Cut, home: SourceFile, tail_text: str, length: int, min_distance: int):
        others = [f for f in self.files if f is not cut.target and f is not home]
        mentions = [f for f in others if cut.name in f.first_use]
        def_line = home.definitions[cut.name]
        after_last = "".join(home.lines[home.last_line_with(cut.name) - 1 :])
        # files between the definition file and the target, whole, until the distance is reached
        between, distance = [], self.tokens(after_last) + self.tokens(tail_text)
        quiet = [f for f in others if f not in mentions]  # NOTE: only files without X lie after home
        while distance < min_distance and quiet:
            f = quiet.pop(0)
            others.remove(f)
            between.append(f)
            distance += self.tokens(f.header + f.text)
        budget = length - sum(self.tokens(f.header + f.text) for f in between) - self.tokens(tail_text)
        # earlier blocks, nearest first: the definition file, then the other files; the last
        # one taken is trimmed from its start, never past the definition's line
        earlier: list[str] = []
        room = budget
        for i, f in enumerate([home] + others):
            whole = self.tokens(f.header + f.text)
            if whole <= room:
                earlier.insert(0, f.header + f.text)
                room -= whole
                continue
            keep_from = self._trim_from(f, room, def_line if i == 0 else None)
            if keep_from is not None:
                earlier.insert(0, f"# file: {f.rel} (from line {keep_from})\n" + "".join(f.lines[keep_from - 1 :]))
            break
        if not earlier or not earlier[-1].endswith(after_last):
            return None  # NOTE: the definition file did not fit, even trimmed to its definition
        def_at = len("".join(earlier)) - len(after_last)
        text = "".join(earlier) + "".join(f.header + f.text for f in between) + tail_text
        ids = self.encode(text)
        if abs(len(ids) - length) > self.tolerance * length:
            return None
        distance = len(ids) - len(self.encode(text[:def_at]))
        if distance < min_distance:
            return None
        return CodePrompt(
            package=self.package,
            length=length,
            target=cut.target.rel,
            function=cut.function,
            cut_line=cut.line - 1,
            next_line=cut.target.lines[cut.line - 1].rstrip("\n"),
            name=cut.name,
            defined_in=home.rel,
            distance=distance,
            text=text,
            ids=tuple(ids),
        )

    def _trim_from(self, f: SourceFile, room: int, keep_line: int | None) -> int | None:
        """The first line (1-based) from which f's end fits in `room` tokens with its header
        (binary search on lines), or None when even its last line does not fit or the cut would
        fall after keep_line."""
        lo, hi = 1, len(f.lines) + 1  # NOTE: fits(hi) holds: an empty rest
        fits = lambda s: self.tokens(f"# file: {f.rel} (from line {s})\n" + "".join(f.lines[s - 1 :])) <= room  # noqa: E731
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        if lo > len(f.lines) or (keep_line is not None and lo > keep_line):
            return None
        return lo


def code_prompts(encode: Encode, lengths: list[int], per_length: int, packages=CODE_EVAL_PACKAGES) -> list[CodePrompt]:
    """per_length prompts at each length, the packages taken in turn (a package that cannot
    give one more prompt at a length is passed over for the rest of that length)."""
    builders = {p: PromptBuilder(p, encode) for p in packages}
    out = []
    for length in lengths:
        taken = {p: 0 for p in packages}  # the packages still in turn, and their prompts so far
        made, turn = 0, 0
        while made < per_length:
            if not taken:
                raise ValueError(f"only {made} prompts of {length} tokens in {', '.join(packages)}")
            package = list(taken)[turn % len(taken)]
            try:
                out.append(builders[package].prompt(length, taken[package]))
            except ValueError:
                del taken[package]
                continue
            taken[package] += 1
            made, turn = made + 1, turn + 1
    return out
