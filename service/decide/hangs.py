"""Hangs: a job whose training stops advancing is restarted as after a worker failure.

A job with `hang_timeout_s` in its spec whose rank 0 reports progress through the runtime
(its step) is watched while it trains: RUNNING, its group formed in this attempt (a round
reported; RECOVERING too once the new group formed, until its first step), no planned
change pending. If the step does not advance for `hang_timeout_s`,
`decide_hang` treats it as a worker failure: it counts against `max_restarts`, and the
workers restart under a new attempt (a fresh rendezvous, as for a lost node: a worker stuck
in a collective would not notice anything less), the job RECOVERING until the new group's
first step (`decide.recovery`); once the restarts are spent the job fails
(`outcome.by_restarts`). A job some of whose nodes finished already cannot be restarted
(`outcome`: finished nodes are not run again), so a hang then fails it.

The clock: "when the step last advanced" is not stored anywhere. The scheduler keeps a
`Watch` per job in the memory of the leading control plane (`observe`, called on every
pass with the step it reads from the job's progress key), and the clock restarts whenever
the step changes, the group re-forms (a new attempt or round) or the job starts being
watched. So a new group has
`hang_timeout_s` from its forming to its first step, and a control plane that takes over
(a restart, a new leader) starts every clock afresh: a hang is then found at most one
timeout later than it would have been, never sooner.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.decide import outcome
from service.decide.change import Change
from service.decide.recovery import is_regrouping, regroup
from service.decide.state import transition
from service.models import JobRecord, JobState, MemberStatus

S = JobState


@dataclass(frozen=True)
class Watch:
    """What the scheduler last saw of a job's training, and since when it has not changed."""

    attempt: int
    rounds: int
    watched: bool
    step: int | None
    since: float


def is_watched(job: JobRecord) -> bool:
    """The job has a hang timeout and a group that should be training: formed in this attempt
    (a round reported; while it re-forms, the new one formed), no planned change pending. A
    group that formed is watched before its first step, RECOVERING or not, so a group that
    never makes one is found too."""
    if job.spec.hang_timeout_s is None or job.state not in (S.STARTING, S.RUNNING, S.RECOVERING):
        return False
    formed = job.group is not None if is_regrouping(job) else job.state is S.RUNNING
    return formed and job.rounds >= 1 and job.control is None


def observe(prev: Watch | None, job: JobRecord, step: int | None, now: float) -> Watch:
    """`prev` if nothing that restarts the clock changed; else a fresh watch from `now`."""
    seen = (job.attempt, job.rounds, is_watched(job), step)
    if prev is not None and (prev.attempt, prev.rounds, prev.watched, prev.step) == seen:
        return prev
    return Watch(*seen, since=now)


def decide_hang(job: JobRecord, step: int | None, advanced_at: float, now: float) -> Change | None:
    """The job after `step` has not advanced since `advanced_at`; None while that is no hang.

    `step` None: rank 0 never reported progress (a script without the runtime): not watched.
    """
    timeout = job.spec.hang_timeout_s
    if timeout is None or step is None or not is_watched(job) or now - advanced_at < timeout:
        return None
    what = f"no progress for {timeout:g} s (hang_timeout_s={timeout:g})"
    done = outcome.finished_members(job.members)
    if done:
        reason = (f"{what} after node(s) {', '.join(done)} finished; finished nodes are not run "
                  "again, so the job cannot be restarted (snapshots are kept)")
        changed, event = transition(job, S.FAILED, reason, now)
        return Change(changed.model_copy(update={"stopping": True}), [event])
    spent = outcome.by_restarts(job.restarts, job.spec.max_restarts)
    if spent is not None:
        changed, event = transition(job, spent.state, f"{what}; {spent.reason}", now)
        return Change(changed.model_copy(update={"stopping": True}), [event])
    restarts = job.restarts + 1
    changed, event = regroup(job, f"{what}; restarting the workers "
                                  f"({restarts} of {job.spec.max_restarts})", now)
    members = {n: MemberStatus(nproc=m.nproc) for n, m in job.members.items() if m.is_live()}
    changed = changed.model_copy(update={
        "attempt": job.attempt + 1, "restarts": restarts, "members": members, "rounds": 0,
        "round_nodes": 0, "world_size": 0, "group": None, "regrouping": True})
    return Change(changed, [event])
