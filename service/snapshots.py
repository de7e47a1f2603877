"""Snapshot records of a job in etcd.

Rank 0 of a job writes a snapshot file itself (the control plane never touches the
file system) and then *commits* its metadata here; what a commit or a corrupt report
changes is decided in `service.decide.snapshots`.

Consistency. A commit must see every snapshot record of the job (to prune beyond
`keep`) and change the job record (its `latest_snapshot`) in one decision. Every write
to a snapshot record in this module goes in the same transaction as a write of the job
key, so the job key's mod_revision fences the snapshot records too: read the job (at
revision R), then the records, decide, and commit only if the job is still at R: the
compare-and-set of `JobStore.update`, with the records read along with the job
(`_update` below).
"""

from __future__ import annotations

from collections.abc import Callable

from service.decide.restore import decide_memory_corrupt, decide_restore
from service.decide.snapshots import Decision, Records, decide_commit, decide_corrupt, decide_memory
from service.errors import JobNotFound
from service.jobs import JobStore
from service.models import JobRecord
from service.store import cas
from service.store.api import Entry, Put
from worker.protocol import (
    CommitRequest,
    CommitResult,
    MemoryCorrupt,
    MemoryReport,
    MemorySnapshot,
    RestorePoint,
    RestoreRequest,
    SnapshotList,
    SnapshotRecord,
)


class SnapshotStore:
    """Snapshot records of jobs in etcd, changed together with the job record by CAS."""

    def __init__(self, jobs: JobStore, snapshot_root: str | None = None):
        self.jobs = jobs
        self.snapshot_root = snapshot_root  # where every node snapshots, if they share one

    def _key(self, job_id: str) -> Callable[[int], str]:
        return lambda step: self.jobs.keys.snapshot(job_id, step)

    async def _records(self, job_id: str) -> Records:
        recs = [SnapshotRecord.model_validate_json(e.value)
                async for e in self.jobs.kv.scan_prefix(self.jobs.keys.snapshots(job_id))]
        return {r.step: r for r in recs}

    async def list(self, job_id: str) -> SnapshotList:
        """The job's committed snapshots, oldest first, and the step of its latest."""
        job = await self.jobs.get(job_id)
        records = await self._records(job_id)
        latest = job.latest_snapshot.step if job.latest_snapshot else None
        # The memory tier of the nodes that are members now (a node that left deleted its copy).
        memory = [m async for e in self.jobs.kv.scan_prefix(self.jobs.keys.memory_copies(job_id))
                  if (m := MemorySnapshot.model_validate_json(e.value)).node in job.members]
        return SnapshotList(items=[records[s] for s in sorted(records)], latest=latest,
                            memory=sorted(memory, key=lambda m: m.node))

    async def report_memory(self, job_id: str, node: str, report: MemoryReport) -> MemorySnapshot:
        """Record what a member node's memory tier holds; fenced on the job record (like
        progress: the write applies only if the job is unchanged since it was read)."""
        kv, job_key, key = self.jobs.kv, self.jobs.keys.job(job_id), self.jobs.keys.memory_copy(job_id, node)
        now = self.jobs.clock()

        async def read() -> Entry:
            entry = await kv.get(job_key)
            if entry is None:
                raise JobNotFound(job_id)
            return entry

        def decide(entry: Entry) -> cas.Write[MemorySnapshot]:
            copy = decide_memory(JobRecord.model_validate_json(entry.value), node, report, now)
            return cas.Write({job_key: entry.mod_revision}, [Put(key, copy.model_dump_json().encode())], copy)

        return await cas.update(kv, read, decide, f"memory tier of job {job_id} on node {node}")

    async def _update(self, job_id: str, decide: Callable[[JobRecord, Records], Decision]) -> Decision:
        """JobStore.update's compare-and-set, with the job's snapshot records read after the job."""
        store = self.jobs

        async def read() -> tuple[JobRecord, int, Records]:
            job, revision = await store.get_with_revision(job_id)
            return job, revision, await self._records(job_id)

        def outcome(read: tuple[JobRecord, int, Records]) -> cas.Done[Decision] | cas.Write[Decision]:
            job, revision, records = read
            decision = decide(job, records)
            if decision.change is None:
                return cas.Done(decision)
            return store.write(revision, decision.change, decision)

        return await cas.update(store.kv, read, outcome, f"job {job_id}", store.written)

    async def commit(self, job_id: str, req: CommitRequest) -> CommitResult:
        """Commit rank 0's snapshot; the answer lists the files to delete."""
        now = self.jobs.clock()
        decision = await self._update(
            job_id, lambda job, recs: decide_commit(job, recs, req, now, self._key(job_id),
                                                    self.snapshot_root))
        assert decision.change is not None and decision.committed is not None
        latest = decision.change.job.latest_snapshot
        return CommitResult(committed=decision.committed, latest=latest.step if latest else None,
                            prune=decision.prune)

    async def report_corrupt(self, job_id: str, step: int, reason: str) -> SnapshotList:
        """Mark a snapshot bad (latest falls back); returns the snapshots as they are now."""
        now = self.jobs.clock()
        await self._update(job_id, lambda job, recs: decide_corrupt(job, recs, step, reason, now,
                                                                     self._key(job_id)))
        return await self.list(job_id)

    async def _copies(self, job_id: str) -> list[MemorySnapshot]:
        return [MemorySnapshot.model_validate_json(e.value)
                async for e in self.jobs.kv.scan_prefix(self.jobs.keys.memory_copies(job_id))]

    async def restore_point(self, job_id: str, req: RestoreRequest) -> RestorePoint:
        """The restore point (service.decide.restore), recorded with an event; fenced on the
        job's revision (the members' reports are read after the job)."""
        now = self.jobs.clock()
        store = self.jobs

        async def read() -> tuple[JobRecord, int, list[MemorySnapshot]]:
            job, revision = await store.get_with_revision(job_id)
            return job, revision, await self._copies(job_id)

        def outcome(got: tuple[JobRecord, int, list[MemorySnapshot]]):
            job, revision, copies = got
            point, change = decide_restore(job, copies, req.attempt, now)
            return store.write(revision, change, point)

        return await cas.update(store.kv, read, outcome, f"job {job_id}", store.written)

    async def memory_corrupt(self, job_id: str, node: str, report: MemoryCorrupt) -> None:
        """Note in the job's events that a node's memory copy was found damaged."""
        now = self.jobs.clock()
        await self._update(job_id, lambda job, _recs: Decision(
            decide_memory_corrupt(job, node, report.step, report.reason, report.attempt, now)))
