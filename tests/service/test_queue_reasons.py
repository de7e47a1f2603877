"""A waiting job's reason is one answer, on the in-memory store: the queue (`GET /v1/queue`)
and the job's own view (`GET /v1/jobs/{id}`, the job list) say the same, backfill included
(`decide.lineup`)."""

from __future__ import annotations

import asyncio
import json

from service.decide.change import Change
from service import scheduler
from service.decide.scheduling import SchedulerConfig
from service.models import JobSpec, JobState
from service.routes import jobs as job_routes
from service.routes import queue as queue_routes
from tests.service.test_stores import ManualClock, context, following


def spec(name: str, n: int, **extra) -> JobSpec:
    return JobSpec(name=name, command=["true"], nodes={"min": n, "max": n}, **extra)


def test_a_job_held_back_for_the_head_says_so_in_its_own_view_as_in_the_queue():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        async with following(ctx):
            for name in ("w1", "w2", "w3"):
                await ctx.nodes.register(name, 1, None, ttl_s=60)
            holder, _ = await ctx.jobs.create(spec("holder", 1, max_duration_s=3600))
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            assert (await ctx.jobs.get(holder.id)).state is JobState.STARTING
            # "big" waits for the holder's node (in an hour, as it declares); "small", behind it,
            # would start on a free node but may not: it could hold it past big's start
            big, _ = await ctx.jobs.create(spec("big", 3))
            clock.now += 1  # (created in this order: the queue's age order)
            small, _ = await ctx.jobs.create(spec("small", 1))
            # ... a plain script that ran before (a job that never ran would borrow the node)
            await ctx.jobs.update(small.id, lambda j: Change(j.model_copy(update={"attempt": 1})))
            await ctx.index.catch_up(5)
            queued = {q.id: q.waiting for q in (await queue_routes.queue(ctx, limit=100)).items}
            assert list(queued) == [big.id, small.id]
            assert f"the free ones are kept for job {big.id} (priority 0)" in queued[small.id]
            own = json.loads((await job_routes.get_job(small.id, ctx)).body)
            assert own["waiting"] == queued[small.id]
            listed = {v.id: v.waiting for v in (await job_routes.list_jobs(ctx, state=None, limit=100,
                                                                           after=None)).items}
            assert listed[small.id] == queued[small.id] and listed[big.id] == queued[big.id]

    asyncio.run(main())
