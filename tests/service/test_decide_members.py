"""Member reports and registration as a table: which reports change the job."""

from __future__ import annotations

import pytest

from service.decide.members import (
    AGENT_RESTARTED,
    MIN_FORMER_MEMBERS,
    decide_registered,
    decide_report,
    drops_copies,
    is_recorded,
    note_former_members,
)
from service.models import JobState
from tests.service.records import NOW, make_job

S = JobState
LIVE = ["assigned", "running"]
FINAL = ["succeeded", "failed", "stopped"]


@pytest.mark.parametrize("job_state", [S.RUNNING, S.RECOVERING, S.CANCELLING])
@pytest.mark.parametrize("before", LIVE)
@pytest.mark.parametrize("report", ["running", *FINAL])
def test_a_live_member_takes_any_new_state(job_state, before, report):
    job = make_job(job_state, {"a": before, "b": "running"})
    change = decide_report(job, "a", 1, report, 3, "why", NOW)
    if report == before:
        assert change is None
        return
    member = change.job.members["a"]
    assert (member.state, member.exit_code, member.reason) == (report, 3, "why")
    assert change.job.members["b"] == job.members["b"]
    assert change.job.updated_at == NOW and change.job.state is job_state
    assert change.events == [] and change.ops == []


@pytest.mark.parametrize("before", FINAL)
@pytest.mark.parametrize("report", ["running", *FINAL])
def test_a_final_member_state_is_final_for_the_attempt(before, report):
    assert decide_report(make_job(S.RUNNING, {"a": before}), "a", 1, report, 0, None, NOW) is None


@pytest.mark.parametrize("job,node,attempt", [
    (make_job(S.RUNNING, {"a": "running"}), "a", 0),  # an earlier attempt
    (make_job(S.RUNNING, {"a": "running"}), "a", 2),  # a later one (never seen by this job)
    (make_job(S.RUNNING, {"a": "running"}), "z", 1),  # not a member
    (make_job(S.PENDING, {}), "a", 1),
    (make_job(S.SUCCEEDED, {"a": "running"}), "a", 1),
    (make_job(S.FAILED, {"a": "running"}), "a", 1),
    (make_job(S.CANCELLED, {"a": "running"}), "a", 1),
])
def test_a_report_outside_the_current_attempt_or_a_live_job_changes_nothing(job, node, attempt):
    assert decide_report(job, node, attempt, "failed", 1, "late", NOW) is None


def test_registering_again_stops_what_the_node_ran():
    change = decide_registered(make_job(S.RUNNING, {"a": "running", "b": "running"}), "a", 1, NOW)
    member = change.job.members["a"]
    assert (member.state, member.exit_code, member.reason) == ("stopped", None, AGENT_RESTARTED)


def test_registering_again_after_the_attempt_moved_on_changes_nothing():
    assert decide_registered(make_job(S.RUNNING, {"a": "running"}, attempt=2), "a", 1, NOW) is None


@pytest.mark.parametrize("stored_state,attempt,report,recorded", [
    ("failed", 1, "failed", True),
    ("failed", 1, "running", False),  # the member moved on: that report was not applied
    ("running", 0, "running", False),  # a stale attempt
])
def test_is_recorded(stored_state, attempt, report, recorded):
    job = make_job(S.RUNNING, {"a": stored_state})
    assert is_recorded(job, "a", attempt, report) is recorded
    assert not is_recorded(job, "z", 1, report)


@pytest.mark.parametrize("job_state,stopping,recorded_as", [
    (S.RUNNING, False, "failed"),  # it cannot have finished its part: the job fails
    (S.RECOVERING, False, "failed"),
    (S.CANCELLING, True, "stopped"),  # told to stop: a stop is what was asked for
    (S.RUNNING, True, "stopped"),
])
def test_a_member_that_stops_after_another_finished(job_state, stopping, recorded_as):
    job = make_job(job_state, {"a": "succeeded", "b": "running"}, stopping=stopping)
    change = decide_registered(job, "b", 1, NOW)
    member = change.job.members["b"]
    assert member.state == recorded_as
    if recorded_as == "failed":
        assert member.reason.startswith(f"its workers stopped ({AGENT_RESTARTED}) after node(s) a finished")
    assert is_recorded(change.job, "b", 1, "stopped")


def test_a_member_that_stops_before_any_finished_is_stopped():
    change = decide_report(make_job(S.RUNNING, {"a": "running", "b": "running"}), "b", 1,
                           "stopped", None, "gone", NOW)
    assert change.job.members["b"].state == "stopped"


@pytest.mark.parametrize("running,member,kept", [
    (("j-abc123", 1), "running", True),  # its lease lapsed while no control plane heard it
    (("j-abc123", 1), "assigned", True),
    (("j-abc123", 1), "stopped", False),  # already final: nothing to keep
    (("j-abc123", 0), "running", False),  # still runs an attempt that is over
    (("other-job", 1), "running", False),  # runs another job's attempt
    (None, "running", False),  # a new agent process runs nothing
])
def test_registering_again_keeps_the_member_only_if_the_agent_still_runs_its_attempt(running, member, kept):
    job = make_job(S.RUNNING, {"a": member, "b": "running"})
    change = decide_registered(job, "a", 1, NOW, running)
    if kept or member == "stopped":
        assert change is None
    else:
        assert change.job.members["a"].state == "stopped"
        assert change.job.members["a"].reason == AGENT_RESTARTED


@pytest.mark.parametrize("before,after,former,expected", [
    ({"a": "running", "b": "running"}, {"a": "assigned"}, [], ["b"]),  # b drained or lost
    ({"a": "running", "b": "running"}, {}, ["c"], ["c", "a", "b"]),  # back to PENDING: in the order they left
    ({"a": "running"}, {"a": "stopped"}, [], []),  # still a member
    ({"a": "running"}, {"a": "assigned", "b": "assigned"}, ["b"], ["b"]),  # b back: still listed
    ({}, {"a": "assigned"}, [], []),
])
def test_a_node_that_leaves_the_members_is_a_former_member(before, after, former, expected):
    old = make_job(S.RUNNING, before, former_members=former)
    new = make_job(S.RUNNING, after, former_members=former)
    assert note_former_members(old, new).former_members == expected


def test_former_members_are_the_latest_to_leave_and_no_more_than_the_cap():
    # A job that runs for months on nodes that come and go under new names.
    job = make_job(S.RUNNING, {"n0": "running"})
    for i in range(1, 3 * MIN_FORMER_MEMBERS):
        job = note_former_members(job, job.model_copy(update={"members": make_job(
            S.RUNNING, {f"n{i}": "running"}).members}))
    last = 3 * MIN_FORMER_MEMBERS - 1
    assert job.former_members == [f"n{i}" for i in range(last - MIN_FORMER_MEMBERS, last)]


def test_a_big_job_that_loses_every_node_at_once_lists_them_all():
    members = {f"n{i:03d}": "running" for i in range(100)}
    job = make_job(S.RUNNING, members, mn=100, mx=100, former_members=["old"])
    after = note_former_members(job, make_job(S.PENDING, {}, mn=100, mx=100, former_members=["old"]))
    assert after.former_members == ["old", *sorted(members)]


@pytest.mark.parametrize("before_state,before,after_state,after,attempt,expected", [
    (S.RUNNING, {"a": "running", "b": "running"}, S.RECOVERING, {"a": "assigned"}, 2, True),  # drained
    (S.RUNNING, {"a": "running", "b": "running"}, S.PENDING, {}, 1, True),  # fell short
    (S.RUNNING, {"a": "running"}, S.RECOVERING, {"a": "assigned"}, 2, True),  # a new attempt
    (S.RUNNING, {"a": "running"}, S.RUNNING, {"a": "stopped"}, 1, False),  # still a member
    (S.RUNNING, {"a": "running"}, S.RUNNING, {"a": "running", "b": "assigned"}, 1, False),  # one more
    (S.CANCELLING, {"a": "running"}, S.CANCELLED, {"a": "stopped"}, 1, True),  # ended
    (S.RUNNING, {"a": "running"}, S.SUCCEEDED, {"a": "succeeded"}, 1, True),
    (S.FAILED, {"a": "failed"}, S.FAILED, {"a": "failed"}, 1, False),  # ended before
    (S.PENDING, {}, S.STARTING, {"a": "assigned"}, 2, False),  # no member had a report
    (S.PENDING, {}, S.CANCELLED, {}, 1, False),
])
def test_the_memory_reports_go_when_a_member_leaves_the_attempt_changes_or_the_job_ends(
        before_state, before, after_state, after, attempt, expected):
    after_job = make_job(after_state, after, attempt=attempt)
    assert drops_copies(make_job(before_state, before), after_job) is expected
