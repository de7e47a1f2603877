"""Backfill as pure decisions: which job may start on free nodes while the queue's head waits
for more (lower priority, nodes that do not fit the head, or a `max_duration_s` that ends
before the head could start), when the head could start, and `max_duration_s` enforced."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.decide import backfill
from service.decide.scheduling import SchedulerConfig, free_again, holders, plan, schedule_queue
from service.models import JobRecord, JobSpec, JobState, MemberStatus, NodeRecord

S = JobState
NOW = 1000.0
CFG = SchedulerConfig(control_ack_timeout_s=10, cancel_ack_timeout_s=3)


def nodes(*names: str, gpus: dict[str, int] | None = None) -> dict[str, NodeRecord]:
    return {n: NodeRecord(name=n, registered_at=1.0, lease_id=1, gpus=(gpus or {}).get(n, 0)) for n in names}


def job(jid: str, prio: int = 0, members=(), mn=1, mx=1, created=1.0, limit=None, started=None,
        **spec) -> JobRecord:
    """A job that has run before and reported no progress (a plain script, as far as the
    scheduler knows): it never borrows kept nodes (tests/service/test_decide_borrow.py)."""
    return JobRecord(id=jid, spec=JobSpec(name=jid, command=["true"], nodes={"min": mn, "max": mx},
                                          priority=prio, max_duration_s=limit, **spec),
                     state=S.RUNNING if members else S.PENDING, created_at=created, updated_at=created,
                     attempt=1, started_at=started,
                     members={n: MemberStatus(state="running") for n in members})


# The head: priority 5, needs 3 nodes; "a" and "b" are free, "c" is held by a job of its own
# priority (so it cannot preempt it), which ends by `held_until` (None: it declares no bound).
def head() -> JobRecord:
    return job("head", 5, mn=3, mx=3, created=1.0)


def holder(held_until: float | None) -> JobRecord:
    limit = None if held_until is None else held_until - 900.0
    return job("holder", 5, ["c"], created=0.5, limit=limit, started=900.0)


@pytest.mark.parametrize("waiter, held_until, starts", [
    # a lower priority: the head would take the node back by preemption
    (job("low", 0, created=2.0), None, True),
    # its own priority, no max_duration_s: it could hold the node past the head's start
    (job("same", 5, created=2.0), None, False),
    (job("same", 5, created=2.0), NOW + 100, False),
    # its own priority, ending before the head could start anyway (the holder's end)
    (job("short", 5, created=2.0, limit=50), NOW + 100, True),
    (job("short", 5, created=2.0, limit=100), NOW + 100, True),
    # ... or not
    (job("long", 5, created=2.0, limit=200), NOW + 100, False),
    # the holder may end at any moment (no bound): no duration is short enough
    (job("short", 5, created=2.0, limit=1), None, False),
])
def test_a_job_behind_a_waiting_head_starts_only_if_it_cannot_delay_it(waiter, held_until, starts):
    plans = schedule_queue([head(), waiter], [holder(held_until)], nodes("a", "b", "c"), NOW, CFG)
    started = {p.job.id for p in plans if p.job.state is S.STARTING}
    assert started == ({waiter.id} if starts else set())


def test_a_suspended_job_resuming_counts_its_duration_from_now_not_its_last_start():
    resumed = job("resumed", 5, created=2.0, limit=50, started=10.0)  # its last run began long ago
    plans = schedule_queue([head(), resumed], [holder(NOW + 40)], nodes("a", "b", "c"), NOW, CFG)
    assert [p.job.id for p in plans] == []


def test_a_job_on_nodes_that_do_not_fit_the_head_starts():
    gpu_head = job("head", 5, mn=3, mx=3, gpus_per_node=1)
    gpu_holder = job("holder", 5, ["c"], created=0.5)
    free = nodes("a", "b", "c", "cpu", gpus={"a": 1, "b": 1, "c": 1})
    plans = schedule_queue([gpu_head, job("same", 5, created=2.0)], [gpu_holder], free, NOW, CFG)
    assert [(p.job.id, sorted(p.job.members)) for p in plans] == [("same", ["cpu"])]


@pytest.mark.parametrize("why", ["fifo", "quota", "never fits"])
def test_a_head_that_nodes_would_not_start_holds_nothing_back(why):
    from service.decide.quotas import Quota, Tenants
    cfg, tenants, big = CFG, None, head()
    if why == "fifo":
        cfg = SchedulerConfig(control_ack_timeout_s=10, cancel_ack_timeout_s=3, fifo=True)
    elif why == "quota":
        tenants = Tenants(users={"admin": Quota(max_nodes=2)})  # the holder's node and one more
    else:
        big = job("head", 5, mn=4, mx=4)  # more than the 3 nodes registered
    plans = schedule_queue([big, job("same", 5, created=2.0)], [holder(None)], nodes("a", "b", "c"), NOW, cfg,
                           tenants=tenants)
    assert [p.job.id for p in plans if p.job.state is S.STARTING] == ["same"]


@pytest.mark.parametrize("grower, grows", [
    (job("same", 5, ["d"], mx=3, created=0.7), False),  # its own priority, no bound
    (job("short", 5, ["d"], mx=3, created=0.7, limit=150, started=900.0), True),  # ends by NOW + 50
    # a higher priority than the head's: it comes first (the head could not take its nodes back)
    (job("higher", 6, ["d"], mx=3, created=0.7), True),
])
def test_a_running_job_grows_onto_nodes_the_head_waits_for_only_if_it_cannot_delay_it(grower, grows):
    plans = schedule_queue([head()], [holder(NOW + 100), grower], nodes("a", "b", "c", "d"), NOW, CFG)
    grown = [p.job for p in plans if p.job.id == grower.id]
    assert (bool(grown) and len(grown[0].members) == 3) is grows


def test_a_plan_made_again_on_a_re_read_record_has_the_first_plans_backfill_limit():
    # The grower may take only the node that does not fit the GPU head; made again on its
    # re-read record (its write lost a race), its plan takes the same (`free_again`).
    gpu_head = job("head", 5, mn=3, mx=3, gpus_per_node=1)
    grower = job("grower", 5, ["d"], mx=3, created=0.7)
    others = [job("holder", 5, ["c"], created=0.5), grower]
    free = nodes("a", "b", "c", "cpu", "d", gpus={"a": 1, "b": 1, "c": 1})
    (p,) = schedule_queue([gpu_head], others, free, NOW, CFG)
    assert (p.job.id, sorted(p.job.members), list(p.offered)) == ("grower", ["cpu", "d"], ["cpu"])
    again = free_again(grower, p.offered, holders(others), free, {}, others, None)
    assert again == ["cpu"] and sorted(plan(grower, free, list(again), NOW, CFG).job.members) == ["cpu", "d"]


@pytest.mark.parametrize("mn, running, start", [
    (2, [], NOW),  # enough free now
    (3, [job("r1", 0, ["c"], limit=300, started=800.0)], 1100.0),  # "c" comes back at its declared end
    (3, [job("r1", 0, ["c"])], NOW),  # no bound: it may end at any moment
    (3, [job("r1", 0, ["c"], limit=300, started=800.0),
         job("r2", 0, ["d"], limit=150, started=900.0)], 1050.0),  # the first back is enough
    (4, [job("r1", 0, ["c"], limit=300, started=800.0),
         job("r2", 0, ["d"], limit=150, started=900.0)], 1100.0),  # both are needed
    (3, [job("r1", 0, ["c"], limit=50, started=800.0)], NOW),  # past its end already
])
def test_planned_start_counts_the_running_jobs_declared_ends(mn, running, start):
    names = ["a", "b", *(n for j in running for n in j.members)]
    head = job("head", 5, mn=mn, mx=mn)
    assert backfill.planned_start(head, ["a", "b"], running, nodes(*names), NOW) == start


def test_planned_start_is_none_when_too_few_nodes_fit_ever():
    head = job("head", 5, mn=4, mx=4)
    assert backfill.planned_start(head, ["a"], [job("r", 0, ["b"])], nodes("a", "b"), NOW) is None


# ------------------------------------------------------------------ max_duration_s

def test_a_job_records_when_it_starts_and_fails_once_it_runs_past_its_max_duration():
    waiting = job("timed", limit=60)
    started = plan(waiting, nodes("a"), ["a"], NOW, CFG).job
    assert started.state is S.STARTING and started.started_at == NOW
    running = started.model_copy(update={"state": S.RUNNING,
                                         "members": {"a": MemberStatus(state="running")}})
    assert plan(running, nodes("a"), [], NOW + 59, CFG) is None
    p = plan(running, nodes("a"), [], NOW + 60, CFG)
    assert p.job.state is S.FAILED and p.job.stopping
    assert "ran past its max_duration_s=60" in p.reason


@pytest.mark.parametrize("value", [0, -5, "long", 365 * 24 * 3600 + 1])
def test_a_bad_max_duration_is_refused_naming_the_field(value):
    with pytest.raises(ValidationError) as err:
        JobSpec(name="j", command=["true"], max_duration_s=value)
    assert err.value.errors()[0]["loc"] == ("max_duration_s",)
