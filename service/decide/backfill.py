"""Backfill: which jobs may start on free nodes while a job ahead of them waits for more.

When the queue's head (the first waiting job, in queue order, that the free nodes cannot
start and that no preemption starts either) waits for nodes, the nodes free now are not left
idle for it, nor handed out blindly: a job behind it starts on them (or a running job grows
onto them) only if it cannot delay the head's start (`may_backfill`):

- it has a lower priority than the head: the head takes the nodes back by preemption
  (`decide.preempt`) as soon as enough can be taken to start it;
- it has a higher priority than the head (a running job growing: a waiting one would be
  ahead of it): it comes first, and the head could not take the nodes back from it anyway;
- the nodes it takes do not fit the head (too few GPUs for it);
- or it ends, by its declared `max_duration_s` (enforced: `scheduling.plan` fails a job that
  runs past it), before the head could start anyway (`planned_start`).

When the head could start is counted from what the running jobs declare, as SLURM's backfill
counts from time limits: a job with a `max_duration_s` gives its nodes back by then, one with
none may end at any moment, so its nodes count as coming back now (a job of the head's
priority without a `max_duration_s` never backfills in front of it). A job that ends
earlier than it declared may let the head start earlier than planned, never later.

A job of the head's priority on the ftrain runtime (`may_borrow`: it reported progress
through it, so it gives nodes up at a step boundary with 0 steps lost), or one that has never
run (most jobs of a queue: whether they use the runtime shows at their first progress
report), may take the kept nodes anyway, as a borrower: the pass marks it (`JobRecord.borrowed`: the head's id and the kept
nodes it took, `lend`) when it starts on them (a waiting job only: a running one growing onto
them would take back, pass after pass, the node fair share gives a starved job of its
priority). Once the head (or a job of
that priority ahead of the borrower in queue order) could start with the borrowed nodes, it
takes them back as a preemption takes nodes (`decide.preempt`, after the victims of lower
priority): the borrower shrinks off them where it stays at its `min`, else is suspended, and
counts a restart of cause "preemption". A job known to be a plain script (it ran and never
reported progress) never borrows: giving back would cost it the work since its last save; one
that borrowed before it was known gives back as a preempted script does (SIGTERM, then its
`preempt_grace_s` to save). The mark goes when the borrower goes back to PENDING or ends
(`state.transition`), gives the nodes back by a shrink, or when the job it borrowed in front of
no longer waits (it started without them, or ended: `released`); from then on the borrower is
an ordinary job, which no job of its priority takes nodes from.

Under the `fifo` queue policy nothing is held for the head (the jobs behind it start on what
is free, as they always did). Pure: the caller gives the nodes and jobs of its pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from service.decide.placement import fits
from service.decide.quotas import held_nodes
from service.decide.state import note, uses_runtime
from service.models import Borrow, EventView, JobRecord, JobState, NodeRecord, NodeState


def ends_by(job: JobRecord) -> float | None:
    """When `job`'s run must have ended (`spec.max_duration_s` from its start); None: no bound."""
    limit = job.spec.max_duration_s
    if limit is None or job.started_at is None:
        return None
    return job.started_at + limit


def planned_start(head: JobRecord, free: Iterable[str], running: Iterable[JobRecord],
                  nodes: Mapping[str, NodeRecord], now: float) -> float | None:
    """The earliest moment `head` could start on its own: the `free` nodes (READY) that fit it,
    and the ones the `running` jobs hold, each given back at its `ends_by` (now, for a job with
    no bound). None: the nodes registered that fit it are too few for it ever to start."""
    need = head.spec.nodes.min - sum(1 for n in free if _fits(head, n, nodes))
    if need <= 0:
        return now
    releases = sorted((max(now, ends_by(j) or now), k) for j in running
                      if (k := sum(1 for n in held_nodes(j) if _fits(head, n, nodes))))
    for at, k in releases:
        need -= k
        if need <= 0:
            return at
    return None


def may_backfill(job: JobRecord, takes: Sequence[str], head: JobRecord, start: float | None,
                 nodes: Mapping[str, NodeRecord], now: float) -> bool:
    """`job` may take `takes` (free nodes) while `head` waits to start at `start`
    (`planned_start`): it cannot delay that start (the module's docstring says how)."""
    if job.spec.priority != head.spec.priority or start is None:
        return True
    if not any(_fits(head, n, nodes) for n in takes):
        return True
    limit = job.spec.max_duration_s
    # (a waiting job's run would start now: a suspended one's last start does not count)
    end = ends_by(job) if job.state is not JobState.PENDING else None if limit is None else now + limit
    return end is not None and end <= start


def may_take(job: JobRecord, free: Sequence[str], head: JobRecord, start: float | None,
             nodes: Mapping[str, NodeRecord], now: float) -> Sequence[str]:
    """The nodes of `free` that `job` (a running job that may grow) may take while `head`
    waits: all of them where it may backfill, else only those that do not fit the head."""
    if may_backfill(job, free, head, start, nodes, now):
        return free
    return [n for n in free if not _fits(head, n, nodes)]


def may_borrow(job: JobRecord, head: JobRecord) -> bool:
    """`job` may take the free nodes kept for `head` as a borrower (the module's docstring):
    it is of `head`'s priority and on the ftrain runtime, so it gives them back at a step
    boundary, 0 steps lost, or it has never run, so nothing says yet that it is not (a plain
    script would lose the work since its last save)."""
    return job.spec.priority == head.spec.priority and (uses_runtime(job) or job.attempt == 0)


def loan(job: JobRecord, free: Sequence[str], allowed: Sequence[str], head: JobRecord,
         now: float) -> Borrow | None:
    """The nodes of `free` that `job` takes only as a borrower in front of `head` (those
    `may_take` did not allow it), offered as a loan; None: it takes none so, or may borrow none."""
    kept = [n for n in free if n not in allowed] if len(allowed) < len(free) else []
    if not kept or not may_borrow(job, head):
        return None
    return Borrow(head=head.id, priority=head.spec.priority, nodes=kept, since=now,
                  head_created_at=head.created_at)


def lend(before: JobRecord, after: JobRecord, offer: Borrow, now: float) -> tuple[JobRecord, EventView] | None:
    """`after` (the next record of `before`) marked as borrowing the nodes of the loan `offer` it
    took (a start on them, or a scale-up onto them), and its event; None: it took none of them."""
    was = {n for n, m in before.members.items() if m.is_live()}
    took = [n for n in offer.nodes if n not in was and n in after.members and after.members[n].is_live()]
    if not took:
        return None
    prior = after.borrowed if after.borrowed is not None and after.borrowed.head == offer.head else None
    borrowed = offer.model_copy(update={"nodes": sorted({*took, *(prior.nodes if prior else ())}),
                                        "since": prior.since if prior else now})
    return note(after.model_copy(update={"borrowed": borrowed}),
                f"borrowed node(s) {', '.join(took)}, kept for {offer.describe()}, which waits for more: "
                "it gives them back at a step boundary (0 steps lost) once that job can start with them",
                now)


def released(job: JobRecord, now: float) -> tuple[JobRecord, EventView] | None:
    """`job` once the job it borrowed nodes in front of no longer waits (it started without
    them, or ended): the nodes are its own (an ordinary job's), and its event; None: none borrowed."""
    b = job.borrowed
    if b is None:
        return None
    return note(job.model_copy(update={"borrowed": None}),
                f"{b.describe()} no longer waits for node(s) {', '.join(b.nodes)}: they are no longer borrowed",
                now)


def _fits(job: JobRecord, name: str, nodes: Mapping[str, NodeRecord]) -> bool:
    node = nodes.get(name)
    return node is not None and node.state is NodeState.READY and fits(job.spec, node)


def held_back(job: JobRecord, head: JobRecord, start: float, now: float) -> str:
    """Why `job` waits while nodes that would start it are free: they are kept for `head`."""
    when = ("at any moment (a job holding the rest may end at any time)" if start <= now
            else f"in {start - now:.0f} s, as the running jobs declare their ends")
    return (f"needs {job.spec.nodes.min} node(s); the free ones are kept for job {head.id} (priority "
            f"{head.spec.priority}), ahead of it, which waits for more and could start {when}: it starts "
            "once that one has, or at once with a max_duration_s that ends before then (a job that has "
            "reported progress through the ftrain runtime borrows them, and gives them back when that "
            "one can start)")
