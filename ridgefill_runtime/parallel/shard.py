"""One rank's shard of a dense checkpoint (Megatron-style tensor parallelism), by Hugging Face name.

Column-parallel (each rank keeps some output rows): q, k, v (and their biases) by head, gate and
up by MLP column. Row-parallel (each rank keeps the matching input columns): o and down; their
products are partial sums the model adds across ranks (DenseLM.sum_shards). Norms, the embedding
and the LM head stay whole on every rank (replicated; benchmarks/tensor_parallel.py measures what
that costs in memory).

K/V heads: with at least as many K/V heads as ranks each rank keeps its own; with fewer, each K/V
head is copied to the ranks whose query heads read it (vLLM's rule), so rank r keeps K/V head
r // (size / num_kv_heads). Either way rank r's query heads H/size * r .. are exactly the ones
whose GQA group its K/V heads serve, so each rank's attention is the whole model's, restricted.

The shard's ModelConfig says the shard's own head and MLP counts: the model, its cache spec and
the K/V pool built from it hold that rank's part and nothing else, on every rank alike.

A packed (GGUF) weight is cut without changing a value: rows whole, columns at group edges; a
column cut that would split a quantization group is refused rather than re-quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import UnsupportedError
from ..ops.grouped_ints import GroupedInts

# The families whose model is models/dense.py's DenseLM (with a family's overrides): their layers
# name their weights as Llama does. Hybrid, MoE and looped families are not sharded yet.
SHARDABLE = ("llama", "qwen2", "qwen3", "gemma3_text")

_Q, _K, _V = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"
_COLUMNS_BY_HEAD = {_Q: "q", _K: "kv", _V: "kv"}  # projection -> whose heads its rows are
_MLP_COLUMNS = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
_ROW_PARALLEL = {"self_attn.o_proj.weight": "q", "mlp.down_proj.weight": "mlp"}  # cut along the input


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of a tensor-parallel group of `size` ranks."""

    rank: int
    size: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"shard rank {self.rank} outside 0..{self.size - 1}")


@dataclass(frozen=True)
class HeadPlan:
    """Which heads and MLP columns one rank keeps: half-open ranges of indices."""

    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    mlp: tuple[int, int]


def check_divides(config: ModelConfig, size: int) -> None:
    """Refuse, naming the setting and the counts, a size the model's heads cannot be split by."""
    where = f"parallel.tensor_parallel_size = {size}"
    if config.architecture not in SHARDABLE:
        raise UnsupportedError(
            f"{where}: tensor parallelism is built for the dense families ({', '.join(SHARDABLE)}), "
            f"not yet for {config.architecture!r}"
        )
    h, hkv, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if h % size:
        raise UnsupportedError(f"{where} does not divide the model's {h} attention heads")
    if hkv % size and size % hkv:
        raise UnsupportedError(
            f"{where}: the model's {hkv} K/V heads can be neither split {size} ways nor copied evenly "
            f"(the size must divide {hkv} or be a multiple of it)"
        )
    if inter % size:
        raise UnsupportedError(f"{where} does not divide the model's MLP width {inter}")


def head_plan(config: ModelConfig, shard: Shard) -> HeadPlan:
    check_divides(config, shard.size)
    r, n = shard.rank, shard.size
    hq = config.num_heads // n
    if config.num_kv_heads >= n:
        hkv = config.num_kv_heads // n
        kv = (r * hkv, (r + 1) * hkv)
    else:
        kv_head = r // (n // config.num_kv_heads)  # NOTE: ranks n / Hkv apart share one copied head
        kv = (kv_head, kv_head + 1)
    inter = config.intermediate_size // n
    return HeadPlan(q_heads=(r * hq, (r + 1) * hq), kv_heads=kv, mlp=(r * inter, (r + 1) * inter))


def shard_config(config: ModelConfig, plan: HeadPlan) -> ModelConfig:
    """The model as one rank sees it: its heads and MLP columns only."""
    return config.replace(
        num_heads=plan.q_heads[1] - plan.q_heads[0],
        num_kv_heads=plan.kv_heads[1] - plan.kv_heads[0],
        intermediate_size=plan.mlp[1] - plan.mlp[0],
    )


def shard_checkpoint(
    config: ModelConfig, tensors: dict[str, torch.Tensor], shard: Shard
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(the shard's config, its tensors by the same names). Views where a cut allows: a rank's
    tensors stay slices of the loader's until the model builds its fused copies."""
    plan = head_plan(config, shard)
    hd = config.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        part = name.split(".")
        layer_part = ".".join(part[3:]) if name.startswith("model.layers.") else ""
        proj = ".".join(part[3:5]) if layer_part else ""
        if proj in _COLUMNS_BY_HEAD and part[-1] in ("weight", "bias"):
            lo, hi = plan.q_heads if _COLUMNS_BY_HEAD[proj] == "q" else plan.kv_heads
            out[name] = _rows(t, lo * hd, hi * hd, name)
        elif layer_part in _MLP_COLUMNS:
            out[name] = _rows(t, *plan.mlp, name)
        elif layer_part in _ROW_PARALLEL:
            lo, hi = plan.q_heads if _ROW_PARALLEL[layer_part] == "q" else plan.mlp
            unit = hd if _ROW_PARALLEL[layer_part] == "q" else 1
            out[name] = _columns(t, lo * unit, hi * unit, name)
        else:
            out[name] = t  # norms, embedding, LM head: whole on every rank
    return shard_config(config, plan), out


def _rows(t, lo: int, hi: int, name: str):
    """Output rows lo..hi of a weight [N, K] (or entries of a bias [N])."""
    if isinstance(t, GroupedInts):
        return GroupedInts(
            q=t.q[lo:hi],
            scale=t.scale[lo:hi],
            min=None if t.min is None else t.min[lo:hi],
            bits=t.bits,
            group=t.group,
        )
    return t[lo:hi]


def _columns(t, lo: int, hi: int, name: str):
    """Input columns lo..hi of a weight [N, K]."""
    if isinstance(t, GroupedInts):
        if lo % t.group or hi % t.group:
            raise UnsupportedError(
                f"{name}: a tensor-parallel cut at columns {lo}..{hi} would split its quantization groups "
                f"of {t.group}; use another tensor_parallel_size or a dequantized checkpoint"
            )
        g0, g1 = lo // t.group, hi // t.group
        return GroupedInts(
            q=t.q[:, lo:hi].contiguous(),
            scale=t.scale[:, g0:g1].contiguous(),
            min=None if t.min is None else t.min[:, g0:g1].contiguous(),
            bits=t.bits,
            group=t.group,
        )
    return t[:, lo:hi]
