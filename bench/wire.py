"""A lean HTTP/1.1 client for load generators: keep-alive connections over asyncio streams.

httpx costs about a millisecond of CPU a request; on a 2-core machine that shares its cores
with the server under test, a Python load of thousands of requests a second would measure
the client. This one does only what the benches need (a request with a JSON body, a reply
with a Content-Length, connections reused), at a fraction of that. It is for bench/ only.
"""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit


class Reply:
    __slots__ = ("status", "body", "retry_after_s")

    def __init__(self, status: int, body: bytes, retry_after_s: float | None = None):
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s  # the answer's Retry-After, in seconds (None: none)

    def json(self):
        return json.loads(self.body)


class Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader = reader
        self.writer = writer

    async def request(self, head: bytes, body: bytes) -> Reply:
        self.writer.write(head + body)
        line = await self.reader.readuntil(b"\r\n\r\n")
        status = int(line[9:12])
        length = 0
        close = False
        retry_after = None
        for h in line.split(b"\r\n")[1:]:
            name, _, value = h.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"connection" and value.strip().lower() == b"close":
                close = True
            elif name == b"retry-after" and value.strip().isdigit():
                retry_after = float(value)
        data = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return Reply(status, data, retry_after)

    def close(self) -> None:
        self.writer.close()


class Client:
    """`conns` keep-alive connections to one server; requests queue for a free one."""

    def __init__(self, url: str, conns: int = 16, token: str | None = None):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.token = token
        self._free: asyncio.Queue[Connection | None] = asyncio.Queue()
        for _ in range(conns):
            self._free.put_nowait(None)  # opened on first use

    async def request(self, method: str, path: str, body=None, token: str | None = None,
                      headers: dict[str, str] | None = None) -> Reply:
        data = b"" if body is None else json.dumps(body).encode()
        token = token or self.token
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}",
                 f"Content-Length: {len(data)}"]
        if body is not None:
            lines.append("Content-Type: application/json")
        if token:
            lines.append(f"Authorization: Bearer {token}")
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        conn = await self._free.get()
        try:
            if conn is None or conn.writer.is_closing():
                conn = Connection(*await asyncio.open_connection(self.host, self.port))
            reply = await conn.request(head, data)
        except BaseException:
            if conn is not None:
                conn.close()
            self._free.put_nowait(None)
            raise
        self._free.put_nowait(None if conn.writer.is_closing() else conn)
        return reply

    async def close(self) -> None:
        while not self._free.empty():
            conn = self._free.get_nowait()
            if conn is not None:
                conn.close()
