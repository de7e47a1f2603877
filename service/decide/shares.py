"""Fair share: among waiting jobs of one priority, a free node goes to the user holding the
smallest share of the cluster now, then to the one whose team holds least, then to the oldest job.

The share is counted in nodes held now (`quotas.Usage`): the owner's own, then its team's (a
user in no team is a team of one). Users get alike whatever their teams, so a team gets as
much as its users with work to do together: a team of two busy users twice what a team of
one gets (node-seconds per user at equal priority are what fair share evens out); between
users holding alike, the one whose team holds less goes first. The queue's order is
`fair_key`: priority first, then `share_key`, then age; `fair_queue` hands the jobs out in
that order while the shares change under it (a job that starts raises its owner's share, and
the next node goes to whoever holds least then), at a cost of a heap operation per job
handed out.

Pure: the caller owns the `Usage` and adds to it what each job it starts takes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from service.decide.quotas import Usage
from service.models import JobRecord


def share_key(job: JobRecord, used: Usage) -> tuple[int, int]:
    """How much of the cluster `job`'s owner holds now: its own nodes, then its team's (its
    own, in no team); smaller starts first."""
    team = used.tenants.team(job.owner)
    own = used.user_nodes[job.owner]
    return (own, own if team is None else used.team_nodes[team])


def fair_key(job: JobRecord, used: Usage) -> tuple:
    """A waiting job's place in the queue: priority (higher first), share, then age."""
    return (-job.spec.priority, share_key(job, used), job.created_at, job.id)


def fair_queue(pending: Iterable[JobRecord], used: Usage) -> Iterator[JobRecord]:
    """`pending` (oldest first) in `fair_key` order, each job's key taken as `used` is when
    its turn comes.

    Each owner's jobs keep their order (priority, then age) in a line of their own; a heap
    holds each line's first job under the key it had when it was pushed. Shares only grow
    while the queue is handed out, so a popped key that is out of date is pushed again with
    the key of now, and the first up-to-date key popped is the smallest."""
    lines: dict[str, list[JobRecord]] = {}
    priorities = set()
    for job in pending:
        lines.setdefault(job.owner, []).append(job)
        priorities.add(job.spec.priority)
    for line in lines.values():
        if len(priorities) > 1:  # (stable: age order within a priority; skipped when all are alike)
            line.sort(key=lambda j: -j.spec.priority)
        line.reverse()  # pop() = first
    heap = [(fair_key(line[-1], used), owner) for owner, line in lines.items()]
    heapq.heapify(heap)
    while heap:
        key, owner = heapq.heappop(heap)
        line = lines[owner]
        now = fair_key(line[-1], used)
        if now != key:
            heapq.heappush(heap, (now, owner))
            continue
        yield line.pop()
        if line:
            heapq.heappush(heap, (fair_key(line[-1], used), owner))


def served(pending: Iterable[JobRecord], used: Usage, fifo: bool = False) -> Iterator[JobRecord]:
    """`pending` in the order it is served: `fair_queue`'s, or under the `fifo` queue policy
    as given (submission order: `decide.order.queue_key`)."""
    return iter(pending) if fifo else fair_queue(pending, used)
