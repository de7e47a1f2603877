"""From the moment a job's group stops to the first step of the group that replaces it.

RUNNING means steps are being made. A job given its nodes is STARTING until its first step,
which ends it as a recovery ends (below: "training: ..."); a fault before then keeps it
STARTING, the reason naming the fault. A fault (a node's torchrun re-forming the group after a
worker failed, `decide.rounds`; a node lost, `decide.scheduling`; a hang, `decide.hangs`)
moves the job to RECOVERING at once, with a reason that names it. A planned change (a node
joining, a drain, a planned change called off) is no fault: the job stays RUNNING, counts no
restart and no recovery time, and its reason says what is changing. Either way the job is
`regrouping`, and the group it had is gone (`group` None) until group rank 0's node reports
the round that forms the next one ('joined': `group` = '<node>/<round>').

The group forming is not training yet: the workers still start, restore and make their first
step (several seconds on GPUs). So the recovery ends, and "training again" is recorded, on:
- a script on the ftrain runtime: rank 0's first progress report from the new group (its
  `group` is the job's: a late report of the replaced group in the same attempt does not
  count; one of an earlier attempt is refused anyway);
- a plain script (it never reported progress): the first line its workers print in the job's
  current attempt once the new group has formed (ftrain's own "ftrain: ..." notices aside),
  from a worker of that group: each line carries the rendezvous round of the group whose
  worker printed it (torchrun's rendezvous handler gives each group's workers their round,
  `FTRAIN_ROUND`, which each worker's launcher notes beside its output files, and the agent
  tags the lines of those files with it: worker/output.py), and the job the round of its group (the
  'joined' report's), so a late line of the replaced group, shipped after the new one formed,
  does not count.
Faults, planned changes and their ends are decided here as pure functions.
"""

from __future__ import annotations

from collections.abc import Sequence

from service.decide.change import Change
from service.decide.state import note, transition
from service.models import EventView, JobRecord, JobState
from worker.protocol import LogLineIn

S = JobState


def is_regrouping(job: JobRecord) -> bool:
    """The job's group stopped (or, STARTING, has yet to form) and no step of the one replacing
    it has been seen yet."""
    return job.state in (S.STARTING, S.RUNNING, S.RECOVERING) and \
        (job.regrouping or job.state in (S.STARTING, S.RECOVERING))


def regroup(job: JobRecord, reason: str, now: float, *, planned: bool = False,
            **fields) -> tuple[JobRecord, EventView]:
    """The job once its group has stopped for `reason`: RECOVERING after a fault (RUNNING kept
    for a `planned` change, STARTING for a job that has made no step yet, RECOVERING for one
    RECOVERING already), the reason current either way."""
    if not planned and job.state is S.RUNNING:
        changed, event = transition(job, S.RECOVERING, reason, now)
    else:
        changed, event = note(job, reason, now, as_reason=True)
    stopped = job.group if job.group is not None else job.stopped_group
    update = {"regrouping": True, "group": None, "group_round": None, "stopped_group": stopped, **fields}
    if changed.attempt != update.get("attempt", changed.attempt):
        update["stopped_group"] = None  # a new attempt: an older one's reports are refused anyway
    return changed.model_copy(update=update), event


def resume(job: JobRecord, how: str, now: float) -> Change:
    """The job once the new group has made its first step (`how`: what showed it)."""
    again = "" if job.state is S.STARTING else " again"
    what = f"training{again}: world size {job.world_size} on {job.round_nodes} node(s), {how}"
    if job.state in (S.STARTING, S.RECOVERING):
        changed, event = transition(job, S.RUNNING, what, now)
    else:
        changed, event = note(job, what, now, as_reason=True)
    return Change(changed.model_copy(update={"regrouping": False, "stopped_group": None}), [event])


def first_step(job: JobRecord, attempt: int | None, group: str | None, step: int,
               now: float) -> Change | None:
    """The job after rank 0 reported `step` from `group` of `attempt`; None unless that is the
    first step of the group that replaced a stopped one, or (STARTING) the attempt's first. A
    report without a group (a runtime not started by torchrun under an agent) counts once the
    group has formed, or while STARTING."""
    if not is_regrouping(job) or (attempt is not None and attempt != job.attempt):
        return None
    if job.state is S.STARTING:
        return resume(job, f"step {step}", now)  # no step of this attempt came before: the first
    if job.group is None:
        # the group's 'joined' report did not arrive (a control-plane outage): a group of this
        # attempt other than the one that stopped is the new one all the same
        if group is None or group == job.stopped_group:
            return None
        job = job.model_copy(update={"group": group})
    elif group is not None and group != job.group:
        return None
    return resume(job, f"step {step}", now)


def _of_group(job: JobRecord, line: LogLineIn) -> bool:
    """`line` may be the new group's: printed by a worker of the round that formed it (lines of
    the group it replaced, printed before the new one formed, may be shipped after it did). A
    line or a group whose round is not known (an agent or a handler that does not say) may."""
    return line.round is None or job.group_round is None or line.round == job.group_round


def first_output(job: JobRecord, attempt: int, lines: Sequence[LogLineIn], now: float) -> Change | None:
    """The job after a node shipped `lines` of `attempt`; None unless the job runs a plain
    script (no progress reports) and one is the first worker line since the new group formed."""
    if job.reports_progress or not is_regrouping(job) or attempt != job.attempt:
        return None
    if job.group is None and job.state is not S.STARTING:  # (STARTING: no group came before)
        return None
    if not any(x.rank is not None and not x.line.startswith("ftrain:") and _of_group(job, x) for x in lines):
        return None
    return resume(job, "its workers' first output", now)
