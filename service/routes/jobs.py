"""User-facing job endpoints: submit, list, get, cancel, events.

Every user sees every job (list, get, events; logs and snapshots too): a shared service's
queue is shared, and a user waiting for nodes needs to see whose jobs hold them. Secrets
go in `secret_env`, which nobody sees. Only the owner of a job, or the admin, may cancel it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Response, status
from fastapi.exceptions import RequestValidationError

from service.api_contract import AuthFirstRoute
from service.context import Context
from service.decide import keep, lineup, quotas
from service.decide.cancel import decide_cancel
from service.decide.waiting import why_waiting
from service.deps import Caller, CallerDep, ContextDep, UserAuth
from service.errors import Conflict, JobNotFound, StoreUnavailable
from service.goodput import job_goodput
from service.keyring import new_nonce
from service.models import (
    CancelResult,
    EventList,
    GoodputView,
    JobList,
    JobRecord,
    JobSpec,
    JobState,
    JobView,
    MetricHistory,
    NodeRecord,
)
from worker.protocol import REVISION_HEADER  # read-your-writes (service.job_index)

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], dependencies=[UserAuth], route_class=AuthFirstRoute)

READ_WAIT_S = 1.0  # how long a read waits for the index to reach that revision, then reads etcd
CUT_OFF_READ_S = 1.0  # how long a replica cut off from etcd waits for it on a status read
RevisionSeen = Annotated[int | None, Header(alias=REVISION_HEADER, ge=0,
                                            description="The highest X-Ftrain-Revision this "
                                                        "client has seen: answer nothing older.")]


@router.post("", status_code=status.HTTP_201_CREATED, response_model=JobView, responses={
    200: {"model": JobView, "description": "A retried submit (the same `Idempotency-Key`): the first "
                                           "job, with `Idempotent-Replayed: true`."}})
async def submit(
    spec: JobSpec,
    ctx: ContextDep,
    caller: CallerDep,
    idempotency_key: Annotated[str | None, Header(max_length=200)] = None,
) -> Response:
    """Submit a job, owned by the caller. With an `Idempotency-Key`, a retried submit
    returns the first job."""
    if errors := spec.size_errors():
        raise RequestValidationError(errors)
    return await submit_answer(ctx, spec, caller, idempotency_key)


async def submit_answer(ctx: Context, spec: JobSpec, caller: Caller,
                        idempotency_key: str | None) -> Response:
    """The answer to a valid submit (one etcd transaction); `service.fastpath` answers an
    admin's submit by it too, without FastAPI's per-request work."""
    nonce, fingerprint = new_nonce(), ""
    if spec.secret_env:  # kept before the job exists: no node may get it without them
        ctx.keyring.put_env(nonce, spec.secret_env)
        fingerprint = ctx.keyring.fingerprint(spec.secret_env)
    try:
        job, created, revision = await ctx.jobs.create_at(
            spec, idempotency_key, owner=caller.name, owner_id=caller.user_id, nonce=nonce,
            fingerprint=fingerprint)
    except Conflict:  # nothing was written (after an error etcd may have written: kept)
        ctx.keyring.delete_env(nonce)
        raise
    if job.token_nonce != nonce:  # a replay: the first job keeps its own
        ctx.keyring.delete_env(nonce)
    headers = {"Location": f"/v1/jobs/{job.id}", REVISION_HEADER: str(revision)}
    if not created:  # (a created job is in this replica's index already: JobStore.written)
        headers["Idempotent-Replayed"] = "true"
    # Serialised as it is: FastAPI would validate the view again on the way out.
    return Response(job.view().model_dump_json().encode(),
                    status_code=status.HTTP_201_CREATED if created else status.HTTP_200_OK,
                    media_type="application/json", headers=headers)


@router.get("", response_model=JobList)
async def list_jobs(
    ctx: ContextDep,
    state: Annotated[list[JobState] | None, Query(description="Only jobs in these states.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[str | None,
                     Query(min_length=1, max_length=100,
                           description="The `next` of the previous page (404 if no such job).")] = None,
) -> JobList:
    """Jobs, oldest first, filtered by state and paginated.

    The order (and which jobs there are) comes from the watch-fed job index; the records
    of the page are read from etcd, a few at a time, so a long history costs one page.
    """
    await ctx.index.wait_ready(ctx.settings.etcd_timeout_s)
    place = None
    if after is not None:
        place = ctx.index.place_of(after)
        if place is None:  # a job the index has not seen yet, or none at all
            try:
                job = await ctx.jobs.get(after)
            except JobNotFound:
                raise HTTPException(status.HTTP_404_NOT_FOUND,
                                    f"job {after} not found (`after` names the last job of the "
                                    "previous page; to list from the start, leave it out)") from None
            place = (job.created_at, job.id)
    page, more = await ctx.jobs.page(ctx.index.ids_after(place, state), state, limit)
    views = await ctx.jobs.views(page)
    if any(v.state is JobState.PENDING for v in views):
        nodes = await ctx.nodes.current()
        # read once for the page: each waiting job's words cost O(nodes), not O(nodes + jobs)
        holders, used = holders_of(ctx, nodes), quota_usage(ctx, nodes)
        queue = Queue(cluster_of(ctx, nodes, holders))  # (read only if a job's free nodes would start it)
        for job, view in zip(page, views, strict=True):
            view.waiting = waiting_of(ctx, job, nodes, holders, used, queue)
    return JobList(items=views, next=page[-1].id if more and page else None)


@router.get("/{job_id}", response_model=JobView)
async def get_job(job_id: str, ctx: ContextDep, seen: RevisionSeen = None) -> Response:
    """The job, from this control plane's watch-fed index, no older than the revision the
    client last saw (`X-Ftrain-Revision`: its own writes, through any replica); read from
    etcd if the index has not reached that revision within a second, or has no such job
    (created through another replica a moment ago, or none: 404). `service.fastpath`
    answers the same from the index, without FastAPI's per-request work."""
    cached = await status_from_index(ctx, job_id, seen)
    if cached is not None:
        body, revision = cached
    else:  # read through
        view = await with_waiting(ctx, await read_through(ctx, job_id))
        body, revision = view.model_dump_json().encode(), ctx.index.revision
    return Response(body, media_type="application/json",
                    headers={REVISION_HEADER: str(max(revision, seen or 0))})


async def read_through(ctx: Context, job_id: str) -> JobView:
    """The job as etcd has it. A replica that seems cut off from etcd waits for it at most
    CUT_OFF_READ_S, then answers 503 (its clients fail over to another replica) rather
    than keep the client for etcd's whole timeout, tried on each member in turn."""
    try:
        ctx.kv.check_contact()
    except StoreUnavailable as cut_off:
        try:
            async with asyncio.timeout(CUT_OFF_READ_S):
                return await ctx.jobs.view(job_id)
        except TimeoutError:
            raise cut_off from None
    return await ctx.jobs.view(job_id)


async def with_waiting(ctx: Context, view: JobView) -> JobView:
    """`view`, with what it waits for if it is PENDING (`decide.waiting`)."""
    if view.state is JobState.PENDING and (job := ctx.index.get(view.id)) is not None:
        view.waiting = waiting_of(ctx, job, await ctx.nodes.current())
    return view


def waiting_of(ctx: Context, job: JobRecord, nodes: dict[str, NodeRecord],
               holders: Mapping[str, JobRecord] | None = None,
               used: quotas.Usage | None = None, queue: Queue | None = None) -> str | None:
    """What `job` waits for, as the queue says it (`decide.lineup`): `decide.waiting.why_waiting`,
    the holders of the nodes taken from the index (the job a node works for, or the waiting job
    it is held for), unless the free nodes would start it: then the queue is read up to it, to
    find whether backfill keeps them for a job ahead. `holders` (`holders_of`), `used`
    (`quota_usage`) and `queue`: read once by a caller that asks for many jobs."""
    if job.state is not JobState.PENDING:
        return None
    holders = holders_of(ctx, nodes) if holders is None else holders
    if lineup.may_be_held_back(job, nodes, holders, ctx.settings.queue_policy == "fifo"):
        queue = Queue(cluster_of(ctx, nodes, holders)) if queue is None else queue
        if (said := queue.waiting(job.id)) is not None:
            return said
    limits: list[quotas.Limit] = []
    if applies(ctx, job.owner):  # (the use is counted only for an owner some quota holds)
        used = quota_usage(ctx, nodes) if used is None else used
        limits = quotas.limits(job.owner, used) if used is not None else []
    return why_waiting(job, nodes, lineup.HeldFrom(holders, job.id), limits)


class Queue:
    """The queue's reasons (`decide.lineup`), read only as far as a job asked for, once."""

    def __init__(self, cluster: lineup.Cluster):
        self._rest = lineup.lineup(cluster)
        self._read: dict[str, lineup.Queued] = {}

    def waiting(self, job_id: str) -> str | None:
        """What the queue says job `job_id` waits for (None: not in the queue)."""
        while job_id not in self._read and (q := next(self._rest, None)) is not None:
            self._read[q.job.id] = q
        return self._read[job_id].waiting if job_id in self._read else None


def cluster_of(ctx: Context, nodes: dict[str, NodeRecord], holders: Mapping[str, JobRecord],
               tenants: quotas.Tenants | None = None) -> lineup.Cluster:
    """What the queue is read against (`decide.lineup`): the index's unfinished jobs, `nodes`,
    `holders` (`holders_of`), `tenants` (None: as the tenancy watch has them)."""
    jobs = [j for j in ctx.index.jobs() if not j.state.is_terminal()]
    tenants = tenants or ctx.tenancy.tenants() or quotas.Tenants()
    used = quotas.usage(jobs, nodes, tenants)
    used.past = ctx.index.ledger.used(ctx.jobs.clock())  # (fair share's node-seconds, as the scheduler has them)
    return lineup.Cluster(jobs, nodes, holders, used, ctx.jobs.clock(),
                          fifo=ctx.settings.queue_policy == "fifo", settle_s=ctx.settings.fair_share_settle_s)


def holders_of(ctx: Context, nodes: dict[str, NodeRecord], waiting: str | None = None) -> dict[str, JobRecord]:
    """node -> the job it works for, or the waiting job it is held for (other than `waiting`),
    as the index has them."""
    now = ctx.jobs.clock()
    holders = {}
    for name, node in nodes.items():
        holder = ctx.index.job_of_node(name)
        if holder is None and (kept := ctx.index.keeper(name)) is not None and kept.id != waiting \
                and keep.holds(kept, node, now):
            holder = kept
        if holder is not None:
            holders[name] = holder
    return holders


def applies(ctx: Context, owner: str) -> bool:
    """Some quota is set on `owner` or its team."""
    tenants = ctx.tenancy.tenants()
    return tenants is not None and (owner in tenants.users or tenants.team(owner) in tenants.teams)


def quota_usage(ctx: Context, nodes: Mapping[str, NodeRecord]) -> quotas.Usage | None:
    """What the unfinished jobs hold now, by user and team (None while the teams and quotas
    are not loaded, or none is set): from the index's counts, as a scheduler pass has them,
    unless a GPU quota asks for the GPUs held."""
    tenants = ctx.tenancy.tenants()
    if tenants is None or not (tenants.users or tenants.teams):
        return None
    if quotas.counts_gpus(tenants):
        return quotas.usage(ctx.index.jobs(), nodes, tenants)
    return quotas.usage_of(ctx.index.held(), tenants)


async def status_from_index(ctx: Context, job_id: str, seen: int | None) -> tuple[bytes, int] | None:
    """The job's view as JSON and the index's revision, if the index can answer: it is
    loaded, has reached `seen` (waited for, at most READ_WAIT_S) and has the job, and this
    replica is not cut off from etcd (`KeyValue.check_contact`)."""
    index = ctx.index
    if not (index.ready.is_set() and index.progress_ready.is_set()):
        return None
    try:  # a replica cut off from etcd does not answer from what it last heard
        ctx.kv.check_contact()
    except StoreUnavailable:
        return None  # read through: an answer if etcd was only slow, else 503
    if seen is not None and not await index.wait_for_revision(seen, READ_WAIT_S):
        return None
    body = index.view_json(job_id)
    if body is None:
        return None
    job = index.get(job_id)
    if job is not None and job.state is JobState.PENDING:  # (what it waits for is of this moment)
        view = json.loads(body)
        view["waiting"] = waiting_of(ctx, job, await ctx.nodes.current())
        body = json.dumps(view, separators=(",", ":")).encode()
    return body, max(index.revision, seen or 0)


@router.post("/{job_id}/cancel", status_code=status.HTTP_202_ACCEPTED, response_model=CancelResult)
async def cancel(job_id: str, ctx: ContextDep, caller: CallerDep, response: Response) -> CancelResult:
    """Ask a job to stop: its owner or the admin (403 for anyone else). Cancelling twice is
    fine; a finished job answers 409 with its state."""
    now = ctx.jobs.clock()
    job, revision = await ctx.jobs.update_at(
        job_id, lambda job: decide_cancel(job, now, caller.name, caller.is_admin, caller.user_id))
    response.headers[REVISION_HEADER] = str(revision)
    return CancelResult(id=job.id, state=job.state)


@router.get("/{job_id}/events", response_model=EventList)
async def events(job_id: str, ctx: ContextDep) -> EventList:
    """Every state change of the job (and notable moments of its life), oldest first."""
    return EventList(items=await ctx.jobs.events(job_id))


@router.get("/{job_id}/goodput", response_model=GoodputView)
async def goodput(job_id: str, ctx: ContextDep) -> GoodputView:
    """Where the job's wall time went, by cause (waiting for nodes, starting, training, steps
    replayed after a fault, snapshot stalls, recovering, hung, ...): the parts add up to
    `wall_s`, up to now while it runs (docs/goodput.md)."""
    g = await job_goodput(ctx.jobs, job_id)
    return GoodputView(wall_s=round(g.wall_s, 3), seconds={c: round(s, 3) for c, s in g.seconds.items()})


@router.get("/{job_id}/metrics", response_model=MetricHistory)
async def metrics(job_id: str, ctx: ContextDep) -> MetricHistory:
    """The job's scalars (loss, samples/s and what its script logs) over its steps: a
    bounded number of points, thinned evenly as the job runs on (`stride`)."""
    return await ctx.jobs.metrics(job_id)
