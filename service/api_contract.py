"""The API's contract beyond the routes: authentication before the body, and an OpenAPI
description that lists the answers the server really sends.

`RequireBearer` (pure ASGI, outside the body-size limit): on a closed control plane (both a
user and a node token configured, as `ftrain up` and any non-loopback server have), a `/v1/`
request with no `Authorization: Bearer` header gets 401 before its body is read or parsed,
so no token and a bad (or too large) body is a 401, not a 400, 413 or 422. Every `/v1/`
route takes some token there (`service/deps.py`). A wrong token (or another principal's) is
judged by the route's own dependencies before its body too (`AuthFirstRoute`, the class of
every `/v1/` route): 401/403, then 413, 415 (a body not sent as JSON: `service.cross_site`)
or 422.

`describe(app)` adds to each operation of the generated OpenAPI the error answers of
`service/app.py` as they are sent: 401 (with `WWW-Authenticate: Bearer`), 403, 404 (routes of
one job or node), 409, 413 (routes with a body), 422 (`detail` a string, `errors` a list of
`{field, message, type}`), 429 (user routes, `service/admission.py`) and 503 (both with
`Retry-After`), each a JSON `ErrorBody`; the NDJSON stream of `GET /v1/jobs/{job_id}/logs?follow=true`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.dependencies.utils import solve_dependencies
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from service.admission import NODE_SCHEMES
from service.cross_site import NOT_JSON, has_body, is_json
from service.models import LogLine


class ErrorBody(BaseModel):
    """Every error answer's body (401, 403, 404, 409, 410, 413, 415, 429, 503)."""

    detail: str = Field(..., examples=["job mnist-1a2b3c not found"])
    state: str | None = Field(None, description="409 on a job: the state it is in.",
                              examples=["CANCELLED"])


class FieldError(BaseModel):
    field: str = Field(..., description="Dotted path of the field ('body' for the whole).",
                       examples=["nodes.min"])
    message: str = Field(..., examples=["Input should be greater than or equal to 1"])
    type: str = Field(..., examples=["greater_than_equal"])


class ValidationErrorBody(BaseModel):
    """422: the request names something the spec's rules refuse."""

    detail: str = Field(..., examples=["invalid request: nodes.min: Input should be greater than or "
                                       "equal to 1"])
    errors: list[FieldError]


_WHY = {
    400: "The body cannot be read (not JSON).",
    401: "No token, or not one this endpoint takes (`WWW-Authenticate: Bearer`).",
    403: "A token of another kind or another job/node than this endpoint takes, or not the admin.",
    404: "No such job or node (finished jobs are deleted after their retention).",
    409: "The request conflicts with the current state (`state` says which, for a job).",
    410: "The rendezvous is closed: its attempt is not the job's current one, or the job has ended "
         "(do not retry).",
    413: "The request body is larger than the server's limit.",
    415: "The request body is not sent as JSON (`Content-Type: application/json`).",
    422: "The request breaks the API's rules: `errors` names each field.",
    429: "More user requests than the control plane serves at once now (node traffic goes "
         "first); try again after `Retry-After` seconds.",
    503: "The store (etcd) or the log storage cannot be reached now; try again (`Retry-After`).",
}


class RequireBearer:
    """401 for a `/v1/` request without a bearer token, before its body is read (pure ASGI)."""

    def __init__(self, app: ASGIApp, closed: bool):
        self.app = app
        self.closed = closed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.closed or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers", ())).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() == b"bearer" and token.strip():
            return await self.app(scope, receive, send)
        body = b'{"detail":"missing \'Authorization: Bearer <token>\'"}'
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"www-authenticate", b"Bearer"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


TOO_LARGE = "ftrain.body_too_large"  # scope key: BodySizeLimit's limit, when it held the body back


def _route_context(route: APIRoute) -> Any:
    """What FastAPI builds `route`'s handler for: since 0.16x an included route's handler is
    built under a context (its dependant with the router's dependencies); before, the route."""
    try:
        from fastapi.routing import _effective_route_context_var
    except ImportError:  # older FastAPI: include_router copied the route, dependencies merged
        return route
    context = _effective_route_context_var.get()
    return context if context is not None and getattr(context, "original_route", None) is route \
        else route


class AuthFirstRoute(APIRoute):
    """A route whose token is judged before its body: a body that is not JSON, or one over
    the size limit (`service.app.BodySizeLimit` marks the request `TOO_LARGE` and passes it
    on without its body), gets the route's 401/403 when its token is wrong, and its 422/413
    only for a caller the route takes. The route's dependencies (the token checks) are run
    once more, with no body, only on those error paths."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        dependant = _route_context(self).dependant
        embed = getattr(_route_context(self), "_embed_body_fields", False)
        takes_body = bool(dependant.body_params)

        async def authenticate(request: Request) -> None:
            # Raises the dependencies' HTTPException (401/403/404); the missing body's errors
            # are the endpoint's own and not looked at.
            await solve_dependencies(request=request, dependant=dependant, body=None,
                                     async_exit_stack=request.scope["fastapi_inner_astack"],
                                     embed_body_fields=embed)

        async def auth_first(request: Request):
            limit = request.scope.get(TOO_LARGE)
            if limit is not None:
                await authenticate(request)
                return JSONResponse({"detail": f"request body larger than {limit} bytes"}, 413)
            if takes_body and not is_json(request.headers.get("content-type")) \
                    and has_body(dict(request.scope["headers"])):
                await authenticate(request)  # (no body read: a form cannot be sent as JSON)
                return JSONResponse({"detail": NOT_JSON}, 415)
            try:
                return await handler(request)
            except RequestValidationError as exc:
                if any(e.get("type") == "json_invalid" for e in exc.errors()):
                    await authenticate(request)
                raise

        return auth_first


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _error(code: int, schema: str) -> dict:
    out: dict[str, Any] = {"description": _WHY[code],
                           "content": {"application/json": {"schema": _ref(schema)}}}
    if code == 401:
        out["headers"] = {"WWW-Authenticate": {"schema": {"type": "string", "example": "Bearer"}}}
    if code in (429, 503):
        out["headers"] = {"Retry-After": {"schema": {"type": "string", "example": "1"}}}
    return out


def describe(app: FastAPI) -> None:
    """Replace `app.openapi` with one that documents the error answers as sent."""

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description,
                             routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in (ErrorBody, ValidationErrorBody, LogLine):
            one = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(one.pop("$defs", {}))
            components[model.__name__] = one
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        for path, ops in schema.get("paths", {}).items():
            for method, op in ops.items():
                _describe_operation(path, method, op)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _is_user_operation(op: dict) -> bool:
    """Whether an operation takes a token other than a node's or a job's."""
    return any(name not in NODE_SCHEMES for req in op.get("security", ()) for name in req)


def _describe_operation(path: str, method: str, op: dict) -> None:
    for param in op.get("parameters", ()):
        # A query, header or path parameter is a string on the wire: it is left out, never
        # null. FastAPI writes an optional one as anyOf [T, null]; a client sending "null"
        # for it gets a 422, so the description says T.
        schema = param.get("schema", {})
        kinds = [k for k in schema.get("anyOf", ()) if k != {"type": "null"}]
        if len(kinds) == 1 and len(schema["anyOf"]) == 2:
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            param["schema"] = {**kinds[0], **rest}
    responses = op.setdefault("responses", {})
    if path.startswith("/v1/"):
        codes = [401, 403, 503]
        names = {p.get("name") for p in op.get("parameters", ())}
        if "{" in path or "after" in names:  # a job, node, user, rendezvous or snapshot named
            codes.append(404)
        if method in ("post", "put", "delete"):
            codes.append(409)
        if "requestBody" in op:
            codes += [400, 413, 415]
        if path.startswith("/v1/rdzv/"):
            codes.append(410)
        if _is_user_operation(op):  # (service.admission: node traffic is never refused)
            codes.append(429)
        for code in codes:
            responses.setdefault(str(code), _error(code, "ErrorBody"))
    if "422" in responses or "requestBody" in op or op.get("parameters"):
        responses["422"] = _error(422, "ValidationErrorBody")
    if path == "/v1/jobs/{job_id}/logs" and method == "get":
        ok = responses.setdefault("200", {"description": "OK"})
        ok.setdefault("content", {})["application/x-ndjson"] = {
            "schema": _ref("LogLine"),
            "description": "With follow=true: one LogLine (JSON) a line, until the job ends."}


class AllowAll:
    """A 405's `Allow` header lists every method of the path, not only the first route's
    (Starlette stops at the first route whose path matches)."""

    def __init__(self, app: ASGIApp, routes_of):
        self.app = app
        self.routes_of = routes_of  # () -> the app's routes

    def _allowed(self, path: str) -> list[str]:
        methods: set[str] = set()
        for route in self.routes_of():
            regex = getattr(route, "path_regex", None)
            if regex is not None and regex.match(path) and getattr(route, "methods", None):
                methods |= set(route.methods)
        return sorted(methods)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_allow(message):
            if message["type"] == "http.response.start" and message["status"] == 405:
                allowed = ", ".join(self._allowed(scope["path"])).encode()
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                message = {**message, "headers": [*headers, (b"allow", allowed)]}
            await send(message)

        await self.app(scope, receive, send_with_allow)
