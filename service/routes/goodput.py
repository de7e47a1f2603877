"""The cluster's goodput: where every job's wall time went, added up (`GET /v1/goodput`).

Each job's own is `GET /v1/jobs/{id}/goodput` (service/routes/jobs.py); both come from the
ledger of service/decide/goodput.py, and the totals from the replica's book (service.goodput),
which `GET /metrics` publishes too.
"""

from __future__ import annotations

from fastapi import APIRouter

from service.api_contract import AuthFirstRoute
from service.context import Context
from service.deps import ContextDep, UserAuth
from service.errors import StoreUnavailable
from service.goodput import node_cause
from service.models import ClusterGoodput

router = APIRouter(prefix="/v1/goodput", tags=["jobs"], dependencies=[UserAuth], route_class=AuthFirstRoute)


@router.get("", response_model=ClusterGoodput)
async def cluster_goodput(ctx: ContextDep) -> ClusterGoodput:
    """Every job's wall time by cause, added up: those that exist (up to now for the unfinished)
    and those retention deleted."""
    await refresh_goodput(ctx)
    seconds = ctx.goodput.totals(ctx.jobs.clock())
    return ClusterGoodput(jobs=ctx.goodput.jobs(), wall_s=round(sum(seconds.values()), 3),
                          seconds={c: round(s, 3) for c, s in seconds.items()})


async def refresh_goodput(ctx: Context) -> None:
    """Bring the goodput book up to date: jobs' events, nodes' states now. Without etcd the
    figures stay as they were (the rest of /metrics still answers)."""
    now = ctx.jobs.clock()
    try:
        await ctx.goodput.refresh(ctx.index.jobs())
        nodes = await ctx.nodes.current()
    except StoreUnavailable:
        return
    ctx.goodput.sample_nodes({name: node_cause(n, ctx.index.job_of_node(name))
                              for name, n in nodes.items()}, now)
