"""Job status from the watch-fed index with read-your-writes (service.job_index): two control
planes on one in-memory KeyValue. A replica shows its own writes at once; another one shows
them once its index has reached the write's revision, which a read waits for."""

from __future__ import annotations

import asyncio
import json

from service.context import Context
from service.decide.cancel import decide_cancel
from service.models import JobSpec
from service.settings import Settings
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait
from worker.protocol import ProgressReport

SPEC = JobSpec(name="t", command=["true"], nodes={"min": 1, "max": 1})


async def _replicas() -> tuple[Context, Context, list[asyncio.Task]]:
    kv = MemoryStore()
    a, b = Context.wire(Settings(), kv), Context.wire(Settings(), kv)
    tasks = [asyncio.create_task(c) for ctx in (a, b)
             for c in (ctx.index.run(), ctx.index.run_progress())]
    for ctx in (a, b):
        await ctx.index.wait_ready(5)
        await asyncio.wait_for(ctx.index.progress_ready.wait(), 5)
    return a, b, tasks


def _state(ctx: Context, job_id: str) -> str | None:
    body = ctx.index.view_json(job_id)
    return None if body is None else json.loads(body)["state"]


def test_a_change_through_one_replica_is_read_through_the_other_once_it_has_the_revision():
    async def main():
        a, b, tasks = await _replicas()
        try:
            job, created, submitted = await a.jobs.create_at(SPEC)
            assert created and _state(a, job.id) == "PENDING"  # the writer shows it at once
            assert await b.index.wait_for_revision(submitted, 5)
            assert _state(b, job.id) == "PENDING"

            cancelled, revision = await a.jobs.update_at(job.id, lambda j: decide_cancel(j, 0.0))
            assert revision > submitted
            assert _state(a, job.id) == cancelled.state.value  # at once, on the writer
            assert _state(b, job.id) == "PENDING"  # the other has not had the watch event yet...
            assert b.index.revision < revision
            assert await b.index.wait_for_revision(revision, 5)  # ...which a read waits for
            assert _state(b, job.id) == cancelled.state.value
        finally:
            await cancel_and_wait(*tasks)

    asyncio.run(main())


def test_a_revision_the_index_never_reaches_is_not_waited_for_past_the_timeout():
    async def main():
        a, _, tasks = await _replicas()
        try:
            assert not await a.index.wait_for_revision(a.index.revision + 1000, 0.2)
        finally:
            await cancel_and_wait(*tasks)

    asyncio.run(main())


def test_progress_is_in_the_view_at_once_on_the_replica_that_wrote_it_and_soon_on_the_other():
    async def main():
        a, b, tasks = await _replicas()
        try:
            job, _, _ = await a.jobs.create_at(SPEC)
            await a.progress.report(job.id, ProgressReport(step=7, loss=0.5))
            assert json.loads(a.index.view_json(job.id))["progress"]["step"] == 7
            for _ in range(500):  # the other replica's progress watch brings it
                if json.loads(b.index.view_json(job.id) or "{}").get("progress") is not None:
                    break
                await asyncio.sleep(0.01)
            assert json.loads(b.index.view_json(job.id))["progress"]["step"] == 7
            # the view is made once per change, then served as it is
            assert a.index.view_json(job.id) is a.index.view_json(job.id)
        finally:
            await cancel_and_wait(*tasks)

    asyncio.run(main())
