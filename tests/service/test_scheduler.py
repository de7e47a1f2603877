"""The scheduler's decisions, as a table of cases with a fixed `now` (pure logic)."""

from __future__ import annotations

from service.decide.scheduling import (
    SchedulerConfig,
    Settled,
    free_for,
    free_nodes,
    holders,
    plan,
    schedule,
    schedule_queue,
)
from service.models import (
    Control,
    ControlAction,
    JobRecord,
    JobSpec,
    JobState,
    MemberStatus,
    NodeRecord,
    NodeState,
    Straggler,
)

S = JobState
NOW = 1000.0
CFG = SchedulerConfig(control_ack_timeout_s=10, cancel_ack_timeout_s=3)


def node(name: str, state: NodeState = NodeState.READY) -> NodeRecord:
    return NodeRecord(name=name, registered_at=1.0, lease_id=1, state=state)


def nodes(*names: str, draining: tuple[str, ...] = ()) -> dict[str, NodeRecord]:
    return {n: node(n, NodeState.DRAINING if n in draining else NodeState.READY) for n in names}


def job(state=S.PENDING, members=None, mn=1, mx=2, created=1.0, jid="j1", **kw) -> JobRecord:
    members = {n: MemberStatus(state=s) for n, s in (members or {}).items()}
    return JobRecord(id=jid, spec=JobSpec(name="j", command=["true"], nodes={"min": mn, "max": mx}),
                     state=state, created_at=created, updated_at=created,
                     members=members, attempt=kw.pop("attempt", 1 if members else 0), **kw)


def test_pending_job_waits_for_min_nodes():
    assert plan(job(mn=2, mx=3), nodes("a"), ["a"], NOW, CFG) is None


def test_pending_job_gang_starts_on_up_to_max_nodes():
    p = plan(job(mn=2, mx=3), nodes("a", "b", "c", "d"), ["a", "b", "c", "d"], NOW, CFG)
    assert p.job.state is S.STARTING and p.job.attempt == 1 and p.job.regrouping  # RUNNING at its first step
    assert sorted(p.job.members) == ["a", "b", "c"]
    assert all(m.state == "assigned" for m in p.job.members.values())


def test_pending_job_never_takes_a_draining_node():
    assert plan(job(mn=2), nodes("a", "b", draining=("b",)), ["a", "b"], NOW, CFG) is None


def test_lost_node_below_min_sends_the_job_back_to_pending():
    j = job(S.RUNNING, {"a": "running", "b": "running"}, mn=2, mx=2)
    p = plan(j, nodes("a"), [], NOW, CFG)
    assert p.job.state is S.PENDING and p.job.members == {}
    assert "lost" in " ".join(e.reason for e in p.events)


def test_lost_node_above_min_keeps_running_without_it_once_the_survivors_reformed():
    j = job(S.RUNNING, {"a": "running", "b": "running"}, mn=1, mx=2, round_nodes=1)
    p = plan(j, nodes("a"), [], NOW, CFG)
    assert p.job.state is S.RUNNING and p.job.attempt == j.attempt
    assert p.job.members["b"].state == "stopped" and p.job.members["a"].state == "running"


def test_survivors_stuck_with_a_lost_node_restart_under_a_new_attempt():
    j = job(S.RUNNING, {"a": "running", "b": "running", "c": "running"}, mn=1, mx=3, round_nodes=3)
    p = plan(j, nodes("a", "b"), [], NOW, CFG)
    # a fault: RECOVERING at once, the reason naming the lost node, until the new group's first step
    assert p.job.state is S.RECOVERING and p.job.attempt == j.attempt + 1
    assert p.job.reason == "node(s) c lost: restarting the 2 remaining node(s) under a new rendezvous"
    assert p.job.regrouping and p.job.group is None
    assert sorted(p.job.members) == ["a", "b"]
    assert all(m.state == "assigned" for m in p.job.members.values())


def test_free_node_scales_up_a_plain_job_at_once():
    j = job(S.RUNNING, {"a": "running"}, mn=1, mx=2)
    p = plan(j, nodes("a", "b"), ["b"], NOW, CFG)
    assert p.job.members["b"].state == "assigned" and p.job.attempt == j.attempt


def test_scale_up_of_a_runtime_job_waits_for_rank0_snapshot():
    j = job(S.RUNNING, {"a": "running"}, mn=1, mx=2, reports_progress=True)
    p = plan(j, nodes("a", "b"), ["b"], NOW, CFG)
    assert "b" not in p.job.members
    assert p.job.control.action is ControlAction.CHECKPOINT_PAUSE
    acked = p.job.model_copy(update={"control_acked": p.job.control.id, "control_acked_step": 5})
    p2 = plan(acked, nodes("a", "b"), ["b"], NOW + 1, CFG)
    assert p2.job.members["b"].state == "assigned" and p2.job.control is None


def test_scale_up_goes_ahead_when_rank0_does_not_ack_in_time():
    c = Control(id=1, action=ControlAction.CHECKPOINT_PAUSE, reason="join", requested_at=NOW - 11)
    j = job(S.RUNNING, {"a": "running"}, reports_progress=True, control=c)
    p = plan(j, nodes("a", "b"), ["b"], NOW, CFG)
    assert "b" in p.job.members


def test_job_at_max_is_not_scaled():
    j = job(S.RUNNING, {"a": "running", "b": "running"}, mx=2)
    assert plan(j, nodes("a", "b", "c"), ["c"], NOW, CFG) is None


def test_member_failure_with_no_restart_left_fails_the_job_with_its_reason():
    j = job(S.RUNNING, {"a": "running"})
    j = j.model_copy(update={"spec": j.spec.model_copy(update={"max_restarts": 0})})
    j.members["a"] = MemberStatus(state="failed", exit_code=1, reason="boom")
    p = plan(j, nodes("a"), [], NOW, CFG)
    assert p.job.state is S.FAILED and "boom" in p.job.reason and p.job.stopping


def test_member_failure_restarts_the_workers_under_a_new_attempt():
    j = job(S.RUNNING, {"a": "running", "b": "running"}, attempt=1, round_nodes=2, rounds=1)
    j.members["b"] = MemberStatus(state="failed", exit_code=-9,
                                  reason="torchrun (pid 7) was killed by SIGKILL\nlast lines:\n[rank1] step 3")
    p = plan(j, nodes("a", "b"), [], NOW, CFG)
    assert (p.job.state, p.job.attempt, p.job.restarts) == (S.RECOVERING, 2, 1)
    assert p.job.reason == "node b: torchrun (pid 7) was killed by SIGKILL; restarting the workers (1 of 3)"
    assert p.events[-1].detail == "last lines:\n[rank1] step 3"
    assert {n: m.state for n, m in p.job.members.items()} == {"a": "assigned", "b": "assigned"}
    assert not p.job.stopping


def test_all_members_succeeded_means_succeeded():
    j = job(S.RUNNING, {"a": "succeeded", "b": "succeeded"})
    assert plan(j, nodes("a", "b"), [], NOW, CFG).job.state is S.SUCCEEDED
    j = job(S.RUNNING, {"a": "succeeded", "b": "running"})
    assert plan(j, nodes("a", "b"), [], NOW, CFG) is None


def test_cancel_of_plain_job_stops_members_then_ends_cancelled():
    j = job(S.CANCELLING, {"a": "running"})
    p = plan(j, nodes("a"), [], NOW, CFG)
    assert p.job.stopping and p.job.state is S.CANCELLING
    stopped = p.job.model_copy(update={"members": {"a": MemberStatus(state="stopped")}})
    assert plan(stopped, nodes("a"), [], NOW, CFG).job.state is S.CANCELLED


def test_cancel_of_runtime_job_asks_for_a_final_snapshot_first():
    j = job(S.CANCELLING, {"a": "running"}, reports_progress=True)
    p = plan(j, nodes("a"), [], NOW, CFG)
    assert p.job.control.action is ControlAction.CHECKPOINT_STOP and not p.job.stopping
    later = plan(p.job, nodes("a"), [], NOW + 4, CFG)
    assert later.job.stopping


def test_drain_removes_the_member_and_job_continues_above_min():
    j = job(S.RUNNING, {"a": "running", "b": "running"}, mn=1)
    p = plan(j, nodes("a", "b", draining=("b",)), [], NOW, CFG)
    assert "b" not in p.job.members and p.job.members["a"].state == "assigned"
    assert p.job.state is S.RUNNING and p.job.attempt == j.attempt + 1


def test_terminal_jobs_are_left_alone():
    for s in (S.SUCCEEDED, S.FAILED, S.CANCELLED):
        assert plan(job(s), nodes("a"), ["a"], NOW, CFG) is None


def test_pending_jobs_get_free_nodes_before_scale_ups():
    running = job(S.RUNNING, {"a": "running"}, mn=1, mx=3, jid="old", created=1.0)
    pending = job(S.PENDING, mn=2, mx=2, jid="new", created=2.0)
    ns = nodes("a", "b", "c")
    plans = {p.job.id: p for p in schedule([running, pending], ns, NOW, CFG)}
    assert sorted(plans["new"].job.members) == ["b", "c"]
    assert "old" not in plans


def test_free_nodes_excludes_live_members_of_active_jobs():
    a = job(S.RUNNING, {"a": "running", "b": "stopped"})
    assert free_nodes([a], nodes("a", "b", "c")) == ["b", "c"]


# A member whose workers exited 0 is finished: not lost, not free, counted for `min`
# (the orders of endings are tabled in test_decide_outcome.py).

def test_a_finished_member_counts_towards_min_so_the_job_does_not_go_back_to_pending():
    j = job(S.RUNNING, {"a": "succeeded", "b": "running"}, mn=2, mx=2)
    assert plan(j, nodes("a", "b"), [], NOW, CFG) is None


def test_a_finished_member_whose_node_vanished_is_not_lost():
    j = job(S.RUNNING, {"a": "succeeded", "b": "running"}, mn=2, mx=2)
    assert plan(j, nodes("b"), [], NOW, CFG) is None
    done = j.model_copy(update={"members": {**j.members, "b": MemberStatus(state="succeeded")}})
    assert plan(done, nodes("b"), [], NOW, CFG).job.state is S.SUCCEEDED


def test_a_finished_members_node_is_not_free_for_another_job():
    ending = job(S.RUNNING, {"a": "succeeded", "b": "running"}, mn=2, mx=2, jid="ending")
    waiting = job(S.PENDING, mn=1, mx=1, jid="waiting", created=2.0)
    assert free_nodes([ending, waiting], nodes("a", "b")) == []
    assert schedule([ending, waiting], nodes("a", "b"), NOW, CFG) == []


def test_an_ending_job_is_not_scaled_up_drained_or_restarted():
    ending = {"a": "succeeded", "b": "running"}
    j = job(S.RUNNING, ending, mn=1, mx=3, reports_progress=True)
    assert plan(j, nodes("a", "b", "c"), ["c"], NOW, CFG) is None  # no join
    assert plan(j, nodes("a", "b", draining=("b",)), [], NOW, CFG) is None  # no drain
    c = Control(id=1, action=ControlAction.CHECKPOINT_PAUSE, reason="join", requested_at=NOW - 11)
    paused = job(S.RUNNING, ending, mn=1, mx=3, control=c)
    assert plan(paused, nodes("a", "b"), [], NOW, CFG) is None  # no called-off restart


def test_a_member_lost_after_another_finished_fails_the_job():
    j = job(S.RUNNING, {"a": "succeeded", "b": "running"}, mn=1, mx=2)
    p = plan(j, nodes("a"), [], NOW, CFG)
    assert p.job.state is S.FAILED and p.job.stopping and p.job.attempt == j.attempt
    assert p.job.reason.startswith("node b: node lost (its lease lapsed) after node(s) a finished")


def test_a_member_lost_after_another_finished_during_a_cancel_just_stops():
    j = job(S.CANCELLING, {"a": "succeeded", "b": "running"}, mn=1, mx=2, stopping=True)
    p = plan(j, nodes("a"), [], NOW, CFG)
    assert p.job.state is S.CANCELLED and p.job.members["b"].state == "stopped"


# A pass over a long queue (bench/scheduler_pass.py): the pending jobs are read only as far
# as a node is free for them, and the running jobs whose plan cannot have changed are skipped.

def test_a_pass_reads_the_pending_queue_only_while_a_ready_node_is_free():
    queue = [job(S.PENDING, mn=1, mx=1, jid=f"p{i}", created=10.0 + i) for i in range(1000)]
    read: list[str] = []

    def pending():
        for j in queue:
            read.append(j.id)
            yield j

    busy = job(S.RUNNING, members={"a": "running", "b": "running"}, mn=2, mx=2, jid="r", created=1.0)
    ns = nodes("a", "b", "c", draining=("c",))
    assert schedule_queue(pending(), [busy], ns, NOW, CFG) == []
    # No READY node is free: only the queue's head is read, to see whether it may preempt
    # (it may not: its priority is the running job's), and not one job more.
    assert read == ["p0"]
    plans = schedule_queue(pending(), [], ns, NOW, CFG)
    assert [(p.job.id, list(p.job.members)) for p in plans] == [("p0", ["a"]), ("p1", ["b"])]
    # (a free node reads the whole queue: fair share must see every owner's first job)
    assert [p.job for p in schedule(queue, ns, NOW, CFG)] == [p.job for p in plans]


def test_a_pass_starts_at_most_max_starts_jobs_and_then_scales_nothing_up():
    queue = [job(S.PENDING, mn=1, mx=1, jid=f"p{i}", created=10.0 + i) for i in range(5)]
    running = job(S.RUNNING, members={"a": "running"}, mn=1, mx=3, jid="r", created=1.0)
    ns = nodes("a", "b", "c", "d", "e", "f")
    plans = schedule_queue(iter(queue), [running], ns, NOW, CFG, max_starts=2)
    assert [(p.job.id, list(p.job.members)) for p in plans] == [("p0", ["b"]), ("p1", ["c"])]
    # Uncapped, the rest of the queue takes the free nodes before any scale-up.
    plans = schedule_queue(iter(queue), [running], ns, NOW, CFG)
    assert [p.job.id for p in plans] == ["p0", "p1", "p2", "p3", "p4"]
    # A queue the cap does not stop leaves the free nodes to scale-ups, as before.
    plans = schedule_queue(iter(queue[:1]), [running], ns, NOW, CFG, max_starts=2)
    assert [p.job.id for p in plans] == ["p0", "r"]


def test_a_running_job_whose_plan_was_none_is_skipped_until_its_record_or_the_nodes_change():
    settled = Settled()
    settled.nodes_version = 1
    j = job(S.RUNNING, {"a": "running"}, mn=1, mx=1)
    ns = nodes("a", "b")
    assert schedule_queue([], [j], ns, NOW, CFG, settled=settled) == []
    assert settled.known(j, frozenset(), {"b"}, ns)  # full (max 1): b cannot join
    # Its node lost, in a new version of the node view: planned again, and it goes back to PENDING.
    settled.nodes_version = 2
    assert not settled.known(j, frozenset(), set(), nodes("b"))
    (p,) = schedule_queue([], [j], nodes("b"), NOW, CFG, settled=settled)
    assert p.job.state is S.PENDING
    # A changed record (another object) is planned again, as is one under other `graced`.
    assert not settled.known(j.model_copy(), frozenset(), set(), ns)
    settled.nodes_version = 1
    assert settled.known(j, frozenset(), set(), ns) is False  # forgotten: its plan was not None


def test_a_settled_job_below_its_max_is_planned_again_when_a_node_it_fits_is_free():
    settled = Settled()
    settled.nodes_version = 7
    j = job(S.RUNNING, {"a": "running"}, mn=1, mx=2)
    assert schedule_queue([], [j], nodes("a"), NOW, CFG, settled=settled) == []
    assert settled.known(j, frozenset(), set(), nodes("a"))
    (p,) = schedule_queue([], [j], nodes("a", "b"), NOW, CFG, settled=settled)  # same version
    assert sorted(p.job.members) == ["a", "b"]


def test_a_job_waiting_on_the_clock_is_never_settled():
    settled = Settled()
    settled.nodes_version = 1
    asked = job(S.RUNNING, {"a": "running"}, mn=1, mx=1,
                control=Control(id=1, action=ControlAction.CHECKPOINT_PAUSE, reason="x",
                                requested_at=NOW))
    assert schedule_queue([], [asked], nodes("a"), NOW, CFG, settled=settled) == []
    assert not settled.known(asked, frozenset(), set(), nodes("a"))
    settled.nodes_version = None  # no node view: nothing is settled
    j = job(S.RUNNING, {"a": "running"}, mn=1, mx=1)
    schedule_queue([], [j], nodes("a"), NOW, CFG, settled=settled)
    assert not settled.known(j, frozenset(), set(), nodes("a"))


def test_free_for_a_re_read_record_is_free_nodes_of_it_and_the_others():
    a = job(S.RUNNING, {"a": "running"}, jid="ja")
    b = job(S.RUNNING, {"b": "running", "c": "succeeded"}, jid="jb")
    held = holders([a, b])
    ns = nodes("a", "b", "c", "d")
    now_a = a.model_copy(update={"members": {}})  # re-read: it let its node go meanwhile
    assert free_for(now_a, held, ns) == free_nodes([now_a, b], ns) == ["a", "d"]
    assert free_for(a, held, ns) == free_nodes([a, b], ns) == ["d"]


def test_a_lost_member_is_said_lost_the_way_it_went():
    """Its lease lapsed only when no control plane noted another way (`gone`): a SIGKILLed
    agent's closed connection, or an agent that stopped, is said so."""
    j = job(S.RUNNING, {"a": "running", "b": "running"}, mn=1, mx=2)
    for gone, said in [({}, "node b lost (its lease lapsed)"),
                       ({"b": "its agent's connection closed"}, "node b lost (its agent's connection closed)"),
                       ({"b": "its agent stopped"}, "node b lost (its agent stopped)")]:
        p = plan(j, nodes("a"), [], NOW, CFG, gone=gone)
        assert said in [e.reason for e in p.events], p.events


# Stragglers (`straggler_action: replace`): the flagged rank's node is swapped for a free one at
# a step boundary (a planned change, as a drain), and not taken back.

def straggling(action="replace", **kw) -> JobRecord:
    j = job(S.RUNNING, {"a": "running", "b": "running"}, mn=2, mx=2, reports_progress=True,
            stragglers=[Straggler(rank=1, node="b", factor=1.5, since=NOW - 5)], **kw)
    return j.model_copy(update={"spec": j.spec.model_copy(update={"straggler_action": action})})


def test_a_straggler_node_is_replaced_by_a_free_one_at_a_step_boundary():
    j = straggling()
    asked = plan(j, nodes("a", "b", "c"), ["c"], NOW, CFG)
    assert asked.job.control.action is ControlAction.CHECKPOINT_PAUSE and sorted(asked.job.members) == ["a", "b"]
    acked = asked.job.model_copy(update={"control_acked": asked.job.control.id})
    p = plan(acked, nodes("a", "b", "c"), ["c"], NOW, CFG)
    assert sorted(p.job.members) == ["a", "c"] and p.job.attempt == j.attempt + 1
    assert p.job.state is S.RUNNING and p.job.stragglers == [] and p.job.replaced == ["b"]
    assert p.job.restarts == 0 and p.reason.startswith("straggler node b replaced by c")


def test_a_straggler_is_only_reported_without_replace_or_a_free_node():
    assert plan(straggling("report"), nodes("a", "b", "c"), ["c"], NOW, CFG) is None
    assert plan(straggling(), nodes("a", "b"), [], NOW, CFG) is None


def test_a_replaced_node_is_not_taken_back_by_a_scale_up():
    j = job(S.RUNNING, {"a": "running"}, mn=1, mx=2, replaced=["b"])
    assert plan(j, nodes("a", "b"), ["b"], NOW, CFG) is None
