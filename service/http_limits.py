"""Limits on what a client may make the control plane hold before a request reaches the app.

uvicorn's httptools protocol takes a request head of any size and any number of header
lines (one connection with a 50 MB header doubled the control plane's memory), and a
connection that sends half a request, or nothing, is kept for ever: its keep-alive timeout
runs only between answers (uvicorn's `h11_max_incomplete_event_size` is for its h11
protocol only, and `limit_concurrency` answers 503 to every connection once the count is
reached). `limited_http(limits)` is the protocol the control plane runs (`ftrain serve`):
uvicorn's, each answer in one write (`service.one_write`), and

* a head (request line and headers) over `max_head_bytes`, or with more than
  `max_headers` lines, is answered 431 and the connection closed, as soon as the limit is
  passed (a head is held only up to the limit and one read of the socket);
* a request not received whole (head and body) within `request_timeout_s` of its first
  byte, or of the connection's start when nothing came, is ended: 408 if its head was
  incomplete, else the connection is closed (the app hears a disconnect);
* past `max_connections` open connections, a new one is answered 503 and closed; those
  already open (agents' presence connections among them) are served as before.

The body's own limit is the app's (`service.app.BodySizeLimit`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from service.one_write import OneWriteHttp
from service.settings import Settings


@dataclass(frozen=True)
class RequestLimits:
    max_head_bytes: int
    max_headers: int
    request_timeout_s: float
    max_connections: int

    @classmethod
    def of(cls, settings: Settings) -> RequestLimits:
        return cls(settings.max_head_bytes, settings.max_headers, settings.request_timeout_s,
                   settings.max_connections)


class _Refused(Exception):
    """Raised from a parser callback to stop the parse; the answer is `LimitedHttp._refusal`."""


class LimitedHttp(OneWriteHttp):
    """uvicorn's protocol with the module's limits (`limits`, set by `limited_http`)."""

    limits: ClassVar[RequestLimits]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes: int | None = 0  # bytes of the head being read; None: in a body
        self._header_lines = 0
        self._refusal: tuple[int, str] | None = None
        self._deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, f"the control plane has {self.limits.max_connections} connections "
                              "open, its limit (FTRAIN_MAX_CONNECTIONS); try again shortly")
            return
        self._arm()  # a connection that sends nothing is an incomplete request too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return
        if self._head_bytes is not None:
            self._head_bytes += len(data)  # may include a body; judged after the parse below
        super().data_received(data)
        if self._refusal is None and self._head_bytes is not None \
                and self._head_bytes > self.limits.max_head_bytes:
            self._refuse(431, f"request head larger than {self.limits.max_head_bytes} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_lines = 0
        self._arm()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_lines += 1
        if self._header_lines > self.limits.max_headers:
            self._refusal = (431, f"more than {self.limits.max_headers} header lines")
            raise _Refused  # the parser stops; uvicorn answers through send_400_response
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._head_bytes = 0  # the next request's head, whenever it comes
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:  # the parse stopped for a limit: say which
            return self._refuse(*self._refusal)
        super().send_400_response(msg)

    # ------------------------------------------------------------------ the deadline
    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.limits.request_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._head_bytes is not None and (self.cycle is None or self.cycle.response_complete):
            return self._refuse(408, f"request not received whole within "
                                     f"{self.limits.request_timeout_s:g} s")
        self.transport.close()  # a body cut short: the app hears a disconnect

    def _refuse(self, status: int, detail: str) -> None:
        """Answer `status` with a JSON `detail` and close the connection."""
        self._refusal = (status, detail)
        self._disarm()
        body = json.dumps({"detail": detail}).encode()
        self.transport.write(b"".join([
            STATUS_LINE[status], b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
        self.transport.close()


def limited_http(limits: RequestLimits) -> type[LimitedHttp]:
    """The protocol class for uvicorn's `http=`, with these limits."""
    return type("LimitedHttp", (LimitedHttp,), {"limits": limits})
