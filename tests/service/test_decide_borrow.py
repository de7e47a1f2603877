"""Borrowing kept nodes as pure decisions: a job on the ftrain runtime of the head's priority
starts on (or grows onto) the free nodes kept for the queue's head, marked borrower; the head
takes them back the way a preemption does once it could start with them; who may take back
from a borrower, and when the mark goes."""

from __future__ import annotations

import pytest

from service.decide import preempt
from service.decide.scheduling import schedule, schedule_queue
from service.models import Borrow, JobRecord, JobState, MemberStatus
from tests.service.test_decide_preempt import CFG, NOW, job, nodes

S = JobState
FOUR = ("a", "b", "c", "d")


def busy() -> list[JobRecord]:
    """Three running jobs of priority 0, one node each (a, b, c): only d is free."""
    return [job(f"r{i}", 0, [n], mn=1, mx=1, created=0.1 * i) for i, n in enumerate("abc", 1)]


def head() -> JobRecord:
    return job("head", 0, mn=2, mx=2, created=1.0)


def pending_runtime(jid: str, prio: int = 0, created: float = 2.0, **kw) -> JobRecord:
    """A waiting job that has reported progress through the runtime (it ran before)."""
    return job(jid, prio, mn=1, mx=1, created=created, **kw).model_copy(update={"reports_progress": True})


def borrower(jid: str = "borrower", prio: int = 0, members=("d",), lent=("d",), for_head: str = "head",
             mn: int = 1, created: float = 2.0) -> JobRecord:
    """A running runtime job that borrowed `lent` in front of `for_head`."""
    return job(jid, prio, list(members), mn=mn, mx=len(members), created=created).model_copy(
        update={"borrowed": Borrow(head=for_head, priority=prio, nodes=list(lent), since=NOW - 60,
                                   head_created_at=1.0)})  # (`head()`'s)


def by_id(plans) -> dict[str, JobRecord]:
    return {p.job.id: p.job for p in plans}


def apply(jobs: list[JobRecord], plans) -> list[JobRecord]:
    changed = by_id(plans)
    return [changed.get(j.id, j) for j in jobs]


@pytest.mark.parametrize("kind, starts", [("runtime", True), ("never run", True), ("plain script", False)])
def test_a_runtime_job_or_one_never_run_borrows_the_free_node_a_known_plain_script_does_not(kind, starts):
    waiter = (pending_runtime("small") if kind == "runtime" else
              job("small", 0, mn=1, mx=1, created=2.0).model_copy(update={"attempt": 1 if kind == "plain script" else 0}))
    plans = by_id(schedule_queue([head(), waiter], busy(), nodes(*FOUR), NOW, CFG))
    if not starts:
        assert plans == {}
        return
    small = plans["small"]
    assert small.state is S.STARTING and sorted(small.members) == ["d"]
    assert small.borrowed == Borrow(head="head", priority=0, nodes=["d"], since=NOW, head_created_at=1.0)
    assert "head" not in plans


def test_the_borrowers_start_event_says_it_borrowed_the_node_and_gives_it_back():
    plans = schedule_queue([head(), pending_runtime("small")], busy(), nodes(*FOUR), NOW, CFG)
    events = [e.reason for p in plans for e in p.events]
    assert any("borrowed node(s) d, kept for job head (priority 0)" in e and "gives them back" in e
               for e in events), events


def test_a_running_job_does_not_grow_onto_a_kept_node():
    """Only a waiting job borrows: a running job growing onto kept nodes took back, at every
    pass, the node fair share had just given a starved job of its priority (1,369 resizes of one
    job in the multi-team benchmark)."""
    grower = job("grower", 0, ["c"], mn=1, mx=2, created=2.0).model_copy(update={"reports_progress": True})
    for at in (NOW, NOW + 1):  # (a scale-up asks rank 0 for a snapshot first: acknowledged here)
        plans = by_id(schedule_queue([head()], [*busy()[:2], grower], nodes(*FOUR), at, CFG))
        if "grower" in plans:
            grower = plans["grower"]
            if grower.control is not None:
                grower = grower.model_copy(update={"control_acked": grower.control.id})
        assert "d" not in grower.members and grower.borrowed is None


def test_a_plain_scripts_waiting_reason_says_the_runtime_would_borrow():
    from service.decide.lineup import Cluster, lineup
    from service.decide.quotas import Tenants, usage
    plain = job("plain", 0, mn=1, mx=1, created=2.0).model_copy(update={"attempt": 1})  # it ran: known plain
    runner = pending_runtime("runner", created=3.0)
    jobs = [*busy(), head(), plain, runner]
    holders = {n: j for j in busy() for n in j.members}
    ns = nodes(*FOUR)
    queued = {q.job.id: q for q in lineup(Cluster(jobs, ns, holders, usage(busy(), ns, Tenants()), NOW))}
    assert "kept for job head" in queued["plain"].waiting and "borrows them" in queued["plain"].waiting
    assert "kept for job head" not in queued["runner"].waiting  # (it would borrow them: it starts)


def test_a_node_that_frees_lets_the_head_take_the_borrowed_node_back_and_start():
    """The head waits for 2 nodes, a runtime job borrowed the free one; a busy node frees: the
    borrower is suspended (0 steps lost: rank 0 snapshots first), the head starts on both, the
    borrower waits and resumes once another node frees."""
    ns = nodes(*FOUR)
    jobs = [*busy()[1:], head(), borrower()]  # r1 ended: a is free
    plans = schedule(jobs, ns, NOW, CFG)
    marked = by_id(plans)["borrower"]
    assert marked.preempt is not None and marked.preempt.by == "head" and marked.preempt.suspend
    assert "job head (priority 0) takes them" in marked.reason and "borrowed" in marked.reason
    assert "head" not in by_id(plans) or by_id(plans)["head"].state is S.PENDING  # waits for d to come back
    jobs = apply(jobs, plans)
    # the borrower's rank 0 is asked for a snapshot at its step boundary; then it acks
    jobs = apply(jobs, schedule(jobs, ns, NOW + 1, CFG))
    b = next(j for j in jobs if j.id == "borrower")
    assert b.control is not None and b.state is S.RUNNING
    jobs = [j.model_copy(update={"control_acked": j.control.id}) if j.id == "borrower" else j for j in jobs]
    jobs = apply(jobs, schedule(jobs, ns, NOW + 2, CFG))
    b = next(j for j in jobs if j.id == "borrower")
    assert b.state is S.PENDING and b.borrowed is None and b.preempt is None
    assert b.restarts_by_cause.preemption == 1 and b.restarts == 0
    assert "gave its nodes back (it borrowed them) to job head" in b.reason
    jobs = apply(jobs, schedule(jobs, ns, NOW + 3, CFG))
    h = next(j for j in jobs if j.id == "head")
    assert h.state is S.STARTING and sorted(h.members) == ["a", "d"]
    assert next(j for j in jobs if j.id == "borrower").state is S.PENDING
    # r2 ends: the borrower resumes on its node, an ordinary job now (no one waits ahead of it)
    jobs = [j for j in jobs if j.id != "r2"]
    resumed = by_id(schedule(jobs, ns, NOW + 4, CFG))["borrower"]
    assert resumed.state is S.STARTING and sorted(resumed.members) == ["b"] and resumed.borrowed is None


def test_a_borrower_above_its_min_gives_back_only_the_borrowed_node():
    grown = borrower(members=("c", "d"), lent=("d",))
    plans = by_id(schedule([busy()[1], head(), grown], nodes(*FOUR), NOW, CFG))  # a frees
    p = plans["grown" if "grown" in plans else "borrower"].preempt
    assert p is not None and p.leave == ["d"] and not p.suspend


def test_the_head_takes_nothing_back_while_that_would_not_start_it():
    plans = by_id(schedule_queue([head()], [*busy(), borrower()], nodes(*FOUR), NOW, CFG))
    assert "borrower" not in plans  # (all four held: the borrowed node alone is one of the two it needs)


def test_a_job_of_the_heads_priority_that_did_not_borrow_is_never_taken_from():
    ordinary = job("ordinary", 0, ["d"], mn=1, mx=1, created=2.0)  # started as an ordinary job
    plans = by_id(schedule([*busy()[1:], head(), ordinary], nodes(*FOUR), NOW, CFG))
    assert "ordinary" not in plans and plans.get("head") is None


@pytest.mark.parametrize("waiter, takes", [
    (job("head", 5, mn=1, mx=1, created=1.0), True),  # the job it borrowed in front of
    (job("older", 5, mn=1, mx=1, created=0.5), True),  # a job of its priority ahead of that one in the queue
    # behind that one, ahead of the borrower: it could not take the node free, nor takes it back
    (job("between", 5, mn=1, mx=1, created=1.5), False),
    (job("newer", 5, mn=1, mx=1, created=9.0), False),  # behind it
    (job("lower", 0, mn=1, mx=1, created=0.1), False),  # a lower priority: never
])
def test_who_may_take_back_from_a_borrower(waiter, takes):
    b = borrower(prio=5, created=2.0)
    victims = preempt.Victims([b], NOW, below=waiter.spec.priority)
    chosen = victims.choose(waiter, 1, nodes(*FOUR))
    assert [t.victim.id for t in chosen] == (["borrower"] if takes else [])


def test_a_borrower_is_never_taken_by_a_lower_priority_job():
    low = job("low", 0, mn=2, mx=2, created=0.1)
    # (the head it borrowed in front of cannot be started by what it could take: it takes nothing)
    jobs = [busy()[1], job("high-head", 5, mn=4, mx=4, created=1.0), low,
            borrower(prio=5, for_head="high-head", members=("d",), lent=("d",)),
            job("r3", 5, ["c"], mn=1, mx=1, created=0.3)]
    plans = by_id(schedule(jobs, nodes(*FOUR), NOW, CFG))  # a is free; low needs 2
    assert "borrower" not in plans


def test_lower_priority_victims_are_taken_before_borrowers():
    low = job("low", -1, ["b"], mn=1, mx=1, created=0.2)
    plans = by_id(schedule([job("r1", 0, ["a"], mn=1, mx=1), low, head(), borrower()],
                           nodes(*FOUR), NOW, CFG))  # c is free: the head needs one more
    assert plans["low"].preempt is not None and plans["low"].preempt.by == "head"
    assert "borrower" not in plans


def test_the_mark_goes_once_the_head_starts_without_the_borrowed_node():
    started = job("head", 0, ["a", "b"], mn=2, mx=2, created=1.0, state=S.STARTING)
    plans = by_id(schedule([started, job("r3", 0, ["c"], mn=1, mx=1), borrower()], nodes(*FOUR), NOW, CFG))
    b = plans["borrower"]
    assert b.borrowed is None and b.preempt is None and sorted(b.members) == ["d"]


def test_a_borrower_that_goes_back_to_pending_for_a_lost_node_is_no_longer_a_borrower():
    b = borrower()
    b = b.model_copy(update={"members": {"d": MemberStatus(state="running")}})
    plans = by_id(schedule([*busy(), head(), b], nodes("a", "b", "c"), NOW, CFG))  # d is lost
    assert plans["borrower"].state is S.PENDING and plans["borrower"].borrowed is None


def test_a_plan_made_again_on_a_re_read_record_marks_the_borrower_too():
    from service.decide.scheduling import lent, plan
    first = next(p for p in schedule_queue([head(), pending_runtime("small")], busy(), nodes(*FOUR), NOW, CFG)
                 if p.job.id == "small")
    assert first.loan is not None and list(first.offered) == ["d"]
    reread = pending_runtime("small").model_copy(update={"event_seq": 7})  # (its write lost a race)
    again = lent(plan(reread, nodes(*FOUR), list(first.offered), NOW + 1, CFG), reread, first.loan, NOW + 1)
    assert again.job.state is S.STARTING and again.job.borrowed is not None
    assert again.job.borrowed.nodes == ["d"] and again.job.borrowed.head == "head"


def test_the_heads_waiting_reason_names_the_borrower_in_front_of_it():
    from service.decide.waiting import why_waiting
    held = [*busy(), borrower()]
    why = why_waiting(head(), nodes(*FOUR), {n: j for j in held for n in j.members})
    assert "job borrower (RUNNING, borrowed in front of this job: d)" in why
