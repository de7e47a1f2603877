"""Stragglers: a rank whose steps take longer than the others', over a window of time.

In synchronous data-parallel training every rank's step takes as long as the slowest one's:
the others wait in the gradient all-reduce. So the runtime reports each rank's step time
split in two (worker/step_timing.py): compute (the step less its waits) and the time spent
waiting in collectives, summed since its group started. Rank 0 gathers every rank's sums and
sends them with its progress reports; each stored report is one interval (`interval`).

For each interval, a rank's figure is its compute time per step, and its ratio is that over
the median of the *other* ranks' figures (with two ranks the median of all would be their
mean, and a rank 1.5 times slower would read 1.2). A sample keeps the ranks at or over the
job's factor (`straggler_factor`, 1.3 by default), so it stays small however many ranks the
job has (at most MAX_OVER of them, the highest).

A rank is flagged when it is over the factor in more than half the samples of the last
`straggler_window_s` (60 s by default), with at least half the window observed and at least
MIN_SAMPLES samples: one slow interval (a snapshot, a garbage collection, the first steps)
is a minority and never flags anything. Its factor is the median of its ratios over the
window. It is cleared when that no longer holds. The figures of a rank's first steps are
left out by the runtime (warm-up); its snapshot copies are not compute.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from service.decide.state import note
from service.models import EventView, JobRecord, Straggler
from worker.protocol import Progress, RankTime, StragglerSample

MIN_SAMPLES = 3  # samples in the window before anything is flagged
MAX_OVER = 16  # ranks kept per sample (the highest ratios)
MIN_COMPUTE_S = 1e-4  # a median compute per step below this gives no ratio


@dataclass(frozen=True)
class Straggling:
    """A rank flagged: its node, and the median of its ratios over the window."""

    rank: int
    node: str | None
    factor: float


def per_step(before: list[RankTime], after: list[RankTime]) -> dict[int, float] | None:
    """Each rank's compute time per step between two cumulative reports; None when `after`
    is not the continuation of `before` (a new group: a rank's sums went back or its ranks
    changed). A rank with no step in between is left out."""
    old = {r.rank: r for r in before}
    if not before or set(old) != {r.rank for r in after}:
        return None
    out: dict[int, float] = {}
    for r in after:
        prev = old[r.rank]
        if r.steps < prev.steps or r.compute_s < prev.compute_s:
            return None
        if r.steps > prev.steps:
            out[r.rank] = (r.compute_s - prev.compute_s) / (r.steps - prev.steps)
    return out


def over(figures: dict[int, float], factor: float) -> dict[int, float]:
    """The ranks whose figure is at least `factor` times the median of the others' (rank ->
    ratio, rounded), at most MAX_OVER of them."""
    if len(figures) < 2:
        return {}
    found: dict[int, float] = {}
    for rank, mine in figures.items():
        others = statistics.median(v for r, v in figures.items() if r != rank)
        if others >= MIN_COMPUTE_S and mine >= factor * others:
            found[rank] = round(mine / others, 3)
    kept = sorted(found, key=found.__getitem__, reverse=True)[:MAX_OVER]
    return {r: found[r] for r in kept}


def window(samples: list[StragglerSample], now: float, window_s: float) -> list[StragglerSample]:
    """The samples of the last `window_s`."""
    return [s for s in samples if now - s.time <= window_s]


def flagged(samples: list[StragglerSample], since: float | None, now: float, window_s: float) -> dict[int, float]:
    """The ranks that straggle (rank -> the median of its ratios over the window); see the
    module docstring. `since`: when this group was first timed."""
    recent = window(samples, now, window_s)
    if since is None or now - since < window_s / 2 or len(recent) < MIN_SAMPLES:
        return {}
    ranks = {r for s in recent for r in s.over}
    out: dict[int, float] = {}
    for rank in ranks:
        ratios = [s.over[rank] for s in recent if rank in s.over]
        if 2 * len(ratios) > len(recent):
            # The median of all the window's ratios: those under the factor are not kept,
            # but they are the lower half, so it is the (n+1)//2-th highest of the kept.
            ratios.sort(reverse=True)
            out[rank] = ratios[(len(recent) + 1) // 2 - 1]
    return out


def observe(stored: Progress | None, group: str, ranks_now: list[RankTime], now: float,
            factor: float, window_s: float) -> tuple[Progress, list[Straggling]]:
    """The straggler fields of the progress key after a report of `group`'s step times
    (`ranks_now`, cumulative), and the ranks flagged: the interval since the stored ones is
    added to the window; a report of another group starts the window afresh.

    Returns a Progress carrying only those fields (`ranks`, `ranks_since`, `ranks_of`,
    `straggler_samples`), for the caller to merge."""
    before = stored if stored is not None and stored.ranks_of == group else None
    if before is None:  # this group's first step times (or none yet)
        return (_fields(ranks_now, now, group, []) if ranks_now else Progress(step=0)), []
    figures = per_step(before.ranks, ranks_now) if ranks_now else {}
    if figures is None:
        return _fields(ranks_now, now, group, []), []
    ranks, samples = before.ranks, before.straggler_samples
    if figures:  # else the same sums again (rank 0 reports more often than it gathers): no interval
        ranks = ranks_now
        samples = window(samples, now, window_s) + [StragglerSample(time=now, over=over(figures, factor))]
    found = flagged(samples, before.ranks_since, now, window_s)
    return _fields(ranks, before.ranks_since, group, samples), _named(found, ranks)


def _fields(ranks: list[RankTime], since: float | None, group: str, samples: list[StragglerSample]) -> Progress:
    return Progress(step=0, ranks=ranks, ranks_since=since, ranks_of=group, straggler_samples=samples)


def _named(found: dict[int, float], ranks: list[RankTime]) -> list[Straggling]:
    nodes = {r.rank: r.node for r in ranks}
    return [Straggling(rank, nodes.get(rank), factor) for rank, factor in sorted(found.items())]


def flag(job: JobRecord, found: list[Straggling], now: float) -> tuple[JobRecord, list[EventView]]:
    """The job record with its `stragglers` set to `found`, and an event for each rank
    flagged or cleared; the record is unchanged while the same ranks stay flagged (their
    factors move every report: the record is not rewritten for that)."""
    old = {s.rank: s for s in job.stragglers}
    new = {s.rank: s for s in found}
    if old.keys() == new.keys():
        return job, []
    events: list[EventView] = []
    spec = job.spec
    for rank in sorted(new.keys() - old.keys()):
        job, event = note(job, describe(new[rank], spec.straggler_factor, spec.straggler_window_s), now)
        events.append(event)
    for rank in sorted(old.keys() - new.keys()):
        where = f" on node {old[rank].node}" if old[rank].node else ""
        job, event = note(job, f"straggler cleared: rank {rank}{where} is no longer flagged (it "
                               f"caught up, or its group was replaced)", now)
        events.append(event)
    kept = [old[r] if r in old else Straggler(rank=r, node=s.node, factor=s.factor, since=now)
            for r, s in sorted(new.items())]
    return job.model_copy(update={"stragglers": kept}), events


def describe(s: Straggling, factor: float, window_s: float) -> str:
    """The event's line for a rank flagged."""
    where = f" on node {s.node}" if s.node else ""
    return (f"straggler: rank {s.rank}{where} computes {s.factor:.2f}x the median of the other ranks' "
            f"step time over the last {window_s:g} s (flagged at {factor:g}x)")
