"""Gemma 3 (text): the dense decoder with QK-norm, four (1 + w) RMSNorms per layer, a GeGLU MLP,
the embedding scaled by sqrt(d), `query_pre_attn_scalar`, and local sliding-window layers (their
own RoPE base) interleaved with global ones. Read from config.json (`gemma3_text`) or a GGUF
(`gemma3`); llama.cpp writes every norm weight as 1 + w, the loader takes the 1 back off
(GGUFFormat.norm_offset) so both sources hold Hugging Face's tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import FamilyConfig, ModelConfig
from ..errors import ModelLoadError, UnsupportedError
from ..layers.mlp import geglu_mlp
from ..layers.rotary import RotaryTable
from ..layers.vocab import embed_tokens
from ..ops.packed_linear import linear
from ..ops.rms_norm import rms_norm_add
from . import decoder_config
from .dense import DenseLM
from .family import GGUFFormat, MetadataLookup, ModelFamily
from .weights import DENSE_SHARDS

# Gemma 3 names its local layers "sliding_attention"; every sixth layer is global unless
# config.json lists the kinds (llama.cpp keeps only the pattern: its converter drops the list).
_PATTERN = 6
_LOCAL_THETA = 10_000.0  # llama.cpp's fixed base for Gemma 3's local layers (not in the GGUF)
_FF_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


# -- config ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SlidingWindow(FamilyConfig):
    """Interleaved local and global attention (Gemma 3): a local layer's query at position p
    sees only keys at p - window < position <= p, and its RoPE turns at its own base."""

    window: int
    local_layers: tuple[int, ...]
    local_rope_theta: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_layers", tuple(int(i) for i in self.local_layers))
        if self.window <= 0:
            raise ModelLoadError(f"model config: sliding window must be positive, got {self.window}")
        if self.local_rope_theta <= 0:
            raise ModelLoadError(f"model config: local rope theta must be positive, got {self.local_rope_theta}")

    def check(self, config: ModelConfig) -> None:
        if any(not 0 <= i < config.num_layers for i in self.local_layers):
            raise ModelLoadError(
                f"model config: sliding-window layers {self.local_layers} outside 0..{config.num_layers - 1}"
            )

    def window_of(self, layer: int) -> int:
        """The layer's window; 0 for a global layer."""
        return self.window if layer in self.local_layers else 0


def _local_layers(kinds, layers: int, pattern: int) -> tuple[int, ...]:
    if kinds is None:
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    if len(kinds) != layers or set(kinds) - {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"layer_types must list {layers} of sliding_attention/full_attention, got {kinds}")
    return tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")


def config_from_hf(family: ModelFamily, raw: dict, generation: dict, where: str) -> ModelConfig:
    """config.json (transformers v4 keys, or v5's rope_parameters per layer kind) -> ModelConfig."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(key) is not None:
            raise UnsupportedError(f"{where}: {key}={raw[key]} is not supported")
    act = raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh"))
    if act != "gelu_pytorch_tanh":
        raise UnsupportedError(f"{where}: unsupported hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
    params = raw.get("rope_parameters") or {}
    full, local = params.get("full_attention", params), params.get("sliding_attention", {})
    scaling = raw.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    if scaling:
        raise UnsupportedError(f"{where}: rope scaling {scaling} is not supported for gemma3 yet")
    try:
        hidden, heads, layers = int(raw["hidden_size"]), int(raw["num_attention_heads"]), int(raw["num_hidden_layers"])
        head_dim = int(raw.get("head_dim") or hidden // heads)
        pattern = int(raw.get("sliding_window_pattern", _PATTERN))
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        return ModelConfig(
            architecture=family.name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(full.get("rope_theta", raw.get("rope_theta", 1e6))),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            qk_norm=True,
            attention_bias=bool(raw.get("attention_bias", False)),
            bos_token_id=generation.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_ids=decoder_config.as_id_tuple(eos),
            family_config=SlidingWindow(
                window=int(raw["sliding_window"]),
                local_layers=_local_layers(raw.get("layer_types"), layers, pattern),
                local_rope_theta=float(local.get("rope_theta", raw.get("rope_local_base_freq", _LOCAL_THETA))),
            ),
            attention_scale=float(raw.get("query_pre_attn_scalar", head_dim)) ** -0.5,
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: missing key {e.args[0]!r}") from None


def config_from_gguf(
    family: ModelFamily, metadata: MetadataLookup, tensors: dict, tokenizer, rope_freqs
) -> ModelConfig:
    base = decoder_config.config_from_gguf(family, metadata, tensors, tokenizer, rope_freqs)
    window = metadata("gemma3.attention.sliding_window", None)
    if window is None:
        raise ModelLoadError("GGUF metadata lacks gemma3.attention.sliding_window")
    # NOTE: llama.cpp scales queries by 1/sqrt(head_dim) for every Gemma 3 size but 27B, whose
    # query_pre_attn_scalar is d / heads; the GGUF keeps neither, so the rule is repeated here.
    scalar = base.head_dim if base.num_layers != 62 else base.hidden_size // base.num_heads
    return base.replace(
        family_config=SlidingWindow(
            window=int(window),
            local_layers=_local_layers(None, base.num_layers, _PATTERN),
            local_rope_theta=_LOCAL_THETA,
        ),
        attention_scale=scalar**-0.5,
    )


def weight_names(config: ModelConfig) -> list[str]:
    return decoder_config.weight_names(config) + [
        f"model.layers.{i}.{part}.weight" for i in range(config.num_layers) for part in _FF_NORMS
    ]


# -- the model ---------------------------------------------------------------------------------


def _one_plus(tensors: dict, name: str, dtype, device) -> torch.Tensor:
    """Gemma's norm weight as applied, 1 + w, formed in float32 before the cast (as transformers)."""
    return (1.0 + tensors[name].float()).to(device=device, dtype=dtype)


class Gemma3LM(DenseLM):
    def __init__(
        self,
        config: ModelConfig,
        tensors: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__(config, tensors, dtype, device)
        if not isinstance(config.family_config, SlidingWindow):
            raise ModelLoadError("gemma3 needs its sliding-window layers in the config")
        plus = lambda name: _one_plus(tensors, name, dtype, self.device)  # noqa: E731
        for i, w in enumerate(self.weights.layers):
            p = f"model.layers.{i}."
            w.input_norm, w.post_norm = plus(p + "input_layernorm.weight"), plus(p + "post_attention_layernorm.weight")
            w.q_norm, w.k_norm = plus(p + "self_attn.q_norm.weight"), plus(p + "self_attn.k_norm.weight")
        self.ff_norms = [
            tuple(plus(f"model.layers.{i}.{part}.weight") for part in _FF_NORMS) for i in range(config.num_layers)
        ]  # per layer (pre, post) [d] each
        self.weights.final_norm = plus("model.norm.weight")
        self.local_rotary = RotaryTable(
            config.replace(rope_theta=config.family_config.local_rope_theta, rope_scaling=None), self.device
        )
        # transformers multiplies by sqrt(d) rounded to the run dtype
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype).item()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        table = self.weights.embed
        return embed_tokens(table, input_ids, self.dtype, self.config.vocab_rows, self.sum_shards) * self.embed_scale

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(cos, sin) of the global base, then of the local base: each [N, 1, D/2]."""
        return self.rotary.lookup(positions, self.dtype) + self.local_rotary.lookup(positions, self.dtype)

    def layer_rope(self, layer: int, rope: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        return rope[2:] if self.window(layer) else rope[:2]

    def finish_layer(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Norms after attention and around the MLP (sandwich): h [R, d], attn [R, H*D]."""
        w, (pre_ff, post_ff), eps = self.weights.layers[layer], self.ff_norms[layer], self.config.rms_norm_eps
        # h + norm(o), then its pre-MLP norm; then h + norm(mlp): one call each (ops/rms_norm.py)
        h, x = rms_norm_add(self.sum_shards(linear(attn, w.o)), h, eps, weight=w.post_norm, next_weight=pre_ff)
        mlp = self.sum_shards(geglu_mlp(x, w.gate_up, w.down))
        return rms_norm_add(mlp, h, eps, weight=post_ff)[0]


# -- the family --------------------------------------------------------------------------------

GEMMA3 = ModelFamily(
    name="gemma3_text",
    model_class=Gemma3LM,
    parse_hf_config=config_from_hf,
    weight_names=weight_names,
    config_class=SlidingWindow,
    packed_weights=True,
    shards=DENSE_SHARDS,
    qk_norm=True,
    gguf=GGUFFormat(
        architecture="gemma3",
        parse_config=config_from_gguf,
        top_level_names=decoder_config.GGUF_TOP_LEVEL_NAMES,
        layer_part_names={
            **decoder_config.GGUF_LAYER_PART_NAMES,
            **decoder_config.GGUF_QK_NORM_PART_NAMES,
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_offset=1.0,
    ),
)
