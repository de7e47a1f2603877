"""Preemption: a waiting job of higher priority takes nodes from running jobs of lower priority.

A waiting job that the free nodes cannot start (fewer than its `nodes.min` fit it) looks for
victims among the running jobs of strictly lower priority (`choose`): first it takes the
nodes of those above their `min` (they shrink to no less than `min`), then, if that is not
enough, whole jobs (they are suspended). Victims are taken lowest priority first, then the
one with the least work since its last snapshot (the least to redo should the snapshot at
the step boundary not come), then the newest. Nothing is taken unless the nodes that free
up (with those free now and those already leaving for it) start the job: a preemption that
cannot start anything would only cost the victims.

A victim is marked (`JobRecord.preempt`, `mark`) and gives its nodes up the way a drain
does (`scheduling.plan`, `yield_nodes`): a job on the ftrain runtime is asked for a snapshot
at its next step boundary (`checkpoint_pause`), and once rank 0 has committed it the job
goes on without the nodes it gives (a shrink: a new attempt on the rest, resumed from that
snapshot, 0 steps lost) or goes back to PENDING (a suspension: its snapshot on disk, and its
memory copy noted in `kept` so that it prefers those nodes when it resumes, though they are
not held from the job that took them). A plain script (no runtime) is stopped: SIGTERM, then
`spec.preempt_grace_s` to save before SIGKILL (`Assignment.cancel_grace_s`); then it starts
again on the nodes it keeps, or waits. Either way the victim counts a restart of cause
"preemption" (`RestartCounts`), not a failure.

Never for a lower priority, and for an equal one only from a borrower: a job on the ftrain
runtime that took free nodes kept for a waiting job of its priority (`decide.backfill`,
`JobRecord.borrowed`). Such a job is taken from after every victim of lower priority, and only
by the job it borrowed in front of or one of its priority ahead of that job in queue order
(`may_take_back`: those that could have taken the nodes free); it gives back its borrowed nodes (a shrink, where it stays at its `min`
without them) or is suspended, a restart of cause "preemption", and its events say it gives
back what it borrowed. A job suspended by a preemption never takes its nodes back from the job
that took them (its priority is lower, or it was behind), and two jobs of one priority that
did not borrow never preempt each other. (A job of one priority does give nodes back to a starved
user's job of that priority, by fair share, the same way: `decide.giveback`, marked
`fair_share`, a shrink only, never below `min`.) While its victims give their nodes up, the waiting job
keeps the free nodes that fit it from every job of lower priority (`scheduling.schedule_queue`),
so that what one victim frees is not handed back to it, or to another job, as a scale-up.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from service.decide.order import queue_key
from service.decide.placement import fits
from service.decide.state import note
from service.models import EventView, JobRecord, JobState, NodeRecord, Preemption

S = JobState


_MAY_GIVE = frozenset((S.STARTING, S.RUNNING, S.RECOVERING))
_LIVE = frozenset(("assigned", "running"))  # `MemberStatus.is_live`


@dataclass(frozen=True)
class Take:
    """What one victim gives the waiting job: `leave` (its nodes that go), all of them if `suspend`."""

    victim: JobRecord
    leave: tuple[str, ...]
    suspend: bool


def live(job: JobRecord) -> list[str]:
    return sorted(n for n, m in job.members.items() if m.is_live())


def is_candidate(job: JobRecord) -> bool:
    """`job` may be preempted: it holds nodes and runs (or starts, or recovers), and is not
    already giving nodes up, stopping, cancelled or ending (a finished member: it is let end)."""
    if job.preempt is not None or job.stopping or job.state not in _MAY_GIVE:
        return False
    states = {m.state for m in job.members.values()}
    return "succeeded" not in states and not states.isdisjoint(_LIVE)


def work_since_snapshot(job: JobRecord, now: float) -> float:
    """Seconds of work since its last committed snapshot (since it was submitted, with none)."""
    snap = job.latest_snapshot
    since = snap.time if snap is not None and snap.time is not None else job.created_at
    return max(0.0, now - since)


def victim_key(job: JobRecord, now: float) -> tuple[int, float, float, str]:
    """Victims in the order they are taken: lowest priority, least work since a snapshot, newest."""
    return (job.spec.priority, work_since_snapshot(job, now), -job.created_at, job.id)


def coming(jobs: Iterable[JobRecord]) -> dict[str, list[str]]:
    """waiting job id -> the nodes its victims are giving up (marked, not yet gone)."""
    found: dict[str, list[str]] = {}
    for j in jobs:
        if j.preempt is not None and j.state.is_active():
            found.setdefault(j.preempt.by, []).extend(n for n in j.preempt.leave if j.members.get(n)
                                                      and j.members[n].is_live())
    return found


def staying(jobs: Iterable[JobRecord]) -> set[str]:
    """The nodes plain scripts giving nodes up keep while their workers are stopped on all of
    them (SIGTERM, then the grace; `scheduling._yield_nodes` starts them again on these): a
    stopped member holds no node, yet these are not free. (Offered as free, such a node went to
    the waiting job, which then no longer waited; the preemption was withdrawn and the script
    started again on all its nodes, that one too: two jobs on one node.)"""
    return {n for j in jobs if j.preempt is not None and j.stopping and not j.preempt.suspend
            and j.state.is_active() for n, m in j.members.items()
            if m.state == "stopped" and n not in j.preempt.leave}


def spare(job: JobRecord, members: list[str], fit) -> list[str]:
    """The nodes `job` can give while staying at its `min`, that fit: group rank 0's node last
    (the node that holds the group's rank 0 stays, where it can)."""
    leader = (job.group or "").split("/")[0]
    ordered = sorted((n for n in members if fit(n)), key=lambda n: (n == leader, n))
    return ordered[:max(0, len(members) - job.spec.nodes.min)]


class Victims:
    """The running jobs that may be preempted (`is_candidate`), in the order victims are taken
    (`victim_key`): sorted once for a scheduler pass (built only when a waiting job looks for
    victims), then asked for each waiting job that does (`choose`), at a cost that grows with
    the victims it takes, not with every running job, save when too few nodes run below it."""

    def __init__(self, jobs: Iterable[JobRecord], now: float, below: int | None = None,
                 taken: set[str] | None = None):
        """`below`: only jobs of a lower priority than this are looked at (the priority of the
        waiting job that asks: in queue order, the highest that will); `taken`: the ids of jobs
        taken already in this pass."""
        self.below = below
        if below is not None:  # (and the borrowers of that priority: `may_take_back`)
            jobs = [j for j in jobs if j.spec.priority < below
                    or (j.spec.priority == below and j.borrowed is not None)]
        self.order = sorted((j for j in jobs if is_candidate(j)), key=lambda j: victim_key(j, now))
        self.live = {j.id: live(j) for j in self.order}
        self.shrinkable = [j for j in self.order if len(self.live[j.id]) > j.spec.nodes.min]
        self.priorities = [j.spec.priority for j in self.order]  # ascending: lowest priority first
        # nodes held by order[:i], for each i: what all the jobs below a priority hold
        self.held = list(itertools.accumulate((len(self.live[j.id]) for j in self.order), initial=0))
        self.taken: set[str] = taken if taken is not None else set()  # by an earlier `choose` of this pass

    def choose(self, waiter: JobRecord, need: int, nodes: Mapping[str, NodeRecord],
               record: bool = True) -> list[Take]:
        """The victims whose nodes give `waiter` the `need` more nodes (that fit it) it lacks to
        start; [] when none is needed or not enough can be taken (then none is taken). Without
        `record` the victims are not counted as taken (what `waiter` would take, were it next)."""
        if need <= 0:
            return []
        prio = waiter.spec.priority
        below = bisect.bisect_left(self.priorities, prio)  # the candidates of lower priority: a prefix
        upto = bisect.bisect_right(self.priorities, prio)  # and those of its own (borrowers are taken)
        if self.held[upto] < need:  # (an upper bound: taken jobs and nodes that do not fit included)
            return []
        cache: dict[str, bool] = {}

        def fit(n: str) -> bool:
            if n not in cache:
                cache[n] = n in nodes and fits(waiter.spec, nodes[n])
            return cache[n]

        takes: dict[str, Take] = {}
        got = 0
        for j in self.shrinkable:  # first shrink those above their min
            if got >= need or j.spec.priority >= prio:
                break
            if j.id not in self.taken and (give := spare(j, self.live[j.id], fit)[:need - got]):
                takes[j.id] = Take(j, tuple(sorted(give)), suspend=False)
                got += len(give)
        for j in itertools.islice(self.order, below):  # then suspend whole jobs
            if got >= need:
                break
            if j.id in self.taken:
                continue
            members = self.live[j.id]
            extra = sum(1 for n in members if fit(n)) - (len(takes[j.id].leave) if j.id in takes else 0)
            if extra > 0:
                takes[j.id] = Take(j, tuple(members), suspend=True)
                got += extra
        if got < need:  # then take back what borrowers of its priority borrowed
            got += self._take_back(waiter, need - got, itertools.islice(self.order, below, upto), takes, fit)
        if got < need:
            return []
        if record:
            self.taken.update(takes)
        return list(takes.values())


    def _take_back(self, waiter: JobRecord, need: int, same: Iterable[JobRecord], takes: dict[str, Take],
                   fit) -> int:
        """Takes (into `takes`) from the borrowers among `same` (candidates of `waiter`'s priority)
        that it may take back from (`may_take_back`) until `need` nodes that fit it are got: the
        nodes they borrowed, where they stay at their `min` without them, else every node (a
        suspension). Returns how many it got."""
        got = 0
        for j in same:
            if got >= need:
                break
            if j.id in self.taken or not may_take_back(waiter, j):
                continue
            members = self.live[j.id]
            give = [n for n in members if n in j.borrowed.nodes and fit(n)][:need - got]
            if give and len(members) - len(give) >= j.spec.nodes.min:
                takes[j.id] = Take(j, tuple(sorted(give)), suspend=False)
                got += len(give)
            elif (extra := sum(1 for n in members if fit(n))) > 0:
                takes[j.id] = Take(j, tuple(members), suspend=True)
                got += extra
        return got


def may_take_back(waiter: JobRecord, borrower: JobRecord) -> bool:
    """`waiter` may take nodes back from `borrower`, a job of its priority that borrowed nodes
    kept for a waiting job (`decide.backfill`): it is that job, or ahead of it in queue order,
    one that could have taken them while they were free. (A job between the two took a
    borrowed node back the moment the borrower started on it, which it could not take free:
    the borrower suspended a tenth of a second after its start.)"""
    b = borrower.borrowed
    if b is None or borrower.spec.priority != waiter.spec.priority:
        return False
    if b.head == waiter.id:
        return True
    head = queue_key(borrower) if b.head_created_at is None else (-b.priority, b.head_created_at, b.head)
    return queue_key(waiter) < head


def shortfall(waiter: JobRecord, usable: int, leaving: int) -> int:
    """How many more nodes `waiter` must take from running jobs to start: its `min` less the
    `usable` free nodes (READY, fitting it) and the `leaving` ones its victims already give up."""
    return waiter.spec.nodes.min - usable - leaving


def giving_to(jobs: Iterable[JobRecord]) -> dict[str, list[Take]]:
    """waiting job id -> what the jobs marked for it are giving up (a preemption under way)."""
    found: dict[str, list[Take]] = {}
    for j in jobs:
        if j.preempt is not None and j.state.is_active():
            found.setdefault(j.preempt.by, []).append(Take(j, tuple(j.preempt.leave), j.preempt.suspend))
    return found


def would_take(waiter: JobRecord, usable: int, under_way: Sequence[Take], victims: Victims,
               nodes: Mapping[str, NodeRecord]) -> list[Take]:
    """What `waiter` takes from running jobs if it is the next to start: the preemption under
    way for it, then what `victims.choose` gives it for the rest it lacks (nothing more where
    that is not enough to start it). `victims` is not changed."""
    leaving = sum(1 for t in under_way for n in t.leave if n in t.victim.members
                  and t.victim.members[n].is_live())
    more = victims.choose(waiter, shortfall(waiter, usable, leaving), nodes, record=False)
    return [*under_way, *more]


def choose(waiter: JobRecord, need: int, candidates: Iterable[JobRecord], nodes: Mapping[str, NodeRecord],
           now: float) -> list[Take]:
    """`Victims(candidates, now).choose(waiter, need, nodes)`: for one waiting job."""
    return Victims(candidates, now).choose(waiter, need, nodes)


def mark(take: Take, waiter: JobRecord, now: float, fair_share: bool = False) -> tuple[JobRecord, EventView]:
    """The victim once told to give its nodes up to `waiter`, with its event (`fair_share`: a
    give-back to a starved user, `decide.giveback`)."""
    p = Preemption(by=waiter.id, by_priority=waiter.spec.priority, leave=list(take.leave),
                   suspend=take.suspend, requested_at=now, fair_share=fair_share,
                   for_user=waiter.owner if fair_share else None)
    return remark(take.victim, p, now)


def remark(victim: JobRecord, p: Preemption, now: float) -> tuple[JobRecord, EventView]:
    """`victim` marked with `p` (made on another record of it: `mark`)."""
    what = ("suspended (its state kept: it waits for nodes and resumes where it stopped)" if p.suspend
            else f"giving up node(s) {', '.join(p.leave)}")
    changed = victim.model_copy(update={"preempt": p})
    if p.fair_share:
        return note(changed, f"giving node(s) {', '.join(p.leave)} back to user {p.for_user} (fair share: it "
                             f"holds no node), for {p.describe()}", now, as_reason=True)
    if gives_back(victim, p):
        return note(changed, f"giving back the node(s) it borrowed while they were kept for "
                             f"{victim.borrowed.describe()}: {p.describe()} takes them; {what}", now, as_reason=True)
    return note(changed, f"preempted by {p.describe()}: {what}", now, as_reason=True)


def gives_back(victim: JobRecord, p: Preemption) -> bool:
    """`victim` gives nodes to a job of its own priority by `p`: it borrowed them (`may_take_back`)."""
    return victim.borrowed is not None and not p.fair_share and p.by_priority == victim.spec.priority


def withdraw(victim: JobRecord, now: float, elsewhere: Callable[[str], bool]) -> tuple[JobRecord, EventView] | None:
    """`victim` once the job it gives nodes to no longer waits for them (cancelled, ended, or
    started on others), and its event; None: nothing left to withdraw.

    What has not happened is called off: the mark goes and the job keeps its nodes. What has
    begun goes on, taking nothing more: rank 0 asked to pause snapshots and the group restarts
    from there on all its nodes (`scheduling.plan`'s called-off change, as for a scale-up whose
    nodes went elsewhere); a plain script already told to stop (SIGTERM, its grace) starts again
    on the nodes it still has: `leave` keeps only those of its stopped members that another job
    holds now (`elsewhere`: often the job it stopped for, which started on them and so no longer
    waits). A node already given up is not taken back, but is free for a scale-up as any other."""
    p = victim.preempt
    if p is None:
        return None
    if victim.stopping:
        gone = sorted(n for n, m in victim.members.items() if m.state == "stopped" and elsewhere(n))
        if not p.suspend and p.leave == gone:  # (withdrawn already, or what it gave is all that went)
            return None
        changed = victim.model_copy(update={"preempt": p.model_copy(update={"leave": gone, "suspend": False})})
        what = (f"its workers, already told to stop, start again on the node(s) it still has "
                f"({', '.join(gone)} went to another job)" if gone
                else "its workers, already told to stop, start again on all its nodes")
    else:
        changed = victim.model_copy(update={"preempt": None})
        what = "it keeps its nodes"
    return note(changed, f"{p.describe()} no longer waits for them: {what}", now, as_reason=True)


def still_applies(victim: JobRecord, p: Preemption) -> bool:
    """`p`, decided on an older record of `victim`, may be marked on this one."""
    return is_candidate(victim) and set(p.leave) <= set(live(victim)) \
        and (not p.suspend or set(p.leave) == set(live(victim)))


def noted_on_waiter(waiter: JobRecord, takes: Sequence[Take], now: float,
                    fair_share: bool = False) -> tuple[JobRecord, EventView]:
    """The waiting job's event: whom it preempts (or takes nodes from by `fair_share`), and how."""
    parts = [f"job {t.victim.id} (priority {t.victim.spec.priority}): "
             + ("suspending it" if t.suspend else f"taking node(s) {', '.join(t.leave)}") for t in takes]
    what = "by fair share (its user holds no node), from " if fair_share else "preempting "
    return note(waiter, what + "; ".join(parts), now, as_reason=True)
