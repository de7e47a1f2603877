"""The queue: the waiting jobs in the order they will start, each with what it waits for and
what it would preempt (`decide.lineup`, which a job's own view reads too)."""

from __future__ import annotations

import itertools

from fastapi import APIRouter, Query

from service.api_contract import AuthFirstRoute
from service.decide import lineup, preempt
from service.deps import ContextDep, UserAuth
from service.models import QueuedJob, QueueView, WouldPreempt
from service.routes.jobs import cluster_of, holders_of

router = APIRouter(prefix="/v1/queue", tags=["jobs"], dependencies=[UserAuth], route_class=AuthFirstRoute)


@router.get("", response_model=QueueView)
async def queue(ctx: ContextDep, limit: int = Query(100, ge=1, le=1000,
                                                    description="The first this many waiting jobs.")) -> QueueView:
    """The waiting (PENDING) jobs, first to start first, each with why it waits."""
    nodes = await ctx.nodes.current()
    tenants = await ctx.tenancy.current()
    cluster = cluster_of(ctx, nodes, holders_of(ctx, nodes), tenants)
    return QueueView(items=[QueuedJob(
        position=q.position, id=q.job.id, name=q.job.spec.name, owner=q.job.owner,
        team=tenants.team(q.job.owner), priority=q.job.spec.priority, nodes_min=q.job.spec.nodes.min,
        nodes_max=q.job.spec.nodes.max, created_at=q.job.created_at,
        waiting=q.waiting, would_preempt=[shown(t, q.fair) for t in q.takes])
        for q in itertools.islice(lineup.lineup(cluster), limit)])


def shown(take: preempt.Take, fair: bool) -> WouldPreempt:
    """`take` as the queue shows it (`fair`: a fair-share give-back, unless one is under way)."""
    under_way = take.victim.preempt
    return WouldPreempt(job_id=take.victim.id, priority=take.victim.spec.priority,
                        how="suspend" if take.suspend else "shrink", nodes=list(take.leave),
                        under_way=under_way is not None,
                        fair_share=under_way.fair_share if under_way is not None else fair)
