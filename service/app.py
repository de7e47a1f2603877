"""The control plane's FastAPI app: `create_app(settings)`."""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from service import background
from service.context import Context
from service.decide.retention import describe
from service.errors import (
    FtrainError,
    InvalidTransition,
    JobNotFound,
    LogStorageUnavailable,
    StoreUnavailable,
)
from service.routes import health, jobs, logs, nodes, rendezvous, snapshots, users
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
            await ctx.kv.close()

    app = FastAPI(title="ftrain", version="1", lifespan=lifespan,
                  description="Elastic, fault-tolerant PyTorch training service.")
    app.state.ctx = ctx
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    _install_error_handlers(app)
    for module in (health, jobs, nodes, rendezvous, snapshots, logs, users):
        app.include_router(module.router)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(FtrainError)
    async def _domain_error(request: Request, exc: FtrainError):
        body: dict = {"detail": exc.message}
        headers = {}
        if isinstance(exc, JobNotFound):  # it may have existed: say how long jobs are kept
            body["detail"] = f"{exc.message} ({describe(request.app.state.ctx.settings.retention)})"
        if isinstance(exc, InvalidTransition):
            body["state"] = exc.state
        if isinstance(exc, StoreUnavailable | LogStorageUnavailable):
            headers["Retry-After"] = "1"
        return JSONResponse(body, status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = []
        for err in exc.errors():
            loc = [str(p) for p in err.get("loc", ()) if p != "body"]
            errors.append({"field": ".".join(loc) or "body", "message": err.get("msg", ""),
                           "type": err.get("type", "")})
        summary = "; ".join(f"{e['field']}: {e['message']}" for e in errors)
        return JSONResponse({"detail": f"invalid request: {summary}", "errors": errors},
                            status_code=422)


class BodySizeLimit:
    """Reject bodies over `max_bytes` with 413 before they are parsed (pure ASGI)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return await self._too_large(send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._too_large(send)

    async def _too_large(self, send: Send) -> None:
        body = (f'{{"detail":"request body larger than {self.max_bytes} bytes"}}').encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass
