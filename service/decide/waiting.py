"""Why a PENDING job waits, in words: the nodes it asks for against those registered, those
that fit it, the quota of its user or team that it would exceed, those free, and the jobs
that hold the rest.

Asked when a job is read (`GET /v1/jobs/{id}`, the job list, `ftrain status`), not written to
the job's record: what a waiting job waits on changes with every node and every other job,
and a thousand waiting jobs rewritten on each change would cost etcd a write storm for words
nobody reads. Pure: the caller gives the live nodes and, for each node, the unfinished job
that holds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from service.decide.placement import fits
from service.decide.quotas import Limit, blocking
from service.models import JobRecord, JobState, NodeRecord, NodeState

MAX_HOLDERS_NAMED = 3


def why_waiting(job: JobRecord, nodes: Mapping[str, NodeRecord],
                holders: Mapping[str, JobRecord], applying: Sequence[Limit] = ()) -> str | None:
    """What `job` waits for (None unless it is PENDING): `nodes` are the live nodes by name,
    `holders` node -> the unfinished job that holds it, `applying` the quotas of its owner
    with their use (`quotas.limits`)."""
    if job.state is not JobState.PENDING:
        return None
    need = job.spec.nodes.min
    gpus = job.spec.gpus_per_node
    asked = f"{need} node(s)" + (f" with {gpus} GPU(s) each" if gpus else "")
    fitting = [n for n in sorted(nodes) if fits(job.spec, nodes[n])]
    if len(nodes) < need:
        return (f"needs {asked}; the cluster has {len(nodes)} registered: it starts when "
                f"{need - len(nodes)} more join")
    if len(fitting) < need:
        return (f"needs {asked}; {len(fitting)} of the {len(nodes)} registered have that many GPUs: "
                f"it starts when {need - len(fitting)} more such node(s) join")
    ready = [n for n in fitting if nodes[n].state is NodeState.READY]
    if len(ready) < need:
        return (f"needs {asked}; {len(fitting) - len(ready)} of the {len(fitting)} that fit are "
                f"draining: it starts when enough are undrained or join")
    if (quota := blocking(job, [nodes[n] for n in ready], applying)) is not None:
        return (f"needs {asked}; {quota.words()}: it starts when {quota.who}'s jobs give "
                f"{quota.what} back or the quota is raised")
    free = [n for n in ready if n not in holders]
    if len(free) >= need:
        return f"needs {asked}; {len(free)} are free: it starts at the scheduler's next pass"
    return (f"needs {asked}; {len(free)} of the {len(ready)} that fit are free, "
            f"{_held_by(ready, holders, job.id)}")


def _held_by(ready: list[str], holders: Mapping[str, JobRecord], waiter: str) -> str:
    """'the others are held by job X (RUNNING: n0, n1) and ...', the first few jobs named (a
    borrower in front of `waiter` first, said to be one)."""
    by_job: dict[str, list[str]] = {}
    states: dict[str, str] = {}
    for n in ready:
        holder = holders.get(n)
        if holder is not None:
            by_job.setdefault(holder.id, []).append(n)
            lent = holder.borrowed is not None and holder.borrowed.head == waiter
            # (a borrower gives the nodes back once they would start this job: `decide.backfill`)
            states[holder.id] = holder.state.value + (", borrowed in front of this job" if lent else "")
    first = sorted(by_job.items(), key=lambda item: "borrowed" not in states[item[0]])  # (stable)
    named = [f"job {j} ({states[j]}: {', '.join(ns)})" for j, ns in first[:MAX_HOLDERS_NAMED]]
    more = len(by_job) - len(named)
    tail = f" and {more} more job(s)" if more > 0 else ""
    return "the others are held by " + ", ".join(named) + tail
