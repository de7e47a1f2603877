"""Named users: the admin adds and removes them, and sets their quotas; anyone may ask who
they are.

A user's token is shown once, in the answer to its creation; etcd keeps its SHA-256 only
(service.users). The admin is not a stored user: it is whoever holds the server's user
token (`ftrain serve --token`, `ftrain up`'s <data-dir>/token). A user may belong to a team
(named at creation); the quotas of users and teams are `service.tenancy`'s.
"""

from __future__ import annotations

from fastapi import APIRouter, status

from service.api_contract import AuthFirstRoute
from service.decide import quotas
from service.deps import AdminAuth, CallerDep, ContextDep
from service.models import (
    ADMIN,
    NewUser,
    QuotaPatch,
    UserAccount,
    UserCreated,
    UserList,
    UserRecord,
    UserView,
)

router = APIRouter(prefix="/v1/users", tags=["users"], route_class=AuthFirstRoute)


def user_view(user: UserRecord, used: quotas.Usage | None = None) -> UserAccount:
    """What the admin sees of a user: its team and quota, and (with `used`) what it holds."""
    view = UserAccount(name=user.name, created_at=user.created_at, team=user.team,
                    max_nodes=user.max_nodes, max_gpus=user.max_gpus)
    if used is not None:
        view.nodes_in_use, view.gpus_in_use = used.user_nodes[user.name], used.user_gpus[user.name]
    return view


@router.post("", status_code=status.HTTP_201_CREATED, response_model=UserCreated,
             dependencies=[AdminAuth])
async def add_user(body: NewUser, ctx: ContextDep) -> UserCreated:
    """Create a user (in a team, if `team` is given) and its token (409 if the name is taken)."""
    user, token = await ctx.users.add(body.name, body.team)
    return UserCreated(name=user.name, created_at=user.created_at, team=user.team, token=token)


@router.get("", response_model=UserList, dependencies=[AdminAuth])
async def list_users(ctx: ContextDep) -> UserList:
    """The named users, by name (the admin first), with their teams, quotas and the nodes
    their unfinished jobs hold."""
    users = sorted(await ctx.users.list(), key=lambda u: u.name)
    used = quotas.usage(ctx.index.jobs(), await ctx.nodes.current(), await ctx.tenancy.current())
    return UserList(items=[UserAccount(name=ADMIN, admin=True, nodes_in_use=used.user_nodes[ADMIN],
                                    gpus_in_use=used.user_gpus[ADMIN]),
                           *(user_view(u, used) for u in users)])


@router.get("/me", response_model=UserView)
async def whoami(caller: CallerDep) -> UserView:
    """Who the caller's token says they are."""
    return UserView(name=caller.name, admin=caller.is_admin)


@router.patch("/{name}", response_model=UserAccount, dependencies=[AdminAuth])
async def set_user_quota(name: str, body: QuotaPatch, ctx: ContextDep) -> UserAccount:
    """Set or clear (null) the user's quota: the most nodes and GPUs its running jobs may
    hold at once. A job that would exceed it waits; one running over a lowered quota runs on."""
    return user_view(await ctx.tenancy.set_user_quota(name, body))


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, dependencies=[AdminAuth])
async def remove_user(name: str, ctx: ContextDep) -> None:
    """Delete a user: its token stops working at once; its jobs run on, still its own."""
    await ctx.users.remove(name)
    return None
