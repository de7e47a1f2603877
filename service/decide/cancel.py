"""Cancel: a job not holding nodes ends at once; one that does drains through CANCELLING.

The scheduler takes it from there: it asks rank 0 for a last snapshot, tells the members
to stop, and moves the job to CANCELLED once no member is live (`scheduling.plan`).
"""

from __future__ import annotations

from service.decide.change import Change
from service.decide.state import transition
from service.errors import InvalidTransition
from service.models import EventView, JobRecord, JobState

S = JobState


def cancel(job: JobRecord, now: float) -> tuple[JobRecord, EventView | None]:
    """The job after a cancel, and its event (None: already CANCELLING, nothing changes).

    A terminal job raises InvalidTransition (from the state machine).
    """
    if job.state is S.CANCELLING:
        return job, None
    if job.state is S.PENDING:
        return transition(job, S.CANCELLED, "cancelled by user", now)
    return transition(job, S.CANCELLING, "cancel requested by user", now)


def decide_cancel(job: JobRecord, now: float) -> Change | None:
    """A user's cancel request; a finished job refuses it (409 naming its state)."""
    if job.state.is_terminal():
        raise InvalidTransition(job.id, job.state.value, S.CANCELLED.value)
    changed, event = cancel(job, now)
    return None if event is None else Change(changed, [event])
