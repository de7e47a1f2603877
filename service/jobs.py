"""Jobs in etcd: create (idempotently), read, list, and change by compare-and-set.

Every change goes through `JobStore.update(job_id, decide)`: read the record and its
mod_revision, let the pure `decide` function return the new record and the events it
causes, and commit both in one transaction that only applies if the record is still at
the revision read (`service.store.cas.update`). On a lost race the record is re-read and
`decide` runs again, so a decision is always made on what is stored now, never on a
stale copy.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
import time
from collections.abc import Callable
from typing import TypeVar

from service.decide.change import Change
from service.decide.state import transition
from service.errors import Conflict, JobNotFound
from service.keys import Keys
from service.models import EventView, JobRecord, JobSpec, JobState, JobView
from service.store import cas
from service.store.api import Delete, KeyValue, Put
from worker.protocol import Progress

_ID_ALPHABET = string.ascii_lowercase + string.digits

Clock = Callable[[], float]
T = TypeVar("T")


# decide(job) -> Change, or None for "nothing to write"
Decide = Callable[[JobRecord], Change | None]


def new_job_id(name: str) -> str:
    return f"{name}-{''.join(secrets.choice(_ID_ALPHABET) for _ in range(6))}"


def spec_digest(spec: JobSpec) -> str:
    return hashlib.sha256(spec.model_dump_json().encode()).hexdigest()


def _dump(model) -> bytes:
    return model.model_dump_json().encode()


class JobStore:
    """Job records and their events in etcd; every change a compare-and-set."""

    def __init__(self, kv: KeyValue, keys: Keys, clock: Clock = time.time):
        self.kv = kv
        self.keys = keys
        self.clock = clock

    async def create(self, spec: JobSpec, idempotency_key: str | None = None) -> tuple[JobRecord, bool]:
        """Store a new PENDING job; returns (job, created). A repeated key returns the first job."""
        now = self.clock()
        job = JobRecord(id=new_job_id(spec.name), spec=spec, created_at=now, updated_at=now,
                        token=secrets.token_urlsafe(24))
        job, event = _first_event(job, now)
        ops: list[Put | Delete] = [Put(self.keys.job(job.id), _dump(job)),
                                   Put(self.keys.event(job.id, event.seq), _dump(event))]
        expect = {self.keys.job(job.id): 0}
        idem_key = None
        if idempotency_key is not None:
            digest = hashlib.sha256(idempotency_key.encode()).hexdigest()
            idem_key = self.keys.idempotency(digest)
            ops.append(Put(idem_key, json.dumps({"job_id": job.id, "spec": spec_digest(spec)}).encode()))
            expect[idem_key] = 0
        if await self.kv.commit(expect, ops):
            return job, True
        if idem_key is None:  # a 6-character id collided: vanishingly rare, try once more
            return await self.create(spec, None)
        entry = await self.kv.get(idem_key)
        if entry is None:  # the key expired between the txn and this read: retry
            return await self.create(spec, idempotency_key)
        first = json.loads(entry.value)
        if first["spec"] != spec_digest(spec):
            raise Conflict("Idempotency-Key was already used for a different job spec "
                           f"(job {first['job_id']}); use a new key for a new job")
        existing, _ = await self.get_with_revision(first["job_id"])
        return existing, False

    async def get_with_revision(self, job_id: str) -> tuple[JobRecord, int]:
        """The job and its mod_revision (the fencing token of a change); JobNotFound if none."""
        entry = await self.kv.get(self.keys.job(job_id))
        if entry is None:
            raise JobNotFound(job_id)
        return JobRecord.model_validate_json(entry.value), entry.mod_revision

    async def get(self, job_id: str) -> JobRecord:
        """The job as stored now; JobNotFound if none."""
        return (await self.get_with_revision(job_id))[0]

    async def get_many(self, job_ids: list[str]) -> list[JobRecord]:
        """The jobs of `job_ids` that exist, in that order (one read per MAX_TXN_OPS of them)."""
        entries = await self.kv.get_many([self.keys.job(i) for i in job_ids])
        return [JobRecord.model_validate_json(e.value) for e in entries if e is not None]

    async def view(self, job_id: str) -> JobView:
        """The job as users see it: the record and its progress, read at one revision."""
        entry, progress = await self.kv.get_many([self.keys.job(job_id), self.keys.progress(job_id)])
        if entry is None:
            raise JobNotFound(job_id)
        return JobRecord.model_validate_json(entry.value).view(_progress(progress))

    async def views(self, jobs: list[JobRecord]) -> list[JobView]:
        """The views of `jobs`, each with its progress (one read per MAX_TXN_OPS jobs)."""
        progress = await self.kv.get_many([self.keys.progress(j.id) for j in jobs])
        return [job.view(_progress(p)) for job, p in zip(jobs, progress, strict=True)]

    async def list(self) -> list[JobRecord]:
        """Every job, oldest first (a read of all of them: the index knows the unfinished ones)."""
        entries = await self.kv.get_prefix(self.keys.jobs)
        jobs = [JobRecord.model_validate_json(e.value) for e in entries]
        jobs.sort(key=lambda j: (j.created_at, j.id))
        return jobs

    async def events(self, job_id: str) -> list[EventView]:
        """The job's events, oldest first."""
        await self.get(job_id)  # 404 for an unknown job, not an empty list
        entries = await self.kv.get_prefix(self.keys.events(job_id))
        return sorted((EventView.model_validate_json(e.value) for e in entries), key=lambda e: e.seq)

    async def update(self, job_id: str, decide: Decide) -> JobRecord:
        """Apply `decide` to the stored job by compare-and-set, re-deciding on a lost race."""

        def outcome(read: tuple[JobRecord, int]) -> cas.Done[JobRecord] | cas.Write[JobRecord]:
            job, revision = read
            change = decide(job)
            return cas.Done(job) if change is None else self.write(revision, change, change.job)

        return await cas.update(self.kv, lambda: self.get_with_revision(job_id), outcome,
                                f"job {job_id}")

    def write(self, revision: int, change: Change, result: T) -> cas.Write[T]:
        """The write of `change` (record, events, extra ops), fenced on the job's `revision`."""
        job_id = change.job.id
        ops: list[Put | Delete] = [Put(self.keys.job(job_id), _dump(change.job))]
        ops += [Put(self.keys.event(job_id, e.seq), _dump(e)) for e in change.events]
        ops += change.ops
        return cas.Write({self.keys.job(job_id): revision}, ops, result)

    async def move(self, job_id: str, target: JobState, reason: str) -> JobRecord:
        """Transition a job (raises InvalidTransition if the machine forbids it)."""

        def decide(job: JobRecord) -> Change:
            changed, event = transition(job, target, reason, self.clock())
            return Change(changed, [event])

        return await self.update(job_id, decide)


def _progress(entry) -> Progress | None:
    return None if entry is None else Progress.model_validate_json(entry.value)


def _first_event(job: JobRecord, now: float) -> tuple[JobRecord, EventView]:
    event = EventView(seq=1, time=now, state=JobState.PENDING, reason="submitted")
    return job.model_copy(update={"event_seq": 1}), event
