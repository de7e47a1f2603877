"""`service.group_commit` under `JobStore.create_at`: submissions that come together are
written several to a transaction, and each is answered as if it had been alone
(idempotency, its own revision for read-your-writes, its own error)."""

from __future__ import annotations

import asyncio

from service.context import Context
from service.errors import StoreUnavailable
from service.models import JobSpec
from service.settings import Settings
from service.store.memory import MemoryStore

SPEC = JobSpec(name="t", command=["true"])


def wired() -> tuple[Context, list[int]]:
    """A context on an in-process store that counts its transactions (ops in each)."""
    ctx = Context.wire(Settings(), MemoryStore())
    sent: list[int] = []
    commit_read = ctx.kv.commit_read

    async def counting(expect, ops, read):
        sent.append(len(ops))
        await asyncio.sleep(0.001)  # a round trip: the next submissions come meanwhile
        return await commit_read(expect, ops, read)

    ctx.kv.commit_read = counting
    return ctx, sent


def test_a_burst_of_submissions_is_written_in_few_transactions_each_with_its_revision():
    async def main():
        ctx, sent = wired()
        got = await asyncio.gather(*(ctx.jobs.create_at(SPEC, f"key-{i}") for i in range(100)))
        assert all(created for _, created, _ in got)
        assert len(sent) < 10 and max(sent) > 3 * 30, sent  # 3 ops a submit, dozens together
        for job, _, revision in got:  # each one's revision is its record's (read-your-writes)
            stored, stored_revision = await ctx.jobs.get_with_revision(job.id)
            assert stored_revision == revision and stored.idempotency_digest == job.idempotency_digest
        # Retried (the same keys), each gets its first job back, not a second.
        again = await asyncio.gather(*(ctx.jobs.create_at(SPEC, f"key-{i}") for i in range(100)))
        assert [(j.id, created) for j, created, _ in again] == [(j.id, False) for j, _, _ in got]
        assert len([k async for k in ctx.jobs.scan()]) == 100

    asyncio.run(main())


def test_the_same_key_twice_in_a_burst_makes_one_job_and_a_group_that_lost_is_sent_alone():
    async def main():
        ctx, sent = wired()
        first, _, _ = await ctx.jobs.create_at(SPEC, "used")
        got = await asyncio.gather(ctx.jobs.create_at(SPEC, "a"), ctx.jobs.create_at(SPEC, "b"),
                                   ctx.jobs.create_at(SPEC, "dup"), ctx.jobs.create_at(SPEC, "dup"),
                                   ctx.jobs.create_at(SPEC, "used"), ctx.jobs.create_at(SPEC, "c"))
        a, b, dup1, dup2, used, c = got
        assert a[1] and b[1] and c[1] and len({a[0].id, b[0].id, c[0].id}) == 3
        assert dup1[0].id == dup2[0].id and sorted([dup1[1], dup2[1]]) == [False, True]
        assert used[0].id == first.id and not used[1]  # the replay: the first job
        assert ctx.jobs.creates.grouped >= 1  # (the replay's group lost and went alone)
        assert len([k async for k in ctx.jobs.scan()]) == 5

    asyncio.run(main())


def test_each_submitter_of_a_group_gets_the_stores_error():
    async def main():
        ctx, _ = wired()

        async def away(expect, ops, read):
            await asyncio.sleep(0.001)
            raise StoreUnavailable("etcd away (the test)")

        ctx.kv.commit_read = away
        got = await asyncio.gather(*(ctx.jobs.create_at(SPEC) for _ in range(10)),
                                   return_exceptions=True)
        assert all(isinstance(e, StoreUnavailable) for e in got), got
        assert ctx.jobs.creates.grouped >= 1

    asyncio.run(main())


def test_a_lone_submission_goes_out_at_once_alone():
    async def main():
        ctx, sent = wired()
        job, created, revision = await ctx.jobs.create_at(SPEC, "k")
        assert created and sent == [3] and ctx.jobs.creates.grouped == 0
        assert (await ctx.jobs.get_with_revision(job.id))[1] == revision

    asyncio.run(main())
