"""The stores on the in-memory KeyValue: nodes, and a scheduler pass over them (the log
store, on files: tests/service/test_logs.py).

The KeyValue contract (tests/contract/test_kv.py) makes MemoryStore stand in for etcd,
so these run without a process and with a clock the test moves.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest

from service import scheduler
from service.context import Context
from service.decide.change import Change
from service.decide.scheduling import SchedulerConfig
from service.errors import NodeNameTaken, NodeNotFound, OutdatedCredential, StaleLeader, StoreUnavailable
from service.models import JobRecord, JobSpec, JobState, MemberStatus, NodeState
from service.nodes import NodeStore
from service.routes.nodes import list_nodes
from service.settings import Settings
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait, running, until
from worker.protocol import MemoryReport, ProgressReport


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextlib.asynccontextmanager
async def following(ctx: Context) -> AsyncIterator[None]:
    """The context's job index following the store for the block, loaded when it begins."""
    async with running(ctx.index.run()):
        await ctx.index.wait_ready(5)
        yield


def scheduling(ctx: Context, lead: scheduler.Leadership, interval_s: float):
    """The context's job index and a scheduler loop under `lead`, running for the block (its
    passes counted in `ctx.scheduler_passes`)."""
    return running(ctx.index.run(), scheduler.run(ctx.jobs, ctx.nodes, ctx.index, lead, interval_s,
                                                  passes=ctx.scheduler_passes))


def context(clock: ManualClock | None = None, **settings) -> Context:
    clock = clock or ManualClock()
    ctx = Context.wire(Settings(**settings), MemoryStore(clock))
    # The node store keeps leases alive by the clock the leases run on: the one the test moves.
    ctx.nodes = NodeStore(ctx.kv, ctx.keys, clock, ttl_s=ctx.settings.node_ttl_s)
    return ctx


# ------------------------------------------------------------------ jobs

def test_a_node_dropped_from_the_members_by_any_decision_is_kept_as_a_former_member():
    # It may still ship its workers' last lines (service/deps.py, require_member_node).
    async def main():
        ctx = context()
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"], nodes={"min": 1, "max": 2}))
        members = {n: MemberStatus() for n in ("n0", "n1")}
        await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={"members": members})))
        stored = await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(
            update={"members": {"n0": MemberStatus()}})))
        assert stored.former_members == ["n1"]
        assert (await ctx.jobs.get(job.id)).former_members == ["n1"]

    asyncio.run(main())


# ------------------------------------------------------------------ nodes

def test_a_job_keeps_its_first_event_and_only_the_latest_others(monkeypatch):
    """A job that runs for months and restarts often would pile up events in etcd: each new
    event past the cap deletes the oldest but the first (the submission), in the same write."""
    from service import jobs as jobs_module
    from service.decide.state import note

    monkeypatch.setattr(jobs_module, "MAX_EVENTS", 5)

    async def main() -> list[int]:
        ctx = context()
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"], nodes={"min": 1, "max": 1}))
        for i in range(12):
            await ctx.jobs.update(job.id, lambda j, i=i: Change(*_one(note(j, f"restart {i}", 1.0 + i))))
        return [e.seq for e in await ctx.jobs.events(job.id)]

    seqs = asyncio.run(main())
    assert seqs == [1, 10, 11, 12, 13]  # 13 events made: the first, and the 4 latest


def _one(made):
    job, event = made
    return job, [event]


def test_a_registered_node_is_listed_and_lives_while_it_heartbeats():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        lease = await ctx.nodes.register("n0", 2, "10.0.0.1", ttl_s=6)
        (record,) = (await ctx.nodes.list()).values()
        assert (record.name, record.nproc_per_node, record.address, record.lease_id) == \
            ("n0", 2, "10.0.0.1", lease)
        for _ in range(5):
            clock.now += 4
            await ctx.nodes.heartbeat("n0", lease)
        await ctx.nodes.heartbeat("n0", None)  # without its lease id: read from the record
        clock.now += 7
        assert await ctx.nodes.list() == {}
        with pytest.raises(NodeNotFound):
            await ctx.nodes.heartbeat("n0", lease)
        with pytest.raises(NodeNotFound):
            await ctx.nodes.heartbeat("n0", None)

    asyncio.run(main())


def test_a_live_nodes_name_is_refused_and_a_drained_one_is_replaced_under_a_new_lease():
    async def main():
        ctx = context()
        first = await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="a" * 64)
        with pytest.raises(NodeNameTaken, match="already registered and alive"):
            await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="b" * 64)
        assert (await ctx.nodes.list())["n0"].credential_sha256 == "a" * 64  # untouched
        await ctx.nodes.drain("n0")
        second = await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="b" * 64)
        assert first != second
        assert not await ctx.kv.refresh_lease(first)
        assert (await ctx.nodes.list())["n0"].lease_id == second
        with pytest.raises(OutdatedCredential):
            await ctx.nodes.heartbeat_with("n0", "a" * 64)
        await ctx.nodes.heartbeat_with("n0", "b" * 64)

    asyncio.run(main())


def test_a_replica_that_never_saw_the_registration_takes_the_heartbeats():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        other = NodeStore(ctx.kv, ctx.keys, clock, ttl_s=ctx.settings.node_ttl_s)  # another control plane on the same etcd
        first = await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="a" * 64)
        await ctx.nodes.heartbeat_with("n0", "a" * 64)
        for _ in range(3):  # kept alive by the other replica alone, past the lease
            clock.now += 4
            await other.heartbeat_with("n0", "a" * 64)
        assert (await other.list())["n0"].lease_id == first
        with pytest.raises(OutdatedCredential):
            await other.heartbeat_with("n0", "b" * 64)
        # registered again on the first replica (drained: a new credential and lease); the
        # other one, which knew the old credential, learns that its lease ended at its next
        # keep-alive of it (service.heartbeats: the flush after a third of the TTL), refuses
        # it from then on and takes the new one
        await ctx.nodes.drain("n0")
        await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="b" * 64)
        await other.heartbeat_with("n0", "a" * 64)  # answered from memory
        clock.now += 2
        assert await other.leases.flush() == 1
        with pytest.raises(NodeNotFound):
            await other.heartbeat_with("n0", "a" * 64)
        await other.heartbeat_with("n0", "b" * 64)

    asyncio.run(main())


def test_a_live_name_is_taken_back_only_with_its_current_credentials_digest():
    async def main():
        ctx = context()
        first = await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="a" * 64)
        for reclaim in (None, "b" * 64, "c" * 64):  # none, or not n0's: the name stays taken
            with pytest.raises(NodeNameTaken):
                await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="c" * 64,
                                         reclaim_sha256=reclaim)
        second = await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="b" * 64,
                                          reclaim_sha256="a" * 64)
        assert not await ctx.kv.refresh_lease(first)  # the old lease, and its credential, end
        assert (await ctx.nodes.list())["n0"].lease_id == second
        with pytest.raises(OutdatedCredential):
            await ctx.nodes.heartbeat_with("n0", "a" * 64)
        with pytest.raises(NodeNameTaken):  # the outdated credential takes nothing back
            await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="d" * 64,
                                     reclaim_sha256="a" * 64)
        await ctx.nodes.heartbeat_with("n0", "b" * 64)

    asyncio.run(main())


def test_a_lapsed_nodes_name_is_free_and_its_credential_is_forgotten():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="a" * 64)
        await ctx.nodes.heartbeat_with("n0", "a" * 64)
        clock.now += 7
        with pytest.raises(NodeNotFound):
            await ctx.nodes.heartbeat_with("n0", "a" * 64)
        await ctx.nodes.register("n0", 1, None, ttl_s=6, credential_sha256="b" * 64)
        with pytest.raises(OutdatedCredential):
            await ctx.nodes.verify("n0", "a" * 64)

    asyncio.run(main())


def test_drain_marks_the_node_and_keeps_it_on_its_lease():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        lease = await ctx.nodes.register("n0", 1, None, ttl_s=6)
        assert (await ctx.nodes.drain("n0")).state is NodeState.DRAINING
        assert (await ctx.nodes.drain("n0")).state is NodeState.DRAINING  # twice is fine
        assert (await ctx.kv.get(ctx.keys.node("n0"))).lease == lease
        clock.now += 7
        with pytest.raises(NodeNotFound):
            await ctx.nodes.drain("n0")

    asyncio.run(main())


def test_a_drain_outlives_the_lease_and_a_re_registration_until_undrain():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        await ctx.nodes.register("n0", 1, None, ttl_s=6)
        await ctx.nodes.drain("n0")
        clock.now += 7  # an etcd pause: the lease lapses, the record with it
        assert await ctx.nodes.list() == {}
        await ctx.nodes.register("n0", 1, None, ttl_s=6)
        assert (await ctx.nodes.list())["n0"].state is NodeState.DRAINING
        await ctx.nodes.deregister("n0")  # its agent restarted
        await ctx.nodes.register("n0", 1, None, ttl_s=6)
        assert (await ctx.nodes.list())["n0"].state is NodeState.DRAINING
        assert (await ctx.nodes.undrain("n0")).state is NodeState.READY
        await ctx.nodes.deregister("n0")
        await ctx.nodes.register("n0", 1, None, ttl_s=6)
        assert (await ctx.nodes.list())["n0"].state is NodeState.READY
        assert (await ctx.nodes.undrain("n0")).state is NodeState.READY  # twice is fine
        with pytest.raises(NodeNotFound):
            await ctx.nodes.undrain("ghost")

    asyncio.run(main())


def test_deregister_removes_the_node_at_once_and_is_idempotent():
    async def main():
        ctx = context()
        await ctx.nodes.register("n0", 1, None, ttl_s=6)
        await ctx.nodes.deregister("n0")
        assert await ctx.nodes.list() == {}
        await ctx.nodes.deregister("n0")

    asyncio.run(main())


# ------------------------------------------------------------------ a scheduler pass

def test_a_scheduler_pass_on_the_memory_store_starts_a_job_on_a_free_node():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        ctx.jobs.clock = clock
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"], nodes={"min": 1, "max": 1}))
        await ctx.nodes.register("n0", 1, None, ttl_s=6)
        await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
        started = await ctx.jobs.get(job.id)
        assert (started.state, list(started.members), started.attempt) == (JobState.STARTING, ["n0"], 1)
        clock.now += 7  # the node's lease lapses: the job goes back to waiting
        await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
        assert (await ctx.jobs.get(job.id)).state is JobState.PENDING

    asyncio.run(main())


def test_a_pass_holds_the_survivor_with_a_memory_copy_for_the_job_that_lost_a_node():
    """min == max == 2 loses a node: the survivor, whose memory tier holds the job's copy (its
    worker's memory report), is not given to a job submitted meanwhile, and the job starts
    again on it and the next node that comes (`decide.keep`, `JobIndex.claims`)."""
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        ctx.jobs.clock = clock

        async def tick() -> None:
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})

        def spec(name: str, n: int) -> JobSpec:
            return JobSpec(name=name, command=["true"], nodes={"min": n, "max": n})

        async with following(ctx):
            pair, _ = await ctx.jobs.create(spec("pair", 2))
            lease = await ctx.nodes.register("n0", 1, None, ttl_s=6)
            await ctx.nodes.register("n1", 1, None, ttl_s=6)
            await tick()
            attempt = (await ctx.jobs.get(pair.id)).attempt
            for name in ("n0", "n1"):
                await ctx.snapshots.report_memory(pair.id, name, MemoryReport(step=20, attempt=attempt))
            for _ in range(2):  # n1's lease lapses, n0's is kept
                clock.now += 4
                await ctx.nodes.heartbeat("n0", lease)
            other, _ = await ctx.jobs.create(spec("other", 1))
            await tick()
            await tick()
            waiting = await ctx.jobs.get(pair.id)
            assert waiting.state is JobState.PENDING and waiting.kept.steps == {"n0": 20}, waiting.reason
            assert (await ctx.jobs.get(other.id)).state is JobState.PENDING
            assert {n.name: n.held_for for n in (await list_nodes(ctx)).items} == {"n0": pair.id}
            await ctx.nodes.register("n2", 1, None, ttl_s=6)
            await tick()
            again = await ctx.jobs.get(pair.id)
            assert (again.state, sorted(again.members), again.kept) == (JobState.STARTING, ["n0", "n2"], None)
            assert (await ctx.jobs.get(other.id)).state is JobState.PENDING
            assert ctx.index.claims() == {}  # (the index forgot the hold with the job's start)

    asyncio.run(main())


def test_a_scheduler_that_lost_the_lead_writes_nothing():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        ctx.jobs.clock = clock
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"], nodes={"min": 1, "max": 1}))
        await ctx.nodes.register("n0", 1, None, ttl_s=600)
        lead = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=5)
        assert await lead.hold()
        stale = lead.fence()
        clock.now += 6  # its lease lapsed (cut off from etcd) and another replica leads
        assert await scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=5).hold()
        with pytest.raises(StaleLeader):
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {}, fence=stale)
        assert (await ctx.jobs.get(job.id)).state is JobState.PENDING  # nothing written
        fence = lead.fence() if await lead.hold() else None
        assert fence is None  # it does not lead again while the other one does

    asyncio.run(main())


def test_a_leader_whose_etcd_calls_hang_stops_by_its_own_clock_and_its_events_name_its_term():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        ctx.jobs.clock = clock
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"], nodes={"min": 1, "max": 1}))
        await ctx.nodes.register("n0", 1, None, ttl_s=600)
        lead = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=2, clock=clock)
        assert await lead.hold()
        fence = lead.fence()
        await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {}, fence=fence)
        submitted, started = await ctx.jobs.events(job.id)
        assert (submitted.leader, submitted.term) == (None, None)  # a user's request, not the leader's
        assert (started.state, started.leader, started.term) == (JobState.STARTING, lead.identity,
                                                                 fence.term)
        # No keep-alive confirmed for the lease's TTL less its margin (etcd's answers hang):
        # it stops leading by its own clock, half a second (a quarter TTL) before its lease
        # could lapse, and the fence it handed out before stops its writes too.
        assert scheduler.STOP_MARGIN * lead.ttl_s == 0.5
        clock.now += 1.45
        assert lead.fence() is not None
        clock.now += 0.05
        assert lead.fence() is None
        with pytest.raises(StaleLeader):
            await ctx.jobs.update(job.id, lambda j: None, fence)

    asyncio.run(main())


def test_a_new_leader_plans_only_once_its_index_has_the_last_leaders_writes():
    """`JobIndex.catch_up`: the index has every job record as etcd has it now, or it waits
    (a new leader's first pass waits for it, instead of reading every unfinished job)."""
    async def main():
        ctx = context()
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"]))
        index = asyncio.create_task(ctx.index.run())
        await asyncio.wait_for(ctx.index.ready.wait(), 5)
        assert await ctx.index.catch_up(1)
        index.cancel()  # this replica's watch stalls: another replica's write does not reach it
        with contextlib.suppress(asyncio.CancelledError):
            await index
        another = Context.wire(ctx.settings, ctx.kv)  # the replica that led before
        await another.jobs.move(job.id, JobState.CANCELLED, "cancelled there")
        assert not await ctx.index.catch_up(0.05)
        index = asyncio.create_task(ctx.index.run())  # the watch goes on
        try:
            assert await ctx.index.catch_up(5)
            assert ctx.index.get(job.id).state is JobState.CANCELLED
        finally:
            index.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await index

    asyncio.run(main())


def test_a_pass_that_starts_many_jobs_writes_them_in_few_transactions_each_fenced_on_its_job():
    """`JobStore.write_many` under the scheduler: 100 jobs start in a handful of
    transactions, not one read-and-write per job; a job changed since the index had it
    loses its transaction's jobs to `update`, which decides again; nothing is lost or
    written twice."""
    async def main():
        ctx = context()
        lead = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=600)
        assert await lead.hold()
        spec = JobSpec(name="t", command=["true"], nodes={"min": 1, "max": 1})
        ids = [(await ctx.jobs.create(spec))[0].id for _ in range(100)]
        for i in range(100):
            await ctx.nodes.register(f"n{i:03d}", 1, None, ttl_s=600)
        index = asyncio.create_task(ctx.index.run())
        await asyncio.wait_for(ctx.index.ready.wait(), 5)
        # Another replica changes one job after this index read it (its watch is slower).
        index.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await index
        bumped = ids[50]
        await Context.wire(ctx.settings, ctx.kv).jobs.update(
            bumped, lambda j: Change(j.model_copy(update={"updated_at": j.updated_at + 1})))
        commits: list[int] = []
        commit_read = ctx.kv.commit_read

        async def counting(expect, ops, read):
            commits.append(len(ops))
            return await commit_read(expect, ops, read)

        ctx.kv.commit_read = counting
        await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {}, fence=lead.fence())
        jobs = [await ctx.jobs.get(i) for i in ids]
        assert all(j.state is JobState.STARTING for j in jobs)
        assert len({n for j in jobs for n in j.members}) == 100  # every node once
        # 2 operations a job (record, event): 63 jobs a transaction. The one with the bumped
        # job lost, whole; its jobs went through `update`, one by one.
        batches, singles = [n for n in commits if n > 2], [n for n in commits if n <= 2]
        assert batches == [126, 74] and len(singles) in (63, 37), commits  # (ids order the queue)
        for job_id in (ids[0], bumped, ids[99]):
            started = [e for e in await ctx.jobs.events(job_id) if e.state is JobState.STARTING]
            assert len(started) == 1 and started[0].term == lead.fence().term

    asyncio.run(main())


def test_write_many_of_a_replica_that_lost_the_lead_writes_nothing():
    async def main():
        ctx = context()
        lead = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=5)
        assert await lead.hold()
        stale = lead.fence()
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"]))
        _, revision = await ctx.jobs.get_with_revision(job.id)
        await ctx.kv.revoke_lease(lead.lease_id)  # its lease went; another replica leads
        assert await scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=5).hold()
        moved = Change(job.model_copy(update={"updated_at": job.updated_at + 1}))
        with pytest.raises(StaleLeader):
            await ctx.jobs.write_many([(job, revision, moved)], stale)
        assert (await ctx.jobs.get_with_revision(job.id))[1] == revision  # nothing written

    asyncio.run(main())


class CutOff(MemoryStore):
    """A store that stops answering lease refreshes (etcd out of this replica's reach)."""

    cut = False

    async def refresh_lease(self, lease_id: int) -> bool:
        if self.cut:
            raise StoreUnavailable("etcd out of reach (the test)")
        return await super().refresh_lease(lease_id)


def test_a_leader_cut_off_from_etcd_drops_its_fence_so_compaction_and_retention_stop():
    async def main():
        ctx = context()
        kv = CutOff()
        ctx = Context.wire(ctx.settings, kv)
        lead = scheduler.Leadership(kv, ctx.keys.leader, ttl_s=2)
        async with scheduling(ctx, lead, 0.05):
            await until(lambda: lead.fence() is not None, "the replica to lead")
            kv.cut = True
            await until(lambda: lead.fence() is None, "the fence to go when etcd is out of reach")
            kv.cut = False  # back in reach, its lease still valid: it leads on
            await until(lambda: lead.fence() is not None, "the replica to lead again")

    asyncio.run(main())


async def _hang_watched_job(**tick_kwargs):
    """A job with hang_timeout_s=5 on one node, and `tick_at(now, step=None)`: the clock set
    to `now`, rank 0's report of `step` if given (its group formed), one scheduler pass, the
    job after it."""
    clock = ManualClock()
    ctx = context(clock)
    ctx.jobs.clock = clock
    spec = JobSpec(name="t", command=["true"], hang_timeout_s=5, max_restarts=1)
    job, _ = await ctx.jobs.create(spec)
    await ctx.nodes.register("n0", 1, None, ttl_s=600)
    watches: dict = {}

    async def tick_at(now: float, step: int | None = None) -> JobRecord:
        clock.now = now
        if step is not None:
            current = await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={
                "rounds": max(j.rounds, 1), "group": j.group or f"n0/{j.attempt}"})))
            await ctx.progress.report(job.id, ProgressReport(step=step, attempt=current.attempt,
                                                             group=current.group))
        await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {}, watches, **tick_kwargs)
        return await ctx.jobs.get(job.id)

    return ctx, job, tick_at


def test_a_scheduler_pass_after_a_stall_of_its_own_does_not_count_it_on_the_hang_clock():
    """Passes every 0.5 s (the scheduler's `stall_after_s`, 1.5 s), then none for 8 s (the
    control plane SIGSTOPped): the first pass after does not find the job hung (before: 8.5 s
    without progress against hang_timeout_s=5); the clock runs on from where it stood."""
    async def main():
        _, _, tick_at = await _hang_watched_job(stall_after_s=1.5)

        assert (await tick_at(1000)).state is JobState.STARTING
        assert (await tick_at(1001, step=1)).state is JobState.RUNNING  # watched from here
        assert (await tick_at(1001.5)).attempt == 1
        assert (await tick_at(1010)).attempt == 1  # stopped from 1001.5: 7 of its 8.5 s not heard
        for now in (1011, 1012, 1012.9):  # passes come round again: counted
            assert (await tick_at(now)).attempt == 1  # at last 2 + 2.9 = 4.9 s
        hung = await tick_at(1013.1)  # 5.1 s counted
        assert (hung.state, hung.attempt) == (JobState.RECOVERING, 2)

    asyncio.run(main())


def test_a_scheduler_pass_restarts_a_job_whose_progress_stopped_for_hang_timeout_s():
    async def main():
        ctx, job, tick_at = await _hang_watched_job()

        assert (await tick_at(1000)).state is JobState.STARTING
        assert (await tick_at(1001, step=1)).state is JobState.RUNNING  # its first step
        assert (await tick_at(1005.9, step=2)).attempt == 1  # advancing: no hang
        assert (await tick_at(1010.8)).attempt == 1  # 4.9 s since step 2
        hung = await tick_at(1010.9)
        assert (hung.state, hung.attempt, hung.restarts) == (JobState.RECOVERING, 2, 1)
        assert (await ctx.jobs.events(job.id))[-1].reason == \
            "no progress for 5 s (hang_timeout_s=5); restarting the workers (1 of 1)"
        await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={
            "rounds": 1, "group": "n0/0"})))  # the new group formed: RECOVERING until its first step
        assert (await tick_at(1020)).state is JobState.RECOVERING
        failed = await tick_at(1025)  # and made no progress either
        assert failed.state is JobState.FAILED and failed.stopping
        assert failed.reason == "no progress for 5 s (hang_timeout_s=5); workers failed 2 times " \
                                "(max_restarts=1)"

    asyncio.run(main())


def test_the_job_index_follows_the_store_and_wakes_a_waiting_heartbeat():
    async def main():
        ctx = context()
        job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"]))
        await ctx.nodes.register("n0", 1, None, ttl_s=6)
        async with following(ctx):
            assert ctx.index.active_ids() == [job.id] and ctx.index.job_of_node("n0") is None
            waiting = asyncio.create_task(
                ctx.index.wait_until(lambda: ctx.index.job_of_node("n0") is not None, 5))
            await asyncio.sleep(0)
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            assert await asyncio.wait_for(waiting, 5)
            assert ctx.index.job_of_node("n0").id == job.id
            await ctx.jobs.move(job.id, JobState.CANCELLING, "test")
            await ctx.jobs.move(job.id, JobState.CANCELLED, "test")
            assert await ctx.index.wait_until(lambda: ctx.index.active_ids() == [], 5)
            assert ctx.index.job_of_node("n0") is None

    asyncio.run(main())


def test_the_watch_fed_node_view_follows_registrations_and_lapses_and_wakes_the_scheduler():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        wake = asyncio.Event()
        follow = asyncio.create_task(ctx.nodes.follow(wake))
        try:
            await ctx.nodes.register("n0", 1, None, ttl_s=6)
            for _ in range(200):
                if "n0" in await ctx.nodes.live() and wake.is_set():
                    break
                await asyncio.sleep(0.01)
            assert ctx.nodes._live is not None and list(await ctx.nodes.live()) == ["n0"]
            wake.clear()
            clock.now += 7  # its lease lapses
            await ctx.kv.check_ready()  # (the in-memory store expires leases when called)
            for _ in range(200):
                if not await ctx.nodes.live():
                    break
                await asyncio.sleep(0.01)
            assert await ctx.nodes.live() == {} and wake.is_set()
        finally:
            await cancel_and_wait(follow)
        assert ctx.nodes._live is None  # stopped: passes read etcd again

    asyncio.run(main())


def test_the_job_index_keeps_the_pending_and_the_running_jobs_apart_in_submission_order():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        ctx.jobs.clock = clock
        async with following(ctx):
            ids = []
            for i in range(4):
                clock.now += 1
                ids.append((await ctx.jobs.create(JobSpec(name=f"t{i}", command=["true"])))[0].id)
            assert list(ctx.index.pending_ids()) == ids and ctx.index.running_ids() == []
            await ctx.nodes.register("n0", 1, None, ttl_s=600)
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})  # t0 runs
            await ctx.jobs.move(ids[2], JobState.CANCELLED, "test")
            expected = (ids[1:2] + ids[3:], ids[:1])
            assert (list(ctx.index.pending_ids()), ctx.index.running_ids()) == expected
            assert ctx.index.active_ids() == [ids[0], ids[1], ids[3]]
            # The watch's events bring nothing new (the writes were shown at once), and a
            # load from etcd (after a broken watch) gives the same lists.
            assert await ctx.index.wait_for_revision(await ctx.kv.revision(), 5)
            assert (list(ctx.index.pending_ids()), ctx.index.running_ids()) == expected
            await ctx.index._load()
            assert (list(ctx.index.pending_ids()), ctx.index.running_ids()) == expected

    asyncio.run(main())


def test_a_burst_of_submissions_while_no_node_is_free_makes_no_scheduler_pass():
    async def main():
        ctx = context()
        leadership = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=600)
        async with scheduling(ctx, leadership, 600.0):
            await until(lambda: ctx.scheduler_passes.count > 0, "the first scheduler pass")
            before = ctx.scheduler_passes.count
            started = asyncio.get_running_loop().time()
            for i in range(100):  # a submission every millisecond or so, each waking the scheduler
                await ctx.jobs.create(JobSpec(name=f"t{i}", command=["true"]))
                await asyncio.sleep(0.001)
            burst_s = asyncio.get_running_loop().time() - started
            await asyncio.sleep(0.1)
            passes = ctx.scheduler_passes.count - before
            # No node is free: new PENDING jobs have nothing to plan, and wake no pass at all
            # (before: one per MIN_PASS_GAP_S, each over every running job).
            assert passes <= 1, (passes, burst_s)
            # ...and what came in during the burst is scheduled: a node takes the oldest job.
            await ctx.nodes.register("n0", 1, None, ttl_s=600)
            first = next(ctx.index.pending_ids())
            await until(lambda: ctx.index.get(first).state is not JobState.PENDING, "the oldest job to start")

    asyncio.run(main())


def test_a_steady_stream_of_submissions_while_no_node_is_free_still_lets_the_interval_pass_run():
    """Skipping the passes that new PENDING jobs wake must not skip the interval's: it keeps
    the clocks of planned changes and hangs and the leader's contact note (`service.contact`)."""
    async def main():
        ctx = context()
        leadership = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=600)
        async with scheduling(ctx, leadership, 0.2):
            await until(lambda: ctx.scheduler_passes.count > 0, "the first scheduler pass")
            before = ctx.scheduler_passes.count
            loop = asyncio.get_running_loop()
            end = loop.time() + 1.5
            i = 0
            while loop.time() < end:  # a submission every few ms, each waking the scheduler
                await ctx.jobs.create(JobSpec(name=f"t{i}", command=["true"]))
                await asyncio.sleep(0.005)
                i += 1
            passes = ctx.scheduler_passes.count - before
            assert 2 <= passes <= 8, (passes, i)  # about one per 0.2 s interval, not one per job

    asyncio.run(main())


def test_a_heartbeats_assignment_is_made_once_per_change_of_its_jobs_record():
    from service.routes.nodes import heartbeat_answer

    async def main():
        ctx = context()
        async with following(ctx):
            await ctx.nodes.register("n0", 1, None, ttl_s=600)
            job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"]))
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            first = await heartbeat_answer(ctx, "n0", None, None)
            assert json.loads(first)["assignment"]["action"] == "run"
            assert await heartbeat_answer(ctx, "n0", None, None) is first  # not made again
            await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={"stopping": True}), []))
            assert json.loads(await heartbeat_answer(ctx, "n0", None, None))["assignment"]["action"] \
                == "stop"  # a changed record: a new answer

    asyncio.run(main())
