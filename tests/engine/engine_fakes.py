"""A real Engine (scheduler, blocks, detokenizer) around a fake runner: no model math, so the
engine and AsyncEngine tests run in milliseconds."""

from __future__ import annotations

import threading
import time

import torch

from ridgefill_runtime.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.scheduler import StepResult

EOS = 2
TOKEN = 7


class StubModel:
    """What Engine reads from a model when it is built; the fake runner never calls it."""

    def __init__(self, max_position_embeddings: int = 4096):
        self.config = ModelConfig(
            architecture="llama",
            vocab_size=64,
            hidden_size=8,
            intermediate_size=8,
            num_layers=2,
            num_heads=1,
            num_kv_heads=1,
            head_dim=8,
            rms_norm_eps=1e-5,
            rope_theta=1e4,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=True,
            eos_token_ids=(EOS,),
        )
        self.dtype = torch.float32
        self.device = torch.device("cpu")


class LetterTokenizer:
    """Token t decodes to one letter, so every token adds text."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(chr(ord("a") + t % 26) for t in ids)


class FakeRunner:
    """Stands in for Runner: samples TOKEN, optionally sleeps per step or raises for chosen
    sequences, and records which sequences it was told to forget."""

    def __init__(self, delay_s: float = 0.0, fail_if=None):
        self.delay_s = delay_s
        self.fail_if = fail_if  # seq -> bool: a step holding such a sequence raises
        self.forgotten: list[int] = []
        self.steps = 0
        self.release = threading.Event()  # set it to end a delayed step early
        self.release.set()

    def run(self, items) -> StepResult:
        self.steps += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        self.release.wait()
        if self.fail_if is not None and any(self.fail_if(it.seq) for it in items):
            raise RuntimeError("injected fault")
        tokens = [([TOKEN] if it.seq.params.max_tokens else None) if it.samples else None for it in items]
        return StepResult(next_tokens=tokens, prompt_logprobs=[None] * len(items))

    def forget(self, seq_id: int) -> None:
        self.forgotten.append(seq_id)


def make_engine(
    num_blocks: int = 64, block_size: int = 4, runner: FakeRunner | None = None, tokenizer=None, **scheduler
) -> Engine:
    config = EngineConfig(
        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size), scheduler=SchedulerConfig(**scheduler)
    )
    engine = Engine(StubModel(), tokenizer, config)
    engine.runner = runner or FakeRunner()
    return engine
