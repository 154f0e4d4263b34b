"""One rank's shard of a checkpoint (Megatron-style tensor parallelism), each weight cut by the rule
its family declares for its name (ModelFamily.shards; models/weights.py DENSE_SHARDS for the Llama
names).

Column-parallel (each rank keeps some output rows): q, k, v (and their biases) by head, gate and
up by MLP column. Row-parallel (each rank keeps the matching input columns): o and down; their
products are partial sums the model adds across ranks (DenseLM.sum_shards). Vocab-parallel: the
embedding and LM head by token, rank r keeping rows r·V/n .. (r+1)·V/n (layers/vocab.py: the
lookups all-reduced, the logits all-gathered); benchmarks/tensor_parallel_parts.py measured it
against keeping them whole. Norms stay whole on every rank.

K/V heads: with at least as many K/V heads as ranks each rank keeps its own; with fewer, each K/V
head is copied to the ranks whose query heads read it (vLLM's rule), so rank r keeps K/V head
r // (size / num_kv_heads). Either way rank r's query heads H/size * r .. are exactly the ones
whose GQA group its K/V heads serve, so each rank's attention is the whole model's, restricted.

The shard's ModelConfig says the shard's own head and MLP counts: the model, its cache spec and
the K/V pool built from it hold that rank's part and nothing else, on every rank alike.

The Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next) add their own counts (FamilyConfig.shard_counts):
a GDN layer is split by key head, each with the value heads that read it, so its conv channels,
gates, decays and recurrent state are the rank's own and only out_proj's product is summed; the
gated attention's q_proj keeps each head's query and gate rows together. MoE experts are split
within each expert (every rank holds every expert's r-th slice of its MLP width, the router whole):
each rank's share of every step is then exactly 1/n of the expert work whatever the routing, and
the sum rides on the one all-reduce the MLP needs anyway. Expert parallelism (whole experts per
rank) balances only on average, so a step would wait on the rank its tokens happened to pick; it
pays at large batches and many ranks, which this CPU cannot show.

A packed (GGUF) weight is cut without changing a value: rows whole, columns at group edges; a
column cut that would split a quantization group is refused rather than re-quantized.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from ..config import ModelConfig
from ..errors import UnsupportedError
from ..models.registry import family, supported
from ..ops.grouped_ints import GroupedInts, concat_rows


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
    vocab: tuple[int, int]
    family: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # FamilyConfig.shard_counts' ranges


def check_divides(config: ModelConfig, size: int) -> None:
    """Refuse, naming the setting and the counts, a size the model's heads cannot be split by."""
    where = f"parallel.tensor_parallel_size = {size}"
    if family(config.architecture).shards is None:
        sharded = [name for name in supported() if family(name).shards is not None]
        raise UnsupportedError(
            f"{where}: tensor parallelism is built for {', '.join(sharded)}, not yet for {config.architecture!r}"
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
    for name, count in config.family_config.shard_counts().items():
        if count % size:
            raise UnsupportedError(f"{where} does not divide the model's {count} {name.replace('_', ' ')}")


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
    own = {name: (r * c // n, (r + 1) * c // n) for name, c in config.family_config.shard_counts().items()}
    return HeadPlan(
        q_heads=(r * hq, (r + 1) * hq),
        kv_heads=kv,
        mlp=(r * inter, (r + 1) * inter),
        vocab=even_rows(config.vocab_size, shard)[r],
        family=own,
    )


def even_rows(count: int, shard: Shard) -> list[tuple[int, int]]:
    """Every rank's part of `count` rows (the vocabulary, the maps' outputs), in rank order; the
    parts' sizes differ by one at most."""
    n = shard.size
    return [(r * count // n, (r + 1) * count // n) for r in range(n)]


def shard_config(config: ModelConfig, plan: HeadPlan, size: int) -> ModelConfig:
    """The model as one rank sees it: its heads and MLP columns only."""
    return config.replace(
        num_heads=plan.q_heads[1] - plan.q_heads[0],
        num_kv_heads=plan.kv_heads[1] - plan.kv_heads[0],
        intermediate_size=plan.mlp[1] - plan.mlp[0],
        family_config=config.family_config.sharded(size),
        vocab_rows=plan.vocab,
    )


def shard_checkpoint(
    config: ModelConfig, tensors: dict[str, torch.Tensor], shard: Shard
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(the shard's config, its tensors by the same names), each cut by its family's rule
    (ModelFamily.shards). Views where a cut allows: a rank's tensors stay slices of the loader's
    until the model builds its fused copies."""
    plan = head_plan(config, shard)
    rules = _rules(config.architecture)
    cuts = _cuts(config, plan)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        rule = next((r for end, r in rules if end.search(name)), None)
        out[name] = t if rule is None else cuts[rule](t, name)  # NOTE: no rule: whole on every rank
    return shard_config(config, plan, shard.size), out


@lru_cache
def _rules(architecture: str) -> tuple[tuple[re.Pattern, str], ...]:
    """The family's rules as (a pattern matching the end of a tensor name, the rule); a `*` in a
    rule's name stands for one index (the expert's in "mlp.experts.*.gate_proj.weight")."""
    rules = family(architecture).shards or {}
    return tuple(
        (re.compile(r"(?:^|\.)" + re.escape(end).replace(r"\*", r"\d+") + "$"), rule) for end, rule in rules.items()
    )


def _cuts(config: ModelConfig, plan: HeadPlan) -> dict:
    """Rule -> (tensor, name) -> this rank's part. Row ranges are of the output (dim 0), column
    ranges of the input (dim 1); fused rules take each part's range and join them."""
    hd, hq, hkv, inter = config.head_dim, config.num_heads, config.num_kv_heads, config.intermediate_size
    q = (plan.q_heads[0] * hd, plan.q_heads[1] * hd)
    kv = (plan.kv_heads[0] * hd, plan.kv_heads[1] * hd)
    mlp = plan.mlp

    def fused(t, name, parts):  # parts: (offset of the part, its range)
        return _join([_rows(t, off + lo, off + hi, name) for off, (lo, hi) in parts])

    return {
        **_hybrid_cuts(config, plan),
        "vocab_rows": lambda t, name: _rows(t, *plan.vocab, name),
        "q_heads": lambda t, name: _rows(t, *q, name),
        "kv_heads": lambda t, name: _rows(t, *kv, name),
        "mlp_rows": lambda t, name: _rows(t, *mlp, name),
        "q_columns": lambda t, name: _columns(t, *q, name),
        "mlp_columns": lambda t, name: _columns(t, *mlp, name),
        # [q; k; v] rows in one tensor (Huginn's Wqkv)
        "qkv_heads": lambda t, name: fused(t, name, [(0, q), (hq * hd, kv), ((hq + hkv) * hd, kv)]),
        # [gate; up] rows in one tensor (Huginn's fc)
        "gate_up_rows": lambda t, name: fused(t, name, [(0, mlp), (inter, mlp)]),
        # a [2, 1, H, D] query and key bias by head (Huginn's qk_bias; its models have as many K/V heads)
        "qk_bias_heads": lambda t, name: t[:, :, plan.q_heads[0] : plan.q_heads[1]],
    }


def _hybrid_cuts(config: ModelConfig, plan: HeadPlan) -> dict:
    """The Gated DeltaNet hybrids' own rules (models/hybrid_weights.py HYBRID_SHARDS names them)."""
    if "key_heads" not in plan.family:
        return {}
    hy, hd = config.family_config, config.head_dim
    (k0, k1), (v0, v1) = plan.family["key_heads"], plan.family["value_heads"]
    dk, dv, per_key = hy.key_head_dim, hy.value_head_dim, hy.value_heads // hy.key_heads
    qk, v = (k0 * dk, k1 * dk), (v0 * dv, v1 * dv)
    conv = [(0, qk), (hy.key_heads * dk, qk), (2 * hy.key_heads * dk, v)]  # [q | k | v] channels
    group = 2 * dk + 2 * per_key * dv  # Qwen3-Next's in_proj_qkvz rows per key head: [q | k | v | z]
    cuts = {
        # q_proj: per head its query rows then its gate rows
        "q_gate_heads": lambda t, name: _rows(t, 2 * plan.q_heads[0] * hd, 2 * plan.q_heads[1] * hd, name),
        "gdn_channels": lambda t, name: _join([_rows(t, off + lo, off + hi, name) for off, (lo, hi) in conv]),
        "value_rows": lambda t, name: _rows(t, *v, name),
        "value_entries": lambda t, name: _rows(t, v0, v1, name),  # one row (or entry) per value head
        "value_columns": lambda t, name: _columns(t, *v, name),
        "key_groups": lambda t, name: _rows(t, k0 * group, k1 * group, name),
        "key_groups_ba": lambda t, name: _rows(t, k0 * 2 * per_key, k1 * 2 * per_key, name),  # [b_g | a_g]
    }
    for part in ("expert_mlp", "shared_mlp"):
        if part in plan.family:
            lo, hi = plan.family[part]
            cuts[part + "_rows"] = lambda t, name, lo=lo, hi=hi: _rows(t, lo, hi, name)
            cuts[part + "_columns"] = lambda t, name, lo=lo, hi=hi: _columns(t, lo, hi, name)
    return cuts


def _join(parts):
    if isinstance(parts[0], GroupedInts):
        return concat_rows(parts)
    return torch.cat(parts)


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
