"""The step loop: schedule -> run -> postprocess. Owns the scheduler, runner and caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache.block_manager import BlockManager
from .cache.kv_pool import KVPool
from .config import EngineConfig, RowsConfig
from .detokenize import TextTracker
from .errors import InputError
from .fill.select import RowSelector
from .fill.tokens import TokenTable, load_counts
from .runner import Runner
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestOutput:
    seq: Sequence
    delta_text: str
    new_token_ids: list[int]
    finished: bool


class Engine:
    def __init__(self, model, tokenizer, config: EngineConfig, fill_maps=None):
        cfg = model.config
        self.model, self.tokenizer, self.config = model, tokenizer, config
        kv_dtype = model.dtype
        bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_dtype.itemsize
        bs = config.cache.block_size
        num_blocks = config.cache.num_blocks or max(1, int(config.cache.kv_cache_gib * 2**30) // (bytes_per_token * bs))
        self.kv = KVPool(cfg.num_layers, num_blocks * bs, cfg.num_kv_heads, cfg.head_dim, kv_dtype, model.device)
        self.blocks = BlockManager(num_blocks, bs)
        self.fill = config.fill
        self.scheduler = Scheduler(config.scheduler, self.blocks, RowSelector(token_table(tokenizer, self.fill.rows)))
        if self.fill.enabled and not 0 < self.fill.split < cfg.num_layers:
            raise ValueError(f"fill.split must be in 1..{cfg.num_layers - 1} for this model, got {self.fill.split}")
        self.runner = Runner(model, self.kv, bs, self.fill, fill_maps)
        self.text = TextTracker(tokenizer)
        self.max_model_len = min(cfg.max_position_embeddings, num_blocks * bs)
        self.eos_ids = tuple(cfg.eos_token_ids) or tuple(getattr(tokenizer, "eos_token_ids", ()) or ())

    # -- requests ----------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, fill: bool = True,
                    rows: RowsConfig | None = None, hide_from: int | None = None) -> Sequence:
        """Queue a request. `fill=False` asks for an exact prefill even when the fill is on;
        `rows` overrides the configured exact-row selectors for this request; `hide_from`
        (evaluation: the question-hidden control) shows the selectors only positions before it."""
        self.validate(prompt_ids, params)
        seq = Sequence(prompt_ids=list(prompt_ids), params=params)
        apply_fill(seq, self.fill, fill, rows, hide_from)
        self.scheduler.add(seq)
        return seq

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InputError("the prompt is empty")
        vocab = self.model.config.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InputError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        need = len(prompt_ids) + params.max_tokens
        if need > self.max_model_len:
            raise InputError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) = {need} "
                f"exceeds the context length of {self.max_model_len} tokens"
            )

    def abort(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, "abort")
        self.runner.forget(seq.seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        items = self.scheduler.schedule()
        if not items:
            return []
        before = {id(it.seq): len(it.seq.output_ids) for it in items}
        result = self.runner.run(items)
        touched = self.scheduler.postprocess(items, result, self.eos_ids)
        return [self._output(seq, before[id(seq)]) for seq in touched]

    def _output(self, seq: Sequence, had: int) -> RequestOutput:
        delta, hit_stop = self.text.update(seq)
        if hit_stop and not seq.finished:
            self.scheduler.finish(seq, "stop")  # NOTE: update() already emitted the cut text
        if seq.finished:
            self.runner.forget(seq.seq_id)
        return RequestOutput(seq=seq, delta_text=delta, new_token_ids=seq.output_ids[had:],
                             finished=seq.finished)


def apply_fill(seq: Sequence, fill, wanted: bool = True, rows: RowsConfig | None = None,
               hide_from: int | None = None) -> None:
    """Set a new sequence's fill: prompt rows before len - tail are filled (when the fill is on
    and the prompt is longer than the tail), with these exact-row selectors."""
    n = len(seq.prompt_ids)
    if not (wanted and fill.enabled and n > fill.tail):
        return
    if hide_from is not None and not 0 < hide_from <= n:
        raise InputError(f"hide_from must be in 1..{n}, got {hide_from}")
    seq.fill_boundary, seq.fill_arm = n - fill.tail, fill.arm
    seq.rows, seq.hide_from = rows or fill.rows, hide_from


def token_table(tokenizer, rows: RowsConfig) -> TokenTable | None:
    """The per-token facts the selectors read; None when there is no tokenizer."""
    if tokenizer is None or not hasattr(tokenizer, "token_type"):
        return None
    counts = load_counts(rows.unigram) if rows.unigram else None
    return TokenTable.from_tokenizer(tokenizer, counts)
