"""A job's metric history: one point per stored progress report, bounded, downsampled.

Rank 0 reports its step, loss, throughput and the scalars the script logs (`rt.log`)
about once a second; each stored report (progress' own rate limit applies) adds a point
here. The history is one small etcd key per job, so it must stay bounded however long the
job runs: it keeps at most `capacity` points, and when full it drops every other point and
doubles `stride`, the least number of steps between two kept points (or sets it to their
average spacing, if that is more), so a long run is seen whole at an even, coarser
resolution (the oldest steps are never lost, only thinned), and the key is written less
often as the run grows: once a point per `stride` steps.

A report of a step at or before the newest point comes from an attempt that resumed from a
snapshot: the points from that step on belonged to steps that are being trained again, so
they are dropped and the curve continues from the snapshot.

Stored as two keys, so that a report does not rewrite the whole history (240 points are
some 12 KiB): the body, and a tail of at most `TAIL_POINTS` newer points. A new point is
written to the tail alone while the body stays a prefix of the history and the rest fits
in the tail; otherwise (the tail is full, the history was thinned, or a resumed attempt cut
into the body) the whole history becomes the body and the tail is emptied. A report then
writes a few hundred bytes, and the body is rewritten once every `TAIL_POINTS` points.
"""

from __future__ import annotations

from service.models import MetricHistory

TAIL_POINTS = 16  # newest points kept in the tail key, written on their own


def rounded(value: float) -> float:
    """Six significant digits: what a curve needs, a third of a float's JSON."""
    return float(f"{value:.6g}")


def add_point(history: MetricHistory | None, step: int, time: float, values: dict[str, float | None],
              capacity: int, max_series: int) -> MetricHistory | None:
    """The history with the point (step, time, values) added; None if it is unchanged
    (the step is within `stride` of the newest point, or there is nothing to keep)."""
    values = {k: v for k, v in values.items() if v is not None}
    if not values:
        return None
    h = history or MetricHistory()
    steps, times = list(h.steps), list(h.times)
    series = {name: list(col) for name, col in h.series.items()}
    if steps and step <= steps[-1]:  # retrained steps: the curve goes on from the snapshot
        keep = next((i for i, s in enumerate(steps) if s >= step), len(steps))
        steps, times = steps[:keep], times[:keep]
        series = {name: col[:keep] for name, col in series.items()}
    elif steps and step < steps[-1] + h.stride:
        return None
    for name in values:
        if name not in series and len(series) < max_series:
            series[name] = [None] * len(steps)
    steps.append(step)
    times.append(round(time, 1))
    for name, col in series.items():
        value = values.get(name)
        col.append(None if value is None else rounded(value))
    stride = h.stride
    if len(steps) > capacity:  # full: every other point, the newest kept
        keep = range((len(steps) - 1) % 2, len(steps), 2)
        steps, times = [steps[i] for i in keep], [times[i] for i in keep]
        series = {name: [col[i] for i in keep] for name, col in series.items()}
        # New points as far apart as the kept ones are on average: reports come every so many
        # steps, not every step, and a stride below that would fill the history with recent
        # points at a finer grain than the old ones.
        spacing = -(-(steps[-1] - steps[0]) // max(1, len(steps) - 1))
        stride = max(stride * 2, spacing)
    return MetricHistory(stride=stride, steps=steps, times=times, series=series)


def merged(body: MetricHistory | None, tail: MetricHistory | None) -> MetricHistory:
    """The history as one: the body's points, then the tail's (a scalar missing from one
    part is null there)."""
    body, tail = body or MetricHistory(), tail or MetricHistory()
    nb, nt = len(body.steps), len(tail.steps)
    names = list(body.series) + [n for n in tail.series if n not in body.series]
    return MetricHistory(stride=body.stride, steps=body.steps + tail.steps, times=body.times + tail.times,
                         series={n: body.series.get(n, [None] * nb) + tail.series.get(n, [None] * nt)
                                 for n in names})


def split(body: MetricHistory | None, history: MetricHistory,
          tail_points: int = TAIL_POINTS) -> tuple[MetricHistory | None, MetricHistory]:
    """What to write of `history` (the stored one with a point added), given the stored
    body: (the new body, or None when the stored one stays; the new tail)."""
    body = body or MetricHistory()
    n = len(body.steps)
    stays = (history.stride == body.stride and history.steps[:n] == body.steps
             and history.times[:n] == body.times and len(history.steps) - n <= tail_points
             and all(col[:n] == body.series.get(name, [None] * n) for name, col in history.series.items()))
    if not stays:
        return history, MetricHistory(stride=history.stride)
    return None, MetricHistory(stride=history.stride, steps=history.steps[n:], times=history.times[n:],
                               series={name: col[n:] for name, col in history.series.items()
                                       if any(v is not None for v in col[n:])})
