"""Job-runtime endpoints: snapshot commits and listing, corrupt reports, progress, control.

Workers call these with their job's token (`FTRAIN_JOB_TOKEN`), and nothing else opens them:
not the node token, not a node's credential (a forged commit names a file that every worker
of the job then loads). Listing snapshots is also open to users.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, status

from service.api_contract import AuthFirstRoute
from service.decide.liveness import broken_peer_suspects
from service.decide.members import decide_run_finished, has_run_finished
from service.decide.snapshots import control_for
from service.deps import (
    ContextDep,
    JobCredentials,
    JobTokenDep,
    UserCredentials,
    require_job_token,
    token_matches,
)
from service.snapshots import SnapshotStore
from worker.protocol import (
    BrokenPeer,
    CommitRequest,
    CommitResult,
    ControlView,
    CorruptReport,
    MemoryCorrupt,
    MemoryReport,
    MemorySnapshot,
    Progress,
    ProgressReport,
    ReportReply,
    RestorePoint,
    RestoreRequest,
    RunFinished,
    SnapshotList,
    Suspects,
)

router = APIRouter(prefix="/v1/jobs", tags=["snapshots"], route_class=AuthFirstRoute)


def get_snapshots(ctx: ContextDep) -> SnapshotStore:
    return ctx.snapshots


SnapshotsDep = Annotated[SnapshotStore, Depends(get_snapshots)]


async def require_reader(ctx: ContextDep, user_creds: UserCredentials, job_creds: JobCredentials,
                         job_id: Annotated[str, Path()]) -> None:
    """A user token (the admin's or a named user's), or the job's own token."""
    creds = user_creds or job_creds  # one header: the OpenAPI names both schemes
    if creds is not None and (token_matches(creds.credentials, ctx.settings.user_token)
                              or await ctx.users.who(creds.credentials) is not None):
        return
    await require_job_token(ctx, creds, job_id)


@router.post("/{job_id}/snapshots", response_model=CommitResult)
async def commit_snapshot(job_id: str, req: CommitRequest, job: JobTokenDep,
                          snapshots: SnapshotsDep, ctx: ContextDep) -> CommitResult:
    """Commit a snapshot rank 0 has written; 409 from a stale attempt or a finished job, 422
    for a file outside the job's snapshot directory (every rank loads the committed file).

    Returns the files the writer should delete (pruned beyond `snapshot.keep`).
    """
    t = ctx.telemetry
    with t.snapshot_commit_s.time():
        result = await snapshots.commit(job.id, req)
    if req.stall_s is not None:
        t.snapshot_stall_s.observe(req.stall_s)
    if req.write_s is not None:
        t.snapshot_write_s.observe(req.write_s)
    return result


@router.get("/{job_id}/snapshots", response_model=SnapshotList,
            dependencies=[Depends(require_reader)])
async def list_snapshots(job_id: str, snapshots: SnapshotsDep) -> SnapshotList:
    """Committed snapshots, oldest first, and the step of the latest good one."""
    return await snapshots.list(job_id)


@router.post("/{job_id}/snapshots/{step}/corrupt", response_model=SnapshotList)
async def report_corrupt(job_id: str, step: Annotated[int, Path(ge=0)], job: JobTokenDep,
                         snapshots: SnapshotsDep, report: CorruptReport | None = None) -> SnapshotList:
    """A worker found this snapshot damaged: mark it bad and fall back to the previous one."""
    return await snapshots.report_corrupt(job.id, step, (report or CorruptReport()).reason)


@router.put("/{job_id}/memory/{node}", response_model=MemorySnapshot)
async def report_memory(job_id: str, node: Annotated[str, Path(max_length=253)], report: MemoryReport,
                        job: JobTokenDep, snapshots: SnapshotsDep) -> MemorySnapshot:
    """The step a member node's memory tier holds (its first worker, about once a second);
    409 from a stale attempt, a finished job or a node that is not a member."""
    return await snapshots.report_memory(job.id, node, report)


@router.post("/{job_id}/memory/{node}/corrupt", status_code=status.HTTP_204_NO_CONTENT)
async def report_memory_corrupt(job_id: str, node: Annotated[str, Path(max_length=253)],
                                report: MemoryCorrupt, job: JobTokenDep, snapshots: SnapshotsDep) -> None:
    """A worker found its node's memory copy damaged and fell back: noted in the job's events;
    409 from a stale attempt or a finished job."""
    await snapshots.memory_corrupt(job.id, node, report)


@router.post("/{job_id}/restore", response_model=RestorePoint)
async def restore_point(job_id: str, req: RestoreRequest, job: JobTokenDep,
                        snapshots: SnapshotsDep) -> RestorePoint:
    """Rank 0 of a (re)started group: the step every rank loads, and from which tier, decided
    from the members' memory reports of this attempt and the disk's latest (an event says
    which); 409 from a stale attempt or a finished job."""
    return await snapshots.restore_point(job.id, req)


@router.post("/{job_id}/broken", response_model=Suspects)
async def report_broken_peer(job_id: str, report: BrokenPeer, job: JobTokenDep, ctx: ContextDep) -> Suspects:
    """A worker's process group broke: the job's other members are suspect, and one whose
    agent's presence connection dropped is lost at once (service/presence.py), not after
    the longer bound a network blip gets. A stale attempt's report suspects nobody."""
    nodes = broken_peer_suspects(job.members, report.node, report.attempt, job.attempt,
                                 job.state.is_terminal())
    ctx.presence.suspect(nodes)
    return Suspects(nodes=nodes)


@router.post("/{job_id}/finished", response_model=ReportReply)
async def report_run_finished(job_id: str, report: RunFinished, job: JobTokenDep,
                              ctx: ContextDep) -> ReportReply:
    """A member node's workers finished the run (the runtime's clean end, after every rank's
    last barrier): if its agent then vanishes before it reports their exit, the node counts
    as finished, not lost (service/decide/outcome.py). Not accepted from a stale attempt or
    a node that is not a live member."""
    now = ctx.jobs.clock()
    updated = await ctx.jobs.update(job_id, lambda current: decide_run_finished(
        current, report.node, report.attempt, now))
    accepted = has_run_finished(updated, report.node, report.attempt)
    return ReportReply(accepted=accepted, detail="recorded" if accepted else
                       "not a live member of the job's current attempt: ignored")


@router.post("/{job_id}/progress", response_model=Progress)
async def report_progress(job_id: str, report: ProgressReport, job: JobTokenDep,
                          ctx: ContextDep) -> Progress:
    """Rank 0's step, loss and throughput, shown in the job view."""
    return await ctx.progress.report(job.id, report)


@router.get("/{job_id}/control", response_model=ControlView)
async def get_control(job_id: str, job: JobTokenDep) -> ControlView:
    """What rank 0 should do at its next step boundary ("none", or a planned change)."""
    return control_for(job)
