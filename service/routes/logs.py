"""Worker logs: agents ship lines, users read or follow them.

Lines are kept in etcd in chunks (one key per shipment, ordered by revision), bounded per
job: the oldest chunks are dropped past `log_keep_lines`. A line's `seq` is the chunk's
create revision times 100,000 plus its index, so `?since=` resumes exactly.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from service.context import Context
from service.deps import ContextDep, NodeAuth, UserAuth
from worker.protocol import LogShipment

router = APIRouter(tags=["logs"])
_LINES_PER_CHUNK = 100_000


class LogLine(BaseModel):
    seq: int
    time: float
    node: str
    rank: int | None
    stream: str
    line: str
    attempt: int = 0


class LogPage(BaseModel):
    items: list[LogLine]
    next_seq: int


def _chunk_key(ctx: Context, job_id: str, node: str) -> str:
    return f"{ctx.keys.logs(job_id)}{time.time_ns():020d}-{node}"


@router.post("/v1/jobs/{job_id}/logs", status_code=204, dependencies=[NodeAuth])
async def ship(job_id: str, body: LogShipment, ctx: ContextDep) -> None:
    await ctx.jobs.get(job_id)  # 404 for an unknown job
    if not body.lines:
        return None
    payload = {"node": body.node, "attempt": body.attempt,
               "lines": [line.model_dump() for line in body.lines]}
    await ctx.etcd.put(_chunk_key(ctx, job_id, body.node), json.dumps(payload).encode())
    await _trim(ctx, job_id)
    return None


async def _trim(ctx: Context, job_id: str) -> None:
    entries = await ctx.etcd.get_prefix(ctx.keys.logs(job_id))
    total = 0
    for e in reversed(entries):
        total += len(json.loads(e.value)["lines"])
        if total > ctx.settings.log_keep_lines:
            await ctx.etcd.delete(e.key)


async def read_lines(ctx: Context, job_id: str, since: int = 0, rank: int | None = None) -> list[LogLine]:
    entries = await ctx.etcd.get_prefix(ctx.keys.logs(job_id))
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


async def last_lines(ctx: Context, job_id: str, n: int) -> list[str]:
    """The last `n` worker lines of a job, as text (for failure reasons)."""
    lines = [x for x in await read_lines(ctx, job_id) if x.rank is not None]
    return [f"[rank{x.rank}] {x.line}" for x in lines[-n:]]


@router.get("/v1/jobs/{job_id}/logs", dependencies=[UserAuth], response_model=LogPage)
async def get_logs(
    job_id: str,
    ctx: ContextDep,
    rank: Annotated[int | None, Query(ge=0)] = None,
    since: Annotated[int, Query(ge=0, description="Only lines with seq >= since.")] = 0,
    follow: bool = False,
):
    """A job's worker logs; `follow=true` streams new lines (NDJSON) until the job ends."""
    await ctx.jobs.get(job_id)
    if not follow:
        items = await read_lines(ctx, job_id, since, rank)
        return LogPage(items=items, next_seq=items[-1].seq + 1 if items else since)

    async def stream():
        cursor = since
        while True:
            job = await ctx.jobs.get(job_id)
            items = await read_lines(ctx, job_id, cursor, rank)
            for item in items:
                yield item.model_dump_json() + "\n"
            if items:
                cursor = items[-1].seq + 1
            if job.state.is_terminal() and not items:
                return
            await asyncio.sleep(0.5)

    return StreamingResponse(stream(), media_type="application/x-ndjson")
