"""Node endpoints: agents register, heartbeat (and learn their assignment), report what
their workers did, and report rendezvous rounds; users list and drain nodes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request, Response, status

from service.api_contract import AuthFirstRoute
from service.context import Context
from service.decide import keep
from service.decide.attribution import failed_alone
from service.decide.change import Change
from service.decide.hangs import decide_stacks
from service.decide.liveness import broken_peer_suspects
from service.decide.members import decide_registered, decide_report, is_recorded
from service.decide.rounds import decide_round
from service.deps import (
    AdminAuth,
    ContextDep,
    JobTokenDep,
    NodeBootstrap,
    NodeSelf,
    UserAuth,
    credential_digest,
    new_node_credential,
    verify_node,
)
from service.errors import NodeNotFound
from service.models import (
    JobRecord,
    NodeList,
    NodeRecord,
    NodeState,
    NodeView,
)
from service.rendezvous import delete_rendezvous
from worker.protocol import (
    Assignment,
    HealthReport,
    HeartbeatReply,
    HeartbeatRequest,
    Known,
    RegisterReply,
    RegisterRequest,
    ReportReply,
    ReportRequest,
    RoundReport,
    StacksReport,
)

router = APIRouter(tags=["nodes"], route_class=AuthFirstRoute)
log = logging.getLogger(__name__)


@router.post("/v1/nodes/register", response_model=RegisterReply, dependencies=[NodeBootstrap])
async def register(req: RegisterRequest, ctx: ContextDep) -> RegisterReply:
    """Register a node under a fresh lease, with the node token; returns its own credential.

    409 while a node of this name is alive (its lease has not lapsed) and not drained, unless
    the request presents that node's current credential (its agent restarted).
    """
    timeouts = ctx.settings.timeouts
    credential, digest = new_node_credential(req.name)
    reclaim = None if req.previous_credential is None else credential_digest(req.previous_credential)
    sick = req.health.reason() if req.health is not None and not req.health.ok else None
    lease = await ctx.nodes.register(req.name, req.nproc_per_node, req.address, timeouts.node_ttl_s,
                                     digest, reclaim, gpus=req.gpus, gpu_model=req.gpu_model,
                                     quarantine=sick)
    # A (re)starting agent runs nothing: whatever it held before is gone; an agent whose
    # lease lapsed and that still runs its member's attempt keeps it. (The index may lag by a
    # watch event; the scheduler's node bookkeeping covers what it misses.)
    job = ctx.index.job_of_node(req.name)
    if job is not None:
        now = ctx.jobs.clock()
        running = None if req.running is None else (req.running.job_id, req.running.attempt)
        await ctx.jobs.update(job.id, lambda current: decide_registered(current, req.name,
                                                                        job.attempt, now, running))
    return RegisterReply(name=req.name, timeouts=timeouts, lease_id=lease, credential=credential)


# A heartbeat's most common answer, made once (answers are serialised, not revalidated).
_IDLE = HeartbeatReply(assignment=None).model_dump_json().encode()


@router.post("/v1/nodes/{name}/heartbeat", response_model=HeartbeatReply)
async def heartbeat(name: str, ctx: ContextDep, digest: NodeSelf, request: Request,
                    req: HeartbeatRequest | None = None) -> Response:
    """Keep the node's lease alive and tell it what to run. 404: register again.

    With the node's credential, a heartbeat is noted in memory: the lease that credential
    was issued under is kept alive by this control plane's batched keep-alives
    (service.heartbeats), and its record read only the first time this control plane sees
    the credential. (Open cluster: the lease id of the registration, if given, saves the
    read of the node's record.) `service.fastpath` answers the same, for the same request,
    without FastAPI's per-request work.
    """
    return Response(await heartbeat_answer(ctx, name, digest, req, request.receive),
                    media_type="application/json")


async def heartbeat_answer(ctx: Context, name: str, digest: str | None,
                           req: HeartbeatRequest | None,
                           receive: Callable[[], Awaitable[object]] | None = None) -> bytes:
    """The heartbeat of node `name` (its credential's `digest`; None in an open cluster):
    the answer's JSON. Raises NodeNotFound (404: register again), OutdatedCredential.

    `receive`, the request's ASGI receive once its body is read, answers when the node's
    connection drops: a long poll ends then, so that a stopped agent's poll does not hold
    a stopping control plane (uvicorn waits for the requests in flight) for the rest of it."""
    with ctx.telemetry.heartbeat_s.time():  # the lease's part, not the long poll
        if digest is not None:
            await ctx.nodes.heartbeat_with(name, digest)
        else:
            await ctx.nodes.heartbeat(name, req.lease_id if req is not None else None)
    if req is not None and req.wait_s > 0 and ctx.index.ready.is_set():
        # Long poll: an idle node learns of its job as soon as the scheduler writes it, not
        # a heartbeat later; the wait is bounded by the heartbeat interval, so the lease is
        # refreshed in time.
        known = req.known
        await _unless_dropped(ctx.index.wait_until(
            lambda: _known_of(ctx.index.job_of_node(name)) != known, req.wait_s), receive)
    job = ctx.index.job_of_node(name)
    if job is None:
        return _hung_or_idle(ctx, req.known if req is not None else None)
    made = ctx.assignments.get(job.id)
    if made is not None and made[0] is job:  # the same record: the same answer
        return made[1]
    if len(ctx.assignments) > 2 * len(ctx.index.running_ids()) + 100:
        ctx.assignments.clear()  # (those of finished jobs go this way)
    answer, complete = _assignment(ctx, job)
    if complete:  # (one whose secret values are not found yet is made again next time)
        ctx.assignments[job.id] = (job, answer)
    return answer


async def _unless_dropped(wait: Awaitable[object], receive: Callable[[], Awaitable[object]] | None) -> None:
    """`wait`, or less if the connection drops first (`receive` answers)."""
    if receive is None:
        await wait
        return
    tasks = {asyncio.ensure_future(wait), asyncio.ensure_future(receive())}
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


def _assignment(ctx: Context, job: JobRecord) -> tuple[bytes, bool]:
    """The heartbeat answer that assigns `job` (the same for each of its nodes), and whether
    it holds every secret env value of the job."""
    spec = job.spec
    secret_env = ctx.keyring.get_env(job.token_nonce) if job.secret_env_names else {}
    if missing := sorted(set(job.secret_env_names) - secret_env.keys()):
        log.error("job %s: the secret env values of %s are not in %s/env (is the secret dir shared "
                  "by every control plane?); its workers run without them", job.id,
                  ", ".join(missing), ctx.settings.secret_dir)
    return HeartbeatReply(assignment=Assignment(
        job_id=job.id, attempt=job.attempt, rdzv_id=job.rdzv_id,
        action="stop" if job.stopping else "run",
        command=spec.command, working_dir=spec.working_dir, env=spec.env,
        secret_env=secret_env,
        nproc_per_node=spec.nproc_per_node, nodes_min=spec.nodes.min, nodes_max=spec.nodes.max,
        job_token=ctx.job_token(job), snapshot_root=ctx.settings.snapshot_root,
        snapshot_every=spec.snapshot.every_steps, snapshot_keep=spec.snapshot.keep,
        global_batch_size=spec.global_batch_size,
        # (a plain script preempted gets its spec's grace to save: `decide.preempt`)
        cancel_grace_s=ctx.settings.cancel_grace_s if job.preempt is None else spec.preempt_grace_s,
        stacks_of=job.hung_attempt,
    )).model_dump_json().encode(), not missing


def _hung_or_idle(ctx: Context, known: Known | None) -> bytes:
    """No assignment; but where the attempt the node runs ended taken for hung (the job failed
    of it), the node is told, so that it collects its workers' stacks before it stops them."""
    ended = ctx.index.get(known.job_id) if known is not None else None
    if ended is None or known is None or ended.hung_attempt != known.attempt:
        return _IDLE
    return HeartbeatReply(assignment=None, hung=known).model_dump_json().encode()


def _known_of(job: JobRecord | None) -> Known | None:
    if job is None:
        return None
    return Known(job_id=job.id, attempt=job.attempt, action="stop" if job.stopping else "run")


@router.get("/v1/nodes/{name}/presence", status_code=status.HTTP_204_NO_CONTENT)
async def presence(name: str, request: Request, ctx: ContextDep, digest: NodeSelf) -> Response:
    """Held open for `presence_hold_s` (a second), then 204; the agent asks again at once. A
    connection that drops while held and is not back soon is a lost node (service/presence.py).
    404: no node of this name is alive (register again)."""
    lease = await ctx.nodes.lease_of(name, digest)
    conn = f"{request.client.host}:{request.client.port}" if request.client else None
    await ctx.presence.hold(name, lease, request.receive, ctx.settings.presence_hold_s, conn)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/v1/nodes/{name}/health", response_model=NodeView)
async def health(name: str, req: HealthReport, ctx: ContextDep, digest: NodeSelf) -> NodeView:
    """The node's health checks, run between jobs: a failing one QUARANTINES the node (no job
    is placed on it) until an admin's undrain; a passing one changes nothing (service/nodes.py)."""
    if digest is not None:
        await verify_node(ctx, name, digest)
    if req.ok:
        return _view(await ctx.nodes.get(name), _holders(ctx), ctx)
    log.warning("node %s quarantined: %s", name, req.reason())
    return _view(await ctx.nodes.quarantine(name, req.reason()), _holders(ctx), ctx)


@router.post("/v1/nodes/{name}/report", response_model=ReportReply)
async def report(name: str, req: ReportRequest, ctx: ContextDep, digest: NodeSelf) -> ReportReply:
    """The node's workers for (job, attempt) started, or ended with this outcome."""
    if digest is not None:
        await verify_node(ctx, name, digest)
    now = ctx.jobs.clock()
    job = await ctx.jobs.update(req.job_id, lambda job: decide_report(
        job, name, req.attempt, req.state, req.exit_code, req.reason, now))
    accepted = is_recorded(job, name, req.attempt, req.state)
    if accepted and req.state == "failed":  # bad-node attribution (service.decide.attribution)
        alone = failed_alone({n: m.state for n, m in job.members.items()}, name)
        try:
            await ctx.nodes.note_failure(name, req.job_id, alone)
        except NodeNotFound:
            pass  # gone meanwhile: nothing to quarantine
    return ReportReply(accepted=accepted,
                       detail="recorded" if accepted else "stale report for an earlier attempt, ignored")


@router.post("/v1/nodes/{name}/stacks", response_model=ReportReply)
async def stacks(name: str, req: StacksReport, ctx: ContextDep, digest: NodeSelf) -> ReportReply:
    """The node's workers' Python stacks, for an attempt taken for hung: an event of the job."""
    if digest is not None:
        await verify_node(ctx, name, digest)
    now = ctx.jobs.clock()
    recorded = False

    def decide(job: JobRecord) -> Change | None:
        nonlocal recorded
        change = decide_stacks(job, name, req, now)
        recorded = change is not None
        return change

    await ctx.jobs.update(req.job_id, decide)
    return ReportReply(accepted=recorded, detail="recorded" if recorded else
                       "not an attempt taken for hung, or not this node's: ignored")


@router.post("/v1/jobs/{job_id}/rounds", response_model=ReportReply)
async def rounds(job_id: str, req: RoundReport, job: JobTokenDep, ctx: ContextDep) -> ReportReply:
    """A node's torchrun is re-forming the group ('joining') or has formed it ('joined').

    Only group rank 0 reports 'joined', once per round. A round with as many nodes as the
    one before is a restart after a worker failure and counts against `max_restarts`; a
    round with more or fewer nodes is a membership change and does not.

    A 'joining' after the first round is also the agent's sign that its group broke (a
    worker failed, or a peer is gone): like a worker's broken-peer report, it makes the
    other members suspect (service/presence.py), so a script without the ftrain runtime
    gets the fast loss detection too.
    """
    if req.phase == "joining" and req.call > 0:
        ctx.presence.suspect(broken_peer_suspects(job.members, req.node, req.attempt, job.attempt,
                                                  job.state.is_terminal()))
    now = ctx.jobs.clock()
    tail = await ctx.logs.last_lines(job_id, 15) if req.phase == "joined" else []
    updated = await ctx.jobs.update(job_id, lambda job: decide_round(job, req, tail, now))
    if updated.state.is_terminal():  # restarts spent: the job's rendezvous is of no more use
        await delete_rendezvous(ctx.kv, ctx.keys, job_id)
    elif req.phase == "joined" and req.round is not None and updated.attempt == req.attempt:
        ctx.rdzv_states.round_seen(ctx.kv, ctx.keys, updated.rdzv_id, req.round)
    return ReportReply(accepted=updated.attempt == req.attempt, detail=updated.state.value)


def _holders(ctx: Context) -> dict[str, tuple[str, str]]:
    """node -> (job id, its part's state) for every node an unfinished job holds: a live
    member, or a finished one (its workers exited 0; the node stays the job's until it ends)."""
    held: dict[str, tuple[str, str]] = {}
    for job_id in ctx.index.active_ids():
        job = ctx.index.get(job_id)
        for node, member in (job.members.items() if job is not None else ()):
            if member.holds_node():
                held[node] = (job_id, member.state)
    return held


def _view(record: NodeRecord, holders: dict[str, tuple[str, str]], ctx: Context) -> NodeView:
    job_id, part = holders.get(record.name, (None, None))
    state = record.state
    if state is NodeState.DRAINING and job_id is None:
        state = NodeState.DRAINED  # idle: safe to take away
    waiting = ctx.index.keeper(record.name) if job_id is None else None
    held_for = waiting.id if waiting is not None and keep.holds(waiting, record, ctx.jobs.clock()) else None
    return NodeView(name=record.name, state=state, nproc_per_node=record.nproc_per_node,
                    gpus=record.gpus, gpu_model=record.gpu_model, address=record.address,
                    registered_at=record.registered_at, reason=record.reason,
                    job=job_id, member_state=part, held_for=held_for)


@router.get("/v1/nodes", response_model=NodeList, dependencies=[UserAuth])
async def list_nodes(ctx: ContextDep) -> NodeList:
    records = await ctx.nodes.list()
    holders = _holders(ctx)
    return NodeList(items=[_view(records[name], holders, ctx) for name in sorted(records)])


@router.post("/v1/nodes/{name}/drain", response_model=NodeView, status_code=status.HTTP_202_ACCEPTED,
             dependencies=[AdminAuth])
async def drain(name: str, ctx: ContextDep) -> NodeView:
    """Take a node out gracefully: its job snapshots and goes on without it; it gets no new work.
    The admin's: draining moves whoever's job runs there."""
    return _view(await ctx.nodes.drain(name), _holders(ctx), ctx)


@router.post("/v1/nodes/{name}/undrain", response_model=NodeView, dependencies=[AdminAuth])
async def undrain(name: str, ctx: ContextDep) -> NodeView:
    """Put a drained node back in service: READY, it may be given work again. The admin's."""
    return _view(await ctx.nodes.undrain(name), _holders(ctx), ctx)


@router.post("/v1/nodes/{name}/leave", response_model=NodeView, status_code=status.HTTP_202_ACCEPTED)
async def leave(name: str, ctx: ContextDep, digest: NodeSelf) -> NodeView:
    """An agent that is stopping takes its own node out as a drain would: its jobs stop at a
    step boundary with their state saved and go on without it (or wait for nodes). The drain
    ends with the node (DELETE, or its lease): it registers again READY."""
    if digest is not None:
        await verify_node(ctx, name, digest)
    return _view(await ctx.nodes.leave(name), _holders(ctx), ctx)


@router.delete("/v1/nodes/{name}", status_code=status.HTTP_204_NO_CONTENT)
async def deregister(name: str, ctx: ContextDep, digest: NodeSelf) -> None:
    """An agent shutting down gives its lease back, so it is gone at once, not after the TTL."""
    if digest is not None:
        try:
            await verify_node(ctx, name, digest)
        except NodeNotFound:
            return None  # already gone
    await ctx.nodes.deregister(name)
    return None
