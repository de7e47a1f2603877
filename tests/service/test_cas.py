"""Compare-and-set on job state, with two real writers racing on one real etcd."""

from __future__ import annotations

import asyncio

from service.errors import InvalidTransition
from service.jobs import Change, JobStore
from service.keys import Keys
from service.models import JobSpec, JobState
from service.store.etcd import EtcdStore
from tests.helpers.tasks import cancel_and_wait


def test_two_writers_racing_on_one_status_exactly_one_wins(etcd):
    async def main():
        a, b = EtcdStore(etcd.endpoint), EtcdStore(etcd.endpoint)
        store_a, store_b = JobStore(a, Keys("/t")), JobStore(b, Keys("/t"))
        wins = 0
        for i in range(20):
            job, _ = await store_a.create(JobSpec(name=f"race{i}", command=["true"]))
            await store_a.move(job.id, JobState.STARTING, "started")

            async def finish(store, target, job=job):
                try:
                    await store.move(job.id, target, f"{target.value} by writer")
                    return target
                except InvalidTransition:
                    return None

            results = await asyncio.gather(finish(store_a, JobState.SUCCEEDED),
                                           finish(store_b, JobState.FAILED))
            winners = [r for r in results if r is not None]
            assert len(winners) == 1, results
            stored = await store_a.get(job.id)
            assert stored.state == winners[0]
            events = await store_a.events(job.id)
            # nothing lost, nothing doubled: submitted, started, and exactly one ending
            assert [e.state for e in events] == [JobState.PENDING, JobState.STARTING, winners[0]]
            wins += 1
        await a.close()
        await b.close()
        return wins

    assert asyncio.run(main()) == 20


def test_concurrent_counters_lose_no_increment(etcd):
    async def main():
        clients = [EtcdStore(etcd.endpoint) for _ in range(4)]
        stores = [JobStore(c, Keys("/t")) for c in clients]
        job, _ = await stores[0].create(JobSpec(name="count", command=["true"]))

        def bump(j):
            return Change(j.model_copy(update={"rounds": j.rounds + 1}))

        await asyncio.gather(*(s.update(job.id, bump) for s in stores for _ in range(10)))
        final = await stores[0].get(job.id)
        for c in clients:
            await c.close()
        return final.rounds

    assert asyncio.run(main()) == 40


def test_scheduler_reads_only_unfinished_jobs_once_the_index_is_ready(etcd):
    """Finished jobs pile up; a pass must not read them (it runs on every job change): with
    the index ready a pass reads no job from etcd; a new leader's check that the index has
    every write of the term before (`JobIndex.catch_up`) is one read of one key, whatever
    the number of jobs."""
    from service import scheduler
    from service.context import Context
    from service.settings import Settings

    async def main():
        ctx = Context.build(Settings(etcd_endpoints=etcd.endpoint, etcd_prefix="/idx"))
        for i in range(30):
            job, _ = await ctx.jobs.create(JobSpec(name=f"old{i}", command=["true"]))
            await ctx.jobs.move(job.id, JobState.CANCELLED, "done")
        live, _ = await ctx.jobs.create(JobSpec(name="live", command=["true"]))
        index = asyncio.create_task(ctx.index.run())
        try:
            await asyncio.wait_for(ctx.index.ready.wait(), 10)
            reads: list = []
            get, get_many, get_range = ctx.kv.get, ctx.kv.get_many, ctx.kv.get_range

            async def counting_get(key, **kw):
                reads.append([key])
                return await get(key, **kw)

            async def counting_get_many(keys, **kw):
                reads.append(list(keys))
                return await get_many(keys, **kw)

            async def counting_get_range(prefix, **kw):
                reads.append(prefix + "*")
                return await get_range(prefix, **kw)

            ctx.kv.get, ctx.kv.get_many = counting_get, counting_get_many
            ctx.kv.get_range = counting_get_range
            jobs = await scheduler.active_jobs(ctx.jobs, ctx.index)
            assert [j.id for j in jobs] == [live.id] and reads == []  # from the index alone
            assert await ctx.index.catch_up(5) and reads == []  # (latest_revision: one Range)
            # A job this replica just finished is dropped (the index has its write at once).
            await ctx.jobs.move(live.id, JobState.CANCELLED, "done")
            assert await scheduler.active_jobs(ctx.jobs, ctx.index) == []
        finally:
            await cancel_and_wait(index)
            await ctx.kv.close()

    asyncio.run(main())


def test_get_many_reads_more_keys_than_one_transaction_holds_in_order(etcd):
    async def main():
        store = EtcdStore(etcd.endpoint)
        keys = [f"/many/{i:04d}" for i in range(300)]
        for k in keys[::2]:
            await store.put(k, k.encode())
        got = await store.get_many(keys)
        assert [None if e is None else e.value.decode() for e in got] == \
            [k if i % 2 == 0 else None for i, k in enumerate(keys)]
        await store.close()

    asyncio.run(main())
