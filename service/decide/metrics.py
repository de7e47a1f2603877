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
"""

from __future__ import annotations

from service.models import MetricHistory


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
