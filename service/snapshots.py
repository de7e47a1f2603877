"""Snapshot commits, the "latest" pointer, progress and planned-change control of a job.

Rank 0 of a job writes a snapshot file itself (the control plane never touches the
file system) and then *commits* its metadata here. Only a committed snapshot can become
"latest", and only a commit from the job's current attempt is accepted: a rank 0 left
over from an earlier attempt (a split group, a slow process that missed a restart) gets
409 and can never move "latest".

Consistency. A commit must see every snapshot record of the job (to prune beyond
`keep`) and change the job record (its `latest_snapshot`) in one decision. Every write
to a snapshot record in this module goes in the same transaction as a write of the job
key, so the job key's mod_revision fences the snapshot records too: read the job (at
revision R), then the records, decide, and commit only if the job is still at R: the
compare-and-set of `JobStore.update`, with the records read along with the job
(`_update` below).

The decide functions (`decide_commit`, `decide_corrupt`, `decide_progress`) are pure:
(job, records, request, now) -> Change, and are tested without etcd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from service.errors import Conflict, FtrainError
from service.jobs import Change, JobStore
from service.models import JobRecord, Progress
from service.state import note
from service.store import cas
from service.store.api import Delete, Put
from worker.protocol import (
    CommitRequest,
    CommitResult,
    ControlAction,
    ControlView,
    ProgressReport,
    SnapshotList,
    SnapshotRecord,
)


class StaleAttempt(Conflict):
    """A write from an attempt that is no longer the job's current one."""


class SnapshotNotFound(FtrainError):
    status_code = 404

    def __init__(self, job_id: str, step: int):
        super().__init__(f"job {job_id} has no committed snapshot at step {step}")


Records = dict[int, SnapshotRecord]


@dataclass
class Decision:
    """A Change plus what the caller should answer (paths to prune)."""

    change: Change | None
    prune: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- pure decisions

def _check_writable(job: JobRecord, attempt: int | None, what: str) -> None:
    if job.state.is_terminal():
        raise Conflict(f"job {job.id} is {job.state.value}; its {what} can no longer change")
    if attempt is not None and attempt != job.attempt:
        raise StaleAttempt(f"attempt {attempt} of job {job.id} is over (the job is on attempt "
                           f"{job.attempt}); a stale worker cannot write its {what}. Stop this worker.")


def newest_good(records: Records) -> SnapshotRecord | None:
    good = [r for r in records.values() if not r.bad]
    return max(good, key=lambda r: r.step) if good else None


def plan_prune(records: Records, latest_step: int | None, keep: int) -> list[int]:
    """Steps to delete: all but the latest and the newest good ones, `keep` in all."""
    kept: set[int] = set()
    if latest_step is not None and latest_step in records:
        kept.add(latest_step)
    for rec in sorted(records.values(), key=lambda r: r.step, reverse=True):
        if len(kept) >= keep:
            break
        if not rec.bad:
            kept.add(rec.step)
    return sorted(step for step in records if step not in kept)


def decide_commit(job: JobRecord, records: Records, req: CommitRequest, now: float,
                  snapshot_key: Callable[[int], str]) -> Decision:
    """Record a snapshot; move latest only forward; ack a control id; prune beyond keep."""
    _check_writable(job, req.attempt, "snapshots")
    rec = SnapshotRecord(step=req.step, path=req.path, size=req.size, checksum=req.checksum,
                         time=now, attempt=req.attempt, control_id=req.control_id,
                         stall_s=req.stall_s, write_s=req.write_s)
    records = {**records, req.step: rec}
    update: dict = {}
    latest = job.latest_snapshot
    if latest is None or req.step >= latest.step:
        latest = rec.meta()
        update["latest_snapshot"] = latest
    if req.control_id is not None and req.control_id >= job.control_acked:
        update["control_acked"] = req.control_id
        update["control_acked_step"] = req.step
    pruned = plan_prune(records, latest.step, job.spec.snapshot.keep)
    ops: list[Put | Delete] = [Put(snapshot_key(req.step), rec.model_dump_json().encode())]
    ops += [Delete(snapshot_key(step)) for step in pruned]
    # A re-commit of a pruned step's path would be deleted by the writer: never list the latest.
    paths = [records[s].path for s in pruned if records[s].path != latest.path]
    return Decision(Change(job.model_copy(update=update), [], ops), paths)


def decide_corrupt(job: JobRecord, records: Records, step: int, reason: str, now: float,
                   snapshot_key: Callable[[int], str]) -> Decision:
    """Mark a snapshot bad, note it in the job's events, move latest back to the newest good."""
    rec = records.get(step)
    if rec is None:
        raise SnapshotNotFound(job.id, step)
    if rec.bad:
        return Decision(None)
    bad = rec.model_copy(update={"bad": True})
    records = {**records, step: bad}
    latest = job.latest_snapshot
    if latest is not None and latest.step == step:
        good = newest_good(records)
        latest = good.meta() if good else None
    resume = f"step {latest.step}" if latest else "the start (no good snapshot left)"
    changed, event = note(job, f"snapshot at step {step} is corrupt ({reason}); "
                               f"resuming from {resume}", now)
    changed = changed.model_copy(update={"latest_snapshot": latest})
    return Decision(Change(changed, [event], [Put(snapshot_key(step), bad.model_dump_json().encode())]))


def decide_progress(job: JobRecord, report: ProgressReport, now: float) -> Change:
    _check_writable(job, report.attempt, "progress")
    progress = Progress(step=report.step, loss=report.loss, samples_per_s=report.samples_per_s, time=now)
    return Change(job.model_copy(update={"progress": progress}))


def control_for(job: JobRecord) -> ControlView:
    """The request rank 0 should act on now: none once it has been acknowledged by a commit."""
    ctl = job.control
    if ctl is None or ctl.action is ControlAction.NONE or ctl.id <= job.control_acked:
        return ControlView()
    return ControlView(id=ctl.id, action=ctl.action, reason=ctl.reason)


# ---------------------------------------------------------------------------- I/O

class SnapshotStore:
    """Snapshot records of jobs in etcd, changed together with the job record by CAS."""

    def __init__(self, jobs: JobStore):
        self.jobs = jobs

    def _key(self, job_id: str) -> Callable[[int], str]:
        return lambda step: self.jobs.keys.snapshot(job_id, step)

    async def _records(self, job_id: str) -> Records:
        entries = await self.jobs.kv.get_prefix(self.jobs.keys.snapshots(job_id))
        recs = (SnapshotRecord.model_validate_json(e.value) for e in entries)
        return {r.step: r for r in recs}

    async def list(self, job_id: str) -> SnapshotList:
        job = await self.jobs.get(job_id)
        records = await self._records(job_id)
        latest = job.latest_snapshot.step if job.latest_snapshot else None
        return SnapshotList(items=[records[s] for s in sorted(records)], latest=latest)

    async def _update(self, job_id: str, decide: Callable[[JobRecord, Records], Decision]) -> Decision:
        """JobStore.update's compare-and-set, with the job's snapshot records read after the job."""
        store = self.jobs

        async def read() -> tuple[JobRecord, int, Records]:
            job, revision = await store.get_with_revision(job_id)
            return job, revision, await self._records(job_id)

        def outcome(read: tuple[JobRecord, int, Records]) -> cas.Done[Decision] | cas.Write[Decision]:
            job, revision, records = read
            decision = decide(job, records)
            if decision.change is None:
                return cas.Done(decision)
            return store.write(revision, decision.change, decision)

        return await cas.update(store.kv, read, outcome, f"job {job_id}")

    async def commit(self, job_id: str, req: CommitRequest) -> CommitResult:
        now = self.jobs.clock()
        decision = await self._update(
            job_id, lambda job, recs: decide_commit(job, recs, req, now, self._key(job_id)))
        assert decision.change is not None
        latest = decision.change.job.latest_snapshot
        committed = SnapshotRecord.model_validate_json(decision.change.ops[0].value)  # type: ignore[union-attr]
        return CommitResult(committed=committed, latest=latest.step if latest else None,
                            prune=decision.prune)

    async def report_corrupt(self, job_id: str, step: int, reason: str) -> SnapshotList:
        now = self.jobs.clock()
        await self._update(job_id, lambda job, recs: decide_corrupt(job, recs, step, reason, now,
                                                                     self._key(job_id)))
        return await self.list(job_id)

    async def report_progress(self, job_id: str, report: ProgressReport) -> Progress:
        now = self.jobs.clock()
        job = await self.jobs.update(job_id, lambda job: decide_progress(job, report, now))
        assert job.progress is not None
        return job.progress
