"""Quarantine in the node store (service/nodes.py) on the in-memory KeyValue: failures that
follow a node across jobs quarantine it; a quarantine outlives a registration and ends with
an undrain."""

from __future__ import annotations

import asyncio

from service.decide.scheduling import plan
from service.keys import Keys
from service.models import NodeState
from service.nodes import NodeStore
from service.settings import Settings
from service.store.memory import MemoryStore
from tests.service.test_scheduler import CFG, NOW, S, job, node

KEYS = Keys("/t")


async def store() -> NodeStore:
    nodes = NodeStore(MemoryStore(), KEYS, ttl_s=Settings().node_ttl_s)
    await nodes.register("n1", 1, None, ttl_s=60)
    return nodes


def test_failures_alone_in_two_jobs_quarantine_the_node_until_undrain_across_registrations():
    async def main():
        nodes = await store()
        assert await nodes.note_failure("n1", "job-a", alone=True) is None
        assert (await nodes.get("n1")).state is NodeState.READY  # one job's word: not enough
        assert await nodes.note_failure("n1", "job-b", alone=False) is None  # b failed everywhere
        why = await nodes.note_failure("n1", "job-c", alone=True)
        assert why is not None and "(job-a, job-c)" in why
        record = await nodes.get("n1")
        assert (record.state, record.reason) == (NodeState.QUARANTINED, why)
        await nodes.register("n1", 1, None, ttl_s=60)  # its agent restarted: still quarantined
        record = await nodes.get("n1")
        assert (record.state, record.reason) == (NodeState.QUARANTINED, why)
        await nodes.undrain("n1")
        record = await nodes.get("n1")
        assert (record.state, record.reason) == (NodeState.READY, None)
        # The admin vouched for it: its failures are forgotten, so one more in another job
        # does not quarantine it again at once.
        assert await nodes.note_failure("n1", "job-d", alone=True) is None
        assert (await nodes.get("n1")).state is NodeState.READY

    asyncio.run(main())


def test_a_failing_check_at_registration_quarantines_and_an_agents_leave_keeps_it():
    async def main():
        nodes = await store()
        await nodes.register("n2", 1, None, ttl_s=60, quarantine="health check failed: own: `false` exited 1")
        assert (await nodes.get("n2")).state is NodeState.QUARANTINED
        await nodes.leave("n2")  # an agent that stops does not turn it into a plain drain
        assert (await nodes.get("n2")).state is NodeState.QUARANTINED
        await nodes.register("n2", 1, None, ttl_s=60)  # no check failing now: still, until undrain
        assert (await nodes.get("n2")).reason == "health check failed: own: `false` exited 1"

    asyncio.run(main())



def test_a_quarantined_node_gets_no_job_and_its_running_job_goes_on_without_it():
    """The scheduler's decisions (pure): a pending job never takes it; a running job's member
    on it leaves as from a drain, the event saying it was quarantined."""
    sick = {"a": node("a"), "b": node("b", NodeState.QUARANTINED)}
    assert plan(job(mn=2), sick, ["a", "b"], NOW, CFG) is None  # b does not count
    running = job(S.RUNNING, {"a": "running", "b": "running"}, mn=1)
    p = plan(running, sick, [], NOW, CFG)
    assert "b" not in p.job.members and p.job.attempt == running.attempt + 1
    assert p.job.reason == "node(s) b quarantined; the others go on from the last snapshot"
