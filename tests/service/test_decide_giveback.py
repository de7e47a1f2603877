"""Fair-share give-back as pure decisions: an elastic job above its `min` gives nodes back to a
starved user of its own priority (a planned shrink, as preemption's), never below `min`,
never turning the shares round, never from a job that just started."""

from __future__ import annotations

import pytest

from service.decide import giveback, quotas
from service.decide.scheduling import SchedulerConfig, plan, schedule_queue
from service.models import (
    ControlAction,
    JobRecord,
    JobSpec,
    JobState,
    MemberStatus,
    RestartCounts,
)
from tests.service.test_decide_preempt import CFG, NOW, nodes

S = JobState
LONG_AGO = NOW - giveback.SETTLE_S - 1


def job(jid: str, owner: str, members=(), mn=1, mx=3, prio=0, created=1.0, started=LONG_AGO) -> JobRecord:
    spec = JobSpec(name=jid, command=["true"], nodes={"min": mn, "max": mx}, priority=prio)
    return JobRecord(id=jid, owner=owner, spec=spec,
                     state=S.RUNNING if members else S.PENDING, created_at=created, updated_at=created,
                     attempt=1 if members else 0, started_at=started if members else None,
                     members={n: MemberStatus(state="running") for n in members},
                     reports_progress=bool(members))


def marks(plans) -> dict[str, tuple[list[str], bool]]:
    return {p.job.id: (p.job.preempt.leave, p.job.preempt.fair_share) for p in plans if p.job.preempt}


ANN = job("ann-sweep", "ann", ["a", "b", "c"])
BOB = job("bob-job", "bob", created=5.0)


def test_a_starved_users_job_takes_a_node_from_an_elastic_job_of_its_priority():
    plans = schedule_queue([BOB], [ANN], nodes("a", "b", "c"), NOW, CFG)
    assert marks(plans) == {"ann-sweep": (["a"], True)}
    by_id = {p.job.id: p for p in plans}
    assert by_id["ann-sweep"].events[0].reason == ("giving node(s) a back to user bob (fair share: it holds "
                                                   "no node), for job bob-job (priority 0)")
    assert by_id["bob-job"].reason == ("by fair share (its user holds no node), from job ann-sweep "
                                       "(priority 0): taking node(s) a")
    victim = by_id["ann-sweep"].job
    assert victim.control is not None and victim.control.action is ControlAction.CHECKPOINT_PAUSE


@pytest.mark.parametrize("why, waiting, running, cfg", [
    ("at its min", BOB, [job("ann-sweep", "ann", ["a", "b", "c"], mn=3)], CFG),
    ("a higher priority than the starved job's", BOB,
     [job("ann-sweep", "ann", ["a", "b", "c"], prio=1)], CFG),
    ("the starved user holds a node", BOB, [ANN, job("bob-other", "bob", ["d"], mx=1)], CFG),
    ("it started just now", BOB, [job("ann-sweep", "ann", ["a", "b", "c"], started=NOW - 5)], CFG),
    ("the shares would turn round", job("bob-job", "bob", mn=2, mx=2, created=5.0),
     [job("ann-sweep", "ann", ["a", "b", "c"])], CFG),  # ann would keep 1 node, bob hold 2
    ("its own user's job", job("ann-job", "ann", created=5.0), [ANN], CFG),
    ("the fifo policy", BOB, [ANN], SchedulerConfig(fifo=True)),
])
def test_nothing_is_given_back(why, waiting, running, cfg):
    names = sorted({n for j in running for n in j.members})
    assert marks(schedule_queue([waiting], running, nodes(*names), NOW, cfg)) == {}, why


def test_users_are_the_sides_of_the_shares_whatever_their_teams():
    # bob's teammate ann holds 2 nodes, carol (another team) 3: bob, holding none, starts on 1 of
    # carol's (as users: 1 against 2); the team that then holds 3 against 2 does not stop it
    carol = job("carol-sweep", "carol", ["a", "b", "c"])
    tenants = quotas.Tenants(team_of={"ann": "ml", "bob": "ml", "carol": "nlp"})
    ann_two = job("ann-2", "ann", ["d", "e"], mn=2, mx=2)
    assert marks(schedule_queue([BOB], [carol, ann_two], nodes(*"abcde"), NOW, CFG, tenants=tenants)) \
        == {"carol-sweep": (["a"], True)}


def test_a_user_starved_by_a_teammate_gets_a_node_back_from_the_teammates_job():
    tenants = quotas.Tenants(team_of={"ann": "ml", "bob": "ml"})
    assert marks(schedule_queue([BOB], [ANN], nodes("a", "b", "c"), NOW, CFG, tenants=tenants)) \
        == {"ann-sweep": (["a"], True)}
    # and not so far that the teammates swap places: bob's 2-node job would leave ann 1
    bob_two = job("bob-job", "bob", mn=2, mx=2, created=5.0)
    assert marks(schedule_queue([bob_two], [ANN], nodes("a", "b", "c"), NOW, CFG, tenants=tenants)) == {}


def test_a_lower_priority_job_is_preempted_first_not_given_back():
    low = job("low", "carol", ["d"], mn=1, mx=1, prio=-1)
    plans = schedule_queue([BOB], [ANN, low], nodes("a", "b", "c", "d"), NOW, CFG)
    assert marks(plans) == {"low": (["d"], False)}


def test_the_job_that_gave_shrinks_at_a_step_boundary_and_counts_a_resize():
    plans = schedule_queue([BOB], [ANN], nodes("a", "b", "c"), NOW, CFG)
    marked = next(p.job for p in plans if p.job.id == "ann-sweep")
    acked = marked.model_copy(update={"control_acked": marked.control.id})  # rank 0 snapshotted
    p = plan(acked, nodes("a", "b", "c"), [], NOW + 1, CFG)
    assert sorted(p.job.members) == ["b", "c"] and p.job.preempt is None and p.job.state is S.RUNNING
    assert p.job.restarts_by_cause == RestartCounts(resize=1)


def test_the_job_given_nodes_is_not_shrunk_back_for_the_next_starved_user():
    # bob's job started with the node ann gave back and grew since; carol, starved, may not take it yet
    bob_now = job("bob-job", "bob", ["a", "d"], started=NOW - 10)
    ann_now = job("ann-sweep", "ann", ["b", "c"], mn=2)
    carol = job("carol-job", "carol", created=9.0)
    assert marks(schedule_queue([carol], [ann_now, bob_now], nodes("a", "b", "c", "d"), NOW, CFG)) == {}
    later = NOW + giveback.SETTLE_S
    assert marks(schedule_queue([carol], [ann_now, bob_now], nodes("a", "b", "c", "d"), later, CFG)) \
        == {"bob-job": (["a"], True)}


def test_one_pass_gives_back_to_a_starved_user_behind_others_in_the_queue_with_no_node_free():
    ann_waiting = [job(f"ann-{i}", "ann", created=2.0 + i) for i in range(5)]
    plans = schedule_queue([*ann_waiting, BOB], [ANN], nodes("a", "b", "c"), NOW, CFG,
                           waiting_owners={"ann", "bob"})
    assert marks(plans) == {"ann-sweep": (["a"], True)}


def test_the_job_index_keeps_the_users_with_waiting_jobs():
    from service.job_index import JobIndex
    index = JobIndex(None, None)  # type: ignore[arg-type]  (applying records touches no store)
    for j in (BOB, job("bob-2", "bob", created=6.0), ANN):
        index._apply(j, j.id)
    assert index.waiting_owners() == ["bob"]
    index._apply(BOB.model_copy(update={"state": S.CANCELLED}), BOB.id)
    assert index.waiting_owners() == ["bob"]  # its other job still waits
    index._apply(None, "bob-2")
    assert index.waiting_owners() == []
