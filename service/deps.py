"""FastAPI dependencies: the request's context and who is calling."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.context import Context
from service.errors import JobNotFound
from service.models import ADMIN, JobRecord

_bearer = HTTPBearer(auto_error=False)
Credentials = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def get_context(request: Request) -> Context:
    return request.app.state.ctx


ContextDep = Annotated[Context, Depends(get_context)]


def unauthorized(detail: str) -> HTTPException:
    """A 401 that asks for a bearer token (for routes that check a token themselves)."""
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail,
                         headers={"WWW-Authenticate": "Bearer"})


def token_matches(given: str, expected: str | None) -> bool:
    """`given` is the token `expected` (compared in constant time); never when none is expected."""
    return expected is not None and secrets.compare_digest(given.encode(), expected.encode())


# This module's own calls still use the old names, so that branches changing them merge cleanly.
_unauthorized, _matches = unauthorized, token_matches


@dataclass(frozen=True)
class Caller:
    """Who a user request comes from: a named user, or the admin (the server's user token,
    or anyone when the server has no user token)."""

    name: str
    is_admin: bool = False


async def require_user(ctx: ContextDep, creds: Credentials) -> Caller:
    """A user token (submit, read, cancel): the admin's, or a named user's (service.users).
    Open, as the admin, only when no user token is configured."""
    expected = ctx.settings.user_token
    if creds is not None and _matches(creds.credentials, expected):
        return Caller(ADMIN, is_admin=True)
    if creds is not None and (name := await ctx.users.who(creds.credentials)) is not None:
        return Caller(name)
    if expected is None:
        return Caller(ADMIN, is_admin=True)
    if creds is None:
        raise _unauthorized("missing 'Authorization: Bearer <token>' (the user token; "
                            "`ftrain up` writes it to <data-dir>/token)")
    if _matches(creds.credentials, ctx.settings.node_token):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "a node token cannot call user endpoints")
    raise _unauthorized("invalid token")


CallerDep = Annotated[Caller, Depends(require_user)]


def require_admin(caller: CallerDep) -> Caller:
    """The admin: managing users, draining nodes."""
    if not caller.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"only the admin may do this (you are {caller.name!r}); the admin's "
                            "token is the server's user token (`ftrain up`: <data-dir>/token)")
    return caller


def require_node(ctx: ContextDep, creds: Credentials) -> None:
    """A node token (register, heartbeat, rendezvous). Never a user token."""
    expected = ctx.settings.node_token
    if expected is None:
        return
    if creds is None:
        raise _unauthorized("missing 'Authorization: Bearer <node token>'")
    if not _matches(creds.credentials, expected):
        if _matches(creds.credentials, ctx.settings.user_token):
            raise HTTPException(status.HTTP_403_FORBIDDEN, "a user token cannot call node endpoints")
        raise _unauthorized("invalid node token")


async def require_job_or_node(
    ctx: ContextDep, creds: Credentials, job_id: Annotated[str, Path()]
) -> JobRecord:
    """The job's own token (given to its workers) or the node token; returns the job."""
    if creds is None and ctx.settings.node_token is not None:
        raise _unauthorized("missing 'Authorization: Bearer <job token>'")
    try:
        job = await ctx.jobs.get(job_id)
    except JobNotFound:
        if creds is not None and _matches(creds.credentials, ctx.settings.node_token):
            raise
        raise _unauthorized("invalid job token") from None
    if ctx.settings.node_token is None:
        return job
    assert creds is not None
    job_token = ctx.job_token(job)  # derived, never stored (service.keyring)
    if _matches(creds.credentials, job_token) or _matches(creds.credentials, ctx.settings.node_token):
        return job
    if _matches(creds.credentials, ctx.settings.user_token):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "a user token cannot call job-runtime endpoints")
    raise _unauthorized("invalid job token")


UserAuth = Depends(require_user)
AdminAuth = Depends(require_admin)
NodeAuth = Depends(require_node)
JobTokenDep = Annotated[JobRecord, Depends(require_job_or_node)]
