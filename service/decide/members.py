"""What a node says about its workers for one job attempt, and what registering says.

A member moves from 'assigned' to 'running', then to one final state of the attempt:
'succeeded', 'failed' or 'stopped'. A report for another attempt, for a node that is not
a member, or for a member already final, changes nothing: reports cross restarts on the
wire, and a late one must not revive or re-end a member. A live member that stops while
another member has finished is recorded as failed (`outcome.failed_after_finish`), and one
whose workers had said they finished the run (`decide_run_finished`) as succeeded
(`outcome.vanished`), except during a cancel or after the scheduler told the members to
stop. Whether the new states end the job is `outcome.by_members`, which the scheduler applies.

A node that leaves the members (drained, lost, not in a new attempt) is kept among the
job's former members (`note_former_members`): its agent still ships the last lines its
workers wrote (rank 0's note of the step where it stopped for a drain is among them),
which reach the control plane after the change that removed it. Only the latest leavers
are listed (`former_cap`): a job that runs for months on nodes that come and go under new
names would otherwise carry every name it ever had in its record.

The members' memory reports (`memory/<job>/<node>`) are of no use once a member left, the
attempt changed or the job ended (`drops_copies`): a report is accepted from a member of the
current attempt only, a restore reads only the members' reports of the current attempt
(`restore.choose_restore`), and a job about to fall short reads its survivors' reports in the
pass that moves it, before they leave (`keep.kept_for`). A member leaves only with a new
attempt or with the move to PENDING (no members), so the write that does either, or ends the
job, deletes the job's reports (one range deletion, in the same transaction, however many
nodes left; `JobStore.retire`), and the members of the new attempt report again. Before, a
node long gone kept its key until the job ended and its retention passed: on a months-long
job with nodes that come and go under new names, a key each.
"""

from __future__ import annotations

from service.decide import outcome
from service.decide.change import Change
from service.models import JobRecord, JobState

AGENT_RESTARTED = "the node's agent restarted"


def decide_report(job: JobRecord, node: str, attempt: int, state: str, exit_code: int | None,
                  reason: str | None, now: float) -> Change | None:
    """Record `node`'s report on its workers of `attempt`; None when it changes nothing."""
    member = job.members.get(node)
    if job.attempt != attempt or member is None or not job.state.is_active():
        return None
    if member.state == state:
        return None
    if not member.is_live():  # stopped/succeeded/failed are final for this attempt
        return None
    updated = member.model_copy(update={"state": state, "exit_code": exit_code, "reason": reason})
    if state == "stopped" and not job.stopping and job.state is not JobState.CANCELLING:
        updated = outcome.vanished(
            job.members, node, f"its workers stopped ({reason or 'no reason given'})") or updated
    members = {**job.members, node: updated}
    return Change(job.model_copy(update={"members": members, "updated_at": now}))


def decide_run_finished(job: JobRecord, node: str, attempt: int, now: float) -> Change | None:
    """`node`'s workers of `attempt` finished the run (the runtime's word, at its clean end):
    noted on the live member, so that its agent vanishing before it reports their exit ends
    the node as finished (`outcome.vanished`); None when it changes nothing (another attempt,
    not a member, already noted, or the member's end already recorded)."""
    member = job.members.get(node)
    if job.attempt != attempt or member is None or not job.state.is_active():
        return None
    if member.run_finished or not member.is_live():
        return None
    updated = member.model_copy(update={"run_finished": True})
    return Change(job.model_copy(update={"members": {**job.members, node: updated}, "updated_at": now}))


def has_run_finished(job: JobRecord, node: str, attempt: int) -> bool:
    """The stored job holds `node`'s word that its workers of `attempt` finished the run (or
    the node's end, which makes that word moot)."""
    member = job.members.get(node)
    return job.attempt == attempt and member is not None and (member.run_finished or not member.is_live())


def decide_registered(job: JobRecord, node: str, attempt: int, now: float,
                      running: tuple[str, int] | None = None) -> Change | None:
    """`node` registered while a member of `attempt`. An agent that says it still runs this
    very attempt (`running` = (job id, attempt)) re-registers after its lease lapsed (while
    no control plane could hear it): its workers train on and it stays a member. Otherwise
    (a new agent process, or one running something else) whatever the node ran is gone."""
    member = job.members.get(node)
    still_runs = running is not None and running == (job.id, job.attempt) and attempt == job.attempt
    if still_runs and member is not None and member.is_live():
        return None
    return decide_report(job, node, attempt, "stopped", None, AGENT_RESTARTED, now)


def is_recorded(job: JobRecord, node: str, attempt: int, state: str) -> bool:
    """The stored job shows the report (so it was applied now or before), not a stale one.

    A 'stopped' that came after another member finished is stored as 'failed'."""
    member = job.members.get(node)
    if job.attempt != attempt or member is None:
        return False
    return member.state == state or (state == "stopped" and member.state == "failed")


# The fewest former members a job lists (`former_cap`): the latest to leave.
MIN_FORMER_MEMBERS = 64


def former_cap(job: JobRecord) -> int:
    """How many former members `job` lists at most: twice its `max` nodes (every member of
    a job that lost them all at once, and as many before), and at least MIN_FORMER_MEMBERS."""
    return max(MIN_FORMER_MEMBERS, 2 * job.spec.nodes.max)


def note_former_members(before: JobRecord, after: JobRecord) -> JobRecord:
    """`after` with the nodes that `before` had as members and `after` has not added to its
    former members (a node that is a member again stays listed: it was one), in the order
    they left, the latest `former_cap` of them."""
    left = before.members.keys() - after.members.keys()
    if not left or left <= set(after.former_members):
        return after
    former = [n for n in after.former_members if n not in left] + sorted(left)
    return after.model_copy(update={"former_members": former[-former_cap(after):]})


def drops_copies(before: JobRecord, after: JobRecord) -> bool:
    """Whether the change from `before` to `after` makes the job's memory reports useless
    (the module's docstring): it ends the job, starts another attempt or removes a member. A
    job without members has none (the write that took them away deleted them; a PENDING job
    starting costs no deletion)."""
    if not before.members:
        return False
    if after.state.is_terminal():
        return not before.state.is_terminal()
    return after.attempt != before.attempt or not before.members.keys() <= after.members.keys()
