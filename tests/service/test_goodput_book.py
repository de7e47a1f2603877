"""The cluster's goodput totals (`service.goodput`) on the in-memory KeyValue with a manual clock:
what /metrics publishes, that a job deleted by retention stays counted (once), and the nodes'
seconds by state."""

from __future__ import annotations

import pytest

from service.goodput import GoodputBook, RetiredGoodput, node_cause
from service.models import JobState, NodeRecord, NodeState
from tests.service.test_retention import RETENTION_S, Cluster, run


def test_a_job_deleted_by_retention_stays_in_the_totals_once():
    async def test(c: Cluster):
        book = GoodputBook(c.ctx.jobs)
        old = await c.job("old", finish=False)
        c.clock.now += 20  # 20 s waiting for nodes
        await c.ctx.jobs.move(old, JobState.CANCELLED, "cancelled by the test")
        recent = await c.job("recent", finish=False)
        c.clock.now += RETENTION_S  # 100 s more for the recent one, still PENDING
        await c.index_caught_up()
        await book.refresh(c.ctx.index.jobs())
        before = book.totals(c.clock.now)
        assert before["waiting"] == pytest.approx(20 + RETENTION_S)

        assert await c.prune() == [old]
        await book.refresh(c.ctx.index.jobs())
        assert book.retired == RetiredGoodput(jobs=1, seconds=book.retired.seconds)
        assert book.retired.seconds["waiting"] == pytest.approx(20)
        assert book.totals(c.clock.now) == pytest.approx(before)

        # The recent one ends and goes too: each counted once, whatever the passes.
        await c.ctx.jobs.move(recent, JobState.CANCELLED, "cancelled by the test")
        c.clock.now += 10 * RETENTION_S
        assert await c.prune() == [recent]
        assert await c.prune() == []
        await book.refresh(c.ctx.index.jobs())
        assert book.retired.jobs == 2
        assert book.totals(c.clock.now)["waiting"] == pytest.approx(20 + RETENTION_S)

    run(test)


def test_a_job_s_events_are_read_again_only_when_they_change():
    async def test(c: Cluster):
        book = GoodputBook(c.ctx.jobs)
        job = await c.job("j", finish=False)
        await c.index_caught_up()
        reads = []
        scan = c.kv.scan_prefix

        def counting(prefix, **kw):
            reads.append(prefix)
            return scan(prefix, **kw)

        c.kv.scan_prefix = counting
        await book.refresh(c.ctx.index.jobs())
        await book.refresh(c.ctx.index.jobs())
        assert [p for p in reads if "/events/" in p] == [c.ctx.keys.events(job)]
        await c.ctx.jobs.move(job, JobState.CANCELLED, "cancelled by the test")
        await c.index_caught_up()
        await book.refresh(c.ctx.index.jobs())
        await book.refresh(c.ctx.index.jobs())  # finished: its ledger is final, never read again
        assert len([p for p in reads if "/events/" in p]) == 2

    run(test)


def node(state: NodeState = NodeState.READY) -> NodeRecord:
    return NodeRecord(name="a", state=state, registered_at=0.0, lease_id=1)


def test_a_node_is_busy_in_a_job_idle_without_and_draining_by_its_state():
    job = object()
    assert node_cause(node(), job) == "busy"
    assert node_cause(node(), None) == "idle"
    assert node_cause(node(NodeState.DRAINING), job) == "draining"
    assert node_cause(node(NodeState.DRAINING), None) == "drained"


def test_each_node_s_time_goes_to_the_state_it_had_at_the_last_sample():
    book = GoodputBook(jobs=None)
    book.sample_nodes({"a": "idle", "b": "busy"}, now=100.0)
    assert book.node_seconds == {("a", "idle"): 0.0, ("b", "busy"): 0.0}
    book.sample_nodes({"a": "busy", "b": "busy"}, now=110.0)
    book.sample_nodes({"a": "busy"}, now=115.0)  # b is gone: its series go with it
    assert book.node_seconds == {("a", "idle"): 10.0, ("a", "busy"): 5.0}
