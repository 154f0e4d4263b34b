"""Errors a user can act on. The CLI and the server print `str(err)` as one line."""


class RidgefillError(Exception):
    """Base class: the message names the cause (file, key, value) in one line."""


class ConfigError(RidgefillError):
    """A settings file or flag that cannot be used; the message names the key and its source."""


class ModelLoadError(RidgefillError):
    """A checkpoint is missing, corrupt, or describes something we do not support."""


class UnsupportedError(ModelLoadError):
    """An architecture, quantization type or setting we refuse by name."""


class InputError(RidgefillError):
    """A request that cannot be served as asked (too long, bad sampling parameters)."""


class ParallelError(RidgefillError):
    """A tensor-parallel rank failed to start, died or timed out; the message names the rank (where
    known) and the cause. The group cannot go on without it: the server ends rather than serve on."""
