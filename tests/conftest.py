"""Repository-wide pytest hooks.

The only sanctioned skip: tests marked `gpu` when torch sees no CUDA device.
Everything else must run (and be able to fail) on a GPU-less machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# NOTE: the tiny random models (tests/models/tiny_models.py) serve tests in several folders.
sys.path.insert(0, str(Path(__file__).parent / "models"))


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated so the marker is known when
    # pytest runs with another rootdir/config file.
    config.addinivalue_line("markers", "gpu: needs a CUDA device; skipped when torch.cuda.is_available() is false")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import torch  # only when needed: keeps collection of torch-free tests fast

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M's real GGUF, put together from its PyPI chunk packages (install.sh --test
    installs them); a missing package fails the test with the pip command, never skips it."""
    from ridgefill_runtime.loader.packaged import packaged_model_path

    return packaged_model_path("gemma3-270m")


@pytest.fixture(scope="session")
def qwen2_gguf() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct's real GGUF from its six PyPI chunk packages (install.sh --test
    installs them); a missing package fails the test with the pip command, never skips it."""
    from ridgefill_runtime.loader.packaged import packaged_model_path

    return packaged_model_path("qwen2.5-coder-0.5b")
