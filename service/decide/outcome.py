"""When a job ends: the one answer, used by the scheduler and by the rounds report.

A job ends in two ways besides a cancel. Its members say so (`by_members`), or its workers
failed once more than `max_restarts` allows (`by_restarts`; `rounds` decides what counts as
a restart, `hangs` adds a step that stops advancing).

A member's states in one attempt: live ('assigned', 'running'), then one of 'succeeded'
(finished: every worker on the node exited 0), 'failed' or 'stopped' (the node vanished,
its agent restarted, or it was told to stop). The rules, torchrun's own for success:

- **Finished is done, not gone.** A finished member keeps its node until the job ends: the
  node is not lost (its lease may lapse: nothing of the job runs there), not free (no job,
  this one included, is given it), and it counts towards `nodes.min`. Nodes of one group
  finish at different moments; treating the first one as lost sent a `min == max` job back
  to PENDING and ran it again for ever. A finished member is never restarted or
  given new work by this job: once one member has finished the job is *ending*, and its
  membership no longer changes (no scale-up, no drain, no restart of the others).
- **SUCCEEDED when every member finished**, i.e. some member finished and none is running
  or failed. Members that took no part in the end do not hold it up: one still 'assigned'
  (given to the job, its workers never joined) and one 'stopped' before any member had
  finished (the group went on without it: torchrun re-formed it, or the scheduler restarted
  the others). A finished member's note (its agent's report of snapshot commits left to it
  that it could not make, `worker/handoff.py`) is in the reason.
- **A failure is a failure**, in whatever order: one failed member fails the job (the first
  by node name is named), even if the others finished; but a member whose torchrun ran and
  exited by itself (killed from outside, crashed: `crashed`) while none has finished is a
  fault like a worker's, and costs one restart of the job's workers while `max_restarts`
  allows (`scheduling.plan`). Only one whose torchrun could not start (a missing command,
  no exit code) fails the job at once: starting it again would fail the same way.
- **Vanishing after its workers finished the run is finishing.** A live member whose
  workers said they finished the run (`MemberStatus.run_finished`: the ftrain runtime's
  clean `finish()`, sent by the node's first worker once every rank of the group has passed
  the last barrier, its final snapshot committed or left to its agent) and whose agent then
  vanishes (SIGKILLed before it saw torchrun's exit or before its report landed: its lease
  lapses, or it restarts) is recorded as succeeded (`vanished`), in whatever order the other
  members end: its exit codes are not known, the runtime's word that the run ended stands
  for them. A member whose agent is alive reports their exit itself, and a non-zero one
  is a failure as before; but once a member vanished that way, a running member that said
  the same counts as finished too (`_past_its_end`): its torchrun may wait in torch's exit
  barrier for the vanished node's, which died with its agent (300 s by default).
- **Vanishing while the job ends is a failure** otherwise. A live member that vanishes (its
  lease lapses, its agent restarts, it stops on its own) after another member finished
  cannot have finished its part (rank 0's last save may be what it was doing), and the
  finished ones cannot be restarted without it: the member is recorded as failed
  (`failed_after_finish`), which fails the job with a reason that says so. Its snapshots
  are kept. Before any member finished, a vanished member is a scheduling question
  (`scheduling.plan`: go on without it, restart the others, or back to PENDING), not an
  ending.
- During a cancel (CANCELLING) the job ends CANCELLED once no member is live, whatever
  the members did.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.models import JobState, MemberStatus
from worker.protocol import telling_line

S = JobState


@dataclass(frozen=True)
class Outcome:
    """How a job ends, and why."""

    state: JobState  # SUCCEEDED or FAILED
    reason: str

    @property
    def stops_workers(self) -> bool:
        """The members must be told to stop (others may still be running after a failure)."""
        return self.state is S.FAILED


def by_members(members: Mapping[str, MemberStatus]) -> Outcome | None:
    """The ending the members' reports call for, or None while the job goes on."""
    failed = [(n, m) for n, m in sorted(members.items()) if m.state == "failed"]
    if failed:
        name, member = failed[0]
        return Outcome(S.FAILED, f"node {name}: {member.reason or f'exit code {member.exit_code}'}")
    states = {m.state for m in members.values()}
    if "succeeded" in states and not any(m.state == "running" and not _past_its_end(m, members)
                                         for m in members.values()):
        # A finished node's note (its snapshot commits that could not be made) is part of the end.
        notes = [f"node {n}: {m.reason}" for n, m in sorted(members.items())
                 if m.state == "succeeded" and m.reason]
        # (a node whose agent vanished after its workers finished the run: exit codes unseen)
        seen = all(m.exit_code == 0 for m in members.values() if m.state == "succeeded")
        head = "every worker exited 0" if seen else "every node's workers finished the run"
        return Outcome(S.SUCCEEDED, "; ".join([head, *notes]))
    return None


def crashed(members: Mapping[str, MemberStatus]) -> list[tuple[str, str]]:
    """(node, reason) of each failed member whose torchrun ran and exited by itself (an exit
    code: it was not a start that failed), by name, while no member has finished (then the
    job is ending and nothing of it is restarted); [] when there is none."""
    if finished_members(members):
        return []
    return [(n, m.reason or f"exit code {m.exit_code}") for n, m in sorted(members.items())
            if m.state == "failed" and m.exit_code is not None]


def _vanished_after_finishing(member: MemberStatus) -> bool:
    """Recorded as finished by `vanished`: no exit code, since none was seen."""
    return member.state == "succeeded" and member.exit_code is None and member.run_finished


def _past_its_end(member: MemberStatus, members: Mapping[str, MemberStatus]) -> bool:
    """A running member whose workers said they finished the run, in a job one of whose nodes
    vanished after its workers finished: its torchrun may be waiting in torch's exit barrier
    for the vanished node's, which died with its agent and never comes (300 s, then it exits
    anyway). Nothing of the run is left to wait for: the job ends, and its rendezvous, closed
    then, ends the wait at once."""
    return member.run_finished and any(_vanished_after_finishing(m) for m in members.values())


def finished_members(members: Mapping[str, MemberStatus]) -> list[str]:
    """The members whose workers all exited 0, by name; any at all means the job is ending."""
    return sorted(n for n, m in members.items() if m.is_finished())


def vanished(members: Mapping[str, MemberStatus], name: str, why: str) -> MemberStatus | None:
    """Member `name`, which vanished (`why`): succeeded if its workers had said they finished
    the run, else `failed_after_finish`; None when neither (a scheduling question)."""
    member = members[name]
    if member.run_finished:
        return member.model_copy(update={"state": "succeeded", "exit_code": None, "reason": (
            f"{why} after its workers finished the run (the runtime's word; their exit was not seen)")})
    return failed_after_finish(members, name, why)


def failed_after_finish(members: Mapping[str, MemberStatus], name: str, why: str) -> MemberStatus | None:
    """Member `name`, which vanished (`why`), recorded as failed if another member had
    finished already; None if none had (then vanishing is not an ending)."""
    done = finished_members(members)
    if not done:
        return None
    return members[name].model_copy(update={"state": "failed", "exit_code": None, "reason": (
        f"{why} after node(s) {', '.join(done)} finished; the job succeeds only when every "
        "node's workers exit 0, and finished nodes are not run again (snapshots are kept)")})


def by_restarts(restarts: int, max_restarts: int, last_lines: Sequence[str] = ()) -> Outcome | None:
    """A worker failure after `restarts` restarts: the end once the restarts are spent.

    The failure is one more than the job allows: the group it re-formed is not let run.
    """
    if restarts < max_restarts:
        return None
    lines = "\n".join(last_lines)
    why = telling_line(list(last_lines))
    return Outcome(S.FAILED, f"workers failed {restarts + 1} times (max_restarts={max_restarts})"
                   + (f": {why}" if why else "") + (f"\nlast log lines:\n{lines}" if lines else ""))
