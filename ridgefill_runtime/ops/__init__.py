"""Numerical ops used by the model code, with compiled kernels where available.

The compiled extension `ridgefill_runtime._C` is optional. Importing it
registers the `torch.ops.ridgefill.*` schemas (csrc/bindings.cpp) and their
CUDA kernels. Without it (pure-Python install, CPU-only torch, no toolkit)
every op falls back to its torch reference, so this package always imports.
"""

from __future__ import annotations

from .extension import extension_error, extension_loaded, op_available
from .rms_norm import rms_norm, rms_norm_reference
from .gdn import (
    gdn_chunk,
    gdn_chunk_reference,
    gdn_recurrent_reference,
    gdn_state_update,
    gdn_state_update_reference,
    gdn_step,
    gdn_step_reference,
)
from .int8_map_gemm import (
    dequantize_int8_groupwise,
    int8_map_gemm,
    int8_map_gemm_reference,
    quantize_int8_groupwise,
)
from .ripe_attention import ripe_attention, ripe_attention_reference
from .scattered_rows_attention import scattered_rows_attention, scattered_rows_attention_reference

__all__ = [
    "dequantize_int8_groupwise",
    "extension_error",
    "extension_loaded",
    "gdn_chunk",
    "gdn_chunk_reference",
    "gdn_recurrent_reference",
    "gdn_state_update",
    "gdn_state_update_reference",
    "gdn_step",
    "gdn_step_reference",
    "int8_map_gemm",
    "int8_map_gemm_reference",
    "op_available",
    "quantize_int8_groupwise",
    "ripe_attention",
    "ripe_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "scattered_rows_attention",
    "scattered_rows_attention_reference",
]
