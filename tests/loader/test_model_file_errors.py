"""Every model-file failure ends `ridgefill serve` and `ridgefill generate` with one line and
status 1, never a traceback nor a server that stays up answering 503 (issue 31, round three,
finding 2): the embedded SmolLM2 GGUF truncated at several offsets, with a corrupt header, with
sizes that disagree with its tensors, and unreadable. The real CLI, in a subprocess."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ridgefill_runtime.loader.gguf import default_model_path

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20


def _source() -> Path:
    return default_model_path()


def _data_offset() -> int:
    from gguf import GGUFReader

    return GGUFReader(str(_source())).data_offset


def _truncated(folder: Path, size: int) -> Path:
    out = folder / f"truncated-{size}.gguf"
    with open(_source(), "rb") as src, open(out, "wb") as dst:
        dst.write(src.read(size))
    return out


def _corrupt_magic(folder: Path) -> Path:
    out = folder / "bad-magic.gguf"
    shutil.copyfile(_source(), out)
    with open(out, "r+b") as f:
        f.write(b"GGUX")
    return out


def _wrong_sizes(folder: Path) -> Path:
    """The header says 512 hidden units; the tensors hold 576."""
    from gguf import GGUFReader

    out = folder / "wrong-sizes.gguf"
    shutil.copyfile(_source(), out)
    reader = GGUFReader(str(out), "r+")
    field = reader.fields["llama.embedding_length"]
    field.parts[field.data[0]][0] = 512
    reader.data.flush()
    del reader
    return out


def _unreadable(folder: Path) -> Path:
    out = folder / "unreadable.gguf"
    if os.geteuid() == 0:  # root reads any file: a folder in the file's place cannot be read as one
        out.mkdir()
    else:
        shutil.copyfile(_source(), out)
        out.chmod(0)
    return out


CASES = {
    "truncated to 1 MiB (mid-header)": (lambda d: _truncated(d, MIB), ["not a readable GGUF"]),
    "truncated after the header": (lambda d: _truncated(d, _data_offset()), ["not a readable GGUF"]),
    "truncated mid-tensor-data": (lambda d: _truncated(d, _source().stat().st_size // 2), ["not a readable GGUF"]),
    "last byte missing": (lambda d: _truncated(d, _source().stat().st_size - 1), ["not a readable GGUF"]),
    "corrupt header": (_corrupt_magic, ["not a readable GGUF"]),
    "wrong sizes": (_wrong_sizes, ["shape", "576"]),
    "unreadable": (_unreadable, []),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(command: str, model: Path, cache: Path) -> subprocess.CompletedProcess:
    args = ["--port", str(_free_port())] if command == "serve" else ["--prompt", "hi", "--max-tokens", "1"]
    return subprocess.run(
        [sys.executable, "-m", "ridgefill_server", command, "--model", str(model), "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=240,  # NOTE: a server that stayed up would end here, failing the test
        cwd=ROOT,
        env={**os.environ, "RIDGEFILL_CACHE_DIR": str(cache)},
    )


@pytest.mark.parametrize("command", ["serve", "generate"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_model_file_ends_the_command_with_one_line(tmp_path, command, case):
    make, words = CASES[case]
    model = make(tmp_path)
    p = _run(command, model, tmp_path / "cache")
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("ridgefill: error: ")]
    assert len(errors) == 1, p.stderr[-2000:]
    assert model.name in errors[0] and all(w in errors[0] for w in words), errors[0]
    if command == "serve":
        assert "cannot load the model" in errors[0]
