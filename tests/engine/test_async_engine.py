"""AsyncEngine around a real Engine with a fake runner: stats snapshots, deadlines, the
watchdog, graceful shutdown and fault isolation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from ridgefill_runtime import async_engine as ae
from ridgefill_runtime.async_engine import AsyncEngine, EngineStopped
from ridgefill_runtime.sequence import SamplingParams

from engine_fakes import FakeRunner, LetterTokenizer, make_engine


def params(n):
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def started(runner=None, **kw) -> AsyncEngine:
    eng = AsyncEngine(make_engine(num_blocks=512, runner=runner, tokenizer=LetterTokenizer()), max_queued=8, **kw)
    eng.start()
    return eng


async def until_finished(handle, timeout=10.0):
    """All of a request's events; the last one finishes it."""
    events = []
    while not events or not events[-1].finished:
        events.append(await asyncio.wait_for(handle.events.get(), timeout))
    return events


async def wait_for(cond, timeout=5.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "condition not met in time"
        await asyncio.sleep(0.005)


def test_requests_complete_and_the_snapshot_is_fresh_after_the_last_one():
    async def main():
        eng = started()
        handles = [eng.submit([5] * 9, params(5)) for _ in range(3)]
        results = [await until_finished(h) for h in handles]
        assert all(r[-1].finish_reason == "length" for r in results)
        assert all("".join(e.delta_text for e in r) == "hhhhh" for r in results)
        await wait_for(lambda: eng.stats().in_flight == 0)
        s = eng.stats()
        assert (s.engine.running, s.engine.waiting, s.engine.kv_blocks_used, s.inbox) == (0, 0, 0, 0)
        assert s.engine.steps_total >= 5 and eng.health().status == "ok"
        eng.stop()

    asyncio.run(main())


def test_abort_publishes_a_fresh_snapshot_without_another_step():
    async def main():
        runner = FakeRunner(delay_s=0.02)
        eng = started(runner)
        handle = eng.submit([5] * 9, params(1000))
        await handle.events.get()  # it is running
        assert eng.stats().engine.running == 1 and eng.stats().engine.kv_blocks_used > 0
        eng.abort(handle)
        events = await until_finished(handle)
        assert events[-1].finish_reason == "abort"
        s = eng.stats().engine
        assert (s.running, s.kv_blocks_used, s.aborts_total) == (0, 0, 1)
        assert handle.seq.seq_id not in eng.engine.text._emitted
        eng.stop()

    asyncio.run(main())


def test_submit_deadline_ends_the_request_with_timeout():
    async def main():
        eng = started(FakeRunner(delay_s=0.01))
        handle = eng.submit([5] * 9, params(1000), deadline=time.monotonic() + 0.1)
        events = await until_finished(handle)
        assert events[-1].finish_reason == "timeout" and events[-1].error is None
        assert 0 < handle.num_output_tokens < 1000
        await wait_for(lambda: eng.stats().engine.kv_blocks_used == 0)
        assert eng.stats().engine.timeouts_total == 1
        eng.stop()

    asyncio.run(main())


def test_health_reports_a_stall_while_no_step_completes_then_recovers():
    async def main():
        runner = FakeRunner()
        eng = started(runner, stall_after_s=0.1)
        assert eng.health().status == "ok" and eng.health().in_flight == 0
        runner.release.clear()  # the next step hangs
        handle = eng.submit([5] * 9, params(3))
        await asyncio.sleep(0.2)
        h = eng.health()
        assert h.status == "stalled" and h.seconds_since_progress >= 0.1 and h.in_flight == 1
        runner.release.set()
        await until_finished(handle)
        assert eng.health().status == "ok"
        eng.stop()
        assert eng.health().status == "stopped" and not eng.health().accepting

    asyncio.run(main())


def test_an_idle_engine_is_not_stalled_when_work_arrives():
    async def main():
        eng = started(FakeRunner(delay_s=0.02), stall_after_s=0.1)
        await asyncio.sleep(0.2)  # idle longer than stall_after_s
        handle = eng.submit([5] * 9, params(3))
        assert eng.health().status == "ok"
        await until_finished(handle)
        eng.stop()

    asyncio.run(main())


def test_a_dead_engine_thread_is_stalled_and_fails_its_requests():
    async def main():
        eng = started(FakeRunner(delay_s=0.01))
        handle = eng.submit([5] * 9, params(1000))
        await handle.events.get()

        def broken():
            raise SystemExit("the loop itself breaks")  # not an Exception: no fault isolation

        eng.engine.has_unfinished = broken
        events = await until_finished(handle)
        assert events[-1].finish_reason == "error" and "engine thread failed" in events[-1].error
        await wait_for(lambda: not eng._thread.is_alive())
        assert eng.health().status == "stalled"
        with pytest.raises(EngineStopped, match="not running"):
            eng.submit([5] * 9, params(3))

    asyncio.run(main())


def test_stop_with_grace_lets_requests_finish_and_refuses_new_ones():
    async def main():
        eng = started(FakeRunner(delay_s=0.005))
        handles = [eng.submit([5] * 9, params(20)) for _ in range(2)]
        stopper = threading.Thread(target=eng.stop, args=(5.0,))
        stopper.start()
        await wait_for(lambda: not eng.alive)
        with pytest.raises(EngineStopped, match="shutting down"):
            eng.submit([5] * 9, params(3))
        results = [await until_finished(h) for h in handles]
        assert [r[-1].finish_reason for r in results] == ["length", "length"]
        await asyncio.get_running_loop().run_in_executor(None, stopper.join)
        assert eng.health().status == "stopped" and eng.stats().in_flight == 0

    asyncio.run(main())


def test_stop_aborts_what_is_left_after_the_grace():
    async def main():
        eng = started(FakeRunner(delay_s=0.01))
        running = eng.submit([5] * 9, params(500))
        await running.events.get()
        queued = [eng.submit([5] * 200, params(50)) for _ in range(3)]
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, eng.stop, 0.2)
        assert 0.15 < time.monotonic() - t0 < 2.0
        last = (await until_finished(running))[-1]
        assert last.finish_reason == "abort" and last.error == "the server is shutting down"
        for h in queued:
            assert (await until_finished(h))[-1].finish_reason in ("abort", "length")
        assert eng.engine.blocks.num_free == eng.engine.blocks.num_blocks and not eng.engine.has_unfinished()
        assert eng.stats().in_flight == 0 and eng.stats().engine.running == 0

    asyncio.run(main())


def test_stop_returns_in_time_while_a_step_hangs(monkeypatch):
    monkeypatch.setattr(ae, "JOIN_SLACK_S", 0.3)

    async def main():
        runner = FakeRunner()
        eng = started(runner)
        runner.release.clear()
        handle = eng.submit([5] * 9, params(5))
        await wait_for(lambda: runner.steps == 1)
        t0 = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(None, eng.stop)
        assert time.monotonic() - t0 < 1.0 and eng._thread.is_alive()
        runner.release.set()  # the step ends: the thread aborts what is left and exits
        events = await until_finished(handle)
        assert events[-1].finish_reason == "abort" and events[-1].error == "the server is shutting down"
        await wait_for(lambda: not eng._thread.is_alive())

    asyncio.run(main())


def test_begin_drain_refuses_new_requests_and_keeps_serving():
    async def main():
        eng = started()
        handle = eng.submit([5] * 9, params(5))
        eng.begin_drain()
        assert not eng.alive and not eng.health().accepting
        with pytest.raises(EngineStopped, match="shutting down"):
            eng.submit([5] * 9, params(3))
        assert (await until_finished(handle))[-1].finish_reason == "length"
        eng.stop()

    asyncio.run(main())


def test_a_failing_sequence_fails_alone_and_the_others_finish():
    async def main():
        bad_prompt = [9] * 9
        eng = started(FakeRunner(fail_if=lambda seq: seq.prompt_ids == bad_prompt))
        good = [eng.submit([5] * 9, params(6)) for _ in range(2)]
        bad = eng.submit(bad_prompt, params(6))
        assert [(await until_finished(h))[-1].finish_reason for h in good] == ["length", "length"]
        last = (await until_finished(bad))[-1]
        assert last.finish_reason == "error" and "injected fault" in last.error
        await wait_for(lambda: eng.stats().in_flight == 0)
        s = eng.stats().engine
        assert s.kv_blocks_used == 0 and s.aborts_total == 0 and s.idle_spins_total == 0
        eng.stop()

    asyncio.run(main())
