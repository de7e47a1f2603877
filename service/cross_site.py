"""What a web page the user happens to visit cannot make the control plane do.

A browser sends a cross-site request without asking the server first (a CORS preflight)
only when it is "simple": no `Authorization` header, and a body that is a form or
`text/plain`, or a Blob with no type at all, which arrives with no Content-Type. So:

* A body must say it is JSON (`application/json`, or `...+json`): any other Content-Type,
  or none, is 415 (`service.api_contract.AuthFirstRoute`, after the token is judged). A page
  cannot send JSON to another origin without a preflight, which this server never approves
  (it sends no CORS headers), so no page can submit a job, register a node or write a
  rendezvous, with or without tokens.
* A control plane with a token for users and nodes takes a request only with a bearer token,
  which a page cannot attach to a simple request: nothing more is needed there.
* A control plane without them (`ftrain serve` on loopback, which refuses any other address
  without tokens) would do what any local page asks, and a page on a name that it points at
  127.0.0.1 (DNS rebinding) reads the answers as its own. There, `LoopbackOnly` answers 403 to
  a `/v1/` request whose `Host` is not a loopback name or address, or whose `Origin`, when
  sent, is not the server's own (`http://<Host>`). The dashboard, served from the same
  origin, passes; curl and the CLI send no Origin.
"""

from __future__ import annotations

import ipaddress

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send


def is_json(content_type: str | bytes | None) -> bool:
    """Whether a Content-Type says JSON (`application/json`, `application/x+json`, any
    parameters)."""
    if content_type is None:
        return False
    if isinstance(content_type, bytes):
        content_type = content_type.decode("latin-1")
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def has_body(headers: dict[bytes, bytes]) -> bool:
    """Whether a request (its raw headers) comes with a body."""
    length = headers.get(b"content-length")
    return b"transfer-encoding" in headers or (length is not None and length.strip() not in (b"", b"0"))


NOT_JSON = ("the request body must be JSON: send it with 'Content-Type: application/json' "
            "(`curl --json`, or `-H 'Content-Type: application/json'`)")


def is_loopback_host(host: str) -> bool:
    """Whether a Host header (name or address, with or without a port) names this machine's
    loopback."""
    name = host.rsplit("]", 1)[0].lstrip("[") if host.startswith("[") else host.rsplit(":", 1)[0]
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class LoopbackOnly:
    """403 for a `/v1/` request to a control plane without tokens whose Host is not loopback
    or whose Origin is another site's (module docstring). Pure ASGI."""

    def __init__(self, app: ASGIApp, open_: bool):
        self.app = app
        self.open = open_  # no user token or no node token: some endpoint takes anyone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.open or scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin")
        if not is_loopback_host(host):
            detail = (f"this control plane has no tokens, so it answers only requests to a "
                      f"loopback address (Host: 127.0.0.1, localhost or [::1]), not Host: {host!r}; "
                      "to serve other hosts, start it with --token and --node-token")
        elif origin is not None and origin.decode("latin-1") != f"{scope.get('scheme', 'http')}://{host}":
            detail = (f"a request from another site (Origin: {origin.decode('latin-1')!r}) to a "
                      "control plane without tokens is refused; use the CLI, curl or the dashboard "
                      "it serves")
        else:
            return await self.app(scope, receive, send)
        await JSONResponse({"detail": detail}, 403)(scope, receive, send)
