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
(a restart, a new leader, or this one again in a new term) starts every clock afresh: a
hang is then found at most one timeout later than it would have been, never sooner.

Nor does the clock count time in which this control plane could not have heard progress:
a leader that was stopped (SIGSTOP), or whose loop stalled, and goes on in the same term
would otherwise find, at its first pass after, a clock that ran through the stall, and
declare the job hung before the progress reports it could not take meanwhile land. So each
watch notes when it was last looked at (`seen_at`), and a gap between two looks longer than
the scheduler's passes allow (`stall_after_s`: its interval plus a second) is the control
plane's own stall: the clock is moved on by the part beyond that (`unheard`).

Before a hung attempt's group is stopped, its stacks are collected: the change names the
attempt (`hung_attempt`), each node's agent sends its workers a signal on which faulthandler
dumps every thread's Python stack (worker/stacks.py) and asks each for its flight recorder's
trace (worker/flight.py), ships both to the job's log and reports them (`decide_stacks`): an
event per node naming, for each rank, where its main thread is and the last collective it
entered, and which ranks had not reached the collective the others wait in
(`not_in_collective`). The ranks are compared across nodes: each report's ranks are kept on
the job (`hung_ranks`), so the event of the last node to report compares them all.

The flight recorder says it best: every rank numbers the collectives of a process group in
the order it enters them, so a rank whose last entered collective is behind the number the
others wait in (entered, not completed) never reached that one. Without recorder dumps (off,
or not answered), the stacks say it less surely: ranks whose main thread is in
torch.distributed's code wait in a collective, the others did not reach it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from service.decide import outcome
from service.decide.change import Change
from service.decide.recovery import is_regrouping, regroup
from service.decide.state import note, transition
from service.models import HungRank, JobRecord, JobState, MemberStatus
from worker.protocol import GroupCollectives, StacksReport

S = JobState


@dataclass(frozen=True)
class Watch:
    """What the scheduler last saw of a job's training, and since when it has not changed."""

    attempt: int
    rounds: int
    watched: bool
    step: int | None
    since: float
    seen_at: float | None = field(default=None, compare=False)  # when this control plane last looked


def is_watched(job: JobRecord) -> bool:
    """The job has a hang timeout and a group that should be training: formed in this attempt
    (a round reported; while it re-forms, the new one formed), no planned change pending. A
    group that formed is watched before its first step, RECOVERING or not, so a group that
    never makes one is found too."""
    if job.spec.hang_timeout_s is None or job.state not in (S.STARTING, S.RUNNING, S.RECOVERING):
        return False
    formed = job.group is not None if is_regrouping(job) else job.state is S.RUNNING
    return formed and job.rounds >= 1 and job.control is None


def observe(prev: Watch | None, job: JobRecord, step: int | None, now: float,
            stall_after_s: float | None = None) -> Watch:
    """`prev` if nothing that restarts the clock changed (its clock moved on by the time this
    control plane could not hear progress since it last looked, `unheard`); else a fresh watch
    from `now`."""
    seen = (job.attempt, job.rounds, is_watched(job), step)
    if prev is not None and (prev.attempt, prev.rounds, prev.watched, prev.step) == seen:
        return replace(prev, since=prev.since + unheard(prev.seen_at, now, stall_after_s), seen_at=now)
    return Watch(*seen, since=now, seen_at=now)


def unheard(last_look: float | None, now: float, stall_after_s: float | None) -> float:
    """Of the time since this control plane last looked (`last_look`), what it could not have
    heard progress in: the part of the gap beyond `stall_after_s`, the most its passes take to
    come round while it runs (None: not known, nothing discounted)."""
    if stall_after_s is None or last_look is None:
        return 0.0
    return max(0.0, now - last_look - stall_after_s)


def decide_hang(job: JobRecord, step: int | None, advanced_at: float, now: float) -> Change | None:
    """The job after `step` has not advanced since `advanced_at`; None while that is no hang.

    `step` None: rank 0 never reported progress (a script without the runtime): not watched.
    """
    timeout = job.spec.hang_timeout_s
    if timeout is None or step is None or not is_watched(job) or now - advanced_at < timeout:
        return None
    what = f"no progress for {timeout:g} s (hang_timeout_s={timeout:g})"
    job = job.model_copy(update={"hung_attempt": job.attempt, "hung_ranks": {}})  # its nodes report their stacks first
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
        "attempt": job.attempt + 1, "restarts_by_cause": job.restarts_by_cause.plus("failure"),
        "members": members, "rounds": 0,
        "round_nodes": 0, "world_size": 0, "group": None, "regrouping": True})
    return Change(changed, [event])


# A frame of faulthandler's dump: `  File "/x/train.py", line 88 in main`.
FRAME = re.compile(r'^\s*File "(?P<path>[^"]*)", line (?P<line>\d+) in (?P<func>.+)$')
THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
# Where a rank waits for its peers: torch.distributed's calls, and DDP's backward (its
# gradient all-reduce is waited for inside it).
COLLECTIVE_PATHS = ("/torch/distributed/", "/torch/autograd/", "/torch/nn/parallel/distributed.py")
STACKS_DETAIL_CHARS = 16_000  # of the dumps kept in the event (all of them are in the job's log)
# Kept on the job record for the nodes that report after (it is written with every change of
# the job until the next hang): the lowest ranks, a few groups each, ~30 KiB at most.
MAX_HUNG_RANKS = 256
MAX_HUNG_GROUPS = 4


def main_frames(dump: str) -> list[tuple[str, int, str]]:
    """The main thread's frames (path, line, function), innermost first: faulthandler lists
    threads newest first, so the main thread, the oldest, is the last."""
    threads: list[list[tuple[str, int, str]]] = []
    for line in dump.splitlines():
        if THREAD.match(line):
            threads.append([])
        elif (m := FRAME.match(line)) and threads:
            threads[-1].append((m["path"], int(m["line"]), m["func"].strip()))
    return threads[-1] if threads else []


def where(frames: list[tuple[str, int, str]]) -> tuple[bool | None, str]:
    """Whether the main thread waits in a collective (None: no stacks), and where it is."""
    if not frames:
        return None, "no stacks (the worker did not answer)"
    for path, line, func in frames:
        if any(p in path for p in COLLECTIVE_PATHS):
            return True, f"in a collective: {func} ({path.rsplit('/', 1)[-1]}:{line})"
    path, line, func = frames[0]
    return False, f"not in a collective: {func} ({path.rsplit('/', 1)[-1]}:{line})"


def not_in_collective(ranks: dict[int, HungRank]) -> tuple[list[int], str] | None:
    """The ranks that did not reach the collective the others wait in, and that collective in
    words; None where the ranks do not show one. By the flight recorders' sequence numbers
    where they show it, else by the stacks."""
    return _behind_by_seq(ranks) or _behind_by_stacks(ranks)


def _behind_by_seq(ranks: dict[int, HungRank]) -> tuple[list[int], str] | None:
    by_pg: dict[str, dict[int, GroupCollectives]] = {}
    for rank, r in ranks.items():
        for g in r.collectives or []:
            by_pg.setdefault(g.pg, {})[rank] = g
    behind: set[int] = set()
    waited: list[str] = []
    for pg, groups in sorted(by_pg.items()):
        top = max(g.last_enqueued for g in groups.values())
        ahead = [g for g in groups.values() if g.last_enqueued == top]
        late = [rank for rank, g in groups.items() if g.last_enqueued < top]
        if late and all(g.last_completed < top for g in ahead):  # the ranks ahead wait in it
            behind.update(late)
            op = next((g.op for g in ahead if g.op), None)
            waited.append(f"collective #{top}{f' {op}' if op else ''} of group {pg}")
    return (sorted(behind), ", ".join(waited)) if behind else None


def _behind_by_stacks(ranks: dict[int, HungRank]) -> tuple[list[int], str] | None:
    behind = [rank for rank, r in sorted(ranks.items()) if r.waits is False]
    if behind and any(r.waits for r in ranks.values()):
        return behind, "the collective"
    return None


def _last_entered(groups: list[GroupCollectives] | None) -> str:
    if groups is None:
        return ""
    if not groups:
        return ", no collectives recorded"
    return "".join(f", last entered #{g.last_enqueued}{f' {g.op}' if g.op else ''} of group {g.pg}"
                   for g in groups)


def decide_stacks(job: JobRecord, node: str, report: StacksReport, now: float) -> Change | None:
    """An event with `node`'s workers' stacks of the attempt taken for hung; None if the report
    is of another attempt or from a node that was not the job's."""
    if report.attempt != job.hung_attempt or (node not in job.members and node not in job.former_members):
        return None
    found = {r.rank: where(main_frames(r.text)) for r in report.ranks}
    parts = [f"rank {r.rank} {found[r.rank][1]}{_last_entered(r.collectives)}"
             for r in sorted(report.ranks, key=lambda r: r.rank)]
    ranks = {**job.hung_ranks, **{r.rank: HungRank(waits=found[r.rank][0], collectives=r.collectives)
                                  for r in report.ranks}}
    line = f"stacks of hung attempt {report.attempt} on node {node}: " + "; ".join(parts)
    if (missing := not_in_collective(ranks)) is not None:
        behind, what = missing
        line += f" (did not reach {what}: rank {', '.join(map(str, behind))})"
    dumps = "\n".join(f"rank {r.rank}:\n{r.text or '(none)'}" for r in report.ranks)
    kept = {rank: r.model_copy(update={"collectives": None if r.collectives is None else r.collectives[:MAX_HUNG_GROUPS]})
            for rank, r in sorted(ranks.items())[:MAX_HUNG_RANKS]}
    changed, event = note(job.model_copy(update={"hung_ranks": kept}), line, now)
    event = event.model_copy(update={"detail": dumps[:STACKS_DETAIL_CHARS]})
    return Change(changed, [event])
