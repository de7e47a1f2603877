"""Rendezvous rounds: what a node's torchrun re-forming its group means for the job.

A node reports 'joining' when its torchrun re-rendezvouses (not the first time: `call` 0
is the start), and group rank 0 reports 'joined' once per round with the group's size.
A round with as many nodes as the one before is a restart after a worker failure and
counts against `max_restarts` (once they are spent, `outcome.by_restarts` fails the job);
a round with more or fewer nodes is a membership change and does not count.

A 'joining' is a fault noticed (the job is RECOVERING, `decide.recovery`) unless the job is
re-forming already (a recovery, or a planned change: a node joining). A 'joined' names the
group it formed ('<node>/<round>' of group rank 0); the job is RUNNING again only at that
group's first step (`recovery.first_step`), not when it forms; meanwhile its reason says the
group formed and its workers started, with no step or output yet (`formed_reason`). A group
formed again takes back the members' word that their workers finished the run (`unfinished`).
"""

from __future__ import annotations

from collections.abc import Sequence

from service.decide import outcome
from service.decide.change import Change
from service.decide.recovery import is_regrouping, regroup
from service.decide.state import note, transition
from service.models import JobRecord, JobState
from worker.protocol import RoundReport

S = JobState


def is_restart(job: JobRecord, group_nodes: int) -> bool:
    """A round formed again with the same number of nodes: the workers failed and restarted."""
    return job.rounds >= 1 and group_nodes == job.round_nodes


def formed_reason(what: str, state: JobState) -> str:
    """The reason while a group that formed has shown no step or line yet: its workers run (a
    plain script that prints nothing shows nothing more until it ends, so the reason says
    what is known: the group formed, the workers started, and nothing came from them yet)."""
    again = "" if state is S.STARTING else " again"
    return f"group formed: {what}; workers started{again}, no step or output yet"


def decide_round(job: JobRecord, report: RoundReport, last_lines: Sequence[str],
                 now: float) -> Change | None:
    """The job after `report`; None for a report of another attempt or one that changes nothing.

    `last_lines` are the job's last worker log lines, quoted when the restarts are spent.
    """
    if job.attempt != report.attempt or job.state not in (S.STARTING, S.RUNNING, S.RECOVERING):
        return None
    if report.phase == "joining":
        if report.call == 0 or is_regrouping(job):
            return None
        changed, event = regroup(job, f"node {report.node} is restarting its workers", now)
        return Change(changed, [event])
    if report.group_rank != 0 or report.group_world_size is None:
        return None
    nodes = report.group_world_size
    nproc = job.members.get(report.node).nproc if report.node in job.members else None
    world = nodes * (nproc or 1)
    update = {"rounds": job.rounds + 1, "round_nodes": nodes, "world_size": world}
    restarted = is_restart(job, nodes)
    spent = outcome.by_restarts(job.restarts, job.spec.max_restarts, last_lines) if restarted else None
    if spent is not None:
        changed, event = transition(job.model_copy(update=update), spent.state, spent.reason, now)
        changed = changed.model_copy(update={"stopping": spent.stops_workers})
        return Change(changed, [event])
    if restarted:
        update["restarts_by_cause"] = job.restarts_by_cause.plus("failure")
    changed = job.model_copy(update=update)
    events = []
    if restarted:
        why = f"workers restarted after a failure ({changed.restarts} of {job.spec.max_restarts})"
        if is_regrouping(changed):
            changed, event = note(changed, why, now)
        else:  # the restart was not seen coming (no 'joining'): a recovery all the same
            changed, event = regroup(changed, why, now)
        events.append(event)
    what = f"world size {world} on {nodes} node(s)"
    if is_regrouping(changed):
        # A job STARTING without a fault says so in its reason (it said "started on ..."
        # until now); after a fault, the reason keeps naming the fault until the first step.
        changed, event = note(changed, formed_reason(what, changed.state), now,
                              as_reason=changed.state is S.STARTING and not restarted)
    else:
        changed, event = note(changed, f"rendezvous complete: {what}", now)
    events.append(event)
    return Change(unfinished(changed).model_copy(update={"group": f"{report.node}/{report.call}",
                                                         "group_round": report.round}), events)


def unfinished(job: JobRecord) -> JobRecord:
    """A group formed again in the attempt: the members' workers run again, so a word that
    they had finished the run (`members.decide_run_finished`, said after `rt.finish()`) is
    taken back; they say it again at the new group's end. (Kept, a node whose agent then
    vanished counted as finished although its restarted workers were not.)"""
    finished = {name: member.model_copy(update={"run_finished": False})
                for name, member in job.members.items() if member.run_finished}
    return job.model_copy(update={"members": {**job.members, **finished}}) if finished else job
