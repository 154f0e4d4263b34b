"""A request's loop settings on a looped model: the operator's [looped] table, the request's
overrides, and what the stored planes can serve -> one LoopPlan, or an InputError naming the field.

The store decides which read policies are possible: a full cache holds plane r of every position
(any policy reads it); a RIPE(W) store holds plane R everywhere and planes 1..R-1 for the last W
positions (RIPE(W' <= W) or the deepest plane); a deepest-plane store only plane R.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from .cache.spec import LoopPlanesCache
from .config import LoopConfig, LoopOverrides, LoopPlan, check_loop_settings
from .errors import InputError


def resolve_loops(
    config: LoopConfig, store: LoopPlanesCache, asked: LoopOverrides | None, speculates: bool
) -> LoopPlan:
    """`speculates`: the request may self-speculate (greedy, not scoring); otherwise block = 0."""
    asked = asked or LoopOverrides()
    given = {k: v for k, v in dataclasses.asdict(asked).items() if v is not None}
    # NOTE: not a LoopConfig: its own check would name the operator's keys; checked below as ridgefill.*
    merged = SimpleNamespace(**{**dataclasses.asdict(config), **given})
    loops = store.loops if merged.loops is None else merged.loops
    window = merged.window if merged.cache == "ripe" else 0
    block = merged.block if speculates else 0
    # NOTE: before the window rule when the request left the window alone: a block past
    # looped.block is then the block's fault, not the server's window's (issue 31, finding 5:
    # "block": 1000000 was blamed on ridgefill.window). A request that sets both is told about
    # the window rule first, as before.
    if block > config.block and "block" in given and "window" not in given:
        raise InputError(f"ridgefill.block must be <= {config.block} (looped.block), got {block}")
    try:
        check_loop_settings(
            loops, merged.cache, window, block, merged.draft_loops, merged.allow_short_window, "ridgefill"
        )
    except ValueError as e:
        raise InputError(str(e)) from None
    if loops > store.loops:
        raise InputError(
            f"ridgefill.loops must be <= {store.loops} (the planes this server stores, looped.loops), got {loops}"
        )
    _check_readable(merged.cache, window, store)
    if block > config.block and "block" in given:
        raise InputError(f"ridgefill.block must be <= {config.block} (looped.block), got {block}")
    return LoopPlan(
        loops=loops, window=None if merged.cache == "full" else window, block=block, draft_loops=merged.draft_loops
    )


def _check_readable(cache: str, window: int, store: LoopPlanesCache) -> None:
    if cache == "full" and store.kind != "full":
        raise InputError(
            f'ridgefill.cache "full" needs every plane stored; this server stores {store.kind!r} (looped.cache)'
        )
    if cache == "ripe" and store.kind == "deepest" and window > 0:
        raise InputError(
            'ridgefill.cache "ripe" needs the recent planes stored; this server stores only the '
            "deepest plane (looped.cache)"
        )
    if cache == "ripe" and store.kind == "ripe" and window > store.window:
        raise InputError(
            f"ridgefill.window must be <= {store.window} (the window this server stores, looped.window), got {window}"
        )


def field_of(message: str) -> str | None:
    """The request field an error from resolve_loops names ("ridgefill.loops", ...)."""
    head = message.split(" ", 1)[0]
    return head if head.startswith("ridgefill.") else None
