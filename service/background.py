"""Background loops of a control plane (the job index, the scheduler), run by the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from service import scheduler
from service.context import Context

log = logging.getLogger(__name__)


async def start(ctx: Context) -> None:
    ctx.tasks.append(asyncio.create_task(ctx.index.run(), name="job-index"))
    leadership = scheduler.Leadership(ctx.kv, ctx.keys.leader)
    ctx.tasks.append(asyncio.create_task(
        scheduler.run(ctx.jobs, ctx.nodes, ctx.index, leadership, ctx.settings.scheduler_interval_s,
                      contact=ctx.contact),
        name="scheduler"))


async def stop(ctx: Context) -> None:
    for task in ctx.tasks:
        task.cancel()
    for task in ctx.tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    ctx.tasks.clear()
