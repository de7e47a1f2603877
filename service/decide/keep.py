"""Scheduling affinity to the memory tier: a job that lost a node gets back the nodes that
hold its memory copy, and for a while no other job gets them.

A job that drops below `nodes.min` goes back to PENDING and lets its survivors go. Each
survivor's agent keeps the job's memory copy (worker/memory.py) while it has no assignment,
for MEMORY_KEEP_S (5 min, worker/torchrun.py `park_memory`), and deletes it at once when it
is given another job. So a job whose survivor went to another job meanwhile restarts from
the disk snapshot, losing every step since (and the faster restore from memory).

What each node holds the control plane knows from the runtime's memory reports (the key
`memory/<job>/<node>`: the step, the attempt, when; about once a second while training,
service/snapshots.py). The scheduler reads them only for a job about to fall below its
`min` (`may_fall_short`: one range read per such job, in the pass that moves it; nothing
per heartbeat or per pass), and the move to PENDING records the survivors that hold a copy
(`kept_for`) in the job record (`JobRecord.kept`, in the same write). Then, until
`kept.until`:

- the job is offered its kept nodes first, newest step first (`prefer`), so it resumes
  from memory as soon as enough other nodes come;
- no other job is offered them (`reserved`): not another pending job, not a scale-up;
- while a node is held for it, the job is planned before the rest of the queue (`holding`),
  so the next free node completes it rather than going to an older waiting job while its
  survivors sit idle and the hold runs out.

The hold is bounded (`SchedulerConfig.memory_hold_s`: FTRAIN_MEMORY_HOLD_S, 120 s by default,
at most 300), because a job that
waits for nodes that never come must not idle other jobs' nodes for ever: it starts when
the job goes to PENDING and is not renewed while it waits, and covers at most `min - 1`
nodes (the survivors of a job short of its `min`). A job suspended by a preemption notes its
copy as well, to prefer those nodes when it resumes, but holds none of them: they go to the job
of higher priority that took them (`decide.preempt`). 120 s covers a lost node's agent coming
back or a replacement registering (seconds to a couple of minutes) and stays well inside the
agent's 5 minutes, so a held node still has the copy when the job comes back for it; past
it, the node is free like any other (the job still prefers it while it is free). A node
whose agent registered again since the job let it go holds nothing (an agent removes its
leftovers when it starts) and is not held.

A pass goes through the job index's map of node -> the PENDING job whose copy it last kept
(`JobIndex.claims`: one entry per kept node, bounded by the number of nodes; `claims` builds
the same from a list), so its cost grows with the nodes held, not with the queue or the free
nodes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence

from service.models import JobRecord, JobState, KeptCopies, NodeRecord
from worker.protocol import MemorySnapshot


def may_fall_short(job: JobRecord, nodes: Mapping[str, NodeRecord], graced: frozenset[str]) -> bool:
    """`job` may fall below its `min` in this pass (a live member's node is gone or draining, or
    it is suspended by a preemption and rank 0 has snapshotted for it: `decide.preempt`): the
    one case in which its members' memory reports are read (`kept_for`)."""
    if not job.state.is_active() or job.state is JobState.CANCELLING:
        return False
    c = job.control
    if job.preempt is not None and job.preempt.suspend and c is not None and job.control_acked >= c.id:
        return True
    live = [n for n, m in job.members.items() if m.is_live()]
    staying = [n for n in live if (n in nodes and not nodes[n].state.takes_no_work())
               or (n not in nodes and n in graced)]
    return len(staying) < len(live) and len(staying) < job.spec.nodes.min


def kept_for(survivors: Iterable[str], copies: Sequence[MemorySnapshot],
             nodes: Mapping[str, NodeRecord], now: float, hold_s: float) -> KeptCopies | None:
    """What a job that goes back to PENDING keeps: its `survivors` whose memory tier holds a
    copy of it (their reports, `copies`), held until `now + hold_s`; None if none does.

    A report made before the node's agent registered is of a copy that agent no longer has
    (it removes its leftovers when it starts)."""
    alive = {n for n in survivors if n in nodes}
    steps: dict[str, int] = {}
    for c in copies:
        if c.node in alive and (c.time is None or c.time >= nodes[c.node].registered_at):
            steps[c.node] = max(steps.get(c.node, -1), c.step)
    if not steps or hold_s <= 0:
        return None
    return KeptCopies(steps=dict(sorted(steps.items())), since=now, until=now + hold_s)


def describe(kept: KeptCopies) -> str:
    """The hold, in words for the job's event."""
    held = ", ".join(f"{n} (step {s})" for n, s in sorted(kept.steps.items(), key=lambda i: (-i[1], i[0])))
    return (f"its memory copy is on {held}: kept for it for {kept.until - kept.since:g} s "
            "(no other job is given them meanwhile)")


def holds(job: JobRecord, node: NodeRecord, now: float) -> bool:
    """`node` is held for `job` now: the job waits, the node kept its copy, the hold runs, and
    the node's agent is the one that kept it (not registered again since)."""
    kept = job.kept
    return (job.state is JobState.PENDING and kept is not None and now < kept.until
            and node.name in kept.steps and node.registered_at <= kept.since)


def reserved(free: Collection[str], claims: Mapping[str, JobRecord],
             nodes: Mapping[str, NodeRecord], now: float) -> dict[str, str]:
    """free node -> the id of the waiting job it is held for (`holds`). `claims`: node -> the
    PENDING job whose copy the node last kept (`claims`, `JobIndex.claims`); looked through,
    not the free nodes, since it is the smaller (a job's survivors, while it waits)."""
    return {n: job.id for n, job in claims.items() if n in free and holds(job, nodes[n], now)}


def holding(held: Mapping[str, str], claims: Mapping[str, JobRecord]) -> list[JobRecord]:
    """The waiting jobs that free nodes are held for now (`held`: node -> job id, `reserved`),
    the oldest hold first: the scheduler plans them before the rest of its queue, so that
    the next free node goes to a job whose survivors wait idle for it, not to an older job
    of the queue while the hold runs out."""
    jobs = {claims[n].id: claims[n] for n in held if n in claims and claims[n].id == held[n]}
    return sorted(jobs.values(), key=lambda j: (j.kept.since if j.kept is not None else 0.0, j.id))


def claims(jobs: Iterable[JobRecord]) -> dict[str, JobRecord]:
    """node -> the PENDING job whose copy it last kept (the latest `kept.since`: a node holds
    one job's copy, the last one it ran)."""
    found: dict[str, JobRecord] = {}
    for job in jobs:
        if job.state is JobState.PENDING and job.kept is not None:
            for n in job.kept.steps:
                other = found.get(n)
                if other is None or other.kept is None or other.kept.since < job.kept.since:
                    found[n] = job
    return found


def prefer(job: JobRecord, free: Sequence[str]) -> list[str]:
    """`free` with the nodes that hold `job`'s copy first, newest step first (otherwise in
    the order given)."""
    steps = job.kept.steps if job.kept is not None else {}
    if not steps:
        return list(free)
    return sorted(free, key=lambda n: (n not in steps, -steps.get(n, 0)))
