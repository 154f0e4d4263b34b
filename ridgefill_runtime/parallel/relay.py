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

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedError

if TYPE_CHECKING:
    from .group import TensorGroup

Event = tuple[str, str, tuple]  # (owner: "states" | "kv" | "runner", method, args)


class StepRelay:
    """Rank 0's end: pool hooks and runner calls that the other ranks repeat."""

    def __init__(self, group: TensorGroup, on_stop: Callable[[], None] = lambda: None):
        self.group = group
        self.pending: list[Event] = []
        self._on_stop = on_stop
        self.stopped = False

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
            self.send("stop")
        finally:
            self._on_stop()


class RelayedRunner:
    """The runner as rank 0's engine sees it: each step goes to every rank first."""

    def __init__(self, runner, relay: StepRelay):
        self.runner, self.relay = runner, relay

    def run(self, items):
        self.relay.send("step", items)
        return self.runner.run(items)

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
