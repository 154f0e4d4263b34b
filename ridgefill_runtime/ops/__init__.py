"""Numerical ops used by the model code, with compiled kernels where available.

The compiled extension `ridgefill_runtime._C` is optional. Importing it
registers the `torch.ops.ridgefill.*` schemas (csrc/bindings.cpp) and their
CUDA kernels. Without it (pure-Python install, CPU-only torch, no toolkit)
every op falls back to its torch reference, so this package always imports.
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


# Imported last: these modules read extension_loaded() at import time.
from .rms_norm import rms_norm, rms_norm_reference  # noqa: E402

__all__ = ["extension_error", "extension_loaded", "rms_norm", "rms_norm_reference"]

from .gdn import (  # noqa: E402
    gdn_chunk,
    gdn_chunk_reference,
    gdn_recurrent_reference,
    gdn_state_update,
    gdn_state_update_reference,
    gdn_step,
    gdn_step_reference,
)
from .int8_map_gemm import (  # noqa: E402
    dequantize_int8_groupwise,
    int8_map_gemm,
    int8_map_gemm_reference,
    quantize_int8_groupwise,
)
from .ripe_attention import ripe_attention, ripe_attention_reference  # noqa: E402
from .scattered_rows_attention import scattered_rows_attention, scattered_rows_attention_reference  # noqa: E402

__all__ += [
    "dequantize_int8_groupwise",
    "gdn_chunk",
    "gdn_chunk_reference",
    "gdn_recurrent_reference",
    "gdn_state_update",
    "gdn_state_update_reference",
    "gdn_step",
    "gdn_step_reference",
    "int8_map_gemm",
    "int8_map_gemm_reference",
    "quantize_int8_groupwise",
    "ripe_attention",
    "ripe_attention_reference",
    "scattered_rows_attention",
    "scattered_rows_attention_reference",
]
