"""eval/roofline.py: the work counts against torch's own FLOP counter on a transformers model,
the byte count against the tensors it walks, and the peaks program on this machine."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ridgefill_runtime.eval.roofline import Peaks, Work, decode_work, measure_peaks, prefill_work, weight_bytes
from ridgefill_runtime.fill.ceiling import LayerShape

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 96, 200, 3


def hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        intermediate_size=INTER,
        vocab_size=VOCAB,
        num_hidden_layers=LAYERS,
        attn_implementation="eager",  # NOTE: plain matmuls, which the FLOP counter counts
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def shapes():
    return (LayerShape(HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, INTER),) * LAYERS


@torch.inference_mode()
def counted_flops(model, ids, past=None) -> tuple[int, object]:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        out = model(ids, past_key_values=past, use_cache=True, logits_to_keep=1)
    return counter.get_total_flops(), out.past_key_values


@pytest.mark.parametrize("context", [1, 7, 40])
def test_decode_flops_equal_torchs_count_of_one_decode_step(context):
    model = hf_llama()
    _, past = counted_flops(model, torch.randint(0, VOCAB, (1, context - 1))) if context > 1 else (0, None)
    flops, _ = counted_flops(model, torch.randint(0, VOCAB, (1, 1)), past)
    assert decode_work(shapes(), VOCAB, HIDDEN, 0, 4, 1, context).flops == flops


def test_prefill_flops_equal_torchs_count_less_the_masked_half_of_attention():
    # eager attention multiplies the whole n x n score matrix; a causal prefill needs the lower
    # triangle (n(n+1)/2 keys), which is what the work count holds
    n = 33
    model = hf_llama()
    flops, _ = counted_flops(model, torch.randint(0, VOCAB, (1, n)))
    full_square = 2 * 2 * HEADS * HEAD_DIM * n * n * LAYERS
    causal = 2 * 2 * HEADS * HEAD_DIM * (n * (n + 1) // 2) * LAYERS
    # transformers runs the final layer for every row; the engine (and the count) runs its
    # attention, o and MLP for the last row only: the other n - 1 rows there project q, k, v
    skipped_attention = 2 * 2 * HEADS * HEAD_DIM * (n * (n + 1) // 2 - n)  # rows 0..n-2, causal
    skipped_linear = 2 * (n - 1) * (HEADS * HEAD_DIM * HIDDEN + 3 * HIDDEN * INTER)  # o, gate, up, down
    # logits_to_keep=1: the LM head runs on the last row only, as in the count
    expected = flops - full_square + causal - skipped_attention - skipped_linear
    assert prefill_work(shapes(), VOCAB, HIDDEN, 0, n).flops == expected


def test_decode_bytes_read_each_layers_keys_once_and_a_window_only_its_window():
    layers = (LayerShape(8, 8, 4, 8), LayerShape(8, 8, 4, 8, window=5))
    work = decode_work(layers, 10, 8, 1000, 2, batch=3, context=9)
    # per row: global layer 9 keys, window layer 5; K and V; 4 wide; 2 bytes
    assert work.bytes == 1000 + 3 * (2 * 4 * (9 + 5) * 2)


@dataclass
class _Layer:
    w: torch.Tensor
    norm: torch.Tensor


@dataclass
class _Weights:
    embed: torch.Tensor
    layers: list
    lm_head: torch.Tensor


def test_weight_bytes_count_a_tied_head_once_and_skip_an_untied_embedding():
    layer = _Layer(torch.zeros(6, 4), torch.zeros(4, dtype=torch.float16))
    per_layer = 6 * 4 * 4 + 4 * 2
    embed = torch.zeros(10, 4)
    assert weight_bytes(_Weights(embed, [layer, layer], embed)) == per_layer + 10 * 4 * 4  # one layer object, once
    assert weight_bytes(_Weights(embed, [layer], torch.zeros(10, 4, dtype=torch.int8))) == per_layer + 40


def test_roofline_fraction_is_the_bound_over_the_time():
    peaks = Peaks(fma_gflops=100.0, copy_gbs=10.0, lanes=8, threads=2)
    compute_bound = Work(flops=50e9, bytes=1e9)  # 0.5 s of FMAs, 0.1 s of bytes
    assert compute_bound.columns(1.0, peaks)["of_roofline"] == pytest.approx(0.5)
    memory_bound = Work(flops=1e9, bytes=5e9)  # 0.01 s, 0.5 s
    cols = memory_bound.columns(2.0, peaks)
    assert cols["of_roofline"] == pytest.approx(0.25) and cols["gbs"] == pytest.approx(2.5)


def test_the_peaks_program_builds_and_measures_this_machine(monkeypatch):
    one, two = measure_peaks(1), measure_peaks(2)  # each checks the threads its loop ran on
    assert one.lanes in (4, 8, 16) and one.fma_gflops > 0 and one.copy_gbs > 0
    # a 1-thread FMA loop can do at most 2 FMAs per cycle per lane at well under 10 GHz
    assert one.fma_gflops < 2 * 2 * one.lanes * 10
    assert two.threads == 2 and two.fma_gflops > 0
    # (whether two threads beat one depends on what else runs: not asserted.) Fewer threads than asked is refused:
    monkeypatch.setenv("OMP_THREAD_LIMIT", "1")
    with pytest.raises(RuntimeError, match="ran on 1 threads, not the 2 asked for"):
        measure_peaks(2)
