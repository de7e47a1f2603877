"""When a job ends: the one answer, used by the scheduler and by the rounds report.

A job ends in two ways besides a cancel. Its members say so: one member's workers failed
(the first, by node name, is named), or some succeeded and none is running any more
(`by_members`). Or its workers failed once more than `max_restarts` allows (`by_restarts`;
`rounds` decides what counts as a restart). A node that vanished or whose agent restarted
is "stopped": it neither fails a job nor keeps it from succeeding; whether the others can
go on without it is a scheduling question (`scheduling.plan`), not an ending.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from service.models import JobState, MemberStatus

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
    if "succeeded" in states and "running" not in states:
        return Outcome(S.SUCCEEDED, "every worker exited 0")
    return None


def by_restarts(restarts: int, max_restarts: int, last_lines: Sequence[str] = ()) -> Outcome | None:
    """A worker failure after `restarts` restarts: the end once the restarts are spent.

    The failure is one more than the job allows: the group it re-formed is not let run.
    """
    if restarts < max_restarts:
        return None
    lines = "\n".join(last_lines)
    return Outcome(S.FAILED, f"workers failed {restarts + 1} times (max_restarts={max_restarts})"
                   + (f"; last log lines:\n{lines}" if lines else ""))
