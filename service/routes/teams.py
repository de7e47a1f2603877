"""Teams: a team is named by its users (`POST /v1/users` with `team`); the admin sets its
quota, which the unfinished jobs of all its users count against together."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from service.api_contract import AuthFirstRoute
from service.decide import quotas
from service.deps import AdminAuth, ContextDep
from service.models import DNS_LABEL, QuotaPatch, TeamList, TeamRecord, TeamView

router = APIRouter(prefix="/v1/teams", tags=["teams"], route_class=AuthFirstRoute,
                   dependencies=[AdminAuth])

TeamName = Annotated[str, Path(min_length=1, max_length=40, pattern=DNS_LABEL.pattern,
                               description="A DNS label: lower-case letters, digits and '-'.")]


@router.get("", response_model=TeamList)
async def list_teams(ctx: ContextDep) -> TeamList:
    """Every team (named by a user or given a quota), with its members, quota and the
    nodes and GPUs its members' unfinished jobs hold."""
    users, teams = await ctx.tenancy.records()
    tenants = await ctx.tenancy.current()
    used = quotas.usage(ctx.index.jobs(), await ctx.nodes.current(), tenants)
    records = {t.name: t for t in teams}
    names = sorted(records.keys() | {u.team for u in users if u.team})
    return TeamList(items=[TeamView(
        name=name, members=sorted(u.name for u in users if u.team == name),
        max_nodes=records[name].max_nodes if name in records else None,
        max_gpus=records[name].max_gpus if name in records else None,
        nodes_in_use=used.team_nodes[name], gpus_in_use=used.team_gpus[name]) for name in names])


@router.patch("/{team}", response_model=TeamView)
async def set_team_quota(team: TeamName, body: QuotaPatch, ctx: ContextDep) -> TeamView:
    """Set or clear (null) the team's quota: the most nodes and GPUs the running jobs of
    all its users may hold at once."""
    record: TeamRecord = await ctx.tenancy.set_team_quota(team, body)
    return TeamView(name=record.name, max_nodes=record.max_nodes, max_gpus=record.max_gpus)
