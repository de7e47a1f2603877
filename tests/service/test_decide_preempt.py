"""Priority and preemption as pure decisions: the queue's order, the choice of victims, a
victim giving its nodes up (shrink, suspend; runtime and plain script), and restarts by cause."""

from __future__ import annotations

import pytest

from service.decide import preempt
from service.decide.order import queue_key
from service.decide.scheduling import SchedulerConfig, plan, schedule, schedule_queue
from service.models import (
    Control,
    ControlAction,
    JobRecord,
    JobSpec,
    JobState,
    MemberStatus,
    NodeRecord,
    Preemption,
    RestartCounts,
)
from worker.protocol import MemorySnapshot, SnapshotMeta

S = JobState
NOW = 1000.0
CFG = SchedulerConfig(control_ack_timeout_s=10, cancel_ack_timeout_s=3)


def nodes(*names: str) -> dict[str, NodeRecord]:
    return {n: NodeRecord(name=n, registered_at=1.0, lease_id=1) for n in names}


def job(jid: str, prio: int = 0, members=(), mn=1, mx=2, created=1.0, state=None, snap_at=None,
        runtime=True, **kw) -> JobRecord:
    state = state or (S.RUNNING if members else S.PENDING)
    snap = None if snap_at is None else SnapshotMeta(step=10, path="/s", size=1, checksum="c", time=snap_at)
    return JobRecord(id=jid, spec=JobSpec(name=jid, command=["true"], nodes={"min": mn, "max": mx},
                                          priority=prio),
                     state=state, created_at=created, updated_at=created, attempt=1 if members else 0,
                     members={n: MemberStatus(state="running") for n in members}, latest_snapshot=snap,
                     reports_progress=runtime and bool(members), **kw)


# ------------------------------------------------------------------ the queue's order

def test_queue_orders_by_priority_then_age():
    jobs = [job("old-low", 0, created=1.0), job("new-high", 10, created=5.0),
            job("old-high", 10, created=2.0),
            job("negative", -5, created=0.5)]
    assert [j.id for j in sorted(jobs, key=queue_key)] == ["old-high", "new-high", "old-low", "negative"]


def test_schedule_starts_the_higher_priority_job_on_the_one_free_node():
    older_low, newer_high = job("low", 0, created=1.0), job("high", 5, created=2.0)
    plans = schedule([older_low, newer_high], nodes("a"), NOW, CFG)
    assert [(p.job.id, p.job.state) for p in plans] == [("high", S.STARTING)]


# ------------------------------------------------------------------ choosing victims

@pytest.mark.parametrize("need, running, taken", [
    # shrink before suspending, whatever the priorities among the victims
    (1, [job("at-min", 0, ["a"]), job("above", 5, ["b", "c"], mn=1, mx=2)], [("above", ("b",), False)]),
    # lowest priority first
    (1, [job("p3", 3, ["a", "b"]), job("p1", 1, ["c", "d"])], [("p1", ("c",), False)]),
    # equal priority: least work since its last snapshot first
    (1, [job("fresh", 0, ["a", "b"], snap_at=990.0), job("stale", 0, ["c", "d"], snap_at=100.0)],
     [("fresh", ("a",), False)]),
    # then the newest
    (1, [job("older", 0, ["a", "b"], created=1.0), job("newer", 0, ["c", "d"], created=2.0)],
     [("newer", ("c",), False)]),
    # a shrink that is not enough is made a suspension of the next, and the shrink kept
    (2, [job("above", 0, ["a", "b"]), job("at-min", 0, ["c"], created=2.0)],
     [("above", ("a",), False), ("at-min", ("c",), True)]),
    # a job above its min is suspended whole once shrinking all is not enough
    (2, [job("above", 0, ["a", "b"])], [("above", ("a", "b"), True)]),
    # never for an equal or higher priority
    (1, [job("same", 10, ["a", "b"]), job("higher", 11, ["c", "d"])], []),
    # not enough to take: nothing is taken
    (3, [job("one", 0, ["a", "b"])], []),
    # group rank 0's node stays where the job shrinks
    (1, [job("led", 0, ["a", "b"], group="a/1")], [("led", ("b",), False)]),
])
def test_choose_victims(need, running, taken):
    waiter = job("w", 10, mn=need, mx=need)
    got = preempt.choose(waiter, need, running, nodes("a", "b", "c", "d"), NOW)
    assert [(t.victim.id, t.leave, t.suspend) for t in got] == taken


def test_a_job_already_giving_nodes_up_stopping_or_ending_is_no_victim():
    marked = job("m", 0, ["a", "b"], preempt=Preemption(by="x", by_priority=5, leave=["b"], requested_at=1.0))
    stopping = job("s", 0, ["c", "d"], stopping=True)
    ending = job("e", 0, ["e", "f"]).model_copy(update={"members": {
        "e": MemberStatus(state="succeeded"), "f": MemberStatus(state="running")}})
    assert preempt.Victims([marked, stopping, ending], NOW).order == []


def test_a_suspended_job_does_not_preempt_back_the_job_that_took_its_nodes():
    # It was suspended for a job of higher priority, which now runs: equal or lower never preempts.
    suspended = job("low", 0)
    taker = job("high", 10, ["a"])
    plans = schedule([suspended, taker], nodes("a"), NOW, CFG)
    assert plans == []
    assert preempt.choose(suspended, 1, [taker], nodes("a"), NOW) == []


# ------------------------------------------------------------------ a pass that preempts

def test_a_pass_marks_the_victim_and_notes_both_jobs():
    low = job("low", 0, ["a", "b"], mn=1, mx=2)
    high = job("high", 10, mn=1, mx=1, created=5.0)
    plans = {p.job.id: p for p in schedule_queue([high], [low], nodes("a", "b"), NOW, CFG)}
    victim = plans["low"].job
    assert victim.preempt is not None and victim.preempt.by == "high" and victim.preempt.leave == ["a"]
    assert victim.control is not None and victim.control.action is ControlAction.CHECKPOINT_PAUSE
    assert plans["low"].events[0].reason == "preempted by job high (priority 10): giving up node(s) a"
    assert plans["high"].job.state is S.PENDING
    assert plans["high"].events[0].reason == "preempting job low (priority 0): taking node(s) a"


@pytest.mark.parametrize("waiter, free, running", [
    (job("high", 10, mn=1, mx=1, created=5.0), 0, [job("low", 0, ["a", "b"], mn=1, mx=2)]),
    (job("high", 10, mn=3, mx=3, created=5.0), 1,
     [job("low", 0, ["a", "b"], mn=1, mx=2), job("at-min", 1, ["c"], mn=1, mx=1)]),
    (job("high", 10, mn=2, mx=2, created=5.0), 0, [job("low", 0, ["a", "b"], mn=2, mx=2)]),
])
def test_what_a_waiting_job_would_preempt_is_what_the_pass_marks(waiter, free, running):
    names = [n for j in running for n in j.members] + [f"free{i}" for i in range(free)]
    victims = preempt.Victims(running, NOW)
    shown = preempt.would_take(waiter, free, [], victims, nodes(*names))
    plans = schedule_queue([waiter], running, nodes(*names), NOW, CFG)
    marked = [(p.job.id, tuple(p.job.preempt.leave), p.job.preempt.suspend) for p in plans if p.job.preempt]
    assert shown and sorted((t.victim.id, t.leave, t.suspend) for t in shown) == sorted(marked)
    assert not victims.taken  # a preview takes nothing: the next job may name the same victims
    assert preempt.would_take(waiter, free, [], victims, nodes(*names)) == shown


def test_what_a_waiting_job_would_preempt_counts_the_preemption_under_way():
    giving = job("low", 0, ["a", "b"], mn=1, mx=2).model_copy(update={"preempt": Preemption(
        by="high", by_priority=10, leave=["a"], requested_at=NOW)})
    other = job("other", 0, ["c", "d"], mn=1, mx=2, created=2.0)
    high = job("high", 10, mn=2, mx=2, created=5.0)
    under_way = preempt.giving_to([giving, other])["high"]
    victims = preempt.Victims([giving, other], NOW)
    shown = preempt.would_take(high, 0, under_way, victims, nodes("a", "b", "c", "d"))
    assert [(t.victim.id, t.leave, t.suspend) for t in shown] == [("low", ("a",), False),
                                                                  ("other", ("c",), False)]
    # one that need not preempt (enough nodes free), or outranks no one, would take nothing
    assert preempt.would_take(high, 2, [], preempt.Victims([other], NOW), nodes("c", "d")) == []
    outranks_none = job("low2", 0, mn=1)
    assert preempt.would_take(outranks_none, 0, [], preempt.Victims([other], NOW), nodes("c", "d")) == []


def test_the_pass_reads_the_queue_only_as_far_as_jobs_may_preempt():
    running = [job("r", 5, ["a"])]
    read = []

    def queue():
        for j in [job("w10", 10, mn=2, mx=2), job("w5", 5), job("w0", 0)]:
            read.append(j.id)
            yield j

    schedule_queue(queue(), running, nodes("a"), NOW, CFG)
    assert read == ["w10", "w5"]  # w5 (priority 5) may not preempt: the rest is not read


def test_free_nodes_that_fit_a_preempting_job_are_not_given_to_lower_jobs():
    # One node free; "high" needs two: it takes one from "low" and keeps the free one meanwhile
    # from the lower waiting job and from "low" scaling up.
    low = job("low", 0, ["a", "b"], mn=1, mx=3)
    high, waiting = job("high", 10, mn=2, mx=2, created=5.0), job("later", 0, created=6.0)
    plans = {p.job.id: p for p in schedule_queue([high, waiting], [low], nodes("a", "b", "c"), NOW, CFG)}
    assert "later" not in plans and "c" not in plans["low"].job.members
    assert plans["low"].job.preempt.leave == ["a"]


def test_nodes_already_leaving_for_a_job_are_counted():
    low = job("low", 0, ["a", "b"], preempt=Preemption(by="high", by_priority=10, leave=["a"],
                                                      requested_at=NOW - 1))
    other = job("other", 0, ["c", "d"])
    high = job("high", 10, mn=1, mx=1, created=5.0)
    plans = schedule_queue([high], [low, other], nodes("a", "b", "c", "d"), NOW, CFG)
    # only "low" moves on (it asks rank 0 for its snapshot); no other victim, no new event on "high"
    assert [(p.job.id, p.job.control.action) for p in plans] == [("low", ControlAction.CHECKPOINT_PAUSE)]


# ------------------------------------------------------------------ a victim gives its nodes up

def marked(suspend=False, **kw) -> JobRecord:
    j = job("v", 0, ["a", "b"], **kw)
    leave = ["a", "b"] if suspend else ["b"]
    return j.model_copy(update={"preempt": Preemption(by="high", by_priority=10, leave=leave, suspend=suspend,
                                                      requested_at=NOW - 1)})


def acked(j: JobRecord) -> JobRecord:
    return j.model_copy(update={"control": Control(id=1, action=ControlAction.CHECKPOINT_PAUSE, reason="x",
                                                    requested_at=NOW - 1), "control_acked": 1})


def test_a_runtime_victim_shrinks_once_rank_0_has_snapshotted():
    waiting = plan(marked(), nodes("a", "b"), [], NOW, CFG)
    assert waiting.job.control.action is ControlAction.CHECKPOINT_PAUSE
    assert sorted(waiting.job.members) == ["a", "b"]
    p = plan(acked(marked()), nodes("a", "b"), [], NOW, CFG)
    assert p.job.state is S.RUNNING and sorted(p.job.members) == ["a"] and p.job.attempt == 2
    assert p.job.preempt is None and p.job.control is None
    assert p.job.restarts_by_cause == RestartCounts(preemption=1)
    assert "gave node(s) b to job high (priority 10)" in p.reason


def test_a_runtime_victim_at_its_min_is_suspended_with_its_memory_copy_noted_not_held():
    copies = [MemorySnapshot(node="a", step=40, attempt=1, time=NOW - 1)]
    p = plan(acked(marked(suspend=True)), nodes("a", "b"), [], NOW, CFG, copies=copies)
    assert p.job.state is S.PENDING and p.job.members == {} and p.job.preempt is None
    assert p.job.kept is not None and p.job.kept.steps == {"a": 40} and p.job.kept.until == NOW
    assert p.job.restarts_by_cause == RestartCounts(preemption=1) and p.job.restarts == 0
    assert p.reason.startswith("suspended: its nodes went to job high (priority 10)")


def test_a_plain_script_victim_is_stopped_with_its_grace_then_goes_on_on_the_rest():
    j = marked(runtime=False)
    stopping = plan(j, nodes("a", "b"), [], NOW, CFG)
    assert stopping.job.stopping and sorted(stopping.job.members) == ["a", "b"]
    stopped = stopping.job.model_copy(update={"members": {n: MemberStatus(state="stopped") for n in "ab"}})
    p = plan(stopped, nodes("a", "b"), [], NOW, CFG)
    assert not p.job.stopping and sorted(p.job.members) == ["a"] and p.job.members["a"].state == "assigned"
    assert p.job.attempt == 2 and p.job.restarts_by_cause == RestartCounts(preemption=1)


# ------------------------------------------------------------------ the job it yields to no longer waits

def test_a_victim_whose_preemptor_no_longer_waits_keeps_its_nodes():
    # "high" was cancelled (or started elsewhere): it is not in the queue any more
    victim = marked()
    (p,) = schedule_queue([], [victim], nodes("a", "b"), NOW, CFG)
    assert p.job.preempt is None and p.job.control is None and sorted(p.job.members) == ["a", "b"]
    assert p.job.attempt == victim.attempt and p.job.restarts_by_cause == RestartCounts()
    assert "job high (priority 10) no longer waits for them: it keeps its nodes" in p.reason
    # while "high" waits, the victim goes on giving its node up
    (p,) = schedule_queue([job("high", 10, mn=2, mx=2, created=5.0)], [victim], nodes("a", "b"), NOW, CFG)
    assert p.job.preempt is not None and p.job.control.action is ControlAction.CHECKPOINT_PAUSE


def test_a_runtime_victim_already_asked_to_pause_resumes_on_all_its_nodes_from_that_snapshot():
    asked = plan(marked(), nodes("a", "b"), [], NOW, CFG).job  # rank 0 may be snapshotting already
    (p,) = schedule_queue([], [asked], nodes("a", "b"), NOW, CFG)
    assert p.job.preempt is None and p.job.control is not None  # its pause is not taken back
    resumed = plan(acked(p.job), nodes("a", "b"), [], NOW, CFG)  # the usual called-off change
    assert sorted(resumed.job.members) == ["a", "b"] and resumed.job.attempt == 2
    assert resumed.job.restarts_by_cause.preemption == 0 and "called off" in resumed.reason


@pytest.mark.parametrize("suspend", [False, True])
def test_a_plain_script_victim_already_told_to_stop_starts_again_on_all_its_nodes(suspend):
    stopping = plan(marked(suspend=suspend, runtime=False), nodes("a", "b"), [], NOW, CFG).job
    assert stopping.stopping  # SIGTERM and its grace are under way: not taken back
    (p,) = schedule_queue([], [stopping], nodes("a", "b"), NOW, CFG)
    assert p.job.stopping and p.job.preempt.leave == [] and not p.job.preempt.suspend
    assert schedule_queue([], [p.job], nodes("a", "b"), NOW, CFG) == []  # (withdrawn once)
    stopped = p.job.model_copy(update={"members": {n: MemberStatus(state="stopped") for n in "ab"}})
    again = plan(stopped, nodes("a", "b"), [], NOW, CFG)
    assert again.job.state is S.RUNNING and sorted(again.job.members) == ["a", "b"]
    assert not again.job.stopping and again.job.preempt is None and again.job.attempt == 2


def test_a_plain_script_victim_keeps_the_nodes_it_stays_on_while_its_workers_are_stopped():
    # Marked to give up "b", told to stop: "a" stopped first, "b" still stopping. A stopped
    # member holds no node, but "a" is not free: given to the waiting job, that job no longer
    # waited, the preemption was withdrawn and the script started again on "a" too.
    stopping = plan(marked(runtime=False), nodes("a", "b"), [], NOW, CFG).job
    part = stopping.model_copy(update={"members": {"a": MemberStatus(state="stopped"),
                                                   "b": MemberStatus(state="running")}})
    high = job("high", 10, mn=1, mx=1, created=5.0)
    assert [p for p in schedule_queue([high], [part], nodes("a", "b"), NOW, CFG)
            if p.job.id == "high" and p.job.state is S.STARTING] == []
    # once "b" has stopped too, "high" starts on it, and the script goes on on "a"
    stopped = part.model_copy(update={"members": {n: MemberStatus(state="stopped") for n in "ab"}})
    plans = {p.job.id: p.job for p in schedule_queue([high], [stopped], nodes("a", "b"), NOW, CFG)}
    assert list(plans["high"].members) == ["b"] and list(plans["v"].members) == ["a"]


def test_a_plain_script_whose_suspension_is_withdrawn_does_not_start_again_on_the_node_its_preemptor_took():
    # Suspended for "high" (1 node), told to stop: "a" stopped first and "high" started on it,
    # so "high" no longer waits and the suspension is withdrawn. The script goes on only where
    # no other job is: started again on "a" too, two jobs held one node, and the agent ran one.
    stopping = plan(marked(suspend=True, runtime=False, mn=1), nodes("a", "b"), [], NOW, CFG).job
    part = stopping.model_copy(update={"members": {"a": MemberStatus(state="stopped"),
                                                   "b": MemberStatus(state="running")}})
    high = job("high", 10, mn=1, mx=1, created=5.0)
    started = {p.job.id: p.job for p in schedule_queue([high], [part], nodes("a", "b"), NOW, CFG)}["high"]
    assert list(started.members) == ["a"]
    (p,) = schedule_queue([], [started, part], nodes("a", "b"), NOW, CFG)
    assert p.job.id == "v" and p.job.preempt.leave == ["a"] and not p.job.preempt.suspend
    assert "start again on the node(s) it still has (a went to another job)" in p.reason
    stopped = p.job.model_copy(update={"members": {n: MemberStatus(state="stopped") for n in "ab"}})
    plans = {q.job.id: q.job for q in schedule_queue([], [started, stopped], nodes("a", "b"), NOW, CFG)}
    assert list(plans["v"].members) == ["b"] and plans["v"].state is S.RUNNING
    # where what is left is below its min, it waits for nodes instead
    two = stopping.model_copy(update={"spec": stopping.spec.model_copy(update={"nodes": stopping.spec.nodes.model_copy(
        update={"min": 2})}), "members": part.members})
    (p,) = schedule_queue([], [started, two], nodes("a", "b"), NOW, CFG)
    stopped = p.job.model_copy(update={"members": {n: MemberStatus(state="stopped") for n in "ab"}})
    plans = {q.job.id: q.job for q in schedule_queue([], [started, stopped], nodes("a", "b"), NOW, CFG)}
    assert plans["v"].state is S.PENDING and plans["v"].members == {}


# ------------------------------------------------------------------ restarts by cause

def test_restarts_by_cause_lost_node_and_resize_do_not_spend_max_restarts():
    running = job("j", 0, ["a", "b"], mn=1, mx=3, round_nodes=2, rounds=1)
    lost = plan(running, nodes("a"), [], NOW, CFG)
    assert lost.job.restarts_by_cause == RestartCounts(lost_node=1) and lost.job.restarts == 0
    grown = plan(job("j", 0, ["a"], mn=1, mx=2, runtime=False), nodes("a", "b"), ["b"], NOW, CFG)
    assert grown.job.restarts_by_cause == RestartCounts(resize=1)


def test_a_record_stored_before_causes_reads_its_restarts_as_failures():
    old = job("j").model_dump(mode="json")
    del old["restarts_by_cause"]
    old["restarts"] = 2
    rec = JobRecord.model_validate(old)
    assert rec.restarts_by_cause == RestartCounts(failure=2) and rec.view().restarts == 2
    assert rec.view().restarts_by_cause.failure == 2


@pytest.mark.parametrize("by, shown", [
    ({"failure": 0, "lost_node": 0, "preemption": 0, "resize": 0}, "0"),
    ({"failure": 1, "lost_node": 0, "preemption": 2, "resize": 0}, "3 (1 fail, 2 preempt)"),
    ({"failure": 0, "lost_node": 1, "preemption": 0, "resize": 4}, "5 (1 lost, 4 resize)"),
])
def test_ftrain_list_shows_restarts_by_cause_compactly(by, shown):
    from service.cli import _restarts
    assert _restarts({"restarts": by["failure"], "restarts_by_cause": by}) == shown


# ------------------------------------------------------------------ the job index keeps the queue's order

def test_the_job_index_keeps_the_queue_in_priority_order_and_the_running_priorities():
    from service.job_index import JobIndex
    index = JobIndex(None, None)  # type: ignore[arg-type]  (applying records touches no store)
    waiting = [job("old-low", 0, created=1.0), job("new-high", 10, created=5.0),
               job("old-high", 10, created=2.0)]
    for j in waiting:
        index._apply(j, j.id)
    assert list(index.pending_ids()) == ["old-high", "new-high", "old-low"]
    assert index.active_ids() == ["old-low", "old-high", "new-high"]  # (oldest first, as before)
    assert index.lowest_running_priority() is None
    started = waiting[1].model_copy(update={"state": S.RUNNING,
                                            "members": {"a": MemberStatus(state="running")}})
    index._apply(started, started.id)
    assert list(index.pending_ids()) == ["old-high", "old-low"] and index.lowest_running_priority() == 10
    giving = started.model_copy(update={"preempt": Preemption(by="x", by_priority=20, leave=["a"],
                                                              requested_at=NOW)})
    index._apply(giving, giving.id)
    assert [j.id for j in index.yielding()] == ["new-high"]
    index._apply(giving.model_copy(update={"state": S.SUCCEEDED, "preempt": None}), giving.id)
    assert index.lowest_running_priority() is None and index.yielding() == []


@pytest.mark.parametrize("field, value", [("priority", 1001), ("priority", -1001), ("priority", "high"),
                                          ("preempt_grace_s", 31), ("preempt_grace_s", -1)])
def test_out_of_range_priority_or_grace_is_refused_naming_the_field(field, value):
    from pydantic import ValidationError
    with pytest.raises(ValidationError) as err:
        JobSpec(name="j", command=["true"], **{field: value})
    assert err.value.errors()[0]["loc"] == (field,)


# ------------------------------------------------------------------ preemption with quotas

def test_a_job_its_quota_would_hold_back_preempts_nobody():
    from service.decide.quotas import Quota, Tenants

    low = job("low", 0, ["a", "b"], mn=1, mx=2, owner="bob")
    mine = job("mine", 0, ["c"], mn=1, mx=1, owner="ann")
    high = job("high", 10, mn=1, mx=1, created=5.0, owner="ann")
    capped = Tenants(users={"ann": Quota(max_nodes=1)})  # ann holds one node already
    plans = schedule_queue([high], [low, mine], nodes("a", "b", "c"), NOW, CFG, tenants=capped)
    assert plans == []  # no victim marked: the nodes it would free could not go to "high"
    roomy = Tenants(users={"ann": Quota(max_nodes=2)})
    plans = {p.job.id: p for p in schedule_queue([high], [low, mine], nodes("a", "b", "c"), NOW, CFG,
                                                tenants=roomy)}
    assert plans["low"].job.preempt is not None and plans["low"].job.preempt.by == "high"


def test_a_free_node_goes_by_fair_share_and_a_higher_priority_job_still_preempts_for_the_rest():
    bob_running = job("bob-1", 0, ["a"], mn=1, mx=1, owner="bob")
    ann_old = job("ann-old", 0, mn=1, mx=1, created=2.0, owner="ann")  # ann holds nothing
    bob_new = job("bob-new", 0, mn=1, mx=1, created=3.0, owner="bob")
    urgent = job("urgent", 10, mn=2, mx=2, created=4.0, owner="cy")
    queue = sorted([ann_old, bob_new, urgent], key=queue_key)
    plans = {p.job.id: p for p in schedule_queue(queue, [bob_running], nodes("a", "b"), NOW, CFG)}
    # "urgent" comes first: it cannot start on the one free node, so it keeps it and takes
    # bob's node by preemption; no job of priority 0 gets the free node meanwhile.
    assert "ann-old" not in plans and "bob-new" not in plans
    assert plans["bob-1"].job.preempt is not None and plans["bob-1"].job.preempt.by == "urgent"


# ------------------------------------------------------------------ the fifo queue policy

def test_the_fifo_policy_serves_submission_order_and_preempts_nobody():
    fifo = SchedulerConfig(control_ack_timeout_s=10, cancel_ack_timeout_s=3, fifo=True)
    older_low, newer_high = job("low", 0, created=1.0), job("high", 5, created=2.0)
    plans = schedule([older_low, newer_high], nodes("a"), NOW, fifo)
    assert [(p.job.id, p.job.state) for p in plans] == [("low", S.STARTING)]
    running_low = job("r", 0, ["a", "b"], mn=1, mx=2)
    assert schedule_queue([job("urgent", 10, created=5.0)], [running_low], nodes("a", "b"), NOW, fifo) == []
    assert queue_key(newer_high, fifo=True) > queue_key(older_low, fifo=True)
