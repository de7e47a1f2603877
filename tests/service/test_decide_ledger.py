"""Fair share over time (`decide.ledger`): the node-seconds each user's jobs have held at each
priority, decayed, with no use banked while a user had nothing to run; and the queue that
orders by them, pass after pass, evening out node-seconds where ordering by nodes held now did
not. Pure logic with a clock the test moves."""

from __future__ import annotations

import pytest

from service.decide import quotas
from service.decide.ledger import Ledger
from service.decide.order import queue_key
from service.decide.quotas import Tenants
from service.decide.scheduling import SchedulerConfig, schedule_queue
from service.job_index import JobIndex
from service.models import JobState
from tests.service.test_decide_shares import job, nodes

S = JobState
FOREVER = 1e12  # a half-life past any test's clock: no decay


def test_node_seconds_are_what_each_user_held_for_how_long():
    book = Ledger(FOREVER)
    book.change(None, job("a", "ann", 0), 0.0)
    book.change(job("a", "ann", 0), job("a", "ann", 0, S.RUNNING, ["n1", "n2"], mx=2), 10.0)
    book.change(job("a", "ann", 0, S.RUNNING, ["n1", "n2"], mx=2), job("a", "ann", 0, S.RUNNING, ["n1"], mx=2), 20.0)
    book.change(job("a", "ann", 0, S.RUNNING, ["n1"], mx=2), job("a", "ann", 0, S.SUCCEEDED, ["n1"], mx=2), 25.0)
    assert book.used(100.0) == {("ann", 0): pytest.approx(2 * 10 + 1 * 5)}  # nothing while it waited or after


def test_use_is_counted_apart_at_each_priority():
    book = Ledger(FOREVER)
    book.change(None, job("u", "ann", 0, S.RUNNING, ["n1"], priority=10), 0.0)
    book.change(None, job("o", "ann", 0, S.RUNNING, ["n2", "n3"], mx=2), 0.0)
    assert book.used(10.0) == {("ann", 10): pytest.approx(10.0), ("ann", 0): pytest.approx(20.0)}


def test_old_use_counts_half_after_a_half_life():
    book = Ledger(half_life_s=60.0)
    running = job("a", "ann", 0, S.RUNNING, ["n1"])
    book.change(None, running, 0.0)
    book.change(running, job("a", "ann", 0, S.SUCCEEDED, ["n1"]), 1.0)  # one node-second, at once
    book.change(None, job("b", "ann", 2), 1.0)  # (something open: the use is not forgotten)
    assert book.used(61.0)[("ann", 0)] == pytest.approx(0.5, rel=1e-3)


def test_a_user_that_comes_back_starts_from_the_least_use_of_those_that_stayed():
    book = Ledger(FOREVER)
    ann = job("a", "ann", 0, S.RUNNING, ["n1", "n2"], mx=2)
    book.change(None, ann, 0.0)
    book.change(None, job("b", "bob", 0, S.RUNNING, ["n3"]), 0.0)
    book.change(None, job("c", "cy", 50.0), 50.0)  # cy had nothing to run until now
    used = book.used(50.0)
    assert used[("cy", 0)] == pytest.approx(used[("bob", 0)]) == pytest.approx(50.0)  # not 0: nothing banked
    # a job of ann's that goes on changing (it never left the unfinished) raises nothing
    book.change(ann, job("a", "ann", 0, S.RUNNING, ["n1"], mx=2), 60.0)
    assert book.used(60.0)[("ann", 0)] == pytest.approx(120.0)


def test_a_reload_recounts_what_is_held_and_keeps_the_use():
    book = Ledger(FOREVER)
    book.change(None, job("a", "ann", 0, S.RUNNING, ["n1"]), 0.0)
    book.change(None, job("b", "bob", 0), 0.0)
    book.recount([job("b", "bob", 0, S.RUNNING, ["n2", "n3"], mx=2)], 10.0)  # ann's job ended meanwhile
    assert book.used(20.0) == {("ann", 0): pytest.approx(10.0), ("bob", 0): pytest.approx(20.0)}
    assert book.held() == {("bob", 0): 2}


def test_the_job_index_keeps_the_ledger_and_gives_it_to_the_shares():
    clock = [0.0]
    index = JobIndex(None, None, clock=lambda: clock[0])  # type: ignore[arg-type]  (touches no store)
    index._apply(job("a", "ann", 0, S.RUNNING, ["n1", "n2"], mx=2), "a", 1)
    clock[0] = 30.0
    shares = index.shares(Tenants())
    assert shares.past == {("ann", 0): pytest.approx(60.0)}
    assert shares.held_at == {("ann", 0): 2} and shares.user_nodes == {"ann": 2}


def _simulate(with_ledger: bool, seconds: float = 600.0) -> dict[str, float]:
    """Three users, two of them in one team, each with more two-node jobs of 10 s than four
    nodes can run: node-seconds each user's jobs held, the scheduler ordering the queue with
    the ledger (or by nodes held now alone)."""
    cluster = nodes("n1", "n2", "n3", "n4")
    tenants = Tenants(team_of={"ann": "ml", "bob": "ml"})
    book = Ledger(FOREVER)
    jobs = {j.id: j for i in range(60) for k, owner in enumerate(("ann", "bob", "cy"))
            for j in [job(f"{owner}{i}", owner, float(i * 3 + k), mn=2, mx=2)]}
    for j in jobs.values():
        book.change(None, j, 0.0)
    ends: dict[str, float] = {}
    now, had = 0.0, {"ann": 0.0, "bob": 0.0, "cy": 0.0}
    while now < seconds:
        unfinished = [j for j in jobs.values() if not j.state.is_terminal()]
        used = quotas.usage([j for j in unfinished if j.state is not S.PENDING], cluster, tenants)
        used.past = book.used(now) if with_ledger else {}
        pending = sorted((j for j in unfinished if j.state is S.PENDING), key=queue_key)
        others = sorted((j for j in unfinished if j.state is not S.PENDING), key=lambda j: j.created_at)
        for p in schedule_queue(pending, others, cluster, now, SchedulerConfig(), shares=used):
            if p.job.state is S.STARTING:
                ends[p.job.id] = now + 10.0
                started = p.job.model_copy(update={"state": S.RUNNING})
                book.change(jobs[p.job.id], started, now)
                jobs[p.job.id] = started
        now = min(ends.values())
        for jid in [jid for jid, t in ends.items() if t <= now]:
            done = jobs[jid].model_copy(update={"state": S.SUCCEEDED})
            book.change(jobs[jid], done, now)
            jobs[jid] = done
            had[done.owner] += 2 * 10.0
            del ends[jid]
    return had


def jain(xs) -> float:
    xs = list(xs)
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


def test_users_get_alike_node_seconds_whatever_their_teams():
    had = _simulate(with_ledger=True)
    assert jain(had.values()) >= 0.99, had
    # Ordered by nodes held now alone, the user alone in a team won every tie on its team's
    # count (a teammate always held the other job's nodes) and got twice what each other did.
    before = _simulate(with_ledger=False)
    assert before["cy"] >= 1.8 * before["ann"] and jain(before.values()) < 0.9, before
