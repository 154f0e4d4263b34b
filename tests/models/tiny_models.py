"""Tiny random transformers checkpoints built offline, saved as HF folders for our loader."""

from __future__ import annotations

import torch

TINY_CONFIGS = {
    "llama_gqa_untied": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama_tied_rope_scaled": dict(
        model_type="llama",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=320,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=True,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    "qwen3_qk_norm": dict(
        model_type="qwen3",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    ),
    # Qwen2: q/k/v biases, odd shapes (3 heads of 16 over a 48-wide model, one KV head, a
    # 333-row vocabulary, intermediate 80), tied and untied heads.
    "qwen2_odd_tied": dict(
        model_type="qwen2",
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=1,
        vocab_size=333,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    "qwen2_untied": dict(
        model_type="qwen2",
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    # Gemma 3: a 16-key window on two local layers (the 300-token tests reach far past it), a
    # global layer, query_pre_attn_scalar unlike head_dim, and two RoPE bases.
    "gemma3_sliding": dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        sliding_window=16,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        tie_word_embeddings=True,
    ),
    # a global layer on each side of a split at 2: window-bounded K/V then has two global groups
    "gemma3_two_global": dict(
        model_type="gemma3_text",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=320,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        sliding_window=16,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    ),
}


# Tensor parallelism's shapes (tests/parallel): heads that split 2 and 3 ways (llama, Gemma 3 with a
# window), one K/V head copied to every rank (Qwen3), and Qwen2's q/k/v biases cut by head.
TP_CONFIGS = {
    "llama_tp_mha": dict(TINY_CONFIGS["llama_gqa_untied"], hidden_size=96, intermediate_size=192,
                         num_attention_heads=6, num_key_value_heads=6),
    "qwen3_tp_one_kv": dict(TINY_CONFIGS["qwen3_qk_norm"], hidden_size=96, intermediate_size=192,
                            num_attention_heads=6, num_key_value_heads=1, head_dim=16),
    "gemma3_tp_window": dict(TINY_CONFIGS["gemma3_sliding"], hidden_size=96, intermediate_size=192, num_attention_heads=12,
                             num_key_value_heads=6, head_dim=16),
    "qwen2_tp_bias": dict(TINY_CONFIGS["qwen2_untied"], hidden_size=96, intermediate_size=192,
                          num_attention_heads=6, num_key_value_heads=2),
}  # fmt: skip


def build_tiny(name: str, folder, seed: int = 0):
    """Save a random model of config `name` into `folder`; returns the transformers model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY_CONFIGS[name] if name in TINY_CONFIGS else TP_CONFIGS[name])
    model_type = kw.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # NOTE: random init leaves norms at 1 and logits tiny; widen weights so the test
    # sees real attention patterns and logits of order 1-10.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.08)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model


# Gated DeltaNet hybrids: 3 GDN layers then 1 gated attention layer, value heads = 2 x key heads.
_HYBRID_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=320,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
HYBRID_CONFIGS = {
    "qwen3_5_text": dict(model_type="qwen3_5_text", **_HYBRID_COMMON),
    # MoE on every layer but layer 1 (a dense MLP there), top-2 of 6 routed experts.
    "qwen3_next_moe": dict(
        model_type="qwen3_next",
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        **_HYBRID_COMMON,
    ),
}


# Shapes for tensor parallelism (tests/parallel): the Qwen3.5 one splits its 2 K/V heads at TP 2; the
# Qwen3-Next one has one K/V head (copied to every rank) and 6 key / 12 value GDN heads, MLP 96,
# experts 24 and shared expert 36 wide, so TP 2 and TP 3 both divide it.
HYBRID_TP_CONFIGS = {
    "qwen3_5_tp": HYBRID_CONFIGS["qwen3_5_text"],
    "qwen3_next_tp": dict(
        HYBRID_CONFIGS["qwen3_next_moe"],
        num_attention_heads=6,
        num_key_value_heads=1,
        linear_num_key_heads=6,
        linear_num_value_heads=12,
        linear_value_head_dim=8,
        shared_expert_intermediate_size=36,
    ),
}


def build_tiny_hybrid(name: str, folder, seed: int = 0):
    """Save a random hybrid of config `name` into `folder`; returns the transformers model.

    NOTE: beyond the dense widening, the conv taps get a larger spread (so the conv's history,
    the part carried across chunks, matters) and A_log / dt_bias a spread of decays."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(HYBRID_CONFIGS.get(name) or HYBRID_TP_CONFIGS[name])
    cfg = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if n.endswith("linear_attn.norm.weight") else 0.0))
            elif "conv1d" in n:
                p.normal_(0, 0.5)
            elif n.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.5, 1.0)
            else:
                p.normal_(0, 0.08)
    model.eval()
    model.save_pretrained(folder, safe_serialization=True)
    return model
