"""Cancel: a job not holding nodes ends at once; one that does drains through CANCELLING.

Only the job's owner or the admin may cancel it (`Forbidden` otherwise); the event names
who asked. The scheduler takes it from there: it asks rank 0 for a last snapshot, tells the members
to stop, and moves the job to CANCELLED once no member is live (`scheduling.plan`).
"""

from __future__ import annotations

from service.decide.change import Change
from service.decide.state import transition
from service.errors import Forbidden, InvalidTransition
from service.models import ADMIN, EventView, JobRecord, JobState

S = JobState


def cancel(job: JobRecord, now: float, by: str = ADMIN) -> tuple[JobRecord, EventView | None]:
    """The job after `by` cancelled it, and its event (None: already CANCELLING, nothing
    changes).

    A terminal job raises InvalidTransition (from the state machine).
    """
    if job.state is S.CANCELLING:
        return job, None
    if job.state is S.PENDING:
        changed, event = transition(job, S.CANCELLED, f"cancelled by {by}", now)
    else:
        changed, event = transition(job, S.CANCELLING, f"cancel requested by {by}", now)
    return changed, event.model_copy(update={"by": by})


def decide_cancel(job: JobRecord, now: float, by: str = ADMIN, is_admin: bool = True,
                  by_id: str | None = None) -> Change | None:
    """A cancel request of user `by` (id `by_id`): refused to anyone but the job's owner and
    the admin (403), and for a job that ended otherwise (409 naming its state). Cancelling a
    cancelled job again changes nothing (None): a retried or repeated cancel is fine."""
    if not is_admin and by != job.owner:
        raise Forbidden(f"job {job.id} belongs to {job.owner!r}; only its owner or the admin "
                        f"can cancel it (you are {by!r})")
    # A job of a user stored before ids (owner_id None) is owned by the name alone.
    if not is_admin and job.owner_id is not None and by_id != job.owner_id:
        raise Forbidden(f"job {job.id} belongs to an earlier user named {job.owner!r}, removed "
                        "since; only the admin can cancel it")
    if job.state is S.CANCELLED:
        return None
    if job.state.is_terminal():
        raise InvalidTransition(job.id, job.state.value, S.CANCELLED.value)
    changed, event = cancel(job, now, by)
    return None if event is None else Change(changed, [event])
