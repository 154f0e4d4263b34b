"""Group-wise integers from GGUF blocks: every value equal to gguf-py's dequantization (bit for bit,
up to the sign of a zero in Q4_0), q in range, refusals, exact concatenation of mixed formats, row
permutation, and the shipped SmolLM2 file."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from ridgefill_runtime.errors import UnsupportedError
from ridgefill_runtime.loader.gguf import default_model_path, dequantize_tensor, unpermute_rope_rows
from ridgefill_runtime.loader.gguf_groups import GROUPABLE, grouped_from_gguf
from ridgefill_runtime.ops.grouped_ints import GroupedInts, concat_rows, dequantize_groups, permute_rows

# ---------------------------------------------------------------------------------------------
# Writing test tensors
# ---------------------------------------------------------------------------------------------

# type: (values per block, bytes per block, byte offsets of the block's fp16 fields)
BLOCKS = {
    Q.Q8_0: (32, 34, (0,)),  # d
    Q.Q4_0: (32, 18, (0,)),  # d
    Q.Q4_1: (32, 20, (0, 2)),  # d, m
    Q.Q4_K: (256, 144, (0, 2)),  # d, dmin
    Q.Q6_K: (256, 210, (208,)),  # d (last)
    Q.Q5_0: (32, 22, (0,)),  # d
    Q.Q5_1: (32, 24, (0, 2)),  # d, m; only used for the refusal
}

# fp16 extremes: the largest finite, +-8192 (the first |d| whose -8d overflows fp16), 8188 (-8d is
# exactly -65504), the smallest subnormal and normal, signed zeros, plain values.
EXTREME_HALVES = [
    65504.0,
    -65504.0,
    8192.0,
    -8192.0,
    8188.0,
    -8188.0,
    2.0**-24,
    -(2.0**-24),
    2.0**-14,
    0.0,
    -0.0,
    1.0,
    -3.5,
]
NO_OVERFLOW_HALVES = [h for h in EXTREME_HALVES if abs(h) <= 8188.0]  # 8188: the largest fp16 below 8192

ROWS, COLS = 8, 1024  # 32 K-quant blocks, 256 of the 32-value ones


def random_blocks(
    rng: np.random.Generator, qtype: Q, rows: int, cols: int, halves: list[float] = EXTREME_HALVES
) -> np.ndarray:
    """uint8 [rows, bytes per row]: random bytes, each fp16 field a random small value except for
    `halves`, placed in random blocks (random bytes there could be NaN or inf)."""
    values, size, offsets = BLOCKS[qtype]
    count = rows * cols // values
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)  # [blocks, bytes]
    for offset in offsets:
        field = rng.uniform(-0.1, 0.1, size=count).astype(np.float16)  # [blocks]
        field[rng.choice(count, size=len(halves), replace=False)] = halves
        blocks[:, offset : offset + 2] = field.view(np.uint8).reshape(count, 2)
    return blocks.reshape(rows, cols // values * size)


def write_and_read(path, tensors: dict[str, tuple[np.ndarray, Q]]) -> dict:
    """Write `tensors` (raw blocks or float arrays) to a GGUF; the reader's tensors by name."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (array, qtype) in tensors.items():
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, array)
        else:
            writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def one_tensor(tmp_path, rng, qtype: Q, rows: int = ROWS, cols: int = COLS, halves=EXTREME_HALVES):
    name = f"blk.0.{qtype.name.lower()}.weight"
    blocks = random_blocks(rng, qtype, rows, cols, halves)
    return write_and_read(tmp_path / f"{name}.gguf", {name: (blocks, qtype)})[name]


def assert_identical(actual: torch.Tensor, expected: torch.Tensor, zero_sign_may_differ: bool = False) -> None:
    """Equal values; equal bits too, except (when allowed) the sign of a zero."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual, expected)
    differ = actual.view(torch.int32) != expected.view(torch.int32)  # [N, K]
    if zero_sign_may_differ:
        assert bool((expected[differ] == 0).all())
    else:
        assert not bool(differ.any()), f"{int(differ.sum())} values differ in their bits"


# ---------------------------------------------------------------------------------------------
# Each supported type against gguf-py
# ---------------------------------------------------------------------------------------------

# type: (bits, group, scale dtype with EXTREME_HALVES, has min, q range)
FORMATS = {
    Q.Q8_0: (8, 32, torch.float16, False, (-128, 127)),
    Q.Q4_0: (4, 32, torch.float32, True, (0, 15)),  # |d| >= 8192 among the d's: -8d overflows fp16
    Q.Q5_0: (8, 32, torch.float16, False, (-16, 15)),  # (q - 16) * d, as gguf-py: no min, fp16 even for huge d
    Q.Q4_1: (4, 32, torch.float16, True, (0, 15)),
    Q.Q4_K: (4, 32, torch.float32, True, (0, 15)),
    Q.Q6_K: (8, 16, torch.float32, False, (-32, 31)),
}


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_values_equal_gguf_py(tmp_path, qtype):
    tensor = one_tensor(tmp_path, np.random.default_rng(int(qtype)), qtype)
    g = grouped_from_gguf(tensor)
    bits, group, dtype, has_min, (low, high) = FORMATS[qtype]
    assert (g.bits, g.group, g.scale.dtype, g.min is not None) == (bits, group, dtype, has_min)
    assert g.q.shape == (ROWS, COLS) and g.scale.shape == (ROWS, COLS // group)

    expected = dequantize_tensor(tensor)  # gguf-py's float32 values, [N, K]
    assert_identical(dequantize_groups(g), expected, zero_sign_may_differ=qtype == Q.Q4_0)
    assert float(expected.abs().max()) > 1e4  # the extreme scales were really used
    assert int(g.q.min()) == low and int(g.q.max()) == high  # the whole range, nothing beyond


def test_q4_0_keeps_fp16_unless_minus_8d_overflows(tmp_path):
    rng = np.random.default_rng(40)
    fits = one_tensor(tmp_path, rng, Q.Q4_0, halves=NO_OVERFLOW_HALVES)  # |d| <= 8188: -8d is an fp16
    g = grouped_from_gguf(fits)
    assert g.scale.dtype == torch.float16 and g.min.dtype == torch.float16
    assert torch.equal(g.min, g.scale * -8)  # fp16 arithmetic: equal because no -8d overflowed
    assert float(g.min.abs().max()) == 65504.0
    assert_identical(dequantize_groups(g), dequantize_tensor(fits), zero_sign_may_differ=True)


def test_q4_0_zero_sign_is_the_only_difference(tmp_path):
    # d = -1 and q = 8 everywhere: gguf-py takes (8 - 8) * -1 = -0, we take 8 * -1 + 8 = +0.
    block = np.concatenate([np.array([-1.0], dtype="<f2").view(np.uint8), np.full(16, 0x88, np.uint8)])
    tensor = write_and_read(tmp_path / "zero.gguf", {"z.weight": (block.reshape(1, 18), Q.Q4_0)})["z.weight"]
    ours, theirs = dequantize_groups(grouped_from_gguf(tensor)), dequantize_tensor(tensor)
    assert torch.equal(ours, theirs) and not bool(ours.signbit().any()) and bool(theirs.signbit().all())


def test_q4_k_layout_on_a_hand_made_block(tmp_path):
    """Independent of gguf-py: d = dmin = 1, 6-bit scales/mins above 15 (so their top bits count)."""
    sc, m = np.arange(60, 52, -1), 17 + 5 * np.arange(8)  # [8] each, sub-block j
    q = np.arange(256) % 16  # [256]
    chunks = q.reshape(4, 2, 32)  # [chunk, low/high nibble, byte]
    qs = chunks[:, 0] | (chunks[:, 1] << 4)  # [4, 32]
    scales = np.concatenate(
        [(sc[:4] & 63) | ((sc[4:] >> 4) << 6), (m[:4] & 63) | ((m[4:] >> 4) << 6), (sc[4:] & 15) | ((m[4:] & 15) << 4)]
    )  # [12]
    block = np.concatenate([np.array([1.0, 1.0], dtype="<f2").view(np.uint8), scales, qs.reshape(-1)]).astype(np.uint8)
    tensor = write_and_read(tmp_path / "q4k.gguf", {"t.weight": (block.reshape(1, 144), Q.Q4_K)})["t.weight"]
    g = grouped_from_gguf(tensor)
    assert torch.equal(g.q[0], torch.tensor(q, dtype=torch.int8))
    assert torch.equal(g.scale[0], torch.tensor(sc, dtype=torch.float32))
    assert torch.equal(g.min[0], -torch.tensor(m, dtype=torch.float32))


def test_q6_k_layout_on_a_hand_made_block(tmp_path):
    """Independent of gguf-py: d = 1, the scale of 16-value group s is s - 8, value v stores v % 64."""
    q6 = np.arange(256) % 64  # [256] stored 6-bit values
    half = q6.reshape(2, 4, 32)  # [half, j, l]: value 128 h + 32 j + l
    ql = (half[:, 0:2] & 0xF) | ((half[:, 2:4] & 0xF) << 4)  # [half, 2, 32]
    qh = sum(((half[:, j] >> 4) & 3) << (2 * j) for j in range(4))  # [half, 32]
    block = np.concatenate(
        [
            ql.reshape(-1),
            qh.reshape(-1),
            (np.arange(16) - 8).astype(np.int8).view(np.uint8),
            np.array([1.0], dtype="<f2").view(np.uint8),
        ]
    ).astype(np.uint8)
    tensor = write_and_read(tmp_path / "q6.gguf", {"t.weight": (block.reshape(1, 210), Q.Q6_K)})["t.weight"]
    g = grouped_from_gguf(tensor)
    assert torch.equal(g.q[0], torch.tensor(q6 - 32, dtype=torch.int8))
    assert torch.equal(g.scale[0], torch.arange(16, dtype=torch.float32) - 8)


# ---------------------------------------------------------------------------------------------
# Refusals and the reference itself
# ---------------------------------------------------------------------------------------------


def test_unsupported_types_are_refused_by_name(tmp_path):
    rng = np.random.default_rng(5)
    tensors = write_and_read(
        tmp_path / "other.gguf",
        {
            "blk.3.ffn_up.weight": (random_blocks(rng, Q.Q5_1, 2, 64, halves=[1.0]), Q.Q5_1),
            "blk.3.attn_q.weight": (rng.standard_normal((2, 64)).astype(np.float16), Q.F16),
        },
    )
    with pytest.raises(UnsupportedError, match=r"'blk\.3\.ffn_up\.weight' has type Q5_1"):
        grouped_from_gguf(tensors["blk.3.ffn_up.weight"])
    with pytest.raises(UnsupportedError, match=r"'blk\.3\.attn_q\.weight' has type F16"):
        grouped_from_gguf(tensors["blk.3.attn_q.weight"])


def test_dequantize_groups_on_hand_made_values():
    g = GroupedInts(
        q=torch.tensor([[0, 1, 2, 3], [-4, 5, 6, -7]], dtype=torch.int8),
        scale=torch.tensor([[0.5, 2.0], [1.0, -1.0]]),
        min=torch.tensor([[1.0, -1.0], [0.0, 0.25]]),
        bits=8,
        group=2,
    )
    expected = torch.tensor([[1.0, 1.5, 3.0, 5.0], [-4.0, 5.0, -5.75, 7.25]])
    assert torch.equal(dequantize_groups(g), expected)
    without_min = GroupedInts(g.q, g.scale, None, 8, 2)
    assert torch.equal(dequantize_groups(without_min), expected - g.min.repeat_interleave(2, 1))


def test_grouped_ints_checks_shapes():
    q = torch.zeros(2, 64, dtype=torch.int8)
    with pytest.raises(ValueError, match="scale"):
        GroupedInts(q, torch.ones(2, 3), None, 4, 32)
    with pytest.raises(ValueError, match="min"):
        GroupedInts(q, torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float16), 4, 32)
    with pytest.raises(ValueError, match="bits"):
        GroupedInts(q, torch.ones(2, 2), None, 6, 32)


# ---------------------------------------------------------------------------------------------
# Concatenation and permutation
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def parts(tmp_path) -> dict[Q, GroupedInts]:
    rng = np.random.default_rng(7)
    rows = {Q.Q4_K: 3, Q.Q6_K: 2, Q.Q8_0: 4, Q.Q4_1: 1, Q.Q4_0: 2, Q.Q5_0: 2}
    written = write_and_read(
        tmp_path / "parts.gguf",
        {
            qtype.name: (random_blocks(rng, qtype, n, 512, halves=EXTREME_HALVES[: n * 2]), qtype)
            for qtype, n in rows.items()
        },
    )
    return {qtype: grouped_from_gguf(written[qtype.name]) for qtype in rows}


@pytest.mark.parametrize(
    "mix",
    [
        (Q.Q4_K, Q.Q6_K, Q.Q8_0),  # group 16, bits 8, float32, a min for Q6_K and Q8_0
        (Q.Q8_0, Q.Q4_1, Q.Q8_0),  # float16 throughout, Q8_0 given a -0.0 min
        (Q.Q6_K, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0),
        (Q.Q4_1, Q.Q4_1),
        (Q.Q5_0, Q.Q5_0, Q.Q8_0),  # Gemma 3 270M's q, k, v
    ],
    ids=lambda mix: "+".join(q.name for q in mix),
)
def test_concat_rows_is_exact(parts, mix):
    chosen = [parts[q] for q in mix]
    fused = concat_rows(chosen)
    expected = torch.cat([dequantize_groups(p) for p in chosen])  # [sum N, K]
    assert_identical(dequantize_groups(fused), expected)
    assert fused.bits == max(p.bits for p in chosen)
    assert fused.group == (16 if Q.Q6_K in mix else 32)
    assert (fused.min is None) == all(p.min is None for p in chosen)
    all_half = all(p.scale.dtype == torch.float16 for p in chosen)
    assert fused.scale.dtype == (torch.float16 if all_half else torch.float32)
    assert fused.q.shape == (expected.shape[0], 512) and fused.scale.shape == (expected.shape[0], 512 // fused.group)


def test_concat_rows_keeps_negative_zeros(parts):
    # Q8_0 rows with a negative d and q = 0 are -0.0; a +0.0 min for them would turn those into +0.0.
    q8 = dequantize_groups(parts[Q.Q8_0])
    assert bool(((q8 == 0) & q8.signbit()).any())
    assert parts[Q.Q8_0].min is None and concat_rows([parts[Q.Q8_0], parts[Q.Q4_1]]).min is not None


def test_concat_rows_refuses_different_row_lengths(parts):
    short = GroupedInts(torch.zeros(1, 32, dtype=torch.int8), torch.ones(1, 1), None, 8, 32)
    with pytest.raises(ValueError, match="row lengths"):
        concat_rows([parts[Q.Q8_0], short])
    with pytest.raises(ValueError):
        concat_rows([])


def test_permute_rows_undoes_llama_cpp_rope_order(tmp_path):
    heads, head_dim = 4, 8
    tensor = one_tensor(tmp_path, np.random.default_rng(11), Q.Q4_K, rows=heads * head_dim, cols=256, halves=[1.0])
    index = unpermute_rope_rows(torch.arange(heads * head_dim), heads)  # [N]: source row of each row
    assert not torch.equal(index, torch.arange(heads * head_dim))
    moved = permute_rows(grouped_from_gguf(tensor), index)
    assert_identical(dequantize_groups(moved), unpermute_rope_rows(dequantize_tensor(tensor), heads))
    with pytest.raises(ValueError, match="integer index"):
        permute_rows(moved, index.float())


# ---------------------------------------------------------------------------------------------
# The shipped model
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_shipped_model_round_trips_exactly():
    reader = gguf.GGUFReader(str(default_model_path()))
    quantized = [t for t in reader.tensors if t.tensor_type.name in GROUPABLE]
    assert sorted({t.tensor_type.name for t in quantized}) == ["Q4_1", "Q8_0"]
    assert len(quantized) == 211  # 30 layers x 7 projections + token_embd

    start = time.perf_counter()
    grouped = [grouped_from_gguf(t) for t in quantized]
    seconds = time.perf_counter() - start
    # A Python loop per block (4.2 M of them) would take minutes; the vectorized path takes ~1 s.
    assert seconds < 15, f"grouped_from_gguf took {seconds:.1f} s for the shipped model"
    assert sum(g.q.numel() for g in grouped) > 134_000_000

    for tensor, g in zip(quantized, grouped):
        assert_identical(dequantize_groups(g), dequantize_tensor(tensor))
        assert g.scale.dtype == torch.float16, tensor.name
    embed = grouped[[t.name for t in quantized].index("token_embd.weight")]
    assert (embed.bits, embed.group, embed.min, embed.q.shape) == (8, 32, None, (49152, 576))


def test_packed_load_is_the_same_from_its_cache_and_without_one(tmp_path, monkeypatch):
    """load_gguf(packed=True) gives the same GroupedInts on a cold cache, a warm one and with
    the cache off, and every packed tensor's values equal the float32 weights it replaces."""
    from ridgefill_runtime.loader.gguf import load_gguf

    monkeypatch.setenv("RIDGEFILL_CACHE_DIR", str(tmp_path))
    path = default_model_path()
    loads = [load_gguf(path, packed=True), load_gguf(path, packed=True), load_gguf(path, use_cache=False, packed=True)]
    dense = load_gguf(path).tensors
    names = [n for n, t in loads[0].tensors.items() if isinstance(t, GroupedInts)]
    assert len(names) == 211  # 210 Q4_1 linear weights and the Q8_0 embedding
    for name in names:
        first = loads[0].tensors[name]
        for other in loads[1:]:
            g = other.tensors[name]
            assert (g.bits, g.group) == (first.bits, first.group) and torch.equal(g.q, first.q)
            assert torch.equal(g.scale, first.scale)
            assert (g.min is None) == (first.min is None) and (g.min is None or torch.equal(g.min, first.min))
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):  # q_proj: the rope rows are un-permuted like the dense weight's
        assert torch.equal(dequantize_groups(loads[0].tensors[name]), dense[name])
