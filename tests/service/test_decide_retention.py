"""Which finished jobs retention deletes, as a table with a fixed `now` (pure logic)."""

from __future__ import annotations

import pytest

from service.decide.retention import (
    DAY_S,
    RetentionPolicy,
    describe,
    expired,
    format_duration,
    parse_duration,
    pass_interval_s,
)

NOW = 1_000_000.0
WEEK = RetentionPolicy(retention_s=7 * DAY_S)


def ago(seconds: float) -> float:
    return NOW - seconds


@pytest.mark.parametrize("finished, policy, deleted", [
    ([], WEEK, []),
    ([("a", ago(7 * DAY_S - 1))], WEEK, []),  # a second short of its retention: kept
    ([("a", ago(7 * DAY_S))], WEEK, ["a"]),  # exactly at it: deleted
    ([("new", ago(60)), ("old", ago(8 * DAY_S)), ("older", ago(9 * DAY_S))], WEEK,
     ["older", "old"]),  # oldest finished first, whatever order they come in
    # A count: the newest N finished are kept, the oldest finished go first.
    ([("a", ago(50)), ("b", ago(40)), ("c", ago(30)), ("d", ago(20))],
     RetentionPolicy(retention_s=7 * DAY_S, keep_jobs=2), ["a", "b"]),
    ([("a", ago(50)), ("b", ago(40))], RetentionPolicy(retention_s=7 * DAY_S, keep_jobs=2), []),
    # Both rules: the age takes what is old, the count what is beyond it; none twice.
    ([("old", ago(8 * DAY_S)), ("b", ago(40)), ("c", ago(30)), ("d", ago(20))],
     RetentionPolicy(retention_s=7 * DAY_S, keep_jobs=2), ["old", "b"]),
    ([("old", ago(8 * DAY_S)), ("d", ago(20))],
     RetentionPolicy(retention_s=7 * DAY_S, keep_jobs=5), ["old"]),
    # Same finish time: ordered by id, so the choice is stable from pass to pass.
    ([("y", ago(10)), ("x", ago(10)), ("z", ago(10))],
     RetentionPolicy(retention_s=DAY_S, keep_jobs=1), ["x", "y"]),
    # A clock that stepped back (finished "in the future"): kept, not deleted early.
    ([("future", NOW + 100)], RetentionPolicy(retention_s=2), []),
], ids=["nothing", "just-younger", "exactly-at", "oldest-first", "count", "count-not-reached",
        "age-and-count", "age-only-under-count", "ties-by-id", "clock-skew"])
def test_expired_jobs(finished, policy, deleted):
    assert [e.job_id for e in expired(finished, NOW, policy)] == deleted


def test_each_expired_job_says_which_rule_took_it():
    policy = RetentionPolicy(retention_s=7 * DAY_S, keep_jobs=1)
    got = expired([("old", ago(8 * DAY_S)), ("b", ago(40)), ("c", ago(30))], NOW, policy)
    assert [(e.job_id, e.reason) for e in got] == [
        ("old", "finished 8 days ago; finished jobs are kept 7 days"),
        ("b", "beyond the newest 1 finished jobs"),
    ]


@pytest.mark.parametrize("text, seconds", [
    ("7d", 7 * DAY_S), ("12h", 43200), ("30m", 1800), ("90s", 90), ("90", 90), ("1.5h", 5400),
    (" 2d ", 2 * DAY_S),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7 days", "-1d", "0", "0s", "d", "1w", "1h30m"])
def test_parse_duration_refuses_what_is_not_a_positive_duration(text):
    with pytest.raises(ValueError, match="duration|longer than 0"):
        parse_duration(text)


@pytest.mark.parametrize("seconds, text", [
    (7 * DAY_S, "7 days"), (DAY_S, "1 day"), (43200, "12 hours"), (5400, "1.5 hours"),
    (1800, "30 minutes"), (90, "1.5 minutes"), (59, "59 seconds"), (1, "1 second"),
    (2.5, "2.5 seconds"), (8.5 * DAY_S, "8.5 days"), (0.25, "0.2 seconds"),
])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_describe_says_the_rule_for_a_404():
    assert describe(WEEK) == "finished jobs are deleted 7 days after they end"
    assert describe(RetentionPolicy(retention_s=2, keep_jobs=100)) == (
        "finished jobs are deleted 2 seconds after they end, and only the newest 100 finished "
        "jobs are kept")


@pytest.mark.parametrize("retention_s, interval_s", [(7 * DAY_S, 60), (120, 12), (2, 0.5)])
def test_a_pass_runs_a_tenth_of_the_retention_apart_within_bounds(retention_s, interval_s):
    assert pass_interval_s(RetentionPolicy(retention_s=retention_s)) == interval_s
