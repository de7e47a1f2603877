"""Snapshot commits and corrupt reports, progress, and rank 0's control request.

Progress is hot state: rank 0 reports about once a second, so a report is kept under a key
of its own, at most one write per `min_interval_s` (reports in between are answered with
what is stored), and never rewrites the job record, except once: the first report sets
`reports_progress`, which the scheduler reads (`decide.scheduling.uses_runtime`).

Only a committed snapshot can become "latest", and only a commit from the job's current
attempt is accepted: a rank 0 left over from an earlier attempt (a split group, a slow
process that missed a restart) gets 409 and can never move "latest". "latest" only moves
forward, except when the snapshot it names is found corrupt: then it falls back to the
newest good one. A commit names a file in the job's own snapshot directory: every rank of
the job loads the committed file, so a commit naming another (forged with a leaked job
token: `/tmp/evil.pt`) is refused (422) before anything is written. A commit that carries a
control id acknowledges that planned change (`control_for` stops showing it). Beyond
`snapshot.keep`, the oldest are pruned, never the latest.

(job, records, request, now) -> Decision: a Change of the job record and the snapshot
records (written in one transaction by `service.snapshots.SnapshotStore`), and the files
the writer should delete.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from service.decide import stragglers
from service.decide.change import Change
from service.decide.metrics import add_point, merged, split
from service.decide.recovery import first_step
from service.decide.state import note
from service.errors import Conflict, InvalidField, SnapshotNotFound, StaleAttempt
from service.models import EventView, JobRecord, MetricHistory, Progress, Replay
from service.store.api import Delete, Put
from worker.protocol import (
    MAX_METRICS,
    CommitRequest,
    ControlAction,
    ControlView,
    MemoryReport,
    MemorySnapshot,
    ProgressReport,
    SnapshotRecord,
    steps_to_prune,
)

Records = dict[int, SnapshotRecord]


@dataclass
class Decision:
    """A Change plus what the caller should answer: the record committed, paths to prune."""

    change: Change | None
    prune: list[str] = field(default_factory=list)
    committed: SnapshotRecord | None = None


def _check_writable(job: JobRecord, attempt: int | None, what: str) -> None:
    if job.state.is_terminal():
        raise Conflict(f"job {job.id} is {job.state.value}; its {what} can no longer change")
    if attempt is not None and attempt != job.attempt:
        raise StaleAttempt(f"attempt {attempt} of job {job.id} is over (the job is on attempt "
                           f"{job.attempt}); a stale worker cannot write its {what}. Stop this worker.")


def newest_good(records: Records) -> SnapshotRecord | None:
    """The good (not corrupt) snapshot with the highest step."""
    good = [r for r in records.values() if not r.bad]
    return max(good, key=lambda r: r.step) if good else None


def plan_prune(records: Records, latest_step: int | None, keep: int) -> list[int]:
    """Steps to delete: all but the latest and the newest good ones, `keep` in all
    (`worker.protocol.steps_to_prune`, the rule the local twin applies too)."""
    return steps_to_prune({step: rec.bad for step, rec in records.items()}, latest_step, keep)


def snapshot_path_error(job_id: str, path: str, snapshot_root: str | None) -> str | None:
    """Why a commit's `path` is refused, None where it names a file directly in the job's
    snapshot directory: `<snapshot_root>/<job id>` (as a node's `pathlib` writes it), or,
    without a root every node shares, a node's own `<data dir>/snapshots/<job id>`, which the
    control plane does not know: then any absolute directory named after the job, reached
    without `..` (the worker checks its own directory before it loads a committed file)."""
    p = PurePosixPath(path)
    if snapshot_root is not None:
        directory = PurePosixPath(snapshot_root) / job_id
        where = str(directory)
    else:
        named = p.is_absolute() and ".." not in p.parts and p.parent.name == job_id
        directory = p.parent if named else None
        where = f"an absolute directory named {job_id} (a node's <data dir>/snapshots/{job_id})"
    if p.parent != directory or p.name in ("", ".."):
        return (f"{path!r} is outside job {job_id}'s snapshot directory, {where}; commit only the "
                "files rank 0 wrote there (FTRAIN_SNAPSHOT_DIR)")
    return None


def decide_commit(job: JobRecord, records: Records, req: CommitRequest, now: float,
                  snapshot_key: Callable[[int], str], snapshot_root: str | None = None) -> Decision:
    """Record a snapshot; move latest only forward; ack a control id; prune beyond keep.
    `snapshot_root`: where every node snapshots, if they share one (`snapshot_path_error`)."""
    _check_writable(job, req.attempt, "snapshots")
    if (why := snapshot_path_error(job.id, req.path, snapshot_root)) is not None:
        raise InvalidField("path", why)
    rec = SnapshotRecord(step=req.step, path=req.path, size=req.size, checksum=req.checksum,
                         time=now, attempt=req.attempt, control_id=req.control_id,
                         stall_s=req.stall_s, write_s=req.write_s, shards=req.shards)
    records = {**records, req.step: rec}
    update: dict = {}
    if req.stall_s:  # the goodput ledger's `snapshot` (decide.goodput): the job's total
        update["snapshot_stall_s"] = job.snapshot_stall_s + req.stall_s
    latest = job.latest_snapshot
    if latest is None or req.step >= latest.step:
        latest = rec.meta()
        update["latest_snapshot"] = latest
    if req.control_id is not None and req.control_id >= job.control_acked:
        update["control_acked"] = req.control_id
        update["control_acked_step"] = req.step
    pruned = plan_prune(records, latest.step, job.spec.snapshot.keep)
    # An older step committed beyond `keep` is itself the one pruned: it is not stored (one
    # transaction may not both put and delete a key), and its file goes back to be deleted.
    ops: list[Put | Delete] = []
    if req.step not in pruned:
        ops.append(Put(snapshot_key(req.step), rec.model_dump_json().encode()))
    ops += [Delete(snapshot_key(step)) for step in pruned]
    # A re-commit of a pruned step's path would be deleted by the writer: never list the latest.
    paths = [records[s].path for s in pruned if records[s].path != latest.path]
    return Decision(Change(job.model_copy(update=update), [], ops), paths, committed=rec)


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
    # What it means first: a reason is shown cut to its first 300 characters (a path is long).
    changed, event = note(job, f"snapshot at step {step} is corrupt; resuming from {resume} "
                               f"({reason})", now)
    changed = changed.model_copy(update={"latest_snapshot": latest})
    return Decision(Change(changed, [event], [Put(snapshot_key(step), bad.model_dump_json().encode())]))


@dataclass(frozen=True)
class ProgressDecision:
    """What a progress report changes: the progress key (and, once, the job record), and
    the metric history's keys (`decide.metrics`: body and tail)."""

    progress: Progress  # what is stored once the decision is applied (the answer)
    write: bool  # write `progress` to the job's progress key
    job: JobRecord | None = None  # the job record to write too (the first report; a recovery's end)
    events: list[EventView] = field(default_factory=list)  # the job's events to write with it
    body: MetricHistory | None = None  # the history's body to write (None: unchanged)
    tail: MetricHistory | None = None  # its tail to write (None: unchanged)


SPEED_WEIGHT = 0.3  # of the newest interval in the smoothed steps per second


def decide_progress(job: JobRecord, stored: Progress | None, report: ProgressReport, now: float,
                    min_interval_s: float, body: MetricHistory | None = None,
                    tail: MetricHistory | None = None, metric_points: int = 240) -> ProgressDecision:
    """Rank 0's latest step, loss and throughput; refused from a stale attempt or a finished job.

    A report within `min_interval_s` of the stored one is dropped (the stored one is the
    answer), so a job writes its progress at a bounded rate however often it reports; rank
    0's final report (one per run of its script) is always stored, so a finished job shows
    the step it ended at. A stored report also adds a point to the metric history
    (`decide.metrics`), and gives the speed (steps per second, smoothed) and, with the
    script's `total_steps`, percent done and the time left.
    """
    _check_writable(job, report.attempt, "progress")
    first = not job.reports_progress
    # The first step of a group that replaced a stopped one: "training again" (`recovery`).
    resumed = first_step(job, report.attempt, report.group, report.step, now)
    if resumed is not None and stored is not None:
        resumed = with_replay(resumed, job, stored, report.step, now)
    if (stored is not None and stored.time is not None and not first and resumed is None and not report.final
            and 0 <= now - stored.time < min_interval_s):
        return ProgressDecision(stored, write=False)
    speed = stored.steps_per_s if stored is not None else None
    if stored is not None and stored.time is not None and now > stored.time and report.step > stored.step:
        latest = (report.step - stored.step) / (now - stored.time)
        speed = latest if speed is None else SPEED_WEIGHT * latest + (1 - SPEED_WEIGHT) * speed
    total = report.total_steps if report.total_steps is not None else (stored.total_steps if stored else None)
    percent = eta = None
    if total is not None:
        percent = round(min(100.0, 100.0 * report.step / total), 2)
        if speed:
            eta = round(max(0, total - report.step) / speed, 1)
    timed, found = stragglers.observe(stored, f"{report.attempt}:{report.group}", report.ranks, now,
                                      job.spec.straggler_factor, job.spec.straggler_window_s)
    progress = Progress(step=report.step, loss=report.loss, samples_per_s=report.samples_per_s, time=now,
                        total_steps=total, steps_per_s=None if speed is None else round(speed, 4),
                        percent=percent, eta_s=eta, metrics=report.metrics, ranks=timed.ranks,
                        ranks_since=timed.ranks_since, ranks_of=timed.ranks_of,
                        straggler_samples=timed.straggler_samples)
    values = {"loss": report.loss, "samples_per_s": report.samples_per_s, **report.metrics}
    added = add_point(merged(body, tail), report.step, now, values, metric_points, MAX_METRICS + 2)
    new_body, new_tail = (None, None) if added is None else split(body, added)
    changed = job if resumed is None else resumed.job
    if first:
        changed = changed.model_copy(update={"reports_progress": True})
    changed, flags = stragglers.flag(changed, found, now)
    return ProgressDecision(progress, write=True, body=new_body, tail=new_tail,
                            job=changed if changed is not job else None,
                            events=([] if resumed is None else resumed.events) + flags)


def with_replay(resumed: Change, job: JobRecord, stored: Progress, step: int, now: float) -> Change:
    """`resumed` (the first step of a group that replaced a stopped one, `step`) with the steps
    it trains again on its event: those the stopped group had reported (`stored`, its last
    report) past the point the new group resumed from (the attempt's restore point; else the
    step before its first). The goodput ledger counts them as replayed (decide.goodput)."""
    point = job.restore
    if point is not None and point.attempt == job.attempt:
        from_step = point.step or 0
    else:
        from_step = max(0, step - 1)
    reached_at = stored.time if stored.time is not None else now  # (a report stored before times)
    replay = Replay(from_step=from_step, reached_step=stored.step, reached_at=reached_at,
                    step_s=round(1.0 / stored.steps_per_s, 6) if stored.steps_per_s else None)
    events = [e.model_copy(update={"replay": replay}) for e in resumed.events]
    return Change(resumed.job, events, resumed.ops)


def decide_memory(job: JobRecord, node: str, report: MemoryReport, now: float) -> MemorySnapshot:
    """A member node's memory-tier copy; refused from a stale attempt, a finished job or a
    node that is not a member of the job's attempt."""
    _check_writable(job, report.attempt, "memory snapshots")
    if node not in job.members:
        raise Conflict(f"node {node!r} is not a member of job {job.id} (attempt {job.attempt}); "
                       "only a member's worker reports its memory tier")
    return MemorySnapshot(node=node, step=report.step, attempt=report.attempt, time=now)


def control_for(job: JobRecord) -> ControlView:
    """The request rank 0 should act on now: none once it has been acknowledged by a commit."""
    ctl = job.control
    if ctl is None or ctl.action is ControlAction.NONE or ctl.id <= job.control_acked:
        return ControlView()
    return ControlView(id=ctl.id, action=ctl.action, reason=ctl.reason)
