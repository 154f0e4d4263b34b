"""Caches as parts: per-layer specs (spec.py), one factory (build.py), the pools that hold the
tensors (kv_pool.py, state_pool.py) and the id bookkeeping the scheduler owns (manager.py)."""

from .build import CacheBudget, ModelCaches, build_caches
from .manager import CacheManager, CacheStats
from .spec import AttentionCache, CacheSpec, RecurrentCache, spec_of

__all__ = [
    "AttentionCache",
    "CacheBudget",
    "CacheManager",
    "CacheSpec",
    "CacheStats",
    "ModelCaches",
    "RecurrentCache",
    "build_caches",
    "spec_of",
]
