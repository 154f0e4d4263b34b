"""`ridgefill tune`'s measurements: each candidate's quality on held-out documents (and needle
prompts) paired with exact, through eval/run.py, and its time to first token through the
engine, interleaved with exact's in the same run."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence

from tqdm import tqdm

from ..config import EngineConfig, FillConfig, RowsConfig, SchedulerConfig
from ..engine import Engine, token_table
from ..fill.select import RowSelector
from ..sequence import SamplingParams
from .run import Arm, document_measures, needle_results, summarize
from .tune import Candidate


def arm_of(c: Candidate, maps_path: str, maps, tokenizer, unigram: str | None) -> Arm:
    rows = RowsConfig(selectors=c.selectors, unigram=unigram)
    fill = FillConfig(arm="ridgefill", split=c.split, tail=c.tail, maps=maps_path, rows=rows)
    return Arm(c.name, fill, maps, RowSelector(token_table(tokenizer, rows)))


def quality(
    model,
    tokenizer,
    arms: dict[Candidate, Arm],
    docs: Sequence[list[int]],
    haystacks: Sequence[str] | None,
    needle_lengths: Sequence[int],
    needles_per_task: int,
) -> tuple[dict[str, dict], dict[int, list[dict]], dict[int, list[dict]]]:
    """-> (summary entry per candidate name, per-document measures by tail, needle rows by
    tail). Candidates sharing a tail share exact's logits and key tokens (both depend on the
    tail only), so documents are measured once per tail with every arm of that tail; needles
    only when `haystacks` are given."""
    tails = sorted({c.tail for c in arms})
    per_doc: dict[int, list[dict]] = {t: [] for t in tails}
    needles: dict[int, list[dict]] = {t: [] for t in tails}
    summary: dict[str, dict] = {}
    bar = tqdm(total=len(tails) * len(docs), desc="quality", unit="doc", file=sys.stderr)
    for tail in tails:
        tail_arms = [a for c, a in arms.items() if c.tail == tail]
        bar.set_description(f"quality: documents, tail {tail}")
        for ids in docs:
            per_doc[tail].append(document_measures(model, ids, tail_arms, tail, None))
            bar.update()
        if haystacks is not None:
            bar.set_description(f"quality: needles, tail {tail}")  # NOTE: needle_results has no bar of its own
            needles[tail] = needle_results(
                model, tokenizer, tail_arms, list(haystacks), needle_lengths, needles_per_task, tail
            )
        summary.update(summarize(per_doc[tail], needles[tail], [a.name for a in tail_arms]))
    bar.close()
    return {a.name: summary[a.name] for a in arms.values()}, per_doc, needles


class SpeedBench:
    """Time to first token of one prompt through the engine (one request, an idle engine, the
    prompt in one chunk), exact against each candidate in the same run."""

    def __init__(self, model, tokenizer, config: EngineConfig, ids: list[int], reps: int):
        self.model, self.tokenizer, self.ids, self.reps = model, tokenizer, list(ids), reps
        # NOTE: prefix caching off: the reps repeat the prompt, and a cached prefix is not prefill
        self.config = dataclasses.replace(
            config,
            cache=dataclasses.replace(config.cache, prefix_caching="off"),
            scheduler=SchedulerConfig(max_num_batched_tokens=len(ids), max_num_seqs=1, chunk_size=len(ids)),
        )
        self.exact = self._engine(FillConfig(), None)
        self.ttft(self.exact)  # NOTE: warm-up: first calls pay for allocation and kernel set-up

    def _engine(self, fill: FillConfig, maps) -> Engine:
        return Engine(self.model, self.tokenizer, dataclasses.replace(self.config, fill=fill), maps)

    def ttft(self, engine: Engine) -> float:
        t = time.perf_counter()
        engine.add_request(list(self.ids), SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished():
            engine.step()
        return time.perf_counter() - t

    def measure(self, arm: Arm) -> tuple[float, float]:
        """-> (median exact seconds, median candidate seconds); the runs alternate so that
        load from other work on the machine falls on both alike."""
        filled = self._engine(arm.fill, arm.maps)
        self.ttft(filled)  # NOTE: warm-up, as for exact
        exact, fill = [], []
        for _ in range(self.reps):
            exact.append(self.ttft(self.exact))
            fill.append(self.ttft(filled))
        return statistics.median(exact), statistics.median(fill)


def speeds(bench: SpeedBench, arms: dict[Candidate, Arm]) -> dict[Candidate, tuple[float, float]]:
    out = {}
    for c, arm in tqdm(arms.items(), desc="speed", unit="candidate", file=sys.stderr):
        out[c] = bench.measure(arm)
    return out
