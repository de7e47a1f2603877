"""Worker logs: agents ship lines, users read or follow them (`service.logs.LogStore`)."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import StreamingResponse

from service.deps import ContextDep, NodeAuth, UserAuth
from service.models import LogPage
from worker.protocol import LogShipment

router = APIRouter(tags=["logs"])
FOLLOW_POLL_S = 0.5  # how often a follower looks for new lines


@router.post("/v1/jobs/{job_id}/logs", status_code=204, dependencies=[NodeAuth])
async def ship(job_id: str, body: LogShipment, ctx: ContextDep) -> None:
    await ctx.jobs.get(job_id)  # 404 for an unknown job
    await ctx.logs.ship(job_id, body)
    return None


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
        items = await ctx.logs.read_lines(job_id, since, rank)
        return LogPage(items=items, next_seq=items[-1].seq + 1 if items else since)

    async def stream():
        cursor = since
        while True:
            job = await ctx.jobs.get(job_id)
            items = await ctx.logs.read_lines(job_id, cursor, rank)
            for item in items:
                yield item.model_dump_json() + "\n"
            if items:
                cursor = items[-1].seq + 1
            if job.state.is_terminal() and not items:
                return
            await asyncio.sleep(FOLLOW_POLL_S)

    return StreamingResponse(stream(), media_type="application/x-ndjson")
