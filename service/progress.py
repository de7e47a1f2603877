"""A job's progress (rank 0's step, loss, throughput): hot state, on a key of its own.

Rank 0 reports about once a second. Rewriting the job record (its spec included) for each
report would wake the watch-fed job index and the scheduler every time and fill etcd's
history, so a report goes to `keys.progress(id)`, a small key, at most once per
`min_interval_s` (reports in between are answered with what is stored). It is still fenced:
the write is a transaction that applies only if the job record is unchanged since it was
read, so a report from a stale attempt or to a finished job is refused
(`decide.snapshots.decide_progress`) even when it races with the change that made it so.
The job record is written by the first report (`reports_progress`), and by the first report
of a group that replaced a stopped one, with its "training again" event (`decide.recovery`). The job view
merges the key back in (`JobStore.view`). Each stored report also adds a point to the job's
metric history (`keys.metrics_body(id)` and `metrics_tail(id)`, bounded: `decide.metrics`)
in the same transaction.
"""

from __future__ import annotations

from service.decide.snapshots import ProgressDecision, decide_progress
from service.errors import JobNotFound
from service.jobs import JobStore, event_ops
from service.models import JobRecord, MetricHistory
from service.store import cas
from service.store.api import Entry, Put
from worker.protocol import Progress, ProgressReport

# the job, its progress, its metric history's body and tail
Read = tuple[Entry, Entry | None, Entry | None, Entry | None]


class ProgressStore:
    """Record progress reports of jobs, at a bounded rate."""

    def __init__(self, jobs: JobStore, min_interval_s: float = 1.0, metric_points: int = 240):
        self.jobs = jobs
        self.min_interval_s = min_interval_s
        self.metric_points = metric_points

    async def report(self, job_id: str, report: ProgressReport) -> Progress:
        """Record rank 0's report; returns the progress as stored."""
        kv, keys = self.jobs.kv, self.jobs.keys
        job_key, progress_key = keys.job(job_id), keys.progress(job_id)
        body_key, tail_key = keys.metrics_body(job_id), keys.metrics_tail(job_id)
        now = self.jobs.clock()

        async def read() -> Read:
            job, progress, body, tail = await kv.get_many([job_key, progress_key, body_key, tail_key])
            if job is None:
                raise JobNotFound(job_id)
            return job, progress, body, tail

        def decide(read: Read) -> cas.Done[Progress] | cas.Write[Progress]:
            job_entry, progress_entry, body_entry, tail_entry = read
            job = JobRecord.model_validate_json(job_entry.value)
            stored = None if progress_entry is None else Progress.model_validate_json(progress_entry.value)
            body, tail = (None if e is None else MetricHistory.model_validate_json(e.value)
                          for e in (body_entry, tail_entry))
            d: ProgressDecision = decide_progress(job, stored, report, now, self.min_interval_s,
                                                  body, tail, self.metric_points)
            if not d.write:
                return cas.Done(d.progress)
            ops = [Put(progress_key, d.progress.model_dump_json().encode())]
            if d.job is not None:
                ops.append(Put(job_key, d.job.model_dump_json().encode()))
                ops += event_ops(keys, job_id, d.events)
            # The progress key first: the one read back for the index (cas.update's `written`).
            for key, part in ((body_key, d.body), (tail_key, d.tail)):
                if part is not None:
                    ops.append(Put(key, part.model_dump_json().encode()))
            expect = {key: 0 if entry is None else entry.mod_revision
                      for key, entry in ((progress_key, progress_entry), (body_key, body_entry),
                                         (tail_key, tail_entry))}
            expect[job_key] = job_entry.mod_revision
            return cas.Write(expect, ops, d.progress)

        return await cas.update(kv, read, decide, f"progress of job {job_id}", self.jobs.written)
