"""Fair share: among waiting jobs of one priority, a free node goes to the team (or user)
holding the smallest share of the cluster now, then to the oldest job.

The share is counted in nodes held now (`quotas.Usage`): the owner's team's, then the
owner's own (a user in no team is a team of one), so two teams get alike whatever their
sizes, and within a team its users get alike. The queue's order is `fair_key`: priority
first, then `share_key`, then age; `fair_queue` hands the jobs out in that order while the
shares change under it (a job that starts raises its owner's share, and the next node goes
to whoever holds least then), at a cost of a heap operation per job handed out.

Pure: the caller owns the `Usage` and adds to it what each job it starts takes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from service.decide.quotas import Usage
from service.models import JobRecord


def share_key(job: JobRecord, used: Usage) -> tuple[int, int]:
    """How much of the cluster `job`'s owner holds now: its team's nodes (its own, in no
    team), then its own; smaller starts first."""
    team = used.tenants.team(job.owner)
    own = used.user_nodes[job.owner]
    return (own if team is None else used.team_nodes[team], own)


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
