"""Shards against the whole checkpoint; refusals at start; torchrun on two loopback "machines"
against one process; a rank that cannot start, or dies, ends every rank with one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, ParallelConfig
from ridgefill_runtime.errors import ParallelError, UnsupportedError
from ridgefill_runtime.llm import LLM
from ridgefill_runtime.loader.hf import load_hf_folder
from ridgefill_runtime.parallel.group import free_port
from ridgefill_runtime.parallel.shard import Shard, check_divides, head_plan, shard_checkpoint
from ridgefill_runtime.sequence import SamplingParams
from tiny_models import build_tiny, build_tiny_hybrid

ROOT = Path(__file__).resolve().parents[2]
RIDGEFILL = [sys.executable, "-m", "ridgefill_server"]
GEMMA_PROMPT = [
    "--model",
    "gemma3-270m",
    "--prompt",
    "The capital of France is",
    "--max-tokens",
    "12",
    "--threads",
    "1",
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama_tp_mha")
    build_tiny("llama_tp_mha", folder)
    return folder


@pytest.mark.parametrize("name,size", [("llama_tp_mha", 3), ("qwen3_tp_one_kv", 3), ("qwen2_tp_bias", 2)])
def test_shards_put_back_together_are_the_checkpoint(tmp_path, name, size):
    build_tiny(name, tmp_path)
    ckpt = load_hf_folder(tmp_path)
    cfg, hd = ckpt.config, ckpt.config.head_dim
    shards = [shard_checkpoint(cfg, ckpt.tensors, Shard(r, size)) for r in range(size)]
    for name_, whole in ckpt.tensors.items():
        parts = [tensors[name_] for _, tensors in shards]
        if "k_proj" in name_ or "v_proj" in name_:
            # K/V heads: each kept once (split) or by size / Hkv ranks in a row (copied)
            copies = max(1, size // cfg.num_kv_heads)
            parts = parts[::copies]
        if "o_proj" in name_ or "down_proj" in name_:
            assert torch.equal(torch.cat(parts, dim=1), whole), name_
        elif parts[0].shape != whole.shape:
            assert torch.equal(torch.cat(parts, dim=0), whole), name_
        else:
            assert all(torch.equal(p, whole) for p in parts), name_  # norms, embedding, head
    for r, (shard_cfg, _) in enumerate(shards):
        assert shard_cfg.num_heads * size == cfg.num_heads
        assert shard_cfg.intermediate_size * size == cfg.intermediate_size
        v = cfg.vocab_size  # vocab-parallel: the embedding and head rows by token, the logits still over all
        assert shard_cfg.vocab_rows == (r * v // size, (r + 1) * v // size) and shard_cfg.vocab_size == v
        plan = head_plan(cfg, Shard(r, size))
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per K/V head in the whole model
        # every query head of the rank reads a K/V head the rank holds
        assert {q // group for q in range(*plan.q_heads)} <= set(range(*plan.kv_heads))
        assert hd * shard_cfg.num_kv_heads == (plan.kv_heads[1] - plan.kv_heads[0]) * hd


def test_sizes_the_heads_cannot_take_are_refused_naming_the_counts(llama):
    cfg = load_hf_folder(llama).config  # 6 heads, 6 K/V heads, MLP 192
    with pytest.raises(
        UnsupportedError, match=r"tensor_parallel_size = 4 does not divide the model's 6 attention heads"
    ):
        check_divides(cfg, 4)
    with pytest.raises(UnsupportedError, match=r"2 K/V heads can be neither split 3 ways nor copied evenly"):
        check_divides(cfg.replace(num_kv_heads=2, num_heads=6), 3)
    # a family that declares no shard rules (every registered one does): refused by name
    import dataclasses

    from ridgefill_runtime.models import registry

    registry.register(dataclasses.replace(registry.family("llama"), name="unsharded_llama", gguf=None, shards=None))
    try:
        with pytest.raises(UnsupportedError, match=r"not yet for 'unsharded_llama'"):
            check_divides(cfg.replace(architecture="unsharded_llama"), 2)
    finally:
        registry.unregister("unsharded_llama")


def test_a_hybrid_size_its_gated_deltanet_heads_cannot_take_is_refused(tmp_path):
    build_tiny_hybrid("qwen3_5_tp", tmp_path)
    cfg = load_hf_folder(tmp_path).config  # 4 heads, 2 K/V heads (copied at 4), MLP 96, GDN 2 key / 4 value heads
    with pytest.raises(UnsupportedError, match=r"tensor_parallel_size = 4 does not divide the model's 2 key heads"):
        check_divides(cfg, 4)


def test_a_refused_size_ends_the_start_with_one_line_and_no_process_left(llama):
    before = _children()
    with pytest.raises(ParallelError, match=r"rank 0 failed to start: .*does not divide the model's 6 attention heads"):
        LLM(EngineConfig(model=str(llama), parallel=ParallelConfig(tensor_parallel_size=4)))
    assert _children() == before


def test_a_rank_that_dies_ends_the_step_naming_it(llama):
    llm = LLM(
        EngineConfig(
            model=str(llama), cache=CacheConfig(num_blocks=32), parallel=ParallelConfig(tensor_parallel_size=2)
        )
    )
    try:
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids
        (worker,) = _children()
        os.kill(worker, signal.SIGKILL)
        with pytest.raises(
            ParallelError, match=r"group lost during a step \(rank 1: its process exited with status -9"
        ):
            llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, temperature=0))
    finally:
        llm.close()
    assert _children() == set()


def _children() -> set[int]:
    """The live ranks this process started (spawned children; not multiprocessing's resource tracker)."""
    me = str(os.getpid())
    found = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[1] == me and fields[0] != "Z" and b"spawn_main" in cmdline:
                found.add(int(pid))
    return found


# -- several processes by hand and under torchrun ------------------------------------------------------


def _env(rank: int, size: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def test_torchrun_on_two_loopback_machines_equals_one_process(gemma3_gguf):
    one = subprocess.run([*RIDGEFILL, "generate", *GEMMA_PROMPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert one.returncode == 0, one.stderr
    port = free_port("127.0.0.1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
    rendezvous = ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    machines = [
        subprocess.Popen(
            [
                *torchrun,
                "--node-rank",
                str(k),
                *rendezvous,
                "-m",
                "ridgefill_server",
                "generate",
                *GEMMA_PROMPT,
                "--tensor-parallel-size",
                "2",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for k in range(2)
    ]
    (out0, err0), (out1, err1) = (m.communicate(timeout=300) for m in machines)
    assert [m.returncode for m in machines] == [0, 0], err0 + err1
    assert one.stdout.strip() and out0 == one.stdout
    assert out1 == ""  # only rank 0 answers


def test_a_rank_that_cannot_start_ends_every_rank_with_one_line(gemma3_gguf, tmp_path):
    """Placed by hand with torchrun's variables; rank 1's model folder is empty (it passes the
    command's checks and fails to load)."""
    port = free_port("127.0.0.1")
    empty = tmp_path / "empty-model"
    empty.mkdir()
    ranks = [
        subprocess.Popen(
            [*RIDGEFILL, "generate", *GEMMA_PROMPT, "--tensor-parallel-size", "2", "--distributed-timeout", "30"]
            + (["--model", str(empty)] if rank == 1 else []),
            env=_env(rank, 2, port),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )  # fmt: skip
        for rank in range(2)
    ]
    for proc in ranks:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 1, err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and "tensor-parallel rank 1 failed to start" in lines[0], err
        assert str(empty) in lines[0] and out == ""


def test_a_rank_that_never_joins_ends_the_start_after_the_timeout_naming_it():
    port = free_port("127.0.0.1")
    alone = subprocess.run(
        [*RIDGEFILL, "generate", *GEMMA_PROMPT, "--tensor-parallel-size", "2", "--distributed-timeout", "3"],
        env=_env(0, 2, port), capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert alone.returncode == 1
    assert (
        alone.stderr.strip() == "ridgefill: error: tensor-parallel rank 1 did not join within 3 s (parallel.timeout_s)"
    )
