"""A looped (recurrent-depth) model's own settings: its layer blocks, loops and initial state.

NOTE: its own module, apart from huginn.py (the family that parses it) and looped.py (the model that
reads it): huginn.py imports looped.py, and both need this class.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import FamilyConfig, ModelConfig
from ..errors import ModelLoadError


@dataclass(frozen=True)
class LoopedConfig(FamilyConfig):
    """A looped (recurrent-depth) model in Huginn's layout (seed 001 §2): a prelude of
    `prelude` layers embeds each token, a core block of `core` layers runs R times on a state
    that starts at random, a coda of `coda` layers reads the last state out. Layer indices:
    prelude 0..P-1, core P..P+C-1, coda P+C.. (each core layer is run once per loop)."""

    prelude: int
    core: int
    coda: int
    mean_recurrence: int  # the loops R a request runs unless it asks otherwise
    embed_scale: float  # input embeddings (and the initial state) are multiplied by this
    init_std: float  # the initial state: truncated normal (+-3 std) of this std, times embed_scale
    adapter_bias: bool = False
    qk_bias: bool = True

    def __post_init__(self) -> None:
        for name in ("prelude", "core", "coda", "mean_recurrence"):
            if getattr(self, name) < (0 if name in ("prelude", "coda") else 1):
                raise ModelLoadError(f"model config: looped.{name} must be positive, got {getattr(self, name)}")
        if self.embed_scale <= 0 or self.init_std < 0:
            raise ModelLoadError(
                f"model config: looped embed_scale must be > 0 and init_std >= 0, "
                f"got {self.embed_scale}, {self.init_std}"
            )

    def check(self, config: ModelConfig) -> None:
        if self.prelude + self.core + self.coda != config.num_layers:
            raise ModelLoadError(f"model config: prelude + core + coda layers != {config.num_layers} layers")

    @property
    def looped(self) -> bool:
        return True

    def is_core(self, layer: int) -> bool:
        return self.prelude <= layer < self.prelude + self.core
