"""Fair-share give-back: an elastic job above its `min` gives nodes back to a starved user.

A user is starved when it has a job waiting and its jobs hold no node (`starved`). Its first
waiting job, when the free nodes cannot start it and no job of lower priority is there to
preempt, takes nodes from running jobs of its own priority that are above their `min`
(`choose`), through the same planned shrink that preemption uses (`decide.preempt`: the job is
marked, rank 0 snapshots at a step boundary, the job goes on on the rest: 0 steps lost with
the runtime; its restart counts as a resize). Never below a job's `min`, never a suspension.

No thrash:
- a give-back never turns the shares round: the owner of a job that gives keeps at least as
  many nodes as the starved user holds once its job has started (nodes held now, by user; a
  teammate's job gives as another team's does), so the one that gave is never starved by it
  and never takes the nodes back;
- a job that started less than `settle_s` ago (SETTLE_S by default; the control plane's
  `fair_share_settle_s`) gives nothing back (the job that just received nodes by fair share
  is not shrunk for the next starved user at the next pass);
- as with preemption, nothing is taken unless it starts the waiting job.

Pure: the caller gives the running jobs and the shares of its pass.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping

from service.decide.placement import fits
from service.decide.preempt import Take, is_candidate, live, spare, victim_key
from service.decide.quotas import Usage
from service.models import JobRecord, NodeRecord

# A job gives nodes back by fair share only once it has run this long since it (re)started.
SETTLE_S = 60.0


def starved(waiting_owners: Iterable[str], used: Usage) -> set[str]:
    """The owners of waiting jobs whose jobs hold no node."""
    return {o for o in waiting_owners if not used.user_nodes[o]}


def donors(running: Iterable[JobRecord]) -> list[JobRecord]:
    """The running jobs that could give nodes back at all (above their `min`, not already giving)."""
    return [j for j in running if is_candidate(j) and len(live(j)) > j.spec.nodes.min]


def choose(waiter: JobRecord, need: int, running: Iterable[JobRecord], used: Usage,
           nodes: Mapping[str, NodeRecord], now: float, taken: Collection[str] = (),
           settle_s: float = SETTLE_S) -> list[Take]:
    """The shrinks of running jobs of `waiter`'s priority that give it the `need` nodes it lacks
    to start (the owner holding most first, then as preemption orders victims); [] when none is
    needed or not enough can be given (then none is). `taken`: ids of jobs already taken in this
    pass."""
    if need <= 0:
        return []
    mine = used.user_nodes[waiter.owner] + waiter.spec.nodes.min  # the starved user's share, once started
    donors = sorted((j for j in running if _may_give(j, waiter, now - settle_s, taken)),
                    key=lambda j: (-used.user_nodes[j.owner], victim_key(j, now)))
    given: Counter = Counter()  # nodes taken from each donor's owner
    takes, got = [], 0
    for j in donors:
        if got >= need:
            break
        room = used.user_nodes[j.owner] - given[j.owner] - mine  # what it may give without falling below
        if room <= 0:
            continue
        give = spare(j, live(j), lambda n: n in nodes and fits(waiter.spec, nodes[n]))[:min(need - got, room)]
        if give:
            takes.append(Take(j, tuple(sorted(give)), suspend=False))
            given[j.owner] += len(give)
            got += len(give)
    return takes if got >= need else []


def _may_give(job: JobRecord, waiter: JobRecord, settled_by: float, taken: Collection[str]) -> bool:
    return (job.spec.priority == waiter.spec.priority and job.owner != waiter.owner
            and job.id not in taken and is_candidate(job) and len(live(job)) > job.spec.nodes.min
            and job.started_at is not None and job.started_at <= settled_by)
