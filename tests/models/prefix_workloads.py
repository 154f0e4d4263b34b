"""A workload the prefix-caching tests of every model kind share: requests on shared prefixes
arriving while others run, on a pool too small for all of them, two aborted mid-run."""

from __future__ import annotations

import random
from collections.abc import Callable

from ridgefill_runtime.sequence import SamplingParams


def drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def concurrent_with_aborts(
    engine,
    tokens: Callable[[int, int], list[int]],
    base_len: int,
    shortest: int,
    longest_suffix: int,
    max_tokens: tuple[int, int],
    suffix_seed: int,
) -> list:
    """Ten greedy requests, each a random start (at least `shortest` tokens) of one of three
    `base_len`-token prefixes plus its own suffix, 0-3 steps apart; the newest live one is
    aborted after the 4th and the 8th. Runs to the end; returns the requests not aborted."""
    rng = random.Random(0)
    bases = [tokens(base_len, 30 + i) for i in range(3)]
    seqs, aborted = [], []
    for i in range(10):
        ids = rng.choice(bases)[: rng.randint(shortest, base_len)] + tokens(
            rng.randint(1, longest_suffix), suffix_seed + i
        )
        params = SamplingParams(max_tokens=rng.randint(*max_tokens), temperature=0, ignore_eos=True, logprobs=0)
        seqs.append(engine.add_request(ids, params))
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if i in (3, 7):
            live = [s for s in seqs if not s.finished]
            aborted.append(live[-1])
            engine.abort(live[-1])
    drain(engine)
    return [s for s in seqs if s not in aborted]
