"""A rendezvous request checks its job and attempt on the watch-fed index (`JobIndex`), not
with an etcd read each (`service.routes.rendezvous._cached_job`), and reads etcd only where
the index cannot answer: a node's credential, a job it lacks, an attempt newer than its own.
On the in-memory store, with the index following it as on a control plane."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.security import HTTPAuthorizationCredentials

from service.context import Context
from service.decide.change import Change
from service.models import JobSpec, JobState
from service.rendezvous import RendezvousGone
from service.routes.rendezvous import current_rendezvous
from service.settings import Settings
from service.store.memory import MemoryStore
from tests.helpers.tasks import running, until


class CountingStore(MemoryStore):
    """Counts the reads of one key (the job's record)."""

    def __init__(self) -> None:
        super().__init__()
        self.watched_key = ""
        self.reads = 0

    async def get(self, key: str):
        if key == self.watched_key:
            self.reads += 1
        return await super().get(key)


def bearer(token: str) -> HTTPAuthorizationCredentials:
    return HTTPAuthorizationCredentials(scheme="Bearer", credentials=token)


async def started(kv: CountingStore) -> tuple[Context, object]:
    ctx = Context.wire(Settings(node_token="node-secret", user_token="user-secret"), kv)
    job, _ = await ctx.jobs.create(JobSpec(name="t", command=["true"]))
    kv.watched_key = ctx.keys.job(job.id)
    return ctx, job


def test_requests_of_a_known_attempt_read_no_job_from_etcd():
    async def scenario():
        kv = CountingStore()
        ctx, job = await started(kv)
        async with running(ctx.index.run()):
            await until(lambda: ctx.index.get(job.id) is not None, "the index has the job")
            token = bearer(ctx.job_token(job))
            before = kv.reads
            for _ in range(50):
                rdzv = await current_rendezvous(ctx, token, None, f"{job.id}-a0")
            return kv.reads - before, rdzv.rdzv_id

    reads, rdzv_id = asyncio.run(scenario())
    assert reads == 0 and rdzv_id.endswith("-a0")


def test_an_attempt_the_index_has_not_seen_yet_is_read_from_etcd_and_served(monkeypatch):
    """A newer attempt than the index's (its watch event still on its way) is not refused."""

    async def scenario():
        kv = CountingStore()
        ctx, job = await started(kv)
        async with running(ctx.index.run()):
            await until(lambda: ctx.index.get(job.id) is not None, "the index has the job")
            await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={"attempt": 1})))
            monkeypatch.setattr(ctx.index, "get", lambda job_id: job)  # still at attempt 0
            before = kv.reads
            rdzv = await current_rendezvous(ctx, bearer(ctx.job_token(job)), None, f"{job.id}-a1")
            return kv.reads - before, rdzv.rdzv_id

    reads, rdzv_id = asyncio.run(scenario())
    assert reads == 1 and rdzv_id.endswith("-a1")


def test_an_older_attempt_or_a_finished_job_is_gone_and_another_token_refused():
    async def scenario():
        kv = CountingStore()
        ctx, job = await started(kv)
        async with running(ctx.index.run()):
            await until(lambda: ctx.index.get(job.id) is not None, "the index has the job")
            await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={"attempt": 2})))
            await until(lambda: ctx.index.get(job.id).attempt == 2, "the index has attempt 2")
            token = bearer(ctx.job_token(job))
            before = kv.reads
            with pytest.raises(RendezvousGone):
                await current_rendezvous(ctx, token, None, f"{job.id}-a1")
            stale_reads = kv.reads - before
            with pytest.raises(Exception) as refused:
                await current_rendezvous(ctx, bearer("not-its-token"), None, f"{job.id}-a2")
            await ctx.jobs.move(job.id, JobState.CANCELLED, "test")
            await until(lambda: ctx.index.get(job.id).state is JobState.CANCELLED, "the index: cancelled")
            with pytest.raises(RendezvousGone):
                await current_rendezvous(ctx, token, None, f"{job.id}-a2")
            return stale_reads, refused.value

    stale_reads, refused = asyncio.run(scenario())
    assert stale_reads == 0  # the index alone says the attempt is over
    assert getattr(refused, "status_code", None) == 401
