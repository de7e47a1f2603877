"""Background loops of a control plane (the job index, the scheduler, compaction,
retention), run by the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from service import admission, compaction, gc_pauses, retention, scheduler
from service.context import Context
from service.decide.scheduling import SchedulerConfig
from service.errors import StoreUnavailable

log = logging.getLogger(__name__)


async def start(ctx: Context) -> None:
    await _drop_legacy_logs(ctx)
    if ctx.settings.gc_freeze_s > 0:
        ctx.tasks.append(asyncio.create_task(
            gc_pauses.run(ctx.settings.gc_freeze_s, ctx.settings.gc_reclaim_s), name="gc-pauses"))
    ctx.tasks.append(asyncio.create_task(admission.watch_lag(ctx.admission), name="admission"))
    ctx.tasks.append(asyncio.create_task(ctx.index.run(), name="job-index"))
    ctx.tasks.append(asyncio.create_task(ctx.index.run_progress(), name="progress-index"))
    ctx.tasks.append(asyncio.create_task(ctx.users.follow(), name="user-tokens"))
    ctx.tasks.append(asyncio.create_task(ctx.tenancy.run(), name="tenancy"))
    # Every replica keeps the leases of the nodes that beat to it (service.heartbeats).
    ctx.tasks.append(asyncio.create_task(ctx.nodes.leases.run(), name="node-leases"))
    # One election: the scheduler's loop keeps it; compaction and retention act on it.
    leadership = scheduler.Leadership(ctx.kv, ctx.keys.leader, ctx.settings.leader_ttl_s)
    ctx.tasks.append(asyncio.create_task(
        scheduler.run(ctx.jobs, ctx.nodes, ctx.index, leadership, ctx.settings.scheduler_interval_s,
                      SchedulerConfig(control_ack_timeout_s=ctx.settings.control_ack_timeout_s,
                                      memory_hold_s=ctx.settings.memory_hold_s,
                                      fifo=ctx.settings.queue_policy == "fifo",
                                      fair_share_settle_s=ctx.settings.fair_share_settle_s),
                      passes=ctx.scheduler_passes, contact=ctx.contact, tenancy=ctx.tenancy),
        name="scheduler"))
    ctx.tasks.append(asyncio.create_task(
        compaction.run(ctx.kv, leadership, ctx.settings.compaction_interval_s,
                       ctx.keys.compacted), name="compaction"))
    ctx.tasks.append(asyncio.create_task(
        retention.run(ctx.jobs, ctx.logs, ctx.index, leadership, ctx.settings.retention,
                      ctx.settings.snapshot_root, ctx.keyring,
                      drains=(ctx.nodes, ctx.settings.drain_keep_s)),
        name="retention"))


async def _drop_legacy_logs(ctx: Context) -> None:
    """Delete the log chunks that versions before the log root kept in etcd (one range delete,
    however many there are; nothing when there are none)."""
    try:
        await ctx.kv.delete_prefix(ctx.keys.legacy_logs)
    except StoreUnavailable as exc:  # etcd away at start-up: the next start does it
        log.warning("could not delete the old log chunks under %s: %s", ctx.keys.legacy_logs, exc)


async def stop(ctx: Context) -> None:
    for task in ctx.tasks:
        task.cancel()
    for task in ctx.tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    ctx.tasks.clear()
