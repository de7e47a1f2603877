"""The job state machine, as pure functions (no I/O): tested with a table of cases."""

from __future__ import annotations

from service.errors import InvalidTransition
from service.models import EventView, JobRecord, JobState

S = JobState
ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.STARTING, S.CANCELLED, S.FAILED}),
    # started: RUNNING at its first step (`decide.recovery`), as after a recovery
    S.STARTING: frozenset({S.RUNNING, S.RECOVERING, S.PENDING, S.CANCELLING, S.SUCCEEDED, S.FAILED}),
    S.RUNNING: frozenset({S.RECOVERING, S.PENDING, S.CANCELLING, S.SUCCEEDED, S.FAILED}),
    S.RECOVERING: frozenset({S.RUNNING, S.PENDING, S.CANCELLING, S.SUCCEEDED, S.FAILED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


def uses_runtime(job: JobRecord) -> bool:
    """The job's rank 0 talks to the control plane (it reported progress), so it can ack a
    planned change at a step boundary (`decide.scheduling`) and lose no step giving nodes up."""
    return job.reports_progress


def can_transition(current: JobState, target: JobState) -> bool:
    return target in ALLOWED[current]


def transition(job: JobRecord, target: JobState, reason: str, now: float) -> tuple[JobRecord, EventView]:
    """Return the job moved to `target`, and the event that records it.

    Raises InvalidTransition for a move the machine forbids (anything out of a terminal
    state among them); the caller decides whether that is an error or a no-op.
    """
    if not can_transition(job.state, target):
        raise InvalidTransition(job.id, job.state.value, target.value)
    seq = job.event_seq + 1
    line, detail = split_reason(reason)
    changed = job.model_copy(update={
        "state": target,
        "reason": line,
        "updated_at": now,
        "event_seq": seq,
        "finished_at": now if target.is_terminal() else job.finished_at,
        # (nodes borrowed in front of a waiting job are given back with every node it leaves)
        "borrowed": None if target is S.PENDING or target.is_terminal() else job.borrowed,
    })
    return changed, EventView(seq=seq, time=now, state=target, reason=line, detail=detail)


def note(job: JobRecord, reason: str, now: float, *, as_reason: bool = False) -> tuple[JobRecord, EventView]:
    """An event without a state change (a restart, a node joining, a skipped snapshot);
    `as_reason`: its line becomes the job's reason too (what the job is doing changed)."""
    seq = job.event_seq + 1
    line, detail = split_reason(reason)
    update = {"event_seq": seq, "updated_at": now} | ({"reason": line} if as_reason else {})
    changed = job.model_copy(update=update)
    return changed, EventView(seq=seq, time=now, state=job.state, reason=line, detail=detail)


REASON_MAX_CHARS = 300


def split_reason(reason: str) -> tuple[str, str | None]:
    """A reason as the job and the tables show it (its first line, at most 300 characters),
    and the rest (log lines quoted by a failure, a line cut short) for the event's detail."""
    text = reason.strip()
    line, _, rest = text.partition("\n")
    line = line.strip()
    if len(line) > REASON_MAX_CHARS:
        return line[: REASON_MAX_CHARS - 1] + "…", text
    return line, (rest.strip("\n") or None)

