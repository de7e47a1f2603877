"""When a job ends, as tables: the members' states, the restarts, and every order in which
members finish, fail, vanish or restart that the scheduler meets."""

from __future__ import annotations

import pytest

from service.decide.members import decide_registered, decide_report, decide_run_finished
from service.decide.outcome import by_members, by_restarts
from service.decide.rounds import decide_round
from service.decide.scheduling import SchedulerConfig, free_nodes, plan
from service.models import JobRecord, JobState, MemberStatus, NodeRecord, NodeState
from tests.service.records import NOW, make_job
from worker.protocol import RoundReport

S = JobState


def members(**states: str) -> dict[str, MemberStatus]:
    codes = {"failed": 1, "succeeded": 0}
    return {n: MemberStatus(state=s, exit_code=codes.get(s)) for n, s in states.items()}


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


def test_a_finished_members_note_is_part_of_the_success():
    """An agent that could not make the snapshot commits its rank 0 left it says so with its
    success (worker/handoff.py): the job's end names it, never a silent success."""
    note = "snapshot(s) written and not committed, ...: step 40: its file cannot be read"
    got = by_members({"a": MemberStatus(state="succeeded", exit_code=0, reason=note),
                      "b": MemberStatus(state="succeeded", exit_code=0)})
    assert (got.state, got.reason) == (S.SUCCEEDED, f"every worker exited 0; node a: {note}")


@pytest.mark.parametrize("restarts,max_restarts,ends", [
    (0, 3, False), (2, 3, False), (3, 3, True), (7, 3, True), (0, 0, True),
])
def test_by_restarts(restarts, max_restarts, ends):
    got = by_restarts(restarts, max_restarts, ["x"])
    assert (got is not None) is ends
    if ends:
        assert got.state is S.FAILED and got.stops_workers
        assert got.reason == f"workers failed {restarts + 1} times (max_restarts={max_restarts}): x\n" \
                             "last log lines:\nx"


# ------------------------------------------------------------------ orders of events

def run(events: list[tuple[str, str] | list[tuple[str, str]]], mn: int,
        start: dict[str, str] | None = None, round_nodes: int | None = None,
        max_restarts: int = 0) -> JobRecord:
    """Apply `events` to a RUNNING job (members `start`, by default a and b running), as
    reports, lost leases and drains arrive, planning after each (a list of events: all
    arrive before the scheduler's next tick). Each report is for the job's current attempt.
    By default no restart is left: a failure ends the job whenever it comes."""
    start = start or {"a": "running", "b": "running"}
    nodes = {n: NodeRecord(name=n, registered_at=1.0, lease_id=1) for n in start}
    job = make_job(S.RUNNING, start, mn=mn, mx=len(start), max_restarts=max_restarts,
                   round_nodes=round_nodes or len(start), rounds=1)
    for step in events:
        for kind, node in step if isinstance(step, list) else [step]:
            change = None
            if kind == "gone":
                del nodes[node]
            elif kind == "drain":
                nodes[node] = nodes[node].model_copy(update={"state": NodeState.DRAINING})
            elif kind == "restart":
                change = decide_registered(job, node, job.attempt, NOW)
            elif kind == "done":  # its workers said they finished the run (the runtime's word)
                change = decide_run_finished(job, node, job.attempt, NOW)
            else:
                # "nostart": torchrun could not be started (no exit code)
                state, code = {"ok": ("succeeded", 0), "fail": ("failed", 1), "nostart": ("failed", None)}[kind]
                # as an agent reports: a reason with a failure, none with a success
                reason = f"{kind} on {node}" if state == "failed" else None
                change = decide_report(job, node, job.attempt, state, code, reason, NOW)
            job = change.job if change is not None else job
        p = plan(job, nodes, free_nodes([job], nodes), NOW, SchedulerConfig())
        job = p.job if p is not None else job
    return job


OK = (S.SUCCEEDED, "every worker exited 0", 1)
PENDING_2 = "only 1 of the 2 nodes it needs are left; waiting for nodes (snapshots are kept)"
PENDING_1 = "only 0 of the 1 nodes it needs are left; waiting for nodes (snapshots are kept)"
RESTARTED_2 = (S.STARTING, "started on 2 node(s): a, b", 2)
AFTER = ("after node(s) {} finished; the job succeeds only when every node's workers exit 0, "
         "and finished nodes are not run again (snapshots are kept)")


def lost_after(node: str, done: str = "a") -> tuple[JobState, str, int]:
    return (S.FAILED, f"node {node}: node lost (its lease lapsed) " + AFTER.format(done), 1)


def restarted_after(node: str, done: str = "a") -> tuple[JobState, str, int]:
    return (S.FAILED, f"node {node}: its workers stopped (the node's agent restarted) "
                      + AFTER.format(done), 1)


def vanished_done(*why: tuple[str, str]) -> tuple[JobState, str, int]:
    """SUCCEEDED, each (node, why) of `why` a node whose agent vanished after its workers said
    they finished the run."""
    notes = [f"node {n}: {w} after its workers finished the run (the runtime's word; their exit "
             "was not seen)" for n, w in why]
    return (S.SUCCEEDED, "; ".join(["every node's workers finished the run", *notes]), 1)


LOST = "node lost (its lease lapsed)"
RESTARTED = "its workers stopped (the node's agent restarted)"


def failed(node: str, attempt: int = 1) -> tuple[JobState, str, int]:
    """Failed by `node`'s failure after another node finished (nothing is restarted then)."""
    return (S.FAILED, f"node {node}: fail on {node}", attempt)


def spent(node: str, attempt: int = 1) -> tuple[JobState, str, int]:
    """Failed by `node`'s failure before any node finished, no restart left (max_restarts=0)."""
    return (S.FAILED, f"node {node}: fail on {node}; workers failed 1 times (max_restarts=0)", attempt)


# Two nodes, a then b (b then a is the same with the names swapped), one tick apart unless
# bracketed together. Rows marked "was" asserted the old behaviour: a finished node was
# taken for a lost one (and for a free one), so the job went back to PENDING or took its
# own finished node back, and ran again for ever.
ORDERS = [
    # ---- min == max == 2
    ([("ok", "a"), ("ok", "b")], 2, OK),  # was: PENDING, then RUNNING attempt 2, for ever
    ([("ok", "b"), ("ok", "a")], 2, OK),  # was: the same
    ([[("ok", "a"), ("ok", "b")]], 2, OK),
    ([("ok", "a"), ("fail", "b")], 2, failed("b")),  # was: RUNNING attempt 2
    ([[("ok", "a"), ("fail", "b")]], 2, failed("b")),
    ([("ok", "a"), ("gone", "b")], 2, lost_after("b")),  # was: PENDING
    ([[("ok", "a"), ("gone", "b")]], 2, lost_after("b")),  # which came first is unknown: failed
    ([("ok", "a"), ("restart", "b")], 2, restarted_after("b")),  # was: RUNNING attempt 2
    ([("ok", "a"), ("drain", "b"), ("ok", "b")], 2, OK),  # an ending job is not drained
    ([("fail", "a"), ("ok", "b")], 2, spent("a")),
    ([("fail", "a"), ("fail", "b")], 2, spent("a")),
    ([("fail", "b"), ("fail", "a")], 2, spent("b")),
    ([[("fail", "b"), ("fail", "a")]], 2, spent("a")),  # the same tick: the first by name
    ([("fail", "a"), ("gone", "b")], 2, spent("a")),
    ([("fail", "a"), ("restart", "b")], 2, spent("a")),
    # below min before anything ended: back to PENDING; later reports are not a member's,
    # and the job starts again once it has its nodes
    ([("gone", "a"), ("ok", "b")], 2, (S.PENDING, PENDING_2, 1)),
    ([("gone", "a"), ("fail", "b")], 2, (S.PENDING, PENDING_2, 1)),
    ([("gone", "a"), ("gone", "b")], 2, (S.PENDING, PENDING_2, 1)),
    ([("gone", "a"), ("restart", "b")], 2, (S.PENDING, PENDING_2, 1)),
    ([("restart", "a"), ("ok", "b")], 2, RESTARTED_2),
    ([("restart", "a"), ("fail", "b")], 2, RESTARTED_2),
    ([("restart", "a"), ("gone", "b")], 2, (S.PENDING, PENDING_2, 1)),
    ([("drain", "b"), ("ok", "a")], 2, (S.PENDING, PENDING_2, 2)),
    # b's workers said they finished the run, then its agent vanished before it reported
    # their exit (SIGKILLed): b finished, in either order. Was: FAILED, or PENDING
    ([("done", "b"), ("ok", "a"), ("gone", "b")], 2, vanished_done(("b", LOST))),
    ([("done", "b"), ("gone", "b"), ("ok", "a")], 2, vanished_done(("b", LOST))),
    ([("done", "b"), [("ok", "a"), ("gone", "b")]], 2, vanished_done(("b", LOST))),
    ([("done", "b"), ("ok", "a"), ("restart", "b")], 2, vanished_done(("b", RESTARTED))),
    ([("done", "b"), ("restart", "b"), ("ok", "a")], 2, vanished_done(("b", RESTARTED))),
    ([[("done", "a"), ("done", "b")], ("gone", "a"), ("gone", "b")], 2, vanished_done(("a", LOST))),
    # both said so, b vanished: a's torchrun may wait in torch's exit barrier for b's, which
    # died with b's agent; the job ends (its rendezvous closes, ending that wait)
    ([[("done", "a"), ("done", "b")], ("gone", "b")], 2, vanished_done(("b", LOST))),
    ([[("done", "a"), ("done", "b")], ("restart", "b")], 2, vanished_done(("b", RESTARTED))),
    ([("done", "b"), ("gone", "b")], 2, (S.RUNNING, "submitted", 1)),  # a has not said so: waited for
    # ... and an agent that lives reports what it saw: an exit that is not 0 is a failure
    ([("done", "b"), ("fail", "b"), ("ok", "a")], 2, spent("b")),
    ([("done", "b"), ("ok", "b"), ("ok", "a")], 2, OK),
    # ---- min 1, max 2: an elastic job goes on without a node that left before the end
    ([("ok", "a"), ("ok", "b")], 1, OK),
    ([("ok", "a"), ("fail", "b")], 1, failed("b")),
    ([("ok", "a"), ("gone", "b")], 1, lost_after("b")),  # was: RUNNING attempt 2 on node a
    ([("ok", "a"), ("restart", "b")], 1, restarted_after("b")),  # was: a rejoined, RUNNING
    ([("ok", "a"), ("drain", "b"), ("ok", "b")], 1, OK),
    ([("fail", "a"), ("ok", "b")], 1, spent("a")),
    ([("fail", "a"), ("gone", "b")], 1, spent("a")),
    ([("gone", "a"), ("ok", "b")], 1, (S.SUCCEEDED, "every worker exited 0", 2)),
    ([("gone", "a"), ("fail", "b")], 1, spent("b", 2)),
    ([("gone", "a"), ("gone", "b")], 1, (S.PENDING, PENDING_1, 2)),
    ([("gone", "a"), ("restart", "b")], 1, (S.PENDING, PENDING_1, 2)),
    # a node whose agent restarted is free again, and rejoins the same attempt ('assigned',
    # which does not hold up the end)
    ([("restart", "a"), ("ok", "b")], 1, OK),
    ([("restart", "a"), ("fail", "b")], 1, spent("b")),
    # b lost: the group stops, a fault (RECOVERING until the new group's first step)
    ([("restart", "a"), ("gone", "b")], 1,
     (S.RECOVERING, "node(s) b lost: restarting the 1 remaining node(s) under a new rendezvous", 2)),
    ([("drain", "b"), ("ok", "a")], 1, (S.SUCCEEDED, "every worker exited 0", 2)),
]


def _ids(rows) -> list[str]:
    return [f"min{mn}:" + ",".join(f"{k} {n}" for step in ev
                                   for k, n in (step if isinstance(step, list) else [step]))
            for ev, mn, *_ in rows]


@pytest.mark.parametrize("events,mn,ending", ORDERS, ids=_ids(ORDERS))
def test_every_order_of_endings(events, mn, ending):
    job = run(events, mn)
    assert (job.state, job.reason, job.attempt) == ending
    assert job.stopping is (job.state is S.FAILED)


RESTART_B = "node b: fail on b; restarting the workers ({} of 3)"
# A node's torchrun that ran and failed by itself (killed from outside: its exit code is known)
# before any node finished costs one restart of the job's workers while max_restarts allows,
# under a new attempt on every node still here; a start that failed (no exit code), or a
# failure once a node has finished, ends the job.
RESTARTS = [
    ([("fail", "b")], 1, (S.RECOVERING, RESTART_B.format(1), 2, 1, ["a", "b"])),
    ([("fail", "b"), ("fail", "b")], 1, (S.RECOVERING, RESTART_B.format(2), 3, 2, ["a", "b"])),
    ([("fail", "b"), ("fail", "b"), ("fail", "b"), ("fail", "b")], 2,
     (S.FAILED, "node b: fail on b; workers failed 4 times (max_restarts=3)", 4, 3, ["a", "b"])),
    ([("fail", "b"), ("ok", "a"), ("ok", "b")], 2, (S.SUCCEEDED, "every worker exited 0", 2, 1, ["a", "b"])),
    # its node lost with it: the others restart without it
    ([[("fail", "b"), ("gone", "b")]], 1,
     (S.RECOVERING, RESTART_B.format(1), 2, 1, ["a"])),
    ([("ok", "a"), ("fail", "b")], 1, (*failed("b"), 0, ["a", "b"])),
    ([("nostart", "b")], 1, (S.FAILED, "node b: nostart on b", 1, 0, ["a", "b"])),
]


@pytest.mark.parametrize("events,mn,ending", RESTARTS, ids=_ids(RESTARTS))
def test_a_torchrun_that_failed_by_itself_costs_one_restart(events, mn, ending):
    job = run(events, mn, max_restarts=3)
    assert (job.state, job.reason, job.attempt, job.restarts, sorted(job.members)) == ending
    assert job.stopping is (job.state is S.FAILED)


THREE = {"a": "running", "b": "running", "c": "running"}
ORDERS_3 = [
    # three nodes, min 1: the same rules with a bystander
    ([("ok", "a"), ("ok", "b"), ("ok", "c")], 1, THREE, 3, OK),
    ([("ok", "a"), ("gone", "b"), ("ok", "c")], 1, THREE, 3, lost_after("b")),
    ([("ok", "c"), ("ok", "a"), ("restart", "b")], 1, THREE, 3, restarted_after("b", "a, c")),
    # b left before anything finished and the others re-formed without it (round of 2):
    # it took no part in the end
    ([("gone", "b"), ("ok", "a"), ("ok", "c")], 1, THREE, 2, OK),
    ([("ok", "a"), ("ok", "c")], 1, {"a": "running", "b": "stopped", "c": "running"}, 2, OK),
    # min 3: a finished node counts towards the minimum, so no PENDING while the rest end
    ([("ok", "a"), ("ok", "b"), ("ok", "c")], 3, THREE, 3, OK),
    ([("ok", "a"), ("ok", "b"), ("fail", "c")], 3, THREE, 3, failed("c")),
]


@pytest.mark.parametrize("events,mn,start,round_nodes,ending", ORDERS_3, ids=_ids(ORDERS_3))
def test_every_order_of_endings_on_three_nodes(events, mn, start, round_nodes, ending):
    job = run(events, mn, start, round_nodes)
    assert (job.state, job.reason, job.attempt) == ending
    assert job.stopping is (job.state is S.FAILED)


@pytest.mark.parametrize("mn", [1, 2])
def test_an_ending_job_keeps_its_nodes_and_its_attempt_until_the_last_one_finishes(mn):
    job = run([("ok", "a")], mn)
    assert job.state is S.RUNNING and job.attempt == 1
    assert job.members["a"].state == "succeeded" and job.members["b"].state == "running"
    nodes = {n: NodeRecord(name=n, registered_at=1.0, lease_id=1) for n in ("a", "b", "c")}
    assert free_nodes([job], nodes) == ["c"]  # the finished node a is not free
    assert plan(job, nodes, ["c"], NOW, SchedulerConfig()) is None  # and c does not join


def test_the_word_that_a_node_finished_the_run_is_noted_only_on_a_live_member_of_the_attempt():
    job = make_job(S.RUNNING, {"a": "running", "b": "succeeded", "c": "stopped"}, mn=2, mx=3)
    noted = decide_run_finished(job, "a", 1, NOW).job
    assert noted.members["a"].run_finished and noted.members["a"].state == "running"
    assert decide_run_finished(noted, "a", 1, NOW) is None  # once
    assert decide_run_finished(job, "a", 2, NOW) is None  # another attempt's
    assert decide_run_finished(job, "b", 1, NOW) is None  # its end is known already
    assert decide_run_finished(job, "c", 1, NOW) is None  # gone: too late to count
    assert decide_run_finished(job, "x", 1, NOW) is None  # not a member
    assert decide_run_finished(make_job(S.SUCCEEDED, {"a": "running"}), "a", 1, NOW) is None


@pytest.mark.parametrize("nodes", [2, 1])  # the same group again (a restart), or a smaller one
def test_a_group_formed_again_in_the_attempt_takes_back_the_word_that_its_workers_finished(nodes):
    """torchrun restarted the group after `rt.finish()` (a worker that failed in its teardown):
    the restarted workers have not finished, so a node whose agent vanishes now is lost, not
    finished; the members say it again at the new group's end."""
    job = make_job(S.RUNNING, {"a": "running", "b": "running"}, mn=1, mx=2, rounds=1, round_nodes=2,
                   world_size=2)
    job = decide_run_finished(decide_run_finished(job, "a", 1, NOW).job, "b", 1, NOW).job
    assert job.members["a"].run_finished and job.members["b"].run_finished
    again = decide_round(job, RoundReport(attempt=1, node="a", phase="joined", call=1, group_rank=0,
                                          group_world_size=nodes), [], NOW).job
    assert not again.members["a"].run_finished and not again.members["b"].run_finished
    assert decide_run_finished(again, "a", 1, NOW).job.members["a"].run_finished  # said again at its end
    other = decide_round(job, RoundReport(attempt=2, node="a", phase="joined", call=1, group_rank=0,
                                          group_world_size=nodes), [], NOW)
    assert other is None  # another attempt's round changes nothing


def test_a_member_that_said_it_finished_and_vanishes_during_a_cancel_is_stopped():
    """A cancel ends CANCELLED whatever the members did: the word changes nothing there."""
    job = make_job(S.CANCELLING, {"a": "running", "b": "running"}, mn=2, mx=2)
    job = decide_run_finished(job, "b", 1, NOW).job
    assert decide_report(job, "b", 1, "stopped", None, "gone", NOW).job.members["b"].state == "stopped"
    nodes = {"a": NodeRecord(name="a", registered_at=1.0, lease_id=1)}
    p = plan(job, nodes, free_nodes([job], nodes), NOW, SchedulerConfig())
    assert p.job.members["b"].state == "stopped"
