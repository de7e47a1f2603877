"""Worker logs: agents ship lines, users page through or follow them (`service.logs.LogStore`)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status
from fastapi.responses import StreamingResponse

from service.api_contract import AuthFirstRoute
from service.decide.recovery import first_output
from service.deps import ContextDep, MemberNode, UserAuth
from service.errors import JobNotFound, LogStorageUnavailable, StoreUnavailable
from service.logs import PAGE_LIMIT, PAGE_MAX_LINES
from service.models import LogPage
from worker.protocol import LOG_FOLLOW_MAX_WAIT_S, LogShipment

log = logging.getLogger(__name__)
router = APIRouter(tags=["logs"], route_class=AuthFirstRoute)
FOLLOW_POLL_S = 0.5  # how often a follower that has read everything looks for new lines
FOLLOW_IDLE_S = 5.0  # a follow stream with no new line for this long ends (`wait_s`)


@router.post("/v1/jobs/{job_id}/logs", status_code=204)
async def ship(job_id: str, body: LogShipment, ctx: ContextDep, node: MemberNode) -> None:
    """Append a node's lines to the job's log (files under the log root; nothing in etcd).

    With node credentials, only a member of the job ships, and only lines as itself.
    """
    if node is not None and body.node != node:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            f"node {node!r} cannot ship lines as node {body.node!r}")
    job = await ctx.jobs.get(job_id)  # 404 for an unknown job
    await ctx.logs.ship(job_id, body)
    now = ctx.jobs.clock()
    if first_output(job, body.attempt, body.lines, now) is not None:
        # a plain script's workers printed: its new group trains (`decide.recovery`)
        await ctx.jobs.update(job_id, lambda j: first_output(j, body.attempt, body.lines, now))
    return None


@router.get("/v1/jobs/{job_id}/logs", dependencies=[UserAuth], response_model=LogPage)
async def get_logs(
    job_id: str,
    ctx: ContextDep,
    rank: Annotated[int | None, Query(ge=0)] = None,
    since: Annotated[int, Query(ge=0, description="Only lines with seq >= since (a page's next_seq).")] = 0,
    limit: Annotated[int, Query(ge=1, le=PAGE_MAX_LINES, description="Most lines in the page.")] = PAGE_LIMIT,
    follow: bool = False,
    tail: Annotated[int | None, Query(ge=0, le=PAGE_MAX_LINES, description=(
        "Only the last N lines (of `rank`, if given), read from the end of the log, whatever its "
        "size (`since` and `limit` are not used); with follow=true, then the new ones."))] = None,
    wait_s: Annotated[float, Query(ge=0.5, le=LOG_FOLLOW_MAX_WAIT_S, description=(
        "With follow=true: end the stream once no new line came for this long (the job goes on; "
        "follow again from the last line's seq + 1)."))] = FOLLOW_IDLE_S,
):
    """A page of a job's worker logs, oldest first; `follow=true` streams the lines from
    `since` on (NDJSON), new ones as they come, until the job ends or no line came for
    `wait_s` seconds (so no request is held for ever; a client follows again)."""
    await ctx.jobs.get(job_id)
    if tail is not None:
        page = await ctx.logs.read_tail(job_id, tail, rank)
        if not follow:
            await ctx.jobs.get(job_id)  # (as below)
            return page
        since = page.items[0].seq if page.items else page.next_seq
    if not follow:
        page = await ctx.logs.read_page(job_id, since, limit, rank)
        # Retention deletes the record before the files: a job that still exists after the
        # read had all its files during it, and a read that raced its deletion answers 404.
        await ctx.jobs.get(job_id)
        return page

    async def stream():
        cursor = since
        quiet_since = time.monotonic()
        while True:
            try:
                over = (await ctx.jobs.get(job_id)).state.is_terminal()
                page = await ctx.logs.read_page(job_id, cursor, limit, rank)
            except (StoreUnavailable, LogStorageUnavailable, JobNotFound) as exc:
                # The answer has begun (200): end it whole, not cut mid-chunk; a client follows
                # again from its last seq and hears the error (503, 404) as an answer then.
                log.info("follow of job %s ended early: %s", job_id, exc)
                return
            if page.items:
                quiet_since = time.monotonic()
                yield "".join(item.model_dump_json() + "\n" for item in page.items)
            cursor = page.next_seq
            if cursor < page.end_seq:
                continue  # more to read now
            if over:  # the job had ended before this read: nothing more will come
                return
            if time.monotonic() - quiet_since >= wait_s:
                return
            await asyncio.sleep(FOLLOW_POLL_S)

    return StreamingResponse(stream(), media_type="application/x-ndjson")
