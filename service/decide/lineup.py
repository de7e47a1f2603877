"""The queue as people see it: the waiting jobs in the order they will start, each with what it
waits for and what it would preempt. `ftrain queue` (`GET /v1/queue`), a job's own `waiting`
(`GET /v1/jobs/{id}`, the job list) and the dashboard all read it here, so they say the same.

The order is the scheduler's own (`decide.shares.fair_queue`: priority, then the owner's share
of the cluster, then age), played forward: each job ahead is counted as holding its `min`
nodes when the next one's turn comes, as a pass that starts it would. The reasons are
`decide.waiting`'s, against what is held now, but for a job that the free nodes would start
while the first job that waits for more (the head, `decide.backfill`) is ahead of it: the
nodes are kept for that one unless it cannot delay it or may borrow them (a job on the ftrain
runtime of its priority), and its reason says so. What each
would preempt is `decide.preempt.would_take` on the running jobs of now, each job taken as if
it were the next to start (so two jobs may name the same victim).

Pure: the caller gives the unfinished jobs, the live nodes, who holds each node and what the
users and teams hold.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from service.decide import backfill, giveback, preempt, quotas
from service.decide.order import queue_key
from service.decide.placement import fits
from service.decide.shares import served
from service.decide.waiting import why_waiting
from service.models import JobRecord, JobState, NodeRecord, NodeState


@dataclass(frozen=True)
class Queued:
    """A waiting job's place in the queue (1: the next to start), whom it would preempt
    (`fair`: by a fair-share give-back) and why it waits (`waiting`, said when asked)."""

    job: JobRecord
    position: int
    takes: list[preempt.Take]
    fair: bool
    held_back: str | None  # the nodes that would start it are kept for the head (`backfill.held_back`)
    holders: Mapping[str, JobRecord]  # node -> the job that holds it from this one
    applying: list[quotas.Limit]
    nodes: Mapping[str, NodeRecord]

    @property
    def waiting(self) -> str | None:
        return self.held_back or why_waiting(self.job, self.nodes, self.holders, self.applying)


@dataclass(frozen=True)
class Cluster:
    """What the queue is read against: the unfinished `jobs`, the live `nodes`, `holders` (node
    -> the job it works for, or the waiting job it is held for), `used` (`quotas.usage` of the
    jobs), the moment and the queue policy."""

    jobs: Sequence[JobRecord]
    nodes: Mapping[str, NodeRecord]
    holders: Mapping[str, JobRecord]
    used: quotas.Usage
    now: float
    fifo: bool = False
    settle_s: float = giveback.SETTLE_S


def lineup(c: Cluster) -> Iterator[Queued]:
    """The waiting (PENDING) jobs, first to start first (read only as far as the caller goes)."""
    ahead = copy.deepcopy(c.used)  # the shares as the jobs ahead would make them
    waiting = sorted((j for j in c.jobs if j.state is JobState.PENDING), key=lambda j: queue_key(j, c.fifo))
    running = [j for j in c.jobs if j.state is not JobState.PENDING]
    victims = preempt.Victims(running, c.now)
    starving = set() if c.fifo else giveback.starved({j.owner for j in waiting}, c.used)
    donors = giveback.donors(running) if starving else []
    under_way = preempt.giving_to(c.jobs)
    head, start = None, None  # the first job that waits for nodes no preemption gives it
    for position, job in enumerate(served(waiting, ahead, c.fifo), 1):
        mine = HeldFrom(c.holders, job.id)
        applying = quotas.limits(job.owner, c.used)
        may_preempt = not c.fifo and quotas.leaves_room_for_min(job, applying)
        free_nodes = usable(job, c.nodes, mine)
        free = len(free_nodes)
        takes, fair = [], False
        if may_preempt:
            takes = preempt.would_take(job, free, under_way.get(job.id, []), victims, c.nodes)
            if not takes and job.owner in starving:  # (as the scheduler's `claim`)
                takes = giveback.choose(job, preempt.shortfall(job, free, 0), donors, c.used, c.nodes,
                                        c.now, settle_s=c.settle_s)
                fair = True
        held_back = None
        if may_preempt and head is None and free < job.spec.nodes.min and not takes:
            start = backfill.planned_start(job, free_nodes, running, c.nodes, c.now)
            head = job if start is not None else None
        elif may_preempt and head is not None and free >= job.spec.nodes.min \
                and len(backfill.may_take(job, free_nodes, head, start, c.nodes, c.now)) < job.spec.nodes.min \
                and not backfill.may_borrow(job, head):
            held_back = backfill.held_back(job, head, start, c.now)
        yield Queued(job, position, takes, fair, held_back, mine, applying, c.nodes)
        ahead.add(job.owner, job.spec.nodes.min, 0, job.spec.priority)


def may_be_held_back(job: JobRecord, nodes: Mapping[str, NodeRecord], holders: Mapping[str, JobRecord],
                     fifo: bool = False) -> bool:
    """The free nodes would start `job` (a PENDING one), so whether backfill keeps them for a
    job ahead of it is a question for `lineup`; else its reason is `why_waiting`'s alone."""
    return not fifo and job.state is JobState.PENDING \
        and len(usable(job, nodes, HeldFrom(holders, job.id))) >= job.spec.nodes.min


def usable(job: JobRecord, nodes: Mapping[str, NodeRecord], holders: Mapping[str, JobRecord]) -> list[str]:
    """The free nodes `job` could start on now: READY, held by no job, with what it asks of each."""
    return [n for n, node in nodes.items() if n not in holders and node.state is NodeState.READY
            and fits(job.spec, node)]


class HeldFrom(Mapping[str, JobRecord]):
    """`holders` as one waiting job sees them: a node held for that job itself is not held
    from it."""

    def __init__(self, holders: Mapping[str, JobRecord], job_id: str):
        self._holders, self._job_id = holders, job_id

    def __getitem__(self, node: str) -> JobRecord:
        holder = self._holders[node]
        if holder.id == self._job_id:
            raise KeyError(node)
        return holder

    def __iter__(self):
        return (n for n, h in self._holders.items() if h.id != self._job_id)

    def __len__(self) -> int:
        return sum(1 for _ in self)
