"""Offline use: load a model, generate for a list of prompts, score a text."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from .config import EngineConfig
from .engine import _DTYPES, Engine
from .errors import InputError, UnsupportedError
from .ops.grouped_ints import GroupedInts
from .ops.packed_linear import bf16_gemm_native, with_gemm_dtype
from .ops.packed_linear import compiled_for as packed_compiled_for
from .fill.maps import FillMaps, check_maps_fit
from .loader.load import load_checkpoint, naming_the_file
from .models.registry import family
from .parallel.group import TensorGroup
from .parallel.launch import start_parallel_engine, wants_parallel
from .parallel.relay import StepRelay
from .parallel.shard import Shard, even_rows, head_plan, shard_checkpoint
from .sequence import SamplingParams


@dataclass
class Completion:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


def build_engine(config: EngineConfig) -> Engine:
    """The engine `config` asks for; with parallel.tensor_parallel_size > 1 (or under torchrun) rank
    0's, the other ranks started and following it (parallel/launch.py). Close it with Engine.close()."""
    if wants_parallel(config):
        return start_parallel_engine(config, build_local_engine)
    return build_local_engine(config)


def build_local_engine(
    config: EngineConfig, group: TensorGroup | None = None, relay: StepRelay | None = None
) -> Engine:
    """This process's engine; in a tensor-parallel `group`, over this rank's shard of the model
    (`relay`: rank 0's, which sends each step to the others)."""
    if config.gemm_dtype != "float32" and not bf16_gemm_native(torch.device(config.device)):
        raise UnsupportedError(
            f'gemm_dtype = "{config.gemm_dtype}" needs a CPU with AVX512-BF16 or AMX; this one has '
            "neither, and its emulated bfloat16 GEMMs would be slower than float32"
        )
    ckpt = load_checkpoint(config.model, packed=_wants_packed(config))
    if config.weights == "packed" and not any(isinstance(t, GroupedInts) for t in ckpt.tensors.values()):
        raise UnsupportedError(
            f'weights = "packed": {ckpt.source} has no packable weights (a GGUF of a dense '
            f"llama/qwen3 model with Q8_0, Q4_0, Q4_1, Q4_K or Q6_K linear weights)"
        )
    # The checkpoint's family (models/registry.py) says which model class runs it.
    model_config, tensors = ckpt.config, ckpt.tensors
    shard = None if group is None else Shard(group.rank, group.size)
    if shard is not None:
        model_config, tensors = shard_checkpoint(model_config, tensors, shard)
    with naming_the_file(ckpt.source):
        model = family(ckpt.config.architecture).build_model(
            model_config, tensors, dtype=_DTYPES[config.dtype], device=config.device
        )
    if shard is not None:
        model.sum_shards = group.sum_shards
        widths = [hi - lo for lo, hi in even_rows(ckpt.config.vocab_size, shard)]
        model.gather_vocab = partial(group.gather_columns, widths=widths)
    model.identity = ckpt.identity
    if config.gemm_dtype != "float32":
        set_gemm_dtype(config, model, ckpt.source)
    tensors.clear()
    ckpt.tensors.clear()  # NOTE: the model holds fused copies; drop the loader's to halve memory
    maps = load_fill_maps(config, model)
    if maps is not None and shard is not None:
        _shard_maps(maps, ckpt.config, shard, group)
    return Engine(model, ckpt.tokenizer, config, maps, relay=relay)


def _shard_maps(maps: FillMaps, config, shard: Shard, group: TensorGroup) -> None:
    """A rank's part of the fill's maps: its columns of each x̂ (all-gathered), its value heads' ΔM."""
    parts = even_rows(config.hidden_size, shard)
    maps.keep_outputs(*parts[shard.rank], partial(group.gather_columns, widths=[hi - lo for lo, hi in parts]))
    if maps.terminal:
        maps.keep_value_heads(*head_plan(config, shard).family["value_heads"])


def set_gemm_dtype(config: EngineConfig, model, source) -> None:
    """gemm_dtype on the model's packed weights; refused where it has none to act on."""
    if not with_gemm_dtype(model.weights, _DTYPES[config.gemm_dtype]):
        raise UnsupportedError(
            f'gemm_dtype = "{config.gemm_dtype}" acts on packed weights, and {source} runs with none '
            f'(weights = "{config.weights}" on {config.device}); for dense weights set dtype instead'
        )


def _wants_packed(config: EngineConfig) -> bool:
    """weights = auto packs where the packed kernel has been measured to pay: the CPU with the
    compiled extension. Explicit "packed" also runs on CUDA when the extension has the CUDA kernel
    (csrc/packed_linear.cu). NOTE: "auto" keeps GPUs dense: the CUDA kernel's speed against dense
    cuBLAS is unmeasured until a GPU is lent (benchmarks/packed_sweep.py --device cuda). Without a
    kernel for the device (a ROCm or CPU-only build, no extension) "packed" is refused: the per-call
    dequantizing fallback would be slower than dense weights."""
    if config.weights == "dequantized":
        return False
    device = torch.device(config.device)
    on_kernel = packed_compiled_for(device)
    if config.weights == "packed":
        if not on_kernel:
            where = (
                "this install (the compiled extension is not loaded)"
                if device.type == "cpu"
                else f"this build for {config.device}"
            )
            raise UnsupportedError(
                f'weights = "packed" needs the packed kernel, which {where} lacks; '
                f'use weights = "dequantized" or "auto"'
            )
        return True
    return on_kernel and device.type == "cpu"


def load_fill_maps(config: EngineConfig, model) -> FillMaps | None:
    """The ridgefill arm's maps, checked against the model they will run on."""
    fill = config.fill
    if fill.arm != "ridgefill":
        return None
    maps = FillMaps(fill.maps, fill.placement, model.dtype, model.device)
    check_maps_fit(maps.meta, model.identity, model.config, fill.split, fill.maps)
    return maps


class LLM:
    def __init__(self, config: EngineConfig | None = None, engine: Engine | None = None):
        self.engine = engine or build_engine(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop a tensor-parallel engine's other ranks (nothing to do on one rank)."""
        self.engine.close()

    def encode(self, prompt: str | list[int], chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: pass token ids")
        if chat:  # NOTE: the template writes any BOS itself (as the server encodes chat prompts)
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True
            )
        return self.tokenizer.encode(prompt, add_special_tokens=not chat)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams, chat: bool = False) -> list[Completion]:
        seqs = [self.engine.add_request(self.encode(p, chat), params) for p in prompts]
        while self.engine.has_unfinished():
            self.engine.step()
        return [Completion(s.prompt_ids, list(s.output_ids), s.text, s.finish_reason or "") for s in seqs]

    def score(self, token_ids: list[int]) -> dict:
        """log p(token_ids[i+1] | token_ids[:i+1]) and the argmax at each position i, for
        i from `first_scored` on (0 exact; the first tail row when the prefix is filled)."""
        seq = self.engine.add_request(token_ids, SamplingParams(max_tokens=0, prompt_logprobs=True))
        while self.engine.has_unfinished():
            self.engine.step()
        return {
            "token_ids": list(token_ids),
            "first_scored": seq.fill.boundary,
            "target_logprobs": seq.logprobs.prompt,
            "argmax": seq.logprobs.prompt_argmax,
        }
