"""The control plane's FastAPI app: `create_app(settings)`."""

from __future__ import annotations

import contextlib
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service import api_contract, background
from service.admission import Admission
from service.context import Context
from service.cross_site import LoopbackOnly
from service.errors import FtrainError, error_response
from service.fastpath import FastPaths
from service.routes import goodput, health, jobs, logs, nodes, queue, rendezvous, snapshots, teams, ui, users
from service.settings import Settings

log = logging.getLogger(__name__)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    ctx = Context.build(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await background.start(ctx)
        try:
            yield
        finally:
            await background.stop(ctx)
            await ctx.presence.close()
            await ctx.kv.close()

    # /docs from the package's own Swagger UI (service.routes.ui), not a CDN; no redoc.
    app = FastAPI(title="ftrain", version="1", lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Elastic, fault-tolerant PyTorch training service.")
    app.state.ctx = ctx
    app.add_middleware(FastPaths, ctx=ctx)  # inside the body-size limit (added after it: outside)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Outside the size limit: no token and a bad or large body is a 401 (service/api_contract.py).
    app.add_middleware(api_contract.AllowAll, routes_of=lambda: app.routes)
    closed = settings.user_token is not None and settings.node_token is not None
    app.add_middleware(api_contract.RequireBearer, closed=closed)
    # Without tokens, only loopback and the server's own origin (service/cross_site.py).
    app.add_middleware(LoopbackOnly, open_=not closed)
    # Outermost: a user request over the limit costs a 429, nothing more; node traffic first.
    app.add_middleware(Admission, limit=ctx.admission, openapi=lambda: app.openapi())
    _install_error_handlers(app)
    for module in (health, jobs, goodput, queue, nodes, rendezvous, snapshots, logs, users, teams):
        app.include_router(module.router)
    ui.install(app)
    api_contract.describe(app)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(FtrainError)
    async def _domain_error(request: Request, exc: FtrainError):
        return error_response(exc, request.app.state.ctx.settings.retention)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            errors.append({"field": ".".join(loc) or "body", "message": _message(err.get("msg", "")),
                           "type": err.get("type", "")})
        summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return JSONResponse({"detail": f"invalid request: {summary}", "errors": errors},
                            status_code=422)


def _message(pydantic_msg: str) -> str:
    """A validator's own words, without pydantic's "Value error, " in front of them."""
    return pydantic_msg.removeprefix("Value error, ").removeprefix("Assertion failed, ")


# The largest rendezvous state write (PUT /v1/rdzv/{id}/state) taken, whatever the body limit
# of other requests: a whole state of about 11,000 nodes (etcd takes 1.5 MiB a request).
RDZV_STATE_MAX_BYTES = 1024 * 1024
_RDZV_STATE_PATH = re.compile(r"^/v1/rdzv/[^/]+/state$")


class BodySizeLimit:
    """Reject bodies over `max_bytes` with 413 before they are parsed (pure ASGI); under `/v1/`
    after the route has judged the token (`api_contract.AuthFirstRoute`)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    def limit_of(self, path: str) -> int:
        """`max_bytes`, or more for a rendezvous state write: any node may write the whole
        state (torch's compare-and-set), about 90 bytes a node as it travels, so a round of
        1,024 nodes would be over a 64 KiB limit (`RDZV_STATE_MAX_BYTES`)."""
        if path.startswith("/v1/rdzv/") and _RDZV_STATE_PATH.match(path):
            return max(self.max_bytes, RDZV_STATE_MAX_BYTES)
        return self.max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length")
        limit = self.limit_of(scope["path"])
        if length is not None:  # the server holds the body to this length
            if length.isdigit() and int(length) > limit:
                return await self._too_large(scope, send, limit)
            return await self.app(scope, receive, send)
        if b"transfer-encoding" not in headers:  # no body
            return await self.app(scope, receive, send)
        # No length (chunked): read the body here, up to the limit, and hand it on whole. An
        # error raised from inside the app's own read would reach FastAPI's body parsing,
        # which answers any failure there with 400.
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > limit:
                return await self._too_large(scope, send, limit)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay_then_receive():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay_then_receive, send)

    async def _too_large(self, scope: Scope, send: Send, limit: int) -> None:
        if scope["path"].startswith("/v1/"):
            # The route judges the token first, then answers 413 (api_contract.AuthFirstRoute):
            # it gets the request marked, without its body.
            async def no_body():
                return {"type": "http.request", "body": b"", "more_body": False}

            return await self.app({**scope, api_contract.TOO_LARGE: limit}, no_body, send)
        body = (f'{{"detail":"request body larger than {limit} bytes"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
