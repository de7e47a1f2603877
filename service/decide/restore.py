"""Where a (re)started group resumes: the restore point, decided once per attempt.

When a group starts (the first attempt, or a restart after a fault or a planned change),
each member node's first worker reports what its memory tier holds *under the new
attempt* (`decide_memory`); then rank 0 asks for the restore point and every rank loads
it. Only reports of the current attempt count: a copy reported under an earlier attempt
may have been overwritten since, and a node that is no longer a member (lost, left) is
not a survivor. The newest reported step wins when it is at least the disk tier's latest
(the durable tier is never skipped backwards); else the disk's latest; else the start.

Rank 0 asks once per group formation (after a barrier that every report is in) and
broadcasts the answer. An ask from another attempt is refused: the agreement is fenced by
the attempt like every worker write. It is decided afresh at each ask, not kept per
attempt: a planned scale-up restarts the group within the same attempt, and by then the
members hold newer copies. The last point is kept in the job record, and each is an event.

(job, memory reports, attempt, now) -> (the point, the Change to write or None).
"""

from __future__ import annotations

from service.decide.change import Change
from service.decide.snapshots import _check_writable
from service.decide.state import note
from service.models import JobRecord
from worker.protocol import MemorySnapshot, RestorePoint


def choose_restore(job: JobRecord, copies: list[MemorySnapshot], attempt: int) -> RestorePoint:
    """The restore point of `attempt` from the members' reports of it and the disk's latest."""
    held = [c for c in copies if c.attempt == attempt and c.node in job.members]
    disk = job.latest_snapshot.step if job.latest_snapshot is not None else None
    newest = max((c.step for c in held), default=None)
    if newest is not None and (disk is None or newest >= disk):
        nodes = sorted(c.node for c in held if c.step == newest)
        on_disk = "none" if disk is None else disk
        return RestorePoint(attempt=attempt, tier="memory", step=newest, nodes=nodes,
                            reason=f"attempt {attempt} resumes from step {newest} in the memory of "
                                   f"{', '.join(nodes)} (disk's latest: {on_disk})")
    if disk is not None:
        why = ("no member holds a copy in memory" if newest is None
               else f"the newest copy in memory is step {newest}")
        return RestorePoint(attempt=attempt, tier="disk", step=disk,
                            reason=f"attempt {attempt} resumes from the disk snapshot at step {disk} ({why})")
    return RestorePoint(attempt=attempt, tier="none",
                        reason=f"attempt {attempt} starts at step 0 (no snapshot)")


def decide_restore(job: JobRecord, copies: list[MemorySnapshot], attempt: int,
                   now: float) -> tuple[RestorePoint, Change]:
    """The restore point of this formation of the attempt's group, recorded with an event."""
    _check_writable(job, attempt, "restore point")
    point = choose_restore(job, copies, attempt)
    changed, event = note(job, point.reason, now)
    return point, Change(changed.model_copy(update={"restore": point}), [event])


def decide_memory_corrupt(job: JobRecord, node: str, step: int, reason: str, attempt: int,
                          now: float) -> Change:
    """A member found its node's memory copy of `step` damaged: say so in the job's events."""
    _check_writable(job, attempt, "memory snapshots")
    changed, event = note(job, f"memory copy at step {step} on node {node} is corrupt; falling back "
                               f"to the next source ({reason})", now)
    return Change(changed, [event])
