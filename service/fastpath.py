"""The requests a large cluster sends most, answered without FastAPI's per-request work.

A node heartbeat (every node, every TTL/4: 3,333 a second for 5,000 nodes at the default
TTL) and a job's status read cost the control plane little of their own once they are
answered from memory (`service.heartbeats`, `service.job_index`); what is left is FastAPI's
own work per request (matching the route among all of them, solving each dependency,
parsing), measured with `bench/api.py --profile` at several times the work of the answer.
This ASGI layer, inside the body-size limit and in front of the app, recognises exactly
those requests and answers them by calling the same functions as their routes, with
the same checks of the caller (`service.deps`):

* `POST /v1/nodes/{name}/heartbeat` with a node credential of node `name`
  (`routes.nodes.heartbeat_answer`);
* `GET /v1/jobs/{id}` with a user token, when the index can answer
  (`routes.jobs.status_from_index`);
* `POST /v1/jobs` with a user token, a JSON body (so said by its Content-Type) that is a
  valid `JobSpec` within its size limits (`routes.jobs.submit_answer`): submissions come in bursts, and FastAPI's
  dependencies and parsing were half of one's time.

A user token is the admin's (or none, in an open cluster), or a named user's that this
replica's cache of tokens has (`UserStore.cached`, fed by a watch: no etcd read).
Anything else, and anything unusual about one of those (another principal's token, a
token the cache has not, a body that does not parse or is not JSON, a job the index does
not have), goes to the app unchanged, which answers it as always. A domain error (a lapsed
lease: 404, a reused Idempotency-Key: 409, etcd away: 503) is answered as the app answers
it, by the same function (`service.errors.error_response`).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api_contract import TOO_LARGE
from service.context import Context
from service.cross_site import is_json
from service.deps import Caller, _node_of_credential, credential_digest, token_matches
from service.errors import FtrainError, error_response
from service.models import ADMIN, JobSpec
from service.users import token_digest
from worker.protocol import REVISION_HEADER, HeartbeatRequest

_HEARTBEAT = re.compile(r"^/v1/nodes/([^/]+)/heartbeat$")
_JOB = re.compile(r"^/v1/jobs/([^/]+)$")
_JSON = (b"content-type", b"application/json")
_REVISION = REVISION_HEADER.lower().encode()
MAX_IDEMPOTENCY_KEY = 200  # characters, as the route's `Header(max_length=200)`


class FastPaths:
    def __init__(self, app: ASGIApp, ctx: Context):
        self.app = app
        self.ctx = ctx

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and TOO_LARGE not in scope:
            method, path = scope["method"], scope["path"]
            if method == "POST" and (m := _HEARTBEAT.match(path)):
                return await self._heartbeat(m.group(1), scope, receive, send)
            if method == "GET" and (m := _JOB.match(path)):
                return await self._status(m.group(1), scope, receive, send)
            if method == "POST" and path == "/v1/jobs":
                return await self._submit(scope, receive, send)
        return await self.app(scope, receive, send)

    def _user(self, scope: Scope) -> Caller | None:
        """The admin (its token, or none in an open cluster), or a named user whose token the
        cache has, as `deps.require_user` tells them; None: the app decides."""
        token, expected = _bearer(scope), self.ctx.settings.user_token
        if (token is not None and token_matches(token, expected)) or (token is None and expected is None):
            return Caller(ADMIN, is_admin=True)
        if token is not None and (user := self.ctx.users.cached(token_digest(token))) is not None:
            return Caller(user.name, user_id=user.id)
        return None

    async def _submit(self, scope: Scope, receive: Receive, send: Send) -> None:
        caller = self._user(scope)
        if caller is None:
            return await self.app(scope, receive, send)
        idempotency_key: str | None = None
        json_body = False
        for key, value in scope["headers"]:
            if key == b"content-type":
                json_body = is_json(value)
            if key == b"idempotency-key":
                if idempotency_key is not None or len(value) > MAX_IDEMPOTENCY_KEY:
                    return await self.app(scope, receive, send)  # the app answers 422
                idempotency_key = value.decode("latin-1")
        if not json_body:  # the app answers 415 (service.cross_site)
            return await self.app(scope, receive, send)
        first = await receive()
        replay = _replaying(first, receive)
        if first["type"] != "http.request" or first.get("more_body", False):
            return await self.app(scope, replay, send)
        try:
            spec = JobSpec.model_validate_json(first.get("body", b""))
        except ValueError:
            return await self.app(scope, replay, send)  # the app answers 422
        if spec.size_errors():
            return await self.app(scope, replay, send)
        from service.routes.jobs import submit_answer

        try:
            answer = await submit_answer(self.ctx, spec, caller, idempotency_key)
        except FtrainError as exc:  # a reused Idempotency-Key (409), etcd away (503)
            return await error_response(exc, self.ctx.settings.retention)(scope, replay, send)
        await answer(scope, replay, send)

    async def _heartbeat(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()
        replay = _replaying(first, receive)
        body = first.get("body", b"")
        token = _bearer(scope)
        if (first["type"] != "http.request" or first.get("more_body", False)
                or self.ctx.settings.node_token is None or token is None
                or _node_of_credential(token) != name
                or (body and not is_json(dict(scope["headers"]).get(b"content-type")))):
            return await self.app(scope, replay, send)
        try:
            req = HeartbeatRequest.model_validate_json(body) if body.strip() else None
        except ValueError:
            return await self.app(scope, replay, send)  # the app answers 422
        from service.routes.nodes import heartbeat_answer

        try:
            answer = await heartbeat_answer(self.ctx, name, credential_digest(token), req, receive)
        except FtrainError as exc:  # 404 (register again), 401, 503: as the app answers them
            return await error_response(exc, self.ctx.settings.retention)(scope, replay, send)
        await _answer(send, answer)

    async def _status(self, job_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        user = self._user(scope) is not None
        seen: int | None = None
        for key, value in scope["headers"]:
            if key == _REVISION:
                if not value.isdigit():
                    user = False  # the app answers 422
                seen = int(value) if value.isdigit() else None
        if not user:
            return await self.app(scope, receive, send)
        from service.routes.jobs import status_from_index

        cached = await status_from_index(self.ctx, job_id, seen)
        if cached is None:
            return await self.app(scope, receive, send)
        body, revision = cached
        await _answer(send, body, [(_REVISION, str(revision).encode())])


def _bearer(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _replaying(first: dict, receive: Receive) -> Receive:
    """`receive`, giving the message already read first (the app reads the body again)."""
    given = False

    async def replay():
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()

    return replay


async def _answer(send: Send, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": 200,
                "headers": [_JSON, (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
