"""How one step crosses to every rank: rank 0 schedules and sends the step's items (ids, positions,
block tables, fill stages, drafts: no tensors); every rank runs the same runner over its shard.

Each rank holds its own caches (its K/V heads, its copies of the states and stashes) under the
same block ids and state slots, so the cache manager and prefix cache live on rank 0 alone. What
the manager does to the pools between steps (zero a freed slot's states, drop a stash, roll a
state back, map window pages) reaches the other ranks with the next step, as events replayed in
order before it runs; so does the runner's forgetting of a finished sequence.

The ranks compute the same hidden states (every partial sum is all-reduced, and an all-reduce
hands every rank the same sum), so each samples, drafts and selects exact rows as rank 0 does;
only rank 0's results leave the engine.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import ParallelError, UnsupportedError

if TYPE_CHECKING:
    from .group import Alive, TensorGroup

DEATH_GRACE_S = 3.0  # how long a failed step waits to learn which rank's process ended
Event = tuple[str, str, tuple]  # (owner: "states" | "kv" | "runner", method, args)


class StepRelay:
    """Rank 0's end: pool hooks and runner calls that the other ranks repeat."""

    def __init__(self, group: TensorGroup, alive: Alive | None = None, on_stop: Callable[[], None] = lambda: None):
        """`alive`: rank -> None, or how the process started for it ended (ranks this one started)."""
        self.group = group
        self.pending: list[Event] = []
        self._alive = alive
        self._on_stop = on_stop
        self.stopped = self.lost = False

    def lost_rank(self, error: BaseException) -> ParallelError:
        """What a failed collective means: the group is gone. Names the ranks known to have died."""
        self.lost = True
        dead = self._dead_ranks()
        cause = (
            "; ".join(dead)
            if dead
            else f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
        )
        return ParallelError(f"tensor-parallel group lost during a step ({cause})")

    def _dead_ranks(self) -> list[str]:
        """The started ranks whose process has ended. NOTE: a collective fails as soon as the peer's
        socket closes, often before its exit status can be read; wait that short moment, so the
        error names the rank rather than the socket."""
        if self._alive is None:
            return []
        deadline = time.monotonic() + DEATH_GRACE_S
        while True:
            dead = [f"rank {r}: {why}" for r in range(1, self.group.size) if (why := self._alive(r)) is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.05)

    def hook(self, owner: str, method: str, fn: Callable[..., None]) -> Callable[..., None]:
        """fn, which also queues the call for the other ranks (the cache manager's pool hooks)."""

        def relayed(*args) -> None:
            fn(*args)
            self.pending.append((owner, method, args))

        return relayed

    def send(self, kind: str, payload: Any = None) -> None:
        events, self.pending = self.pending, []
        self.group.send_step((kind, events, payload))

    def wrap_runner(self, runner) -> RelayedRunner:
        return RelayedRunner(runner, self)

    def stop(self) -> None:
        """Tell the other ranks to stop, then end the group (once)."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if not self.lost:  # NOTE: after a loss the others have gone, or will at their next collective
                self.send("stop")
        except RuntimeError:
            pass  # the same: nobody is left to tell
        finally:
            self._on_stop()


class RelayedRunner:
    """The runner as rank 0's engine sees it: each step goes to every rank first."""

    def __init__(self, runner, relay: StepRelay):
        self.runner, self.relay = runner, relay

    def run(self, items):
        if self.relay.lost:
            raise ParallelError("tensor-parallel group lost earlier; the engine cannot run")
        try:
            self.relay.send("step", items)
            return self.runner.run(items)
        except Exception as e:  # NOTE: whatever ended the step on this rank left the others out of step
            raise self.relay.lost_rank(e) from e

    def forget(self, seq_id: int) -> None:
        self.runner.forget(seq_id)
        self.relay.pending.append(("runner", "forget", (seq_id,)))

    def stash(self, seq):
        return self.runner.stash(seq)

    def put_stash(self, seq, stash) -> None:
        raise UnsupportedError("a saved lower sweep (evaluation splices) is not sent to tensor-parallel ranks")

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


def follow_steps(runner, caches, group: TensorGroup) -> None:
    """A rank other than 0: run rank 0's steps until it says stop."""
    targets = {"runner": runner, "states": caches.states, "kv": caches.kv}
    while True:
        kind, events, items = group.next_step()
        for owner, method, args in events:
            getattr(targets[owner], method)(*args)
        if kind == "stop":
            return
        runner.run(items)
