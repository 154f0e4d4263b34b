"""The looped model on CUDA, where core-layer attention runs on the compiled ripe_attention op:
against the float64 reference and against the CPU path (gpu-marked: run by scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch

from ridgefill_runtime.config import LoopConfig
from ridgefill_runtime.layers.loop_attention import LoopRead, on_ripe_kernel
from ridgefill_runtime.loader.load import load_checkpoint
from ridgefill_runtime.models.registry import family

from harness import Harness
from looped_reference import TINY_HUGINN, LoopedReference, ripe_policy, write_tiny_huginn

pytestmark = pytest.mark.gpu
PROMPT = [5, 7, 9, 11, 3, 40, 22, 17, 8, 30, 2, 19, 44, 21, 34, 8, 50]


@pytest.fixture(scope="module")
def on_gpu(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA: torch.cuda.is_available() is False")
    folder = tmp_path_factory.mktemp("huginn")
    tensors = write_tiny_huginn(folder)
    ckpt = load_checkpoint(str(folder))
    model = family("huginn_raven").build_model(ckpt.config, ckpt.tensors, dtype=torch.float32, device="cuda")
    return tensors, model


@pytest.mark.parametrize("kind,window", [("full", None), ("ripe", 4), ("deepest", 0)])
def test_cuda_decode_equals_the_reference_policy(on_gpu, kind, window):
    tensors, model = on_gpu
    q = torch.zeros(1, 1, 1, 8, device="cuda")
    assert on_ripe_kernel(q), "the compiled ripe_attention op is not loaded"
    harness = Harness(model, looped=LoopConfig(cache=kind, window=window or 0, block=0), device="cuda")
    seq = harness.new_seq(PROMPT)
    got = torch.cat([harness.step([(seq, 1)], reads=(LoopRead(4, window),))[0] for _ in PROMPT]).double().cpu()
    policy = None if window is None else ripe_policy(window)
    ref = (
        LoopedReference(tensors, TINY_HUGINN, 4)
        if policy is None
        else LoopedReference(tensors, TINY_HUGINN, 4, policy=policy)
    )
    want = torch.stack([ref.step(t) for t in PROMPT])
    assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("kind,window", [("full", None), ("ripe", 4)])
def test_cuda_chunks_and_verification_equal_cpu(on_gpu, kind, window):
    tensors, model = on_gpu
    cpu = family("huginn_raven").build_model(model.config, tensors, dtype=torch.float32, device="cpu")
    looped = LoopConfig(cache=kind, window=window or 0, block=3, draft_loops=2)
    outs = []
    for m, device in ((model, "cuda"), (cpu, "cpu")):
        harness = Harness(m, looped=looped, history_rows=4, device=device)
        seq = harness.new_seq(PROMPT)
        got = [harness.step([(seq, n)], reads=(LoopRead(4, window),))[0] for n in (5, 5, 4)]
        got.append(harness.step([(seq, 3)], reads=(LoopRead(4, window),))[0])
        outs.append(torch.cat(got).cpu())
    assert float((outs[0] - outs[1]).abs().max()) <= 1e-4 * float(outs[1].abs().max())
