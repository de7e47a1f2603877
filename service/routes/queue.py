"""The queue: the waiting jobs in the order they will start, each with what it waits for.

The order is the scheduler's own (`decide.shares.fair_queue`: priority, then the owner's
share of the cluster, then age), played forward: each job ahead is counted as holding its
`min` nodes when the next one's turn comes, as a pass that starts it would. The reasons are
`decide.waiting`'s, as `GET /v1/jobs/{id}` gives them, against what is held now, but for a job
that the free nodes would start while the first job that waits for more is ahead of it: the
nodes are kept for that one unless it cannot delay it (`decide.backfill`), and its reason says
so. What each would preempt is `decide.preempt.would_take` on the running jobs of now, each job taken as if
it were the next to start (so two jobs may name the same victim).
"""

from __future__ import annotations

import copy

from fastapi import APIRouter, Query

from service.api_contract import AuthFirstRoute
from service.decide import backfill, giveback, preempt, quotas
from service.decide.placement import fits
from service.decide.order import queue_key
from service.decide.shares import served
from service.decide.waiting import why_waiting
from service.deps import ContextDep, UserAuth
from service.models import JobRecord, JobState, NodeRecord, NodeState, QueuedJob, QueueView, WouldPreempt
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
    running = [j for j in jobs if j.state is not JobState.PENDING]
    victims = preempt.Victims(running, ctx.jobs.clock())
    starving = set() if fifo else giveback.starved({j.owner for j in waiting}, used)
    donors = giveback.donors(running) if starving else []
    under_way = preempt.giving_to(jobs)
    now = ctx.jobs.clock()
    head, start = None, None  # the first job that waits for nodes no preemption gives it (`decide.backfill`)
    for position, job in enumerate(served(waiting, ahead, fifo), 1):
        if position > limit:
            break
        mine = holders if job.kept is None else {n: h for n, h in holders.items() if h.id != job.id}
        applying = quotas.limits(job.owner, used)
        may_preempt = not fifo and quotas.leaves_room_for_min(job, applying)
        free_nodes = usable(job, nodes, mine)
        free = len(free_nodes)
        takes, fair = [], False
        if may_preempt:
            takes = preempt.would_take(job, free, under_way.get(job.id, []), victims, nodes)
            if not takes and job.owner in starving:  # (as the scheduler's `claim`)
                takes = giveback.choose(job, preempt.shortfall(job, free, 0), donors, used, nodes,
                                        now, settle_s=ctx.settings.fair_share_settle_s)
                fair = True
        reason = why_waiting(job, nodes, mine, applying)
        if may_preempt and head is None and free < job.spec.nodes.min and not takes:
            start = backfill.planned_start(job, free_nodes, running, nodes, now)
            head = job if start is not None else None
        elif may_preempt and head is not None and free >= job.spec.nodes.min \
                and len(backfill.may_take(job, free_nodes, head, start, nodes, now)) < job.spec.nodes.min:
            reason = backfill.held_back(job, head, start, now)
        items.append(QueuedJob(
            position=position, id=job.id, name=job.spec.name, owner=job.owner,
            team=tenants.team(job.owner), priority=job.spec.priority, nodes_min=job.spec.nodes.min,
            nodes_max=job.spec.nodes.max, created_at=job.created_at,
            waiting=reason, would_preempt=[shown(t, fair) for t in takes]))
        ahead.add(job.owner, job.spec.nodes.min, 0)
    return QueueView(items=items)


def shown(take: preempt.Take, fair: bool) -> WouldPreempt:
    """`take` as the queue shows it (`fair`: a fair-share give-back, unless one is under way)."""
    under_way = take.victim.preempt
    return WouldPreempt(job_id=take.victim.id, priority=take.victim.spec.priority,
                        how="suspend" if take.suspend else "shrink", nodes=list(take.leave),
                        under_way=under_way is not None,
                        fair_share=under_way.fair_share if under_way is not None else fair)


def usable(job: JobRecord, nodes: dict[str, NodeRecord], holders: dict[str, JobRecord]) -> list[str]:
    """The free nodes `job` could start on now: READY, held by no job, with what it asks of each."""
    return [n for n, node in nodes.items() if n not in holders and node.state is NodeState.READY
            and fits(job.spec, node)]
