"""Scheduling affinity to the memory tier (`service.decide.keep`), as tables with a fixed `now`."""

from __future__ import annotations

import pytest

from service.decide import keep
from service.decide.scheduling import SchedulerConfig, offer_to, plan, schedule, schedule_queue
from service.models import JobRecord, JobSpec, JobState, KeptCopies, MemberStatus, NodeRecord, NodeState
from worker.protocol import MemorySnapshot

S = JobState
NOW = 1000.0
CFG = SchedulerConfig(memory_hold_s=120)


def node(name: str, state: NodeState = NodeState.READY, registered_at: float = 1.0) -> NodeRecord:
    return NodeRecord(name=name, registered_at=registered_at, lease_id=1, state=state)


def nodes(*names: str, draining: tuple[str, ...] = (), registered: dict[str, float] | None = None):
    return {n: node(n, NodeState.DRAINING if n in draining else NodeState.READY,
                    (registered or {}).get(n, 1.0)) for n in names}


def job(state=S.PENDING, members=None, mn=2, mx=2, created=1.0, jid="j1", kept=None) -> JobRecord:
    members = {n: MemberStatus(state=s) for n, s in (members or {}).items()}
    return JobRecord(id=jid, spec=JobSpec(name="j", command=["true"], nodes={"min": mn, "max": mx}),
                     state=state, created_at=created, updated_at=created, members=members,
                     attempt=3, kept=kept)


def copy(n: str, step: int, time: float | None = 900.0) -> MemorySnapshot:
    return MemorySnapshot(node=n, step=step, attempt=3, time=time)


def kept(since=990.0, until=1110.0, **steps: int) -> KeptCopies:
    return KeptCopies(steps=steps, since=since, until=until)


# ------------------------------------------------------------------ what a job keeps

@pytest.mark.parametrize("survivors, copies, registered, hold_s, expect", [
    # each survivor with a report is kept, with its step
    (["a", "b"], [copy("a", 20), copy("b", 19)], {}, 120, {"a": 20, "b": 19}),
    # a survivor that reported nothing (a plain script; no memory tier) holds nothing
    (["a", "b"], [copy("a", 20)], {}, 120, {"a": 20}),
    (["a"], [], {}, 120, None),
    # the lost node's report is not a survivor's
    (["a"], [copy("a", 20), copy("c", 21)], {}, 120, {"a": 20}),
    # a report made before the node's agent registered again: that agent removed the copy
    (["a"], [copy("a", 20, time=900.0)], {"a": 950.0}, 120, None),
    (["a"], [copy("a", 20, time=None)], {"a": 950.0}, 120, {"a": 20}),  # (a record of before `time`)
    # no hold configured: nothing kept
    (["a"], [copy("a", 20)], {}, 0, None),
])
def test_the_survivors_that_reported_a_copy_are_kept_with_their_steps(survivors, copies, registered,
                                                                       hold_s, expect):
    got = keep.kept_for(survivors, copies, nodes("a", "b", registered=registered), NOW, hold_s)
    if expect is None:
        assert got is None
    else:
        assert (got.steps, got.since, got.until) == (expect, NOW, NOW + hold_s)


@pytest.mark.parametrize("j, ns, graced, expect", [
    (job(S.RUNNING, {"a": "running", "b": "running"}), nodes("a"), frozenset(), True),  # lost below min
    (job(S.RUNNING, {"a": "running", "b": "running"}, mn=1), nodes("a"), frozenset(), False),  # above min
    (job(S.RUNNING, {"a": "running", "b": "running"}), nodes("a"), frozenset({"b"}), False),  # graced
    (job(S.RUNNING, {"a": "running", "b": "running"}), nodes("a", "b", draining=("b",)), frozenset(), True),
    (job(S.RUNNING, {"a": "running", "b": "running"}), nodes("a", "b"), frozenset(), False),  # nothing lost
    (job(S.CANCELLING, {"a": "running", "b": "running"}), nodes("a"), frozenset(), False),
    (job(S.PENDING), nodes("a"), frozenset(), False),
])
def test_the_reports_are_read_only_for_a_job_that_may_fall_below_its_min(j, ns, graced, expect):
    assert keep.may_fall_short(j, ns, graced) is expect


def test_a_job_that_loses_a_node_below_min_keeps_the_survivor_that_holds_its_copy():
    j = job(S.RUNNING, {"a": "running", "b": "running"})
    p = plan(j, nodes("a"), [], NOW, CFG, copies=[copy("a", 812), copy("b", 812)])
    assert p.job.state is S.PENDING and p.job.members == {}
    assert p.job.kept == KeptCopies(steps={"a": 812}, since=NOW, until=NOW + 120)
    assert "its memory copy is on a (step 812): kept for it for 120 s" in p.job.reason


def test_a_job_without_memory_reports_keeps_nothing():
    p = plan(job(S.RUNNING, {"a": "running", "b": "running"}), nodes("a"), [], NOW, CFG)
    assert p.job.state is S.PENDING and p.job.kept is None


def test_a_job_that_starts_again_forgets_what_it_kept():
    p = plan(job(kept=kept(a=812)), nodes("a", "c"), ["a", "c"], NOW, CFG)
    assert p.job.state is S.STARTING and sorted(p.job.members) == ["a", "c"] and p.job.kept is None


# ------------------------------------------------------------------ the hold, in a pass

WAITING = job(kept=kept(s=812), created=5.0, jid="waits")  # min == max == 2, s holds its copy
OTHER = job(mn=1, mx=1, created=1.0, jid="other")  # older: first in the queue


def started(plans) -> dict[str, list[str]]:
    return {p.job.id: sorted(p.job.members) for p in plans if p.job.state is S.STARTING}


@pytest.mark.parametrize("pending, free, now, registered, expect", [
    # the survivor is not given to another job while the one it holds a copy of waits
    ([OTHER, WAITING], ("s",), NOW, {}, {}),
    # a node comes: the waiting job takes its survivor first (not the first two by name)
    ([WAITING], ("a", "b", "s"), NOW, {}, {"waits": ["a", "s"]}),
    ([OTHER, WAITING], ("a", "b", "s"), NOW, {}, {"waits": ["a", "s"], "other": ["b"]}),
    # one node comes: it completes the waiting job first, not the older job ahead of it
    ([OTHER, WAITING], ("a", "s"), NOW, {}, {"waits": ["a", "s"]}),
    # the hold has ended: the node is free like any other (still first for the job, while free)
    ([OTHER, WAITING], ("s",), 1110.0, {}, {"other": ["s"]}),
    ([WAITING], ("a", "b", "s"), 1110.0, {}, {"waits": ["a", "s"]}),
    # the node's agent registered again since: it holds no copy, and is not held
    ([OTHER, WAITING], ("s",), NOW, {"s": 995.0}, {"other": ["s"]}),
])
def test_a_waiting_jobs_kept_node_goes_to_it_first_and_to_no_other_job_while_the_hold_runs(
        pending, free, now, registered, expect):
    ns = nodes(*free, registered=registered)
    plans = schedule_queue(iter(pending), [], ns, now, CFG, claims=keep.claims(pending))
    assert started(plans) == expect
    assert started(schedule(pending, ns, now, CFG)) == expect  # the same over the whole list


def test_a_running_job_below_its_max_is_not_scaled_up_onto_a_held_node():
    running = job(S.RUNNING, {"x": "running"}, mn=1, mx=2, jid="run")
    assert schedule([running, WAITING], nodes("x", "s"), NOW, CFG) == []
    # The hold ended: the node is free like any other, so the waiting job, first in the queue,
    # keeps it from a job that could hold it past its start (`decide.backfill`), not from one
    # that ends before it could start anyway.
    assert schedule([running, WAITING], nodes("x", "s"), 1110.0, CFG) == []
    bounded = running.model_copy(update={"spec": running.spec.model_copy(update={"max_duration_s": 60.0}),
                                         "started_at": 1100.0})
    grown = schedule([bounded, WAITING], nodes("x", "s"), 1110.0, CFG)
    assert [sorted(p.job.members) for p in grown] == [["s", "x"]]


def test_a_pass_does_not_read_the_queue_when_the_only_free_nodes_are_held():
    read: list[str] = []

    def pending():
        for j in [WAITING, *(job(mn=1, mx=1, created=10.0 + i, jid=f"p{i}") for i in range(100))]:
            read.append(j.id)
            yield j

    assert schedule_queue(pending(), [], nodes("s"), NOW, CFG, claims={"s": WAITING}) == []
    assert read == []


def test_the_jobs_that_free_nodes_are_held_for_come_first_oldest_hold_first():
    a = job(kept=kept(since=950.0, a=10), jid="a-job")
    b = job(kept=kept(since=900.0, b=20), jid="b-job")
    claims = {"a": a, "b": b}
    assert [j.id for j in keep.holding({"a": "a-job", "b": "b-job"}, claims)] == ["b-job", "a-job"]
    assert [j.id for j in keep.holding({"a": "a-job"}, claims)] == ["a-job"]  # b's node not free
    assert keep.holding({}, claims) == []


def test_a_node_is_held_for_the_job_whose_copy_it_kept_last():
    older = job(kept=kept(since=900.0, until=1500.0, a=100), jid="older")
    newer = job(kept=kept(since=950.0, until=1500.0, a=300), jid="newer", created=2.0)
    assert keep.claims([older, newer]) == {"a": newer}
    assert keep.claims([newer, older]) == {"a": newer}
    assert keep.reserved({"a", "b"}, keep.claims([older, newer]), nodes("a", "b"), NOW) == {"a": "newer"}


def test_a_re_decision_is_offered_its_own_held_nodes_first_and_none_held_for_another():
    held = {"s": "waits", "b": "elsewhere"}
    assert offer_to(WAITING, ["b", "c", "s"], held) == ["s", "c"]
    assert offer_to(OTHER, ["b", "c", "s"], held) == ["c"]
    two = job(kept=kept(a=10, c=30))
    assert keep.prefer(two, ["a", "b", "c"]) == ["c", "a", "b"]  # newest copy first
