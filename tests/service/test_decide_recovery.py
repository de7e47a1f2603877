"""Recovery as tables: when a job's group stops, and when it trains again (`decide.recovery`).

RUNNING means steps are being made: a fault makes the job RECOVERING at once, a planned
change keeps it RUNNING with the change as its reason, and either ends ("training again")
only at the first step of the group that replaced the stopped one (rank 0's progress from
that group, or a plain script's first worker line once it formed), not when it forms.
"""

from __future__ import annotations

import pytest

from service.decide.recovery import first_output, first_step, regroup
from service.decide.scheduling import SchedulerConfig, plan
from service.decide.snapshots import decide_progress
from service.models import JobState
from tests.service.records import NOW, make_job
from tests.service.test_scheduler import nodes
from worker.protocol import LogLineIn, Progress, ProgressReport

S = JobState
TRAINING = "training again: world size 4 on 2 node(s), "


def job(state=S.RECOVERING, group="a/1", regrouping=True, **kw):
    return make_job(state, {"a": "running", "b": "running"}, nproc=2, rounds=2, round_nodes=2,
                    world_size=4, group=group, regrouping=regrouping,
                    reason="node b is restarting its workers", **kw)


REGROUP = [
    # (what, state before, planned) -> (state after, reason)
    ("a fault while training", S.RUNNING, False, S.RECOVERING),
    ("a second fault while recovering: the reason names the newest", S.RECOVERING, False, S.RECOVERING),
    ("a planned change is no fault", S.RUNNING, True, S.RUNNING),
]


@pytest.mark.parametrize("what,before,planned,after", REGROUP, ids=[r[0] for r in REGROUP])
def test_a_stopped_group_is_recovering_after_a_fault_and_running_for_a_planned_change(
        what, before, planned, after):
    changed, event = regroup(job(before, regrouping=False), "node(s) c lost", NOW, planned=planned)
    assert (changed.state, changed.reason, changed.regrouping, changed.group) == \
        (after, "node(s) c lost", True, None)
    assert (event.state, event.reason, event.seq) == (after, "node(s) c lost", 6)


STEPS = [
    # (what, job, report attempt, report group) -> (state, reason) or None: nothing ends
    ("the new group's first step ends the recovery", job(), 1, "a/1", (S.RUNNING, TRAINING + "step 41")),
    ("a planned change's first step: RUNNING, the reason current", job(S.RUNNING), 1, "a/1",
     (S.RUNNING, TRAINING + "step 41")),
    ("a report without a group counts once the group formed", job(), 1, None,
     (S.RUNNING, TRAINING + "step 41")),
    ("a late step of the stopped group, the new one not formed", job(group=None, stopped_group="a/0"), 1,
     "a/0", None),
    ("a step of another group while none is known: its 'joined' report was lost",
     job(group=None, stopped_group="a/0"), 1, "b/2", (S.RUNNING, TRAINING + "step 41")),
    ("no group named, none known", job(group=None), 1, None, None),
    ("a late step of the replaced group", job(), 1, "a/0", None),
    ("a step of another attempt", job(), 0, "a/1", None),
    ("training, nothing to end", job(S.RUNNING, regrouping=False), 1, "a/1", None),
    ("cancelling", job(S.CANCELLING, regrouping=False), 1, "a/1", None),
]


@pytest.mark.parametrize("what,before,attempt,group,after", STEPS, ids=[r[0] for r in STEPS])
def test_training_again_is_the_first_step_of_the_new_group(what, before, attempt, group, after):
    change = first_step(before, attempt, group, 41, NOW)
    if after is None:
        assert change is None
        return
    assert (change.job.state, change.job.reason, change.job.regrouping) == (*after, False)
    assert [(e.state, e.reason, e.time) for e in change.events] == [(*after, NOW)]


def line(text: str, rank: int | None = 0, round_: int | None = None) -> LogLineIn:
    return LogLineIn(rank=rank, stream="stdout", line=text, time=NOW, round=round_)


OUTPUT = [
    # (what, job, shipment attempt, lines) -> resumed?
    ("a plain script's first worker line", job(), 1, [line("epoch 3")], True),
    ("torchrun's own lines are not the workers'", job(), 1, [line("Traceback", rank=None)], False),
    ("ftrain's notices are not the script's", job(), 1, [line("ftrain: the worker (pid 7) died of SIGKILL")],
     False),
    ("a script on the runtime waits for its step", job(reports_progress=True), 1, [line("epoch 3")], False),
    ("lines of the attempt before", job(), 0, [line("epoch 3")], False),
    ("the group has not formed yet", job(group=None), 1, [line("epoch 3")], False),
    ("a worker line of the group that formed in round 5", job(group_round=5), 1, [line("epoch 3", round_=5)],
     True),
    ("a late line of the replaced group (round 4), shipped after round 5 formed", job(group_round=5), 1,
     [line("Traceback", round_=4), line("epoch 2", rank=1, round_=4)], False),
    ("its late lines, then the new group's", job(group_round=5), 1,
     [line("epoch 2", round_=4), line("epoch 3", round_=5)], True),
    ("a line of an agent that does not tag them", job(group_round=5), 1, [line("epoch 3")], True),
]


@pytest.mark.parametrize("what,before,attempt,lines,resumed", OUTPUT, ids=[r[0] for r in OUTPUT])
def test_a_plain_script_trains_again_at_its_workers_first_output(what, before, attempt, lines, resumed):
    change = first_output(before, attempt, lines, NOW)
    assert (change is not None) is resumed
    if resumed:
        assert (change.job.state, change.job.reason) == (S.RUNNING, TRAINING + "its workers' first output")


def test_the_first_step_is_written_with_its_event_even_within_the_progress_rate_limit():
    stored = Progress(step=40, time=NOW - 0.1)
    report = ProgressReport(step=41, attempt=1, group="a/1")
    d = decide_progress(job(reports_progress=True), stored, report, NOW, min_interval_s=1.0)
    assert d.write and d.job.state is S.RUNNING and [e.reason for e in d.events] == [TRAINING + "step 41"]
    late = decide_progress(job(reports_progress=True), stored, report.model_copy(update={"group": "a/0"}),
                           NOW, min_interval_s=1.0)
    assert not late.write and late.job is None and late.events == []


PLANS = [
    # (what, job, live nodes, free nodes) -> (state, reason, attempt)
    ("a lost node is a fault", job(S.RUNNING, regrouping=False), ["a"], [],
     (S.RECOVERING, "node(s) b lost: restarting the 1 remaining node(s) under a new rendezvous", 2)),
    ("a node lost while recovering becomes the reason", job(), ["a"], [],
     (S.RECOVERING, "node(s) b lost: restarting the 1 remaining node(s) under a new rendezvous", 2)),
    ("a node joining is planned: RUNNING, the reason says so",
     job(S.RUNNING, regrouping=False).model_copy(update={"spec": job().spec.model_copy(
         update={"nodes": job().spec.nodes.model_copy(update={"max": 3})})}), ["a", "b", "c"], ["c"],
     (S.RUNNING, "node(s) c joined; scaling up", 1)),
]


@pytest.mark.parametrize("what,before,live,free,after", PLANS, ids=[r[0] for r in PLANS])
def test_the_scheduler_stops_the_group_for_a_lost_node_or_a_planned_change(what, before, live, free, after):
    p = plan(before, nodes(*live), free, NOW, SchedulerConfig())
    assert (p.job.state, p.job.reason, p.job.attempt) == after
    assert p.job.regrouping and p.job.group is None


STARTED = "training: world size 4 on 2 node(s), "


def test_a_started_job_is_starting_until_its_first_step_then_running():
    """RUNNING means steps are being made: a job given its nodes is STARTING until its group's
    first step (rank 0's progress) or, for a plain script, its workers' first output."""
    starting = job(S.STARTING, group="a/0")
    unnamed = starting.model_copy(update={"group": None})  # no 'joined' report came (a fake node)
    assert first_step(starting, 0, "a/0", 1, NOW) is None  # another attempt's
    assert first_output(starting, 1, [line("W torchrun", rank=None)], NOW) is None  # not a worker's
    for change, how in ((first_step(starting, 1, "a/0", 1, NOW), "step 1"),
                        (first_step(unnamed, 1, None, 1, NOW), "step 1"),
                        (first_output(starting, 1, [line("epoch 1")], NOW), "its workers' first output"),
                        (first_output(unnamed, 1, [line("epoch 1")], NOW), "its workers' first output")):
        assert (change.job.state, change.job.reason, change.job.regrouping) == \
            (S.RUNNING, STARTED + how, False)
        assert [(e.state, e.reason) for e in change.events] == [(S.RUNNING, STARTED + how)]


def test_a_fault_before_the_first_step_keeps_the_job_starting_with_the_fault_as_its_reason():
    changed, event = regroup(job(S.STARTING, regrouping=True), "node b is restarting its workers", NOW)
    assert (changed.state, changed.reason, changed.group) == \
        (S.STARTING, "node b is restarting its workers", None)
    assert event.state is S.STARTING
