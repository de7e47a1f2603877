"""Worker log lines of a job, in etcd.

Lines are kept in chunks (one key per shipment, ordered by revision), bounded per job:
the oldest chunks are dropped past `keep_lines`. A line's `seq` is the chunk's create
revision times 100,000 plus its index, so `?since=` resumes exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from service.keys import Keys
from service.models import LogLine
from service.store.api import KeyValue
from worker.protocol import LogShipment

_LINES_PER_CHUNK = 100_000


class LogStore:
    """Ship, trim and read a job's worker logs."""

    def __init__(self, kv: KeyValue, keys: Keys, keep_lines: int,
                 clock_ns: Callable[[], int] = time.time_ns):
        self.kv = kv
        self.keys = keys
        self.keep_lines = keep_lines
        self.clock_ns = clock_ns

    async def ship(self, job_id: str, shipment: LogShipment) -> None:
        """Store one shipment of lines as a chunk, then drop the oldest chunks past the cap."""
        if not shipment.lines:
            return
        payload = {"node": shipment.node, "attempt": shipment.attempt,
                   "lines": [line.model_dump() for line in shipment.lines]}
        key = f"{self.keys.logs(job_id)}{self.clock_ns():020d}-{shipment.node}"
        await self.kv.put(key, json.dumps(payload).encode())
        await self.trim(job_id)

    async def trim(self, job_id: str) -> None:
        """Delete the oldest chunks beyond `keep_lines` lines."""
        entries = [e async for e in self.kv.scan_prefix(self.keys.logs(job_id))]
        total = 0
        for e in reversed(entries):
            total += len(json.loads(e.value)["lines"])
            if total > self.keep_lines:
                await self.kv.delete(e.key)

    async def read_lines(self, job_id: str, since: int = 0, rank: int | None = None) -> list[LogLine]:
        """The job's lines with seq >= `since` (of one rank, if given), oldest first."""
        entries = [e async for e in self.kv.scan_prefix(self.keys.logs(job_id))]
        out = []
        for e in sorted(entries, key=lambda e: e.create_revision):
            base = e.create_revision * _LINES_PER_CHUNK
            if base + _LINES_PER_CHUNK <= since:
                continue
            chunk = json.loads(e.value)
            for i, line in enumerate(chunk["lines"]):
                seq = base + i
                if seq < since or (rank is not None and line.get("rank") != rank):
                    continue
                out.append(LogLine(seq=seq, node=chunk["node"], attempt=chunk.get("attempt", 0), **line))
        return out

    async def delete(self, job_id: str) -> None:
        """Delete every line of a job (retention deletes a finished job's logs with it)."""
        await self.kv.delete_prefix(self.keys.logs(job_id))

    async def last_lines(self, job_id: str, n: int) -> list[str]:
        """The last `n` worker lines of a job, as text (for failure reasons)."""
        lines = [x for x in await self.read_lines(job_id) if x.rank is not None]
        return [f"[rank{x.rank}] {x.line}" for x in lines[-n:]]
