"""Named users: the admin adds and removes them; anyone may ask who they are.

A user's token is shown once, in the answer to its creation; etcd keeps its SHA-256 only
(service.users). The admin is not a stored user: it is whoever holds the server's user
token (`ftrain serve --token`, `ftrain up`'s <data-dir>/token).
"""

from __future__ import annotations

from fastapi import APIRouter, status

from service.api_contract import AuthFirstRoute
from service.deps import AdminAuth, CallerDep, ContextDep
from service.models import ADMIN, NewUser, UserCreated, UserList, UserView

router = APIRouter(prefix="/v1/users", tags=["users"], route_class=AuthFirstRoute)


@router.post("", status_code=status.HTTP_201_CREATED, response_model=UserCreated,
             dependencies=[AdminAuth])
async def add_user(body: NewUser, ctx: ContextDep) -> UserCreated:
    """Create a user and its token (409 if the name is taken)."""
    user, token = await ctx.users.add(body.name)
    return UserCreated(name=user.name, created_at=user.created_at, token=token)


@router.get("", response_model=UserList, dependencies=[AdminAuth])
async def list_users(ctx: ContextDep) -> UserList:
    """The named users, by name (the admin first)."""
    users = sorted(await ctx.users.list(), key=lambda u: u.name)
    return UserList(items=[UserView(name=ADMIN, admin=True),
                           *(UserView(name=u.name, created_at=u.created_at) for u in users)])


@router.get("/me", response_model=UserView)
async def whoami(caller: CallerDep) -> UserView:
    """Who the caller's token says they are."""
    return UserView(name=caller.name, admin=caller.is_admin)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, dependencies=[AdminAuth])
async def remove_user(name: str, ctx: ContextDep) -> None:
    """Delete a user: its token stops working at once; its jobs run on, still its own."""
    await ctx.users.remove(name)
    return None
