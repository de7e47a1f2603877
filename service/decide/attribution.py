"""Bad-node attribution (pure; no I/O): failures that follow a node across jobs.

One job's failures say little about a node: the script may be at fault, or its data. But a
node on which the workers of two different jobs failed within an hour, while each of those
jobs ran on elsewhere (its other members did not fail with it), is the common factor: the
node is QUARANTINED (service/nodes.py), never on one job's word alone.

A `Failure` is noted when a member reports that its workers failed (service/routes/nodes.py),
`alone` when the job had another member then and none of them had failed; notes expire with
the window (a lease of WINDOW_S), so what `blame` sees is bounded by the node's recent jobs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

WINDOW_S = 3600.0  # failures in two jobs within this, each alone: the node is blamed
JOBS = 2  # how many different jobs' failures it takes


@dataclass(frozen=True)
class Failure:
    """A node's workers of `job` failed at `at` (wall clock, s); `alone`: the job's other
    members did not fail with them (the job ran on elsewhere)."""

    node: str
    job: str
    at: float
    alone: bool


def failed_alone(members: Mapping[str, str], node: str) -> bool:
    """Whether `node`'s failure in a job whose members are in these states (node -> member
    state) was its own: the job has another member, and none of the others failed."""
    others = [state for name, state in members.items() if name != node]
    return bool(others) and "failed" not in others


def blame(failures: Iterable[Failure], node: str, now: float, window_s: float = WINDOW_S) -> str | None:
    """Why `node` is quarantined, or None: its workers failed alone in JOBS different jobs
    within `window_s` before `now`."""
    # (a note a little ahead of `now` counts: replicas' clocks differ, and notes are rounded)
    jobs = sorted({f.job for f in failures if f.node == node and f.alone and now - f.at <= window_s})
    if len(jobs) < JOBS:
        return None
    return (f"workers failed on this node in {len(jobs)} different jobs ({', '.join(jobs)}) within "
            f"{window_s / 60:g} min while those jobs' other members did not: the node is the common factor")
