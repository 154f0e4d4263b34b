"""ridgefill runtime: model loading, KV cache and kernels for the ridgefill server.

Deliberately import-light: importing this package must not import torch, load
the compiled extension or touch a GPU. Import subpackages (e.g.
`ridgefill_runtime.ops`) for functionality.
"""

__version__ = "0.1.0"
