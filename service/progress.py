"""A job's progress (rank 0's step, loss, throughput), kept on the job record.

Reports are written by compare-and-set like every job change (`JobStore.update`), so a
report never undoes a state change it raced with; one from a stale attempt or to a
finished job is refused (`decide.snapshots.decide_progress`). What rank 0 should do at
its next step boundary is read off the record (`decide.snapshots.control_for`).
"""

from __future__ import annotations

from service.decide.snapshots import decide_progress
from service.jobs import JobStore
from worker.protocol import Progress, ProgressReport


class ProgressStore:
    """Record progress reports of jobs."""

    def __init__(self, jobs: JobStore):
        self.jobs = jobs

    async def report(self, job_id: str, report: ProgressReport) -> Progress:
        """Record rank 0's report; returns the progress as stored."""
        now = self.jobs.clock()
        job = await self.jobs.update(job_id, lambda job: decide_progress(job, report, now))
        assert job.progress is not None
        return job.progress
