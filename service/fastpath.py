"""The two requests a large cluster sends most, answered without FastAPI's per-request work.

A node heartbeat (every node, every TTL/4: 3,333 a second for 5,000 nodes at the default
TTL) and a job's status read cost the control plane little of their own once they are
answered from memory (`service.heartbeats`, `service.job_index`); what is left is FastAPI's
own work per request (matching the route among all of them, solving each dependency,
parsing), measured with `bench/api.py --profile` at several times the work of the answer.
This ASGI layer, inside the body-size limit and in front of the app, recognises exactly
those two requests and answers them by calling the same functions as their routes, with
the same checks of the caller (`service.deps`):

* `POST /v1/nodes/{name}/heartbeat` with a node credential of node `name`
  (`routes.nodes.heartbeat_answer`);
* `GET /v1/jobs/{id}` with the admin's token (or none, in an open cluster), when the
  index can answer (`routes.jobs.status_from_index`).

Anything else, and anything unusual about one of those (another principal's token, a
named user's token, a body that does not parse, a job the index does not have), goes to the
app unchanged, which answers it as always. A heartbeat's domain error (a lapsed lease: 404,
etcd away: 503) is answered as the app answers it, by the same function
(`service.app.domain_error`).
"""

from __future__ import annotations

import re

from starlette.types import ASGIApp, Receive, Scope, Send

from service.api_contract import TOO_LARGE
from service.context import Context
from service.deps import _node_of_credential, credential_digest, token_matches
from service.errors import FtrainError
from worker.protocol import REVISION_HEADER, HeartbeatRequest

_HEARTBEAT = re.compile(r"^/v1/nodes/([^/]+)/heartbeat$")
_JOB = re.compile(r"^/v1/jobs/([^/]+)$")
_JSON = (b"content-type", b"application/json")
_REVISION = REVISION_HEADER.lower().encode()


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
        return await self.app(scope, receive, send)

    async def _heartbeat(self, name: str, scope: Scope, receive: Receive, send: Send) -> None:
        first = await receive()
        replay = _replaying(first, receive)
        body = first.get("body", b"")
        token = _bearer(scope)
        if (first["type"] != "http.request" or first.get("more_body", False)
                or self.ctx.settings.node_token is None or token is None
                or _node_of_credential(token) != name):
            return await self.app(scope, replay, send)
        try:
            req = HeartbeatRequest.model_validate_json(body) if body.strip() else None
        except ValueError:
            return await self.app(scope, replay, send)  # the app answers 422
        from service.routes.nodes import heartbeat_answer

        try:
            answer = await heartbeat_answer(self.ctx, name, credential_digest(token), req)
        except FtrainError as exc:  # 404 (register again), 401, 503: as the app answers them
            from service.app import domain_error

            return await domain_error(self.ctx, exc)(scope, replay, send)
        await _answer(send, answer)

    async def _status(self, job_id: str, scope: Scope, receive: Receive, send: Send) -> None:
        settings = self.ctx.settings
        token = _bearer(scope)
        admin = (token is not None and token_matches(token, settings.user_token)) or (
            token is None and settings.user_token is None)
        seen: int | None = None
        for key, value in scope["headers"]:
            if key == _REVISION:
                if not value.isdigit():
                    admin = False  # the app answers 422
                seen = int(value) if value.isdigit() else None
        if not admin:
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
