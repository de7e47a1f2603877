"""The order in which waiting jobs are offered nodes: the one place it is decided.

Higher `priority` first, then the oldest (`created_at`, then the id, so that the order is total);
fair share (`decide.shares`) reorders the jobs of one priority while a node is free. Under the
`fifo` queue policy (`FTRAIN_QUEUE_POLICY=fifo`) the order is submission order alone, and
nothing preempts.
The job index keeps its PENDING jobs sorted by `queue_key` as they change
(`JobIndex.pending_ids`), so a scheduler pass reads the queue from its head and only as far as
it can start (or preempt for) jobs; `schedule` sorts a plain list by the same key. A job's key
never changes while it waits (its spec is fixed), which is what lets the index keep the order
by insertion alone.
"""

from __future__ import annotations

from service.models import JobRecord

QueueKey = tuple[int, float, str]


def queue_key(job: JobRecord, fifo: bool = False) -> QueueKey:
    """Sort key of a waiting job: smaller starts first. `fifo` (the control plane's
    `queue_policy`): submission order only, priority not looked at."""
    return (0 if fifo else -job.spec.priority, job.created_at, job.id)
