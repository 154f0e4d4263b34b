"""Huginn-0125's layout (model_type "huginn_raven", Geiping et al. 2025; seed 001 §2): its
config.json keys and tensor names -> ModelConfig (with a LoopedConfig) and LoopedLM.

config.json: n_embd, n_heads (or num_attention_heads), num_key_value_heads, intermediate_size,
n_layers_in_prelude / _recurrent_block / _coda, mean_recurrence, vocab_size (padded_vocab_size
when given: the embedding table is padded), block_size (context), rope_base, norm_eps, qk_bias,
bias (the adapter's), tie_embeddings, injection_type ("linear" only), state_init, and optionally
init_values {"std", "embed_scale"} (default sqrt(2 / (5 d)) and sqrt(d), as Huginn's code).
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from ..errors import ModelLoadError, UnsupportedError
from .family import ModelFamily
from .looped import LoopedLM
from .looped_config import LoopedConfig
from .looped_weights import BLOCK_PARTS, LOOPED_SHARDS, block_prefix


def config_from_hf(family: ModelFamily, raw: dict, generation: dict, where: str) -> ModelConfig:
    if raw.get("injection_type", "linear") != "linear":
        raise UnsupportedError(f'{where}: injection_type {raw["injection_type"]!r} is not supported (only "linear")')
    if raw.get("state_init", "like-init") not in ("like-init", "zero"):
        raise UnsupportedError(f"{where}: state_init {raw['state_init']!r} is not supported (like-init, zero)")
    try:
        d = int(raw["n_embd"])
        heads = int(raw.get("n_heads") or raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        prelude, core, coda = (
            int(raw[k]) for k in ("n_layers_in_prelude", "n_layers_in_recurrent_block", "n_layers_in_coda")
        )
        init = dict(raw.get("init_values") or {})
        std = 0.0 if raw.get("state_init") == "zero" else float(init.get("std", math.sqrt(2 / (5 * d))))
        looped = LoopedConfig(
            prelude=prelude,
            core=core,
            coda=coda,
            mean_recurrence=int(raw["mean_recurrence"]),
            embed_scale=float(init.get("embed_scale", math.sqrt(d))),
            init_std=std,
            adapter_bias=bool(raw.get("bias", False)),
            qk_bias=bool(raw.get("qk_bias", False)),
        )
        if looped.qk_bias and kv_heads != heads:
            raise UnsupportedError(
                f"{where}: qk_bias with grouped K/V heads ({kv_heads} of {heads}) has no "
                f"defined layout (Huginn's bias is per query head)"
            )
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        return ModelConfig(
            architecture=family.name,
            vocab_size=int(raw.get("padded_vocab_size") or raw["vocab_size"]),
            hidden_size=d,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=prelude + core + coda,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=d // heads,
            rms_norm_eps=float(raw.get("norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_base", 50000.0)),
            max_position_embeddings=int(raw.get("block_size", 4096)),
            tie_word_embeddings=bool(raw.get("tie_embeddings", True)),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=() if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),),
            family_config=looped,
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing key {e.args[0]!r}") from None
    except ModelLoadError as e:
        raise ModelLoadError(f"{where}: {e}") from None


def huginn_weight_names(config: ModelConfig) -> list[str]:
    lc = config.family_config
    names = ["transformer.wte.weight", "transformer.adapter.weight", "transformer.ln_f.weight"]
    if lc.adapter_bias:
        names.append("transformer.adapter.bias")
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for layer in range(config.num_layers):
        p = block_prefix(config, layer)
        names += [p + part for part in BLOCK_PARTS] + ([p + "attn.qk_bias"] if lc.qk_bias else [])
    return names


HUGINN_RAVEN = ModelFamily(
    name="huginn_raven",
    model_class=LoopedLM,
    parse_hf_config=config_from_hf,
    weight_names=huginn_weight_names,
    config_class=LoopedConfig,
    shards=LOOPED_SHARDS,
)
