"""decide.metrics: a job's metric history stays bounded, thins evenly, and restarts its
curve where a resumed attempt trains again."""

from __future__ import annotations

import pytest

from service.decide.metrics import add_point, merged, split
from service.models import MetricHistory

CAP = 8
SERIES = 4


def grow(steps: list[int], history: MetricHistory | None = None) -> MetricHistory | None:
    for s in steps:
        history = add_point(history, s, 100.0 + s, {"loss": 1.0 / (s + 1)}, CAP, SERIES) or history
    return history


@pytest.mark.parametrize("steps,kept,stride", [
    ([1, 2, 3], [1, 2, 3], 1),
    (list(range(1, 9)), list(range(1, 9)), 1),  # exactly full
    # one more: every other point, the newest kept; the stride doubles
    (list(range(1, 10)), [1, 3, 5, 7, 9], 2),
    # at stride 2 a step one past the newest point is not kept, two past is
    (list(range(1, 11)), [1, 3, 5, 7, 9], 2),
    (list(range(1, 12)), [1, 3, 5, 7, 9, 11], 2),
    # a long run: never more than CAP points, first and newest steps kept, evenly thinned
    (list(range(1, 1001)), [1, 129, 257, 385, 513, 641, 769, 897], 128),
])
def test_history_is_bounded_and_thinned_evenly(steps, kept, stride):
    h = grow(steps)
    assert (h.steps, h.stride) == (kept, stride)
    assert len(h.times) == len(h.series["loss"]) == len(kept) <= CAP
    assert h.series["loss"] == [float(f"{1.0 / (s + 1):.6g}") for s in kept]


@pytest.mark.parametrize("reports", [12, 500])
def test_points_stay_evenly_spread_when_reports_come_every_so_many_steps(reports):
    # a report every 20 steps: once the history is thinned, new points come no closer
    # together than the kept ones (not at every report, which would make the key's writes
    # no rarer and the recent curve finer than the old)
    h = grow(list(range(20, 20 * (reports + 1), 20)))
    gaps = {b - a for a, b in zip(h.steps, h.steps[1:])}
    assert len(h.steps) <= CAP and h.steps[0] == 20 and gaps == {h.stride}, (h.steps, h.stride)


def test_a_resumed_attempts_steps_replace_those_trained_again():
    h = grow([10, 20, 30, 40])
    h = add_point(h, 25, 500.0, {"loss": 9.0}, CAP, SERIES)  # resumed from the snapshot at 25
    assert h.steps == [10, 20, 25] and h.series["loss"][-1] == 9.0 and h.times[-1] == 500.0
    h = add_point(h, 20, 501.0, {"loss": 8.0}, CAP, SERIES)  # at a kept step: it is replaced
    assert h.steps == [10, 20] and h.series["loss"] == [0.0909091, 8.0]


def test_series_that_start_late_are_padded_and_their_number_is_capped():
    h = add_point(None, 1, 0.0, {"loss": 1.0}, CAP, SERIES)
    h = add_point(h, 2, 1.0, {"loss": 0.9, "lr": 0.1, "a": 1, "b": 2, "c": 3}, CAP, SERIES)
    assert h.series == {"loss": [1.0, 0.9], "lr": [None, 0.1], "a": [None, 1.0], "b": [None, 2.0]}
    h = add_point(h, 3, 2.0, {"lr": 0.05}, CAP, SERIES)  # loss not logged this time: null
    assert h.series["loss"] == [1.0, 0.9, None] and h.series["lr"][-1] == 0.05


def test_nothing_to_keep_leaves_the_history_unchanged():
    assert add_point(None, 1, 0.0, {"loss": None}, CAP, SERIES) is None
    assert add_point(grow([1]), 2, 0.0, {}, CAP, SERIES) is None


def test_values_keep_six_significant_digits():
    h = add_point(None, 1, 12.3456, {"loss": 0.123456789, "big": 123456789.0}, CAP, SERIES)
    assert h.series == {"loss": [0.123457], "big": [123457000.0]} and h.times == [12.3]


def stored_as_body_and_tail(steps: list[int], tail_points: int) -> tuple[list[tuple], MetricHistory]:
    """Add points as the progress store does (merge, add, split); return what each added
    point wrote ((points in the body written or None, points in the tail)) and the merge."""
    body = tail = None
    writes = []
    for s in steps:
        added = add_point(merged(body, tail), s, 100.0 + s, {"loss": 1.0 / (s + 1)}, CAP, SERIES)
        if added is None:
            continue
        new_body, tail = split(body, added, tail_points)
        body = new_body or body
        writes.append((None if new_body is None else len(new_body.steps), len(tail.steps)))
    return writes, merged(body, tail)


def test_the_tail_takes_new_points_and_the_body_is_rewritten_only_when_it_is_full():
    writes, history = stored_as_body_and_tail([1, 2, 3, 4, 5, 6], tail_points=2)
    assert writes == [(None, 1), (None, 2), (3, 0), (None, 1), (None, 2), (6, 0)]
    assert history == grow([1, 2, 3, 4, 5, 6])  # the same history as one key would hold


@pytest.mark.parametrize("steps", [list(range(1, 40)), [10, 20, 30, 40, 25, 26, 27, 15, 16, 50, 60, 70]])
def test_body_and_tail_hold_the_same_history_as_one_key_through_thinning_and_resumes(steps):
    assert stored_as_body_and_tail(steps, tail_points=3)[1] == grow(steps)


def test_a_series_that_starts_in_the_tail_is_padded_in_the_merge():
    body = add_point(None, 1, 0.0, {"loss": 1.0}, CAP, SERIES)
    history = add_point(body, 2, 1.0, {"loss": 0.5, "lr": 0.1}, CAP, SERIES)
    new_body, tail = split(body, history)
    assert new_body is None and tail.series == {"loss": [0.5], "lr": [0.1]}
    assert merged(body, tail).series == {"loss": [1.0, 0.5], "lr": [None, 0.1]}
