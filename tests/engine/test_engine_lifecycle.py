"""Engine bookkeeping around a request's end: deadlines, aborts, leftovers and stats."""

from __future__ import annotations

import logging
import time

from ridgefill_runtime.engine import IDLE_BACKOFF_S
from ridgefill_runtime.sequence import SamplingParams, Sequence

from engine_fakes import LetterTokenizer, make_engine

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def run(engine, limit=500):
    outs = []
    for _ in range(limit):
        if not engine.has_unfinished():
            return outs
        outs += engine.step()
    raise AssertionError("the engine did not finish")


def test_deadline_ends_a_running_request_with_timeout_and_frees_everything():
    eng = make_engine(tokenizer=LetterTokenizer())
    seq = eng.add_request([5] * 10, PARAMS, deadline=time.monotonic() + 0.05)
    other = eng.add_request([5] * 10, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    eng.step()
    eng.step()
    assert seq.output_ids and seq.seq_id in eng.text._emitted  # it has streamed text
    time.sleep(0.06)
    outs = eng.step()
    done = [o for o in outs if o.seq is seq]
    assert len(done) == 1 and done[0].finished and done[0].new_token_ids == []
    assert seq.finish_reason == "timeout" and seq.block_table == []
    assert seq.seq_id in eng.runner.forgotten and seq.seq_id not in eng.text._emitted
    run(eng)
    assert other.finish_reason == "length"
    stats = eng.stats()
    assert stats.timeouts_total == 1 and stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0


def test_deadline_already_past_ends_a_waiting_request_before_it_runs():
    eng = make_engine()
    seq = eng.add_request([5] * 10, PARAMS, deadline=time.monotonic() - 1)
    outs = eng.step()
    assert [o.seq for o in outs] == [seq] and seq.finish_reason == "timeout"
    assert eng.runner.steps == 0 and not eng.has_unfinished()


def test_abort_after_text_drops_the_detokenizer_entry_and_counts():
    eng = make_engine(tokenizer=LetterTokenizer())
    seq = eng.add_request([5] * 6, PARAMS)
    eng.step()
    eng.step()
    assert seq.seq_id in eng.text._emitted
    eng.abort(seq)
    eng.abort(seq)  # a second abort of a finished request changes nothing
    assert seq.finish_reason == "abort" and seq.seq_id not in eng.text._emitted
    assert seq.seq_id in eng.runner.forgotten and eng.stats().aborts_total == 1


def test_stats_are_fresh_after_a_final_abort():
    eng = make_engine(num_blocks=16)
    seqs = [eng.add_request([5 + i] * 9, PARAMS) for i in range(3)]  # NOTE: distinct: no prefix to share
    eng.step()
    busy = eng.stats()
    assert busy.running == 3 and busy.kv_blocks_used == 9 and busy.kv_blocks_total == 16
    assert busy.kv_usage == 9 / 16 and busy.steps_total == 1
    for s in seqs:
        eng.abort(s)
    idle = eng.stats()
    assert (idle.running, idle.waiting, idle.kv_blocks_used, idle.kv_usage, idle.aborts_total) == (0, 0, 0, 0.0, 3)


def test_preemptions_are_counted():
    eng = make_engine(num_blocks=6, block_size=4)
    a, b = (
        eng.add_request([5 + i] * 12, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)) for i in range(2)
    )  # NOTE: distinct prompts: shared blocks would leave room enough for both
    run(eng)
    assert a.finish_reason == b.finish_reason == "length" and eng.stats().preemptions_total >= 1


def test_a_step_with_nothing_to_run_backs_off_logs_once_and_counts(caplog):
    eng = make_engine(num_blocks=2, block_size=4)
    # NOTE: past Engine.validate, straight into the scheduler: a request the pool cannot hold,
    # the only way left to make the scheduler find nothing to run.
    eng.scheduler.add(Sequence(prompt_ids=[5] * 20, params=PARAMS))
    with caplog.at_level(logging.ERROR, logger="ridgefill.engine"):
        t0 = time.monotonic()
        for _ in range(3):
            assert eng.step() == []
        took = time.monotonic() - t0
    assert took >= 3 * IDLE_BACKOFF_S * 0.9 and eng.stats().idle_spins_total == 3
    assert len([r for r in caplog.records if "nothing to run" in r.getMessage()]) == 1
