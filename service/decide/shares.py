"""Fair share: among waiting jobs of one priority, a free node goes to the user whose jobs of
that priority have held least (node-seconds, decayed: `decide.ledger`), then to the one
holding least of the cluster now, then to the one whose team holds least, then to the oldest job.

A node a user's jobs of that priority hold now counts as `HORIZON_S` of use already: the
user that has held least is served first, but not with every free node of a pass (each job
that starts in the pass raises its owner's count, and the next node goes to whoever counts
least then), and a user that holds much now is not served before one that holds little on
the strength of a few seconds less of history. Without a ledger (`Usage.past` empty) the
order is the nodes held now, as it was.

Users get alike whatever their teams, so a team gets as much as its users with work to do
together: a team of two busy users twice what a team of one gets (node-seconds per user at
equal priority are what fair share evens out); between users alike, the one whose team holds
less goes first. The queue's order is `fair_key`: priority first, then `share_key`, then
age; `fair_queue` hands the jobs out in that order while the shares change under it, at a
cost of a heap operation per job handed out.

Pure: the caller owns the `Usage` and adds to it what each job it starts takes.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from service.decide.quotas import Usage
from service.models import JobRecord


# A node held now counts as this many seconds of use already (see above).
HORIZON_S = 60.0


def share_key(job: JobRecord, used: Usage) -> tuple[float, int, int]:
    """How much `job`'s owner has had: node-seconds at `job`'s priority (decayed, with what it
    holds now at that priority as `HORIZON_S` more), then its nodes now, then its team's (its
    own, in no team); smaller starts first."""
    key = (job.owner, job.spec.priority)
    team = used.tenants.team(job.owner)
    own = used.user_nodes[job.owner]
    had = used.past.get(key, 0.0) + used.held_at[key] * HORIZON_S
    return (had, own, own if team is None else used.team_nodes[team])


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
