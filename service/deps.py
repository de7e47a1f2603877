"""FastAPI dependencies: the request's context and who is calling.

Principals and their tokens (docs/api.md's "Who can do what" says which endpoint takes which):
- a user: the user token;
- a node: the node token is only a bootstrap secret, good for registering; registration
  returns the node's own credential (`ftrain-node.<name>.<secret>`, only its sha256 kept in
  etcd), good for that node's heartbeats, reports and leaving, and for the log shipments and
  rendezvous of jobs it is a member of, while the lease it was registered under lives;
- a job: its token, for its rendezvous, rounds, snapshots, progress and control.
Another principal's valid token is 403; a missing, wrong or outdated one is 401.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.context import Context
from service.errors import JobNotFound
from service.models import ADMIN, JobRecord, NodeRecord

# One security scheme per kind of token, so the OpenAPI says which one each endpoint takes
# (all are `Authorization: Bearer <token>`; docs/api.md's "Who can do what" says the same).
_SCHEMES = {
    "userToken": "A user token: the admin's (the server's user token; `ftrain up` writes it to "
                 "<data-dir>/token) or a named user's (`ftrain users add`).",
    "adminToken": "The admin's token: the server's user token (`ftrain up`: <data-dir>/token).",
    "nodeToken": "The node (bootstrap) token: registers a node, nothing else.",
    "nodeCredential": "A node's own credential, returned by its registration "
                      "(`ftrain-node.<name>.<secret>`).",
    "jobToken": "A job's token, given to its workers as FTRAIN_JOB_TOKEN.",
}


def _scheme(name: str):
    return Annotated[HTTPAuthorizationCredentials | None,
                     Depends(HTTPBearer(auto_error=False, scheme_name=name, description=_SCHEMES[name]))]


UserCredentials = _scheme("userToken")
AdminCredentials = _scheme("adminToken")
NodeTokenCredentials = _scheme("nodeToken")
NodeCredentials = _scheme("nodeCredential")
JobCredentials = _scheme("jobToken")


async def get_context(request: Request) -> Context:
    # async, as every dependency here: FastAPI runs a plain `def` one in a worker thread, a
    # thread hop per request that cost more than the request's own work (bench/api.py --profile).
    return request.app.state.ctx


ContextDep = Annotated[Context, Depends(get_context)]


def unauthorized(detail: str) -> HTTPException:
    """A 401 that asks for a bearer token (for routes that check a token themselves)."""
    return HTTPException(status.HTTP_401_UNAUTHORIZED, detail=detail,
                         headers={"WWW-Authenticate": "Bearer"})


def token_matches(given: str, expected: str | None) -> bool:
    """`given` is the token `expected` (compared in constant time); never when none is expected."""
    return expected is not None and secrets.compare_digest(given.encode(), expected.encode())


@dataclass(frozen=True)
class Caller:
    """Who a user request comes from: a named user, or the admin (the server's user token,
    or anyone when the server has no user token)."""

    name: str
    is_admin: bool = False
    user_id: str | None = None  # a named user's id (service.users.UserRef); None for the admin


async def require_user(ctx: ContextDep, creds: UserCredentials) -> Caller:
    """A user token (submit, read, cancel): the admin's, or a named user's (service.users).
    Open, as the admin, only when no user token is configured."""
    return await user_caller(ctx, creds)


async def user_caller(ctx: Context, creds: HTTPAuthorizationCredentials | None) -> Caller:
    """Who a user token is (the admin or a named user); 401/403 for anything else."""
    expected = ctx.settings.user_token
    if creds is not None and token_matches(creds.credentials, expected):
        return Caller(ADMIN, is_admin=True)
    if creds is not None and (user := await ctx.users.who(creds.credentials)) is not None:
        return Caller(user.name, user_id=user.id)
    if expected is None:
        return Caller(ADMIN, is_admin=True)
    if creds is None:
        raise unauthorized("missing 'Authorization: Bearer <token>' (the user token; "
                            "`ftrain up` writes it to <data-dir>/token)")
    await _refuse_other_principal(ctx, creds.credentials, "user endpoints")
    raise unauthorized("invalid token")


CallerDep = Annotated[Caller, Depends(require_user)]


async def require_admin(ctx: ContextDep, creds: AdminCredentials) -> Caller:
    """The admin: managing users, draining nodes."""
    caller = await user_caller(ctx, creds)
    if not caller.is_admin:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"only the admin may do this (you are {caller.name!r}); the admin's "
                            "token is the server's user token (`ftrain up`: <data-dir>/token)")
    return caller


NODE_CREDENTIAL_PREFIX = "ftrain-node."


def new_node_credential(name: str) -> tuple[str, str]:
    """A fresh credential for node `name`, and the digest of it that etcd keeps."""
    credential = f"{NODE_CREDENTIAL_PREFIX}{name}.{secrets.token_urlsafe(32)}"
    return credential, credential_digest(credential)


def credential_digest(credential: str) -> str:
    # 256 random bits need no slow hash: nothing short of the credential itself matches.
    return hashlib.sha256(credential.encode()).hexdigest()


def _node_of_credential(given: str) -> str | None:
    """The node a credential-shaped token names (unverified), else None."""
    if not given.startswith(NODE_CREDENTIAL_PREFIX):
        return None
    name, dot, secret = given[len(NODE_CREDENTIAL_PREFIX):].rpartition(".")
    return name if dot and name and secret else None


def _is_job_token(ctx: Context, given: str) -> bool:
    """Whether `given` is the token of an unfinished job (to answer 403, not 401)."""
    for job_id in ctx.index.active_ids():
        job = ctx.index.get(job_id)
        if job is not None and token_matches(given, ctx.job_token(job)):
            return True
    return False


async def _refuse_other_principal(ctx: Context, given: str, what: str) -> None:
    """403 if `given` is another principal's valid-looking token; else return (then 401)."""
    s = ctx.settings
    if token_matches(given, s.user_token) or await ctx.users.who(given) is not None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"a user token cannot call {what}")
    if token_matches(given, s.node_token):
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"the node token cannot call {what}: it only registers a node "
                            "(POST /v1/nodes/register), which returns the node's own credential")
    if _node_of_credential(given) is not None:
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"a node credential cannot call {what}")
    if _is_job_token(ctx, given):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"a job token cannot call {what}")


async def require_node_token(ctx: ContextDep, creds: NodeTokenCredentials) -> None:
    """The node (bootstrap) token: registration only. Never a user token."""
    expected = ctx.settings.node_token
    if expected is None:
        return
    if creds is None:
        raise unauthorized("missing 'Authorization: Bearer <node token>'")
    if not token_matches(creds.credentials, expected):
        if _node_of_credential(creds.credentials) is not None:
            raise HTTPException(status.HTTP_403_FORBIDDEN,
                                "registering takes the node token, not a node credential")
        await _refuse_other_principal(ctx, creds.credentials, "node registration")
        raise unauthorized("invalid node token")


async def _node_credential(ctx: Context, creds: HTTPAuthorizationCredentials | None,
                           what: str) -> tuple[str, str]:
    """(node name, credential digest) of a credential-shaped token; 401/403 for anything else."""
    if creds is None:
        raise unauthorized("missing 'Authorization: Bearer <node credential>' (the credential "
                            "that registering returned)")
    name = _node_of_credential(creds.credentials)
    if name is None:
        await _refuse_other_principal(ctx, creds.credentials, what)
        raise unauthorized("invalid node credential")
    return name, credential_digest(creds.credentials)


async def verify_node(ctx: Context, name: str, digest: str) -> NodeRecord:
    """Node `name`'s live record if `digest` is its current credential's; 401
    (OutdatedCredential) if outdated, 404 (NodeNotFound) if no node of that name is alive."""
    return await ctx.nodes.verify(name, digest)


async def require_node_self(ctx: ContextDep, creds: NodeCredentials,
                            name: Annotated[str, Path()]) -> str | None:
    """The credential of node `name` itself (heartbeat, report, leaving); returns its digest.

    404 (NodeNotFound) when no node of that name is alive: the agent registers again.
    Open cluster (no node token): anyone, and None.
    """
    if ctx.settings.node_token is None:
        return None
    owner, digest = await _node_credential(ctx, creds, "this node endpoint")
    if owner != name:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"this credential is node {owner!r}'s; it cannot act for node {name!r}")
    return digest


async def require_member_node(ctx: ContextDep, creds: NodeCredentials,
                              job_id: Annotated[str, Path()]) -> str | None:
    """The credential of a live node that is (or was) a member of job `job_id`; its name.

    Open cluster (no node token): anyone, and None.
    """
    if ctx.settings.node_token is None:
        return None
    name, digest = await _node_credential(ctx, creds, "this endpoint")
    await verify_node(ctx, name, digest)
    job = await ctx.jobs.get(job_id)
    if name not in job.members and name not in job.former_members:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"node {name!r} is not a member of job {job_id}")
    return name


async def require_job_token(
    ctx: ContextDep, creds: JobCredentials, job_id: Annotated[str, Path()]
) -> JobRecord:
    """The job's own token (given to its workers); returns the job. Nothing else opens it."""
    if ctx.settings.node_token is None:
        return await ctx.jobs.get(job_id)
    if creds is None:
        raise unauthorized("missing 'Authorization: Bearer <job token>' (FTRAIN_JOB_TOKEN)")
    return await job_of_token(ctx, creds.credentials, job_id, f"act for job {job_id}",
                              "job-runtime endpoints (they take the job's own token, FTRAIN_JOB_TOKEN)")


async def job_of_token(ctx: Context, given: str, job_id: str, to: str, endpoints: str) -> JobRecord:
    """The job whose own token `given` is. Another job's token: 403 ("it cannot `to`");
    another kind of principal: 403 naming `endpoints`; anything else: 401. Strangers are
    not told which jobs exist."""
    try:
        job = await ctx.jobs.get(job_id)
    except JobNotFound:
        job = None
    if job is not None and token_matches(given, ctx.job_token(job)):  # derived (service.keyring)
        return job
    if _is_job_token(ctx, given):
        raise HTTPException(status.HTTP_403_FORBIDDEN, f"this is another job's token; it cannot {to}")
    await _refuse_other_principal(ctx, given, endpoints)
    raise unauthorized("invalid job token")


UserAuth = Depends(require_user)
AdminAuth = Depends(require_admin)
NodeBootstrap = Depends(require_node_token)
NodeSelf = Annotated[str | None, Depends(require_node_self)]
MemberNode = Annotated[str | None, Depends(require_member_node)]
JobTokenDep = Annotated[JobRecord, Depends(require_job_token)]
