"""User-facing job endpoints: submit, list, get, cancel, events."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Response, status

from service.decide.cancel import decide_cancel
from service.deps import ContextDep, UserAuth
from service.models import CancelResult, EventList, JobList, JobSpec, JobState, JobView

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[UserAuth])


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobView)
async def submit(
    spec: JobSpec,
    ctx: ContextDep,
    response: Response,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> JobView:
    """Submit a job. With an `Idempotency-Key`, a retried submit returns the first job."""
    job, created = await ctx.jobs.create(spec, idempotency_key)
    if not created:
        response.status_code = status.HTTP_200_OK
        response.headers["Idempotent-Replayed"] = "true"
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job.view()


@router.get("", response_model=JobList)
async def list_jobs(
    ctx: ContextDep,
    state: Annotated[list[JobState] | None, Query(description="Only jobs in these states.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None,
                     Query(max_length=100, description="The `next` of the previous page.")] = None,
) -> JobList:
    """Jobs, oldest first, filtered by state and paginated."""
    jobs = await ctx.jobs.list()
    if state:
        jobs = [j for j in jobs if j.state in state]
    if after is not None:
        ids = [j.id for j in jobs]
        jobs = jobs[ids.index(after) + 1:] if after in ids else [j for j in jobs if j.id > after]
    page = jobs[:limit]
    more = len(jobs) > limit
    return JobList(items=await ctx.jobs.views(page), next=page[-1].id if more and page else None)


@router.get("/{job_id}", response_model=JobView)
async def get_job(job_id: str, ctx: ContextDep) -> JobView:
    return await ctx.jobs.view(job_id)


@router.post("/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=CancelResult)
async def cancel(job_id: str, ctx: ContextDep) -> CancelResult:
    """Ask a job to stop. Cancelling twice is fine; a finished job answers 409 with its state."""
    now = ctx.jobs.clock()
    job = await ctx.jobs.update(job_id, lambda job: decide_cancel(job, now))
    return CancelResult(id=job.id, state=job.state)


@router.get("/{job_id}/events", response_model=EventList)
async def events(job_id: str, ctx: ContextDep) -> EventList:
    """Every state change of the job (and notable moments of its life), oldest first."""
    return EventList(items=await ctx.jobs.events(job_id))
