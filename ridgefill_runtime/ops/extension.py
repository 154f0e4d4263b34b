"""Loading the compiled extension `ridgefill_runtime._C`, and what it provides.

NOTE: its own module, not the package's __init__: every op module asks it at import time, and
the package imports every op module, so asking the package would be an import circle.
"""

from __future__ import annotations

import importlib
import warnings

_EXTENSION_MODULE = "ridgefill_runtime._C"


def _load_extension() -> str | None:
    """Import the compiled extension; return None on success, else why not."""
    import torch  # noqa: F401  (the .so links against libtorch: load it first)

    try:
        importlib.import_module(_EXTENSION_MODULE)
    except ModuleNotFoundError as exc:
        if exc.name != _EXTENSION_MODULE:
            raise
        return "not built (pure-Python install)"
    except ImportError as exc:
        # Present but unloadable, typically built against another torch
        # (undefined symbols). Worth a warning: it silently costs speed.
        reason = f"failed to load: {exc}"
        warnings.warn(
            f"{_EXTENSION_MODULE} {reason}; using torch reference ops. Rebuild with scripts/install.sh.",
            RuntimeWarning,
            stacklevel=2,
        )
        return reason
    return None


_EXTENSION_ERROR = _load_extension()


def extension_loaded() -> bool:
    """True when ridgefill_runtime._C is loaded and torch.ops.ridgefill exists."""
    return _EXTENSION_ERROR is None


def op_available(name: str) -> bool:
    """The extension is loaded *and* has this op. NOTE: a stale _C built before the op existed
    would otherwise break `import ridgefill_runtime.ops` at register_fake; fall back loudly."""
    if not extension_loaded():
        return False
    import torch

    if hasattr(torch.ops.ridgefill, name):
        return True
    warnings.warn(
        f"ridgefill_runtime._C has no ridgefill::{name} (built from older sources?); using the torch "
        "reference. Rebuild with scripts/install.sh.",
        RuntimeWarning,
        stacklevel=2,
    )
    return False


def extension_error() -> str | None:
    """Why the extension is not loaded (None when it is); for diagnostics."""
    return _EXTENSION_ERROR
