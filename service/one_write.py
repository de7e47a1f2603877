"""Each answer in one socket write.

uvicorn writes an answer's head (status line and headers) and its body apart: two `send`
system calls, and on loopback or a LAN two TCP segments (the socket has TCP_NODELAY), each
a wake-up for the client. py-spy under bench/api.py's submissions (1,000 nodes heartbeating,
one job training): 21% of the control plane's samples were in those writes, about 2,000
answers a second. `OneWriteHttp` is uvicorn's HTTP protocol (httptools) on a transport that
holds what is written in one step of the event loop and sends it as one write right after
that step (`call_soon`): the head and body of an answer made in one step, as the fast
paths (`service.fastpath`) and plain responses make them, go out together. A streamed
answer (a log follow) is written chunk by chunk as before, each right after its step.
Order is kept (every write goes through the one buffer); a close sends what is held first.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _OneWrite:
    """A transport that sends the writes of one event-loop step as one write."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self.flush)
        self._held.append(data)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(map(len, self._held))

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._held.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:  # is_closing, get_extra_info, pause_reading, ...
        return getattr(self._transport, name)


class OneWriteHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol, each answer sent in one write (`_OneWrite`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_OneWrite(transport, self.loop))  # type: ignore[arg-type]
