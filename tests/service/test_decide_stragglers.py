"""Stragglers as tables: a rank over the factor in most of the window is flagged, a healthy
job's one slow interval (a snapshot, warm-up) never is (fixed `now`, no I/O)."""

from __future__ import annotations

import pytest

from service.decide import stragglers as st
from service.decide.snapshots import decide_progress
from service.models import JobState
from tests.service.records import NOW, make_job
from worker.protocol import Progress, ProgressReport, RankTime, StragglerSample

WINDOW_S = 10.0


def times(*per_rank: tuple[int, float], nodes: str = "ab") -> list[RankTime]:
    """Cumulative times: (steps, compute_s) for each rank in turn, on nodes a, b, ..."""
    return [RankTime(rank=r, node=nodes[r % len(nodes)], steps=s, compute_s=c, wait_s=0.0)
            for r, (s, c) in enumerate(per_rank)]


@pytest.mark.parametrize("before,after,expected", [
    (times((10, 1.0), (10, 1.5)), times((20, 2.0), (20, 3.0)), {0: 0.1, 1: 0.15}),
    (times((10, 1.0), (10, 1.5)), times((10, 1.0), (20, 2.5)), {1: 0.1}),  # rank 0 made no step
    (times((10, 1.0), (10, 1.5)), times((5, 0.5), (5, 0.7)), None),  # sums went back: a new group
    (times((10, 1.0)), times((20, 2.0), (20, 3.0)), None),  # the ranks changed
    ([], times((20, 2.0), (20, 3.0)), None),
])
def test_per_step_is_each_ranks_compute_per_step_between_two_reports(before, after, expected):
    got = st.per_step(before, after)
    assert got == (None if expected is None else pytest.approx(expected))


@pytest.mark.parametrize("figures,factor,expected", [
    ({0: 0.10, 1: 0.15}, 1.3, {1: 1.5}),  # two ranks: against the other's, not the mean (1.2)
    ({0: 0.10, 1: 0.12}, 1.3, {}),
    ({0: 0.10, 1: 0.10, 2: 0.10, 3: 0.20}, 1.3, {3: 2.0}),
    ({0: 0.10, 1: 0.10, 2: 0.30, 3: 0.30}, 1.3, {2: 3.0, 3: 3.0}),  # the others' median: 0.1
    ({0: 0.0, 1: 0.0}, 1.3, {}),  # no compute: no ratio
    ({0: 0.10}, 1.3, {}),  # one rank: nobody to compare with
])
def test_over_compares_each_rank_with_the_median_of_the_others(figures, factor, expected):
    assert st.over(figures, factor) == expected


def test_over_keeps_the_highest_ranks_only():
    figures = {r: 0.1 for r in range(100)} | {r: 0.2 + r / 1000 for r in range(100, 140)}
    got = st.over(figures, 1.3)
    assert len(got) == st.MAX_OVER and min(got) == 140 - st.MAX_OVER


def samples(*overs: dict[int, float], every_s: float = 1.0) -> list[StragglerSample]:
    """Samples ending at NOW, one every `every_s`."""
    n = len(overs)
    return [StragglerSample(time=NOW - (n - 1 - i) * every_s, over=o) for i, o in enumerate(overs)]


@pytest.mark.parametrize("window,since,expected", [
    (samples(*[{1: 1.5}] * 8), NOW - 8, {1: 1.5}),  # slow throughout
    (samples({1: 1.4}, {1: 1.6}, {}, {1: 1.5}, {1: 1.7}), NOW - 6, {1: 1.5}),  # the median, 3 of 5
    (samples({}, {}, {1: 1.5}, {}, {}, {}), NOW - 8, {}),  # one slow interval (a snapshot)
    (samples({0: 3.0}, {}, {}, {}, {}, {}), NOW - 8, {}),  # the first (warm-up)
    (samples({1: 1.5}, {}, {1: 1.5}, {}), NOW - 8, {}),  # half: not more than half
    (samples(*[{1: 1.5}] * 2), NOW - 8, {}),  # fewer than MIN_SAMPLES
    (samples(*[{1: 1.5}] * 4), NOW - 4, {}),  # less than half the window observed
    (samples(*[{1: 1.5}] * 4), None, {}),
    (samples(*[{1: 1.5}] * 6, *[{}] * 8), NOW - 20, {}),  # slow only before the window
])
def test_flagged_needs_most_of_the_window_over_the_factor(window, since, expected):
    assert st.flagged(window, since, NOW, WINDOW_S) == expected


def running(**spec):
    job = make_job(JobState.RUNNING, {"a": "running", "b": "running"}, reports_progress=True)
    spec = {"straggler_window_s": WINDOW_S, **spec}
    return job.model_copy(update={"spec": job.spec.model_copy(update=spec)})


def report(step: int, ranks: list[RankTime]) -> ProgressReport:
    return ProgressReport(step=step, attempt=1, group="a/1", ranks=ranks)


def run_reports(job, per_rank_s: list[tuple[float, float]], every_s: float = 1.0, start: float = NOW):
    """Feed progress reports every `every_s` in which rank 0 and rank 1 take these seconds
    per step (one pair per report, ten steps each); returns the job and all its events."""
    stored: Progress | None = None
    events = []
    sums = [0.0, 0.0]
    for i, pair in enumerate([(0.1, 0.1), *per_rank_s]):
        sums = [s + 10 * t for s, t in zip(sums, pair, strict=True)]
        ranks = times((10 * (i + 1), sums[0]), (10 * (i + 1), sums[1]))
        d = decide_progress(job, stored, report(10 * (i + 1), ranks), start + i * every_s, 0.5)
        stored = d.progress
        if d.job is not None:
            job = d.job
        events += d.events
    return job, events, stored


def test_a_rank_half_as_slow_again_is_flagged_with_its_node_and_factor_in_an_event():
    job, events, _ = run_reports(running(), [(0.1, 0.15)] * 8)
    assert [(s.rank, s.node, s.factor) for s in job.stragglers] == [(1, "b", 1.5)]
    assert [e.reason for e in events] == [
        "straggler: rank 1 on node b computes 1.50x the median of the other ranks' step time over "
        "the last 10 s (flagged at 1.3x)"]


def test_a_healthy_job_with_a_slow_snapshot_interval_and_warm_up_is_not_flagged():
    intervals = [(0.3, 0.1)] + [(0.1, 0.105)] * 5 + [(0.25, 0.1)] + [(0.1, 0.1)] * 12
    job, events, stored = run_reports(running(), intervals)
    assert job.stragglers == [] and events == []
    assert stored is not None and len(stored.straggler_samples) <= WINDOW_S + 1  # bounded by the window


def test_a_straggler_that_recovers_is_cleared():
    job, events, _ = run_reports(running(), [(0.1, 0.2)] * 8 + [(0.1, 0.1)] * 12)
    assert job.stragglers == []
    assert [e.reason.split(":")[0] for e in events] == ["straggler", "straggler cleared"]


def test_a_new_group_starts_the_window_afresh():
    job, _, stored = run_reports(running(), [(0.1, 0.2)] * 8)
    assert job.stragglers
    again = ProgressReport(step=3, attempt=2, group="a/2", ranks=times((5, 0.5), (5, 1.0)))
    d = decide_progress(job.model_copy(update={"attempt": 2}), stored, again, NOW + 20, 0.5)
    assert d.progress.straggler_samples == [] and d.progress.ranks_since == NOW + 20
    assert d.job is not None and d.job.stragglers == []


def test_the_factor_is_the_jobs():
    job, _, _ = run_reports(running(straggler_factor=2.0), [(0.1, 0.15)] * 8)
    assert job.stragglers == []


def test_reports_between_gathers_add_no_interval():
    """Rank 0 reports every second and gathers every two: a report with the sums already
    stored (or none) is no interval in which nobody stepped."""
    job, _, stored = run_reports(running(), [(0.1, 0.15)] * 3)
    assert stored is not None
    for ranks in (stored.ranks, []):
        d = decide_progress(job, stored, report(40, ranks), NOW + 10, 0.5)
        assert d.progress.straggler_samples == stored.straggler_samples
        assert d.progress.ranks == stored.ranks and d.progress.ranks_since == stored.ranks_since
