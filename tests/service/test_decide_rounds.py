"""Restart accounting as a table: what each rendezvous round report does to the job.

Columns: the job (state, rounds, round_nodes, restarts, max_restarts), the report (phase,
call, group rank, group size) and what comes of it (None: nothing; else the job's state,
rounds, round_nodes, restarts, world size and the reasons of its events).
"""

from __future__ import annotations

import pytest

from service.decide.rounds import decide_round, is_restart
from service.models import JobState
from tests.service.records import NOW, make_job
from worker.protocol import RoundReport

S = JobState
TAIL = ["[rank0] Traceback", "[rank0] RuntimeError: boom"]


def formed(world: int, nodes: int) -> str:
    return f"group formed: world size {world} on {nodes} node(s); workers started again, " \
        "no step or output yet"


FORMED_4 = formed(4, 2)


def joining(call: int = 1, node: str = "a", attempt: int = 1) -> RoundReport:
    return RoundReport(attempt=attempt, node=node, phase="joining", call=call)


def joined(nodes: int, rank: int | None = 0, node: str = "a", attempt: int = 1) -> RoundReport:
    return RoundReport(attempt=attempt, node=node, phase="joined", call=0, group_rank=rank,
                       group_world_size=nodes)


def job(state=S.RUNNING, rounds=0, round_nodes=0, restarts=0, max_restarts=3, **kw):
    return make_job(state, {"a": "running", "b": "running", "c": "running"}, mx=3, nproc=2,
                    rounds=rounds, round_nodes=round_nodes, restarts=restarts,
                    max_restarts=max_restarts, world_size=0, **kw)


NOTHING = [
    ("a report of another attempt", job(), joined(2, attempt=0)),
    ("a pending job", job(S.PENDING), joined(2)),
    ("a cancelling job", job(S.CANCELLING), joining()),
    ("a finished job", job(S.SUCCEEDED), joined(2)),
    ("a failed job", job(S.FAILED), joining()),
    ("the first rendezvous of a torchrun", job(), joining(call=0)),
    ("a second node joining a recovery", job(S.RECOVERING), joining(call=3, node="b")),
    ("a node re-forming for a planned change (a join)", job(regrouping=True), joining(call=1)),
    ("a joined round reported by rank 1", job(rounds=1, round_nodes=2), joined(2, rank=1)),
    ("a joined round without its size", job(), joined(None)),
]


@pytest.mark.parametrize("what,before,report", NOTHING, ids=[w for w, _, _ in NOTHING])
def test_reports_that_change_nothing(what, before, report):
    assert decide_round(before, report, TAIL, NOW) is None


CHANGES = [
    # (what, job before, report) -> (state, rounds, round_nodes, restarts, world, reasons)
    ("a torchrun re-rendezvousing starts a recovery",
     job(rounds=1, round_nodes=2), joining(call=1, node="b"),
     (S.RECOVERING, 1, 2, 0, 0, ["node b is restarting its workers"])),
    ("the first round forms the group",
     job(), joined(2),
     (S.RUNNING, 1, 2, 0, 4, ["rendezvous complete: world size 4 on 2 node(s)"])),
    ("a round with more nodes is a scale-up, not a restart",
     job(rounds=1, round_nodes=2), joined(3),
     (S.RUNNING, 2, 3, 0, 6, ["rendezvous complete: world size 6 on 3 node(s)"])),
    # a group formed is not training yet: RECOVERING until its first step (test_decide_recovery)
    ("a round with fewer nodes is a shrink, not a restart",
     job(S.RECOVERING, rounds=1, round_nodes=2), joined(1),
     (S.RECOVERING, 2, 1, 0, 2, [formed(2, 1)])),
    ("a round with as many nodes after a recovery is a restart",
     job(S.RECOVERING, rounds=1, round_nodes=2), joined(2),
     (S.RECOVERING, 2, 2, 1, 4, ["workers restarted after a failure (1 of 3)",
                                 FORMED_4])),
    ("a restart seen without its 'joining' still counts, and is a recovery",
     job(rounds=3, round_nodes=2, restarts=1), joined(2),
     (S.RECOVERING, 4, 2, 2, 4, ["workers restarted after a failure (2 of 3)",
                                 FORMED_4])),
    ("the last restart allowed",
     job(S.RECOVERING, rounds=3, round_nodes=2, restarts=2), joined(2),
     (S.RECOVERING, 4, 2, 3, 4, ["workers restarted after a failure (3 of 3)",
                                 FORMED_4])),
    ("a planned change's round (RUNNING, regrouping) is no restart and stays RUNNING",
     job(rounds=1, round_nodes=2, regrouping=True), joined(3),
     (S.RUNNING, 2, 3, 0, 6, [formed(6, 3)])),
    ("one restart more than allowed fails the job, quoting the last lines",
     job(S.RECOVERING, rounds=4, round_nodes=2, restarts=3), joined(2),
     (S.FAILED, 5, 2, 3, 4, ["workers failed 4 times (max_restarts=3): [rank0] RuntimeError: boom"])),
    ("max_restarts=0: the first restart fails the job",
     job(S.RECOVERING, rounds=1, round_nodes=2, max_restarts=0), joined(2),
     (S.FAILED, 2, 2, 0, 4, ["workers failed 1 times (max_restarts=0): [rank0] RuntimeError: boom"])),
    ("a report from a node that is not a member counts one process per node",
     job(), joined(2, node="z"),
     (S.RUNNING, 1, 2, 0, 2, ["rendezvous complete: world size 2 on 2 node(s)"])),
]


@pytest.mark.parametrize("what,before,report,after", CHANGES, ids=[c[0] for c in CHANGES])
def test_reports_that_change_the_job(what, before, report, after):
    state, rounds, round_nodes, restarts, world, reasons = after
    change = decide_round(before, report, TAIL, NOW)
    got = change.job
    assert (got.state, got.rounds, got.round_nodes, got.restarts, got.world_size) == \
        (state, rounds, round_nodes, restarts, world)
    assert [e.reason for e in change.events] == reasons
    assert [e.seq for e in change.events] == list(range(6, 6 + len(reasons)))
    moved = [e.reason for e in change.events if e.state is not before.state]
    assert got.event_seq == 5 + len(reasons) and got.reason == (moved[0] if moved else before.reason)
    assert got.stopping is (state is S.FAILED)
    assert got.finished_at == (NOW if state.is_terminal() else None)
    assert change.ops == []


def test_a_starting_jobs_group_formed_says_in_its_reason_that_its_workers_started():
    """A plain script that prints nothing stays STARTING until its first line; meanwhile its
    reason (status, list, the dashboard) says the group formed and its workers started."""
    starting = job(S.STARTING, reason="started on 2 node(s): a, b")
    got = decide_round(starting, joined(2), TAIL, NOW).job
    assert (got.state, got.reason) == (
        S.STARTING, "group formed: world size 4 on 2 node(s); workers started, no step or output yet")
    # after a fault the reason keeps naming it
    failed = job(S.STARTING, rounds=1, round_nodes=2, reason="node b is restarting its workers")
    got = decide_round(failed, joined(2), TAIL, NOW).job
    assert got.reason == "node b is restarting its workers" and got.restarts == 1


def test_spent_restarts_give_a_one_line_reason_and_quote_the_log_lines_in_the_events_detail():
    change = decide_round(job(S.RECOVERING, rounds=4, round_nodes=2, restarts=3), joined(2), TAIL, NOW)
    assert change.job.reason == "workers failed 4 times (max_restarts=3): [rank0] RuntimeError: boom"
    assert change.events[-1].reason == change.job.reason
    assert change.events[-1].detail == "last log lines:\n[rank0] Traceback\n[rank0] RuntimeError: boom"


def test_spent_restarts_without_log_lines_say_so_plainly():
    change = decide_round(job(S.RECOVERING, rounds=2, round_nodes=2, restarts=3), joined(2), [], NOW)
    assert change.job.reason == "workers failed 4 times (max_restarts=3)"


@pytest.mark.parametrize("rounds,round_nodes,nodes,restart", [
    (0, 0, 2, False), (0, 2, 2, False), (1, 2, 2, True), (1, 2, 3, False), (5, 1, 1, True),
])
def test_is_restart(rounds, round_nodes, nodes, restart):
    assert is_restart(job(rounds=rounds, round_nodes=round_nodes), nodes) is restart


def test_a_joining_report_stops_the_group_and_a_joined_one_names_the_new_group():
    """The group that trains is named by rank 0's node and round; none while it re-forms."""
    running = job(rounds=1, round_nodes=2).model_copy(update={"group": "a/0", "group_round": 6})
    stopped = decide_round(running, joining(call=1, node="b"), TAIL, NOW).job
    assert (stopped.state, stopped.regrouping, stopped.group, stopped.group_round, stopped.stopped_group) == \
        (S.RECOVERING, True, None, None, "a/0")
    assert stopped.reason == "node b is restarting its workers"
    report = joined(2, node="c").model_copy(update={"call": 4, "round": 7})  # torch's round 7
    formed = decide_round(stopped, report, TAIL, NOW).job
    assert (formed.state, formed.regrouping, formed.group, formed.group_round) == \
        (S.RECOVERING, True, "c/4", 7)
    assert formed.reason == "node b is restarting its workers"  # still what it recovers from
