"""Which stored drains to sweep (pure; no I/O).

A drain is kept under the node's name with no lease (`Keys.drain`), so it outlives the node's
record: a node that comes back is still drained. A node that never comes back would leave it
for ever, so the leader's retention loop sweeps it: the first pass that finds no node of that
name notes `absent_since` on the drain; a pass that finds the node again clears the note; the
drain is deleted once the node has been absent for `keep_s` (`FTRAIN_DRAIN_KEEP_S`, 7 days by
default). So a drain holds across any absence shorter than that (an agent restart, an etcd
pause, a maintenance window) and is gone within `keep_s` plus a pass after a node left for good.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class StoredDrain:
    name: str
    drained_at: float
    absent_since: float | None = None  # when a sweep first found no node of this name


@dataclass(frozen=True)
class DrainAction:
    name: str
    do: Literal["note_absent", "clear_absent", "delete"]


def sweep(drains: list[StoredDrain], live: set[str], now: float, keep_s: float) -> list[DrainAction]:
    """What a sweep does with each drain, given the names of the nodes registered now."""
    actions = []
    for drain in drains:
        if drain.name in live:
            if drain.absent_since is not None:
                actions.append(DrainAction(drain.name, "clear_absent"))
        elif drain.absent_since is None:
            actions.append(DrainAction(drain.name, "note_absent"))
        elif now - drain.absent_since >= keep_s:
            actions.append(DrainAction(drain.name, "delete"))
    return actions
