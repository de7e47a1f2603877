"""The queue: the waiting jobs in the order they will start, each with what it waits for.

The order is the scheduler's own (`decide.shares.fair_queue`: priority, then the owner's
share of the cluster, then age), played forward: each job ahead is counted as holding its
`min` nodes when the next one's turn comes, as a pass that starts it would. The reasons are
`decide.waiting`'s, as `GET /v1/jobs/{id}` gives them, against what is held now.
"""

from __future__ import annotations

import copy

from fastapi import APIRouter, Query

from service.api_contract import AuthFirstRoute
from service.decide import quotas
from service.decide.order import queue_key
from service.decide.shares import served
from service.decide.waiting import why_waiting
from service.deps import ContextDep, UserAuth
from service.models import JobState, QueuedJob, QueueView
from service.routes.jobs import holders_of

router = APIRouter(prefix="/v1/queue", tags=["jobs"], dependencies=[UserAuth], route_class=AuthFirstRoute)


@router.get("", response_model=QueueView)
async def queue(ctx: ContextDep, limit: int = Query(100, ge=1, le=1000,
                                                    description="The first this many waiting jobs.")) -> QueueView:
    """The waiting (PENDING) jobs, first to start first, each with why it waits."""
    nodes = await ctx.nodes.current()
    tenants = await ctx.tenancy.current()
    jobs = [j for j in ctx.index.jobs() if not j.state.is_terminal()]
    used = quotas.usage(jobs, nodes, tenants)
    ahead = copy.deepcopy(used)  # the shares as the jobs ahead would make them
    holders = holders_of(ctx, nodes)
    items = []
    fifo = ctx.settings.queue_policy == "fifo"
    waiting = sorted((j for j in jobs if j.state is JobState.PENDING), key=lambda j: queue_key(j, fifo))
    for position, job in enumerate(served(waiting, ahead, fifo), 1):
        if position > limit:
            break
        mine = holders if job.kept is None else {n: h for n, h in holders.items() if h.id != job.id}
        items.append(QueuedJob(
            position=position, id=job.id, name=job.spec.name, owner=job.owner,
            team=tenants.team(job.owner), priority=job.spec.priority, nodes_min=job.spec.nodes.min,
            nodes_max=job.spec.nodes.max, created_at=job.created_at,
            waiting=why_waiting(job, nodes, mine, quotas.limits(job.owner, used))))
        ahead.add(job.owner, job.spec.nodes.min, 0)
    return QueueView(items=items)
