"""When a job ends, as tables: the members' states, the restarts, and every order in which
members finish, fail, vanish or restart that the scheduler meets."""

from __future__ import annotations

import pytest

from service.decide.members import decide_registered, decide_report
from service.decide.outcome import by_members, by_restarts
from service.decide.scheduling import SchedulerConfig, free_nodes, plan
from service.models import JobRecord, JobState, MemberStatus, NodeRecord
from tests.service.records import NOW, make_job

S = JobState


def members(**states: str) -> dict[str, MemberStatus]:
    return {n: MemberStatus(state=s, exit_code=1 if s == "failed" else None) for n, s in states.items()}


@pytest.mark.parametrize("states,ending", [
    ({"a": "running", "b": "running"}, None),
    ({"a": "assigned", "b": "assigned"}, None),
    ({"a": "succeeded", "b": "running"}, None),
    ({"a": "succeeded", "b": "succeeded"}, (S.SUCCEEDED, "every worker exited 0")),
    # a member that never started does not hold up the end; one that left does not either
    ({"a": "succeeded", "b": "assigned"}, (S.SUCCEEDED, "every worker exited 0")),
    ({"a": "succeeded", "b": "stopped"}, (S.SUCCEEDED, "every worker exited 0")),
    ({"a": "stopped", "b": "stopped"}, None),
    ({"a": "stopped", "b": "running"}, None),
    ({}, None),
    # one failure ends the job whatever the others do; the first by name is the one named
    ({"a": "running", "b": "failed"}, (S.FAILED, "node b: exit code 1")),
    ({"a": "succeeded", "b": "failed"}, (S.FAILED, "node b: exit code 1")),
    ({"b": "failed", "a": "failed"}, (S.FAILED, "node a: exit code 1")),
])
def test_by_members(states, ending):
    got = by_members(members(**states))
    assert (None if got is None else (got.state, got.reason)) == ending
    if got is not None:
        assert got.stops_workers is (got.state is S.FAILED)


def test_by_members_names_the_reason_a_member_gave():
    got = by_members({"a": MemberStatus(state="failed", exit_code=1, reason="OOM killed")})
    assert got.reason == "node a: OOM killed"


@pytest.mark.parametrize("restarts,max_restarts,ends", [
    (0, 3, False), (2, 3, False), (3, 3, True), (7, 3, True), (0, 0, True),
])
def test_by_restarts(restarts, max_restarts, ends):
    got = by_restarts(restarts, max_restarts, ["x"])
    assert (got is not None) is ends
    if ends:
        assert got.state is S.FAILED and got.stops_workers
        assert got.reason == f"workers failed {restarts + 1} times (max_restarts={max_restarts}); " \
                             "last log lines:\nx"


# ------------------------------------------------------------------ orders of events

def run(events: list[tuple[str, str] | list[tuple[str, str]]], mn: int) -> JobRecord:
    """Apply `events` to a RUNNING job on nodes a and b, as reports and lost leases arrive,
    planning after each (a list of events: all arrive before the scheduler's next tick)."""
    nodes = {n: NodeRecord(name=n, registered_at=1.0, lease_id=1) for n in ("a", "b")}
    job = make_job(S.RUNNING, {"a": "running", "b": "running"}, mn=mn, mx=2, round_nodes=2,
                   rounds=1)
    for step in events:
        for kind, node in step if isinstance(step, list) else [step]:
            change = None
            if kind == "gone":
                del nodes[node]
            elif kind == "restart":
                change = decide_registered(job, node, job.attempt, NOW)
            else:
                state, code = {"ok": ("succeeded", 0), "fail": ("failed", 1)}[kind]
                change = decide_report(job, node, job.attempt, state, code, f"{kind} on {node}", NOW)
            job = change.job if change is not None else job
        p = plan(job, nodes, free_nodes([job], nodes), NOW, SchedulerConfig())
        job = p.job if p is not None else job
    return job


PENDING_2 = "only 1 of the 2 nodes it needs are left; waiting for nodes (snapshots are kept)"
ORDERS = [
    # (events, min nodes) -> (state, reason, attempt): today's behaviour, asserted as it is
    ([[("ok", "a"), ("ok", "b")]], 2, (S.SUCCEEDED, "every worker exited 0", 1)),
    ([("fail", "a"), ("ok", "b")], 2, (S.FAILED, "node a: fail on a", 1)),
    ([("fail", "b"), ("fail", "a")], 2, (S.FAILED, "node b: fail on b", 1)),
    ([[("fail", "b"), ("fail", "a")]], 2, (S.FAILED, "node a: fail on a", 1)),
    ([[("ok", "a"), ("fail", "b")]], 2, (S.FAILED, "node b: fail on b", 1)),
    ([("fail", "a"), ("gone", "b")], 2, (S.FAILED, "node a: fail on a", 1)),
    # Today, with min 2, a node that finished first leaves one live member, below min:
    # the job goes back to PENDING, and runs again (attempt 2) once both nodes are free.
    # This is the "finished is not lost" trap of DESIGN.md for min > 1 (reported, not fixed).
    ([("ok", "a"), ("ok", "b")], 2, (S.RUNNING, "started on 2 node(s): a, b", 2)),
    ([("ok", "b"), ("ok", "a")], 2, (S.RUNNING, "started on 2 node(s): a, b", 2)),
    ([("ok", "a"), ("fail", "b")], 2, (S.RUNNING, "started on 2 node(s): a, b", 2)),
    ([("ok", "a"), ("restart", "b")], 2, (S.RUNNING, "started on 2 node(s): a, b", 2)),
    ([("ok", "a"), ("gone", "b")], 2, (S.PENDING, PENDING_2, 1)),
    # below min before anything ended: back to PENDING; late reports change nothing, and
    # the job starts again once it has its nodes
    ([("gone", "b"), ("ok", "a")], 2, (S.PENDING, PENDING_2, 1)),
    ([("gone", "b"), ("fail", "a")], 2, (S.PENDING, PENDING_2, 1)),
    ([("gone", "a"), ("gone", "b")], 2, (S.PENDING, PENDING_2, 1)),
    ([("restart", "b"), ("ok", "a")], 2, (S.RUNNING, "started on 2 node(s): a, b", 2)),
    # an elastic job (min 1) goes on without a lost node under a new attempt, then ends
    ([("ok", "a"), ("ok", "b")], 1, (S.SUCCEEDED, "every worker exited 0", 1)),
    ([("gone", "b"), ("ok", "a")], 1, (S.SUCCEEDED, "every worker exited 0", 2)),
    ([("gone", "b"), ("fail", "a")], 1, (S.FAILED, "node a: fail on a", 2)),
    ([("gone", "a"), ("gone", "b")], 1, (S.PENDING, "only 0 of the 1 nodes it needs are left; "
                                                    "waiting for nodes (snapshots are kept)", 2)),
    # Today, with min 1, a node that finished is free again and rejoins the same attempt as
    # 'assigned' (scale-up); if the other node is then lost, the job restarts under attempt 2
    # on the finished node instead of succeeding (reported, not fixed).
    ([("ok", "a"), ("gone", "b")], 1, (S.RUNNING, "submitted", 2)),
    # a node whose agent restarted is free again, and rejoins the same attempt
    ([("restart", "a"), ("ok", "b")], 1, (S.SUCCEEDED, "every worker exited 0", 1)),
    ([("restart", "a"), ("fail", "b")], 1, (S.FAILED, "node b: fail on b", 1)),
]

@pytest.mark.parametrize("events,mn,ending", ORDERS, ids=[
    f"min{mn}:" + ",".join(f"{k} {n}" for step in ev for k, n in (step if isinstance(step, list)
                                                                 else [step]))
    for ev, mn, _ in ORDERS])
def test_every_order_of_endings(events, mn, ending):
    job = run(events, mn)
    assert (job.state, job.reason, job.attempt) == ending
    assert job.stopping is (job.state is S.FAILED)
