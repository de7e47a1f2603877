"""Jobs in etcd: create (idempotently), read, list, and change by compare-and-set.

Every change goes through `JobStore.update(job_id, decide)`: read the record and its
mod_revision, let the pure `decide` function return the new record and the events it
causes, and commit both in one transaction that only applies if the record is still at
the revision read (`service.store.cas.update`). On a lost race the record is re-read and
`decide` runs again, so a decision is always made on what is stored now, never on a
stale copy.

Reads of many jobs are paged (`JOB_PAGE_SIZE` records a request): the API lists jobs in
the order the watch-fed `JobIndex` keeps and reads the records of one page fresh
(`page`); `scan` pages through every record in key order. Finished jobs are deleted,
with everything kept for them, by `delete_finished` (the retention loop, on the leader).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
import string
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from service.batching import TxnRoom, pack
from service.decide.change import Change
from service.decide.members import drops_copies, note_former_members
from service.decide.metrics import merged
from service.decide.state import transition
from service.errors import Conflict, JobNotFound, StaleLeader
from service.group_commit import GroupCommit
from service.keyring import new_nonce
from service.keys import Keys
from service.models import ADMIN, EventView, JobRecord, JobSpec, JobState, JobView, MetricHistory
from service.store import cas
from service.store.api import MAX_TXN_OPS, PAGE_SIZE, Delete, Entry, Fence, KeyValue, Put
from worker.protocol import Progress

# Job records per read. A record is its spec (at most MAX_SPEC_BYTES, checked at submit)
# and a few KiB of state: 16 of them stay near 1 MiB, a quarter of gRPC's 4 MiB reply cap.
JOB_PAGE_SIZE = 16
# Events a job keeps in etcd: its first (the submission) and the latest others (`event_ops`).
MAX_EVENTS = 1000

_ID_ALPHABET = string.ascii_lowercase + string.digits
_JOB_ID = re.compile(r"^[a-z0-9-]{1,40}-[a-z0-9]{6}$")

Clock = Callable[[], float]
T = TypeVar("T")


# decide(job) -> Change, or None for "nothing to write"
Decide = Callable[[JobRecord], Change | None]
# What a deletion of finished jobs writes with them (`delete_finished`): (key, revision, value).
Retire = Callable[[Sequence[JobRecord]], Awaitable[tuple[str, int, bytes]]]


def new_job_id(name: str) -> str:
    return f"{name}-{''.join(secrets.choice(_ID_ALPHABET) for _ in range(6))}"


def looks_like_job_id(text: str) -> bool:
    """Whether `text` has the shape `new_job_id` gives (a folder name that may be a job's)."""
    return _JOB_ID.match(text) is not None


def spec_digest(spec: JobSpec, fingerprint: str = "") -> str:
    """What tells two submits apart: the spec without its secret values (an unkeyed hash of
    those would let a reader of etcd test guesses), and their keyed `fingerprint`."""
    return hashlib.sha256((spec.without_secrets().model_dump_json() + fingerprint).encode()).hexdigest()


def _dump(model) -> bytes:
    return model.model_dump_json().encode()


class JobStore:
    """Job records and their events in etcd; every change a compare-and-set."""

    def __init__(self, kv: KeyValue, keys: Keys, clock: Clock = time.time):
        self.kv = kv
        self.keys = keys
        self.clock = clock
        # Told of every job record (and progress) this control plane writes, as written, with
        # its revision (and the record written, when it is a job's, so that it is not parsed
        # again): the job index shows a replica's own writes at once (service.job_index).
        self.written: Callable[..., None] | None = None  # (entry[, record])
        self.creates = GroupCommit(kv)  # submissions, several to a transaction under a burst

    async def create(self, spec: JobSpec, idempotency_key: str | None = None, *, owner: str = ADMIN,
                     owner_id: str | None = None, nonce: str | None = None,
                     fingerprint: str = "") -> tuple[JobRecord, bool]:
        """Store a new PENDING job of `owner` (user id `owner_id`); returns (job, created). A
        repeated key returns the first job. (`create_at` also returns the record's revision.)"""
        job, created, _ = await self.create_at(spec, idempotency_key, owner=owner, owner_id=owner_id,
                                               nonce=nonce, fingerprint=fingerprint)
        return job, created

    async def create_at(self, spec: JobSpec, idempotency_key: str | None = None, *,
                        owner: str = ADMIN, owner_id: str | None = None, nonce: str | None = None,
                        fingerprint: str = "") -> tuple[JobRecord, bool, int]:
        """Like `create`, with the etcd revision of the job record returned (the revision
        the write made, or the first job's for a repeated key): a read that waits for it
        sees the job (read-your-writes, `service.job_index`).

        The record keeps the spec without its secret env values (their names only);
        `nonce` (random if None) names where the caller keeps the values, and `fingerprint`
        is their keyed digest (service.keyring): a retry with other values is a conflict.
        Submissions that come together share transactions (`service.group_commit`).
        """
        now = self.clock()
        job = JobRecord(id=new_job_id(spec.name), spec=spec.without_secrets(), owner=owner,
                        owner_id=owner_id, created_at=now, updated_at=now, token_nonce=nonce or new_nonce(),
                        secret_env_names=sorted(spec.secret_env))
        job, event = _first_event(job, now)
        ops: list[Put | Delete] = [Put(self.keys.job(job.id), _dump(job)),
                                   *event_ops(self.keys, job.id, [event])]
        expect = {self.keys.job(job.id): 0}
        idem_key = None
        if idempotency_key is not None:
            # Keys are the submitter's own: another user's key is another key, a user added
            # again under a removed one's name included (its id differs). (The admin's are
            # unscoped, as every key was before there were users.)
            scoped = idempotency_key if owner == ADMIN else f"{owner_id or owner}\0{idempotency_key}"
            digest = hashlib.sha256(scoped.encode()).hexdigest()
            idem_key = self.keys.idempotency(digest)
            # The record names its key, so that the key is deleted with the job (retention).
            job = job.model_copy(update={"idempotency_digest": digest})
            ops[0] = Put(self.keys.job(job.id), _dump(job))
            ops.append(Put(idem_key, json.dumps(
                {"job_id": job.id, "spec": spec_digest(spec, fingerprint)}).encode()))
            expect[idem_key] = 0
        written, entry = await self.creates.commit_read(expect, ops, self.keys.job(job.id))
        if written and entry is not None:
            if self.written is not None:
                self.written(entry, job)
            return job, True, entry.mod_revision
        again = {"owner": owner, "owner_id": owner_id, "nonce": job.token_nonce,
                 "fingerprint": fingerprint}
        if idem_key is None:  # a 6-character id collided: vanishingly rare, try once more
            return await self.create_at(spec, None, **again)
        entry = await self.kv.get(idem_key)
        if entry is None:  # the key expired between the txn and this read: retry
            return await self.create_at(spec, idempotency_key, **again)
        first = json.loads(entry.value)
        if first["spec"] != spec_digest(spec, fingerprint):
            raise Conflict("Idempotency-Key was already used for a different job spec "
                           f"(job {first['job_id']}); use a new key for a new job")
        try:
            existing, revision = await self.get_with_revision(first["job_id"])
        except JobNotFound:  # deleted (with its key) since: the key is free again
            return await self.create_at(spec, idempotency_key, **again)
        return existing, False, revision

    async def get_with_revision(self, job_id: str) -> tuple[JobRecord, int]:
        """The job and its mod_revision (the fencing token of a change); JobNotFound if none."""
        entry = await self.kv.get(self.keys.job(job_id))
        if entry is None:
            raise JobNotFound(job_id)
        return JobRecord.model_validate_json(entry.value), entry.mod_revision

    async def get(self, job_id: str) -> JobRecord:
        """The job as stored now; JobNotFound if none."""
        return (await self.get_with_revision(job_id))[0]

    async def get_many(self, job_ids: Sequence[str]) -> list[JobRecord]:
        """The jobs of `job_ids` that exist, in that order (JOB_PAGE_SIZE records a read)."""
        return [job for job, _ in await self.get_many_with_revisions(job_ids)]

    async def get_many_with_revisions(self, job_ids: Sequence[str]) -> list[tuple[JobRecord, int]]:
        """Like `get_many`, with each record's mod_revision (to fence a change of it)."""
        entries = await self.kv.get_many([self.keys.job(i) for i in job_ids], page_size=JOB_PAGE_SIZE)
        return [(JobRecord.model_validate_json(e.value), e.mod_revision) for e in entries if e is not None]

    async def scan(self) -> AsyncIterator[JobRecord]:
        """Every job, in key (id) order, JOB_PAGE_SIZE records a read."""
        async for entry in self.kv.scan_prefix(self.keys.jobs, page_size=JOB_PAGE_SIZE):
            yield JobRecord.model_validate_json(entry.value)

    async def page(self, job_ids: Iterable[str], states: Sequence[JobState] | None,
                   limit: int) -> tuple[list[JobRecord], bool]:
        """The first `limit` jobs of `job_ids` (in that order) that exist and are in `states`
        (any state if none), read fresh; and whether another such job follows.

        `job_ids` may be long (a listing's order of every job): it is consumed a page at a
        time and only as far as needed.
        """
        ids = iter(job_ids)
        out: list[JobRecord] = []
        while chunk := list(itertools.islice(ids, JOB_PAGE_SIZE)):
            for job in await self.get_many(chunk):
                if states and job.state not in states:
                    continue
                if len(out) == limit:
                    return out, True
                out.append(job)
        return out, False

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

    async def progress(self, jobs: list[JobRecord]) -> list[Progress | None]:
        """The progress of each of `jobs`, from its own key (one read per MAX_TXN_OPS jobs)."""
        return [_progress(p) for p in await self.kv.get_many([self.keys.progress(j.id) for j in jobs])]

    async def metrics(self, job_id: str) -> MetricHistory:
        """The job's metric history (empty until its first progress report)."""
        entry, body, tail = await self.kv.get_many(
            [self.keys.job(job_id), self.keys.metrics_body(job_id), self.keys.metrics_tail(job_id)])
        if entry is None:
            raise JobNotFound(job_id)
        return merged(*(None if e is None else MetricHistory.model_validate_json(e.value)
                        for e in (body, tail)))

    async def events(self, job_id: str) -> list[EventView]:
        """The job's events, oldest first."""
        await self.get(job_id)  # 404 for an unknown job, not an empty list
        events = [EventView.model_validate_json(e.value)
                  async for e in self.kv.scan_prefix(self.keys.events(job_id))]
        return sorted(events, key=lambda e: e.seq)

    def deletion(self, job: JobRecord) -> list[Delete]:
        """What to delete with a job in etcd: its record, events, progress, metrics, snapshot records
        (both tiers) and idempotency key. (Its rendezvous keys and logs go first, on their own.)"""
        ops = [Delete(self.keys.job(job.id)), Delete(self.keys.events(job.id), prefix=True),
               Delete(self.keys.progress(job.id)), Delete(self.keys.metrics(job.id), prefix=True),
               Delete(self.keys.snapshots(job.id), prefix=True),
               Delete(self.keys.memory_copies(job.id), prefix=True)]
        if job.idempotency_digest is not None:
            ops.append(Delete(self.keys.idempotency(job.idempotency_digest)))
        return ops

    async def delete_finished(self, jobs: Sequence[tuple[JobRecord, int]],
                              fence: dict[str, int], retire: Retire | None = None) -> list[str]:
        """Delete finished jobs, each as read at its mod_revision, in transactions of at most
        MAX_TXN_OPS operations that also compare `fence` (the leader's key: only the leader
        deletes). Returns the ids deleted; a job changed since it was read is left for the
        next pass, and a lost fence stops the deletion (StaleLeader). `retire(batch)`: a key
        to write in each transaction, with the revision it must still have, and its value
        (the deleted jobs' goodput totals: service.goodput)."""

        def parts() -> Iterator[_JobDeletion]:
            for job, revision in jobs:
                if not job.state.is_terminal():
                    raise ValueError(f"job {job.id} is {job.state.value}: only finished jobs are deleted")
                yield _JobDeletion(job, revision, {self.keys.job(job.id): revision}, self.deletion(job))

        deleted: list[str] = []
        extra = 0 if retire is None else 1
        for batch in pack(parts(), lambda: TxnRoom(shared=len(fence) + extra, reads=extra)):
            deleted.extend(await self._delete_batch([(d.job, d.revision) for d in batch], fence, retire))
        return deleted

    async def delete_orphaned_keys(self, fence: dict[str, int]) -> int:
        """Delete idempotency keys whose job is gone; returns how many.

        A job record names its key and retention deletes both together; this is for keys
        of jobs deleted before records named them. Paged; each deletion compares the key,
        the job's absence and `fence`.
        """
        prefix = self.keys.idempotency("")
        deleted = 0
        batch: list[tuple[str, int, str]] = []  # (key, its mod_revision, job id)

        async def flush() -> None:
            nonlocal deleted, batch
            exists = await self.kv.get_many([self.keys.job(job_id) for _, _, job_id in batch],
                                            page_size=JOB_PAGE_SIZE)
            orphans = [(k, rev, job_id) for (k, rev, job_id), job in zip(batch, exists, strict=True)
                       if job is None]
            step = (MAX_TXN_OPS - len(fence)) // 2
            for i in range(0, len(orphans), step):
                chunk = orphans[i:i + step]
                expect = {**fence, **{k: rev for k, rev, _ in chunk},
                          **{self.keys.job(job_id): 0 for _, _, job_id in chunk}}
                if not await self.kv.commit(expect, [Delete(k) for k, _, _ in chunk]):
                    raise StaleLeader("the idempotency keys changed under the sweep, or this "
                                      "control plane no longer leads; the next pass sweeps again")
                deleted += len(chunk)
            batch = []

        async for entry in self.kv.scan_prefix(prefix):
            batch.append((entry.key, entry.mod_revision, json.loads(entry.value)["job_id"]))
            if len(batch) == PAGE_SIZE:
                await flush()
        if batch:
            await flush()
        return deleted

    async def _delete_batch(self, batch: list[tuple[JobRecord, int]],
                            fence: dict[str, int], retire: Retire | None = None) -> list[str]:
        expect = {**fence, **{self.keys.job(job.id): revision for job, revision in batch}}
        ops: list[Put | Delete] = [op for job, _ in batch for op in self.deletion(job)]
        if retire is not None:
            key, revision, value = await retire([job for job, _ in batch])
            expect[key] = revision
            ops.append(Put(key, value))
        if await self.kv.commit(expect, ops):
            return [job.id for job, _ in batch]
        # Lost: the fence moved (another leader), or a job changed or went since it was read.
        now = await self.kv.get_many(list(fence))
        if any((e.mod_revision if e else 0) != fence[k] for k, e in zip(fence, now, strict=True)):
            raise StaleLeader("this control plane no longer leads; the deletion of finished "
                              "jobs is left to the leader")
        current = {job.id: revision for job, revision in await self.get_many_with_revisions(
            [job.id for job, _ in batch])}
        still = [(job, revision) for job, revision in batch if current.get(job.id) == revision]
        if len(still) == len(batch):  # nothing changed: cannot lose again for the same reason
            return []
        return await self._delete_batch(still, fence, retire) if still else []

    async def update(self, job_id: str, decide: Decide, fence: dict[str, int] | None = None) -> JobRecord:
        """Apply `decide` to the stored job by compare-and-set, re-deciding on a lost race.

        With `fence` (the leader's key at its revision: `Leadership.fence`), the write also
        compares it, so a replica that lost the lead writes nothing (StaleLeader)."""
        return (await self.update_at(job_id, decide, fence))[0]

    async def update_at(self, job_id: str, decide: Decide,
                        fence: dict[str, int] | None = None) -> tuple[JobRecord, int]:
        """Like `update`, with the job record's revision (the write's, or the one read when
        there was nothing to write): a read that waits for it sees the change."""
        revision_of: dict[str, int] = {}
        record: dict[str, JobRecord] = {}  # the record of the last write tried

        async def read() -> tuple[JobRecord, int]:
            if isinstance(fence, Fence) and fence.lapsed():
                raise StaleLeader("this control plane's lead lapsed; its scheduler stops")
            for key, revision in (fence or {}).items():
                entry = await self.kv.get(key)
                if entry is None or entry.mod_revision != revision:
                    raise StaleLeader("this control plane no longer leads; its scheduler stops")
            job, revision_of["read"] = await self.get_with_revision(job_id)
            return job, revision_of["read"]

        def outcome(read: tuple[JobRecord, int]) -> cas.Done[JobRecord] | cas.Write[JobRecord]:
            job, revision = read
            change = decide(job)
            if change is None:
                return cas.Done(job)
            change = self.retire(job, change)  # whichever decision dropped them
            if isinstance(fence, Fence):  # a leader-only loop's: its events name the lead
                stamp = {"leader": fence.holder, "term": fence.term}
                change = replace(change, events=[e.model_copy(update=stamp) for e in change.events])
            write = self.write(revision, change, change.job)
            record["written"] = change.job
            return cas.Write({**write.expect, **(fence or {})}, write.ops, write.result)

        def written(entry: Entry) -> None:
            revision_of["written"] = entry.mod_revision
            if self.written is not None:
                self.written(entry, record.get("written"))

        job = await cas.update(self.kv, read, outcome, f"job {job_id}", written)
        return job, revision_of.get("written", revision_of["read"])

    async def write_many(self, changes: Sequence[tuple[JobRecord, int, Change]],
                         fence: dict[str, int] | None = None) -> list[JobRecord | None]:
        """Write the changes of several jobs, each decided on the record given at the
        revision given (e.g. the job index's), in transactions of as many jobs as fit
        (`service.batching.TxnRoom`: MAX_TXN_OPS operations, MAX_BATCH_BYTES), each comparing
        every job's revision and `fence`: a scheduler pass that starts a thousand jobs makes a
        few dozen round trips, not three thousand (`update`: the leader's key, the record, the
        write, per job).

        Returns the record written for each change, or None where its transaction lost (a
        job of it changed since that revision): nothing of that transaction was written,
        and the caller decides on those jobs again (`update`). StaleLeader if `fence` moved
        or lapsed."""
        out: list[JobRecord | None] = [None] * len(changes)

        def parts() -> Iterator[_JobWrite]:
            for place, (job, revision, change) in enumerate(changes):
                if isinstance(fence, Fence) and fence.lapsed():
                    raise StaleLeader("this control plane's lead lapsed; its scheduler stops")
                retired = self.retire(job, change)
                record, events = retired.job, retired.events
                if isinstance(fence, Fence):  # a leader-only loop's: its events name the lead
                    stamp = {"leader": fence.holder, "term": fence.term}
                    events = [e.model_copy(update=stamp) for e in events]
                ops = self.write(revision, Change(record, events, retired.ops), None).ops
                yield _JobWrite(place, record, {self.keys.job(record.id): revision}, ops)

        # Sent one after the other as the pass's plans are made (`pack` is lazy): a lead that
        # lapses stops the writes that are left.
        for batch in pack(parts(), lambda: TxnRoom(shared=len(fence or {}))):
            await self._write_batch(batch, fence, out)
        return out

    async def _write_batch(self, batch: list[_JobWrite], fence: dict[str, int] | None,
                           out: list[JobRecord | None]) -> None:
        expect = {**{k: v for part in batch for k, v in part.expect.items()}, **(fence or {})}
        first = self.keys.job(batch[0].record.id)
        ok, entry = await self.kv.commit_read(expect, [op for part in batch for op in part.ops], first)
        if not ok:
            now = await self.kv.get_many(list(fence or {}))
            if any((e.mod_revision if e else 0) != fence[k] for k, e in zip(fence or {}, now, strict=True)):
                raise StaleLeader("this control plane no longer leads; its scheduler stops")
            return  # a job changed since it was read: the caller decides on each again
        for part in batch:
            out[part.place] = part.record
            if self.written is not None and entry is not None:
                # Every key of one transaction has its revision. (The index reads the key,
                # the value and that revision; the creation revision is not known here.)
                put = part.ops[0]
                self.written(Entry(put.key, put.value, entry.mod_revision, 0, 0), part.record)

    def retire(self, before: JobRecord, change: Change) -> Change:
        """`change` of the job `before`, with what the nodes that leave its members leave
        behind: their names among its former members; and the deletion of the members' memory
        reports where the change makes them useless (`decide.members.drops_copies`)."""
        record = note_former_members(before, change.job)
        if drops_copies(before, record):
            return Change(record, change.events, [*change.ops, Delete(self.keys.memory_copies(record.id),
                                                                      prefix=True)])
        return Change(record, change.events, change.ops)

    def write(self, revision: int, change: Change, result: T) -> cas.Write[T]:
        """The write of `change` (record, events, extra ops), fenced on the job's `revision`."""
        job_id = change.job.id
        ops: list[Put | Delete] = [Put(self.keys.job(job_id), _dump(change.job))]
        ops += event_ops(self.keys, job_id, change.events)
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


def event_ops(keys: Keys, job_id: str, events: Sequence[EventView]) -> list[Put | Delete]:
    """The writes of a job's new `events`, and the deletion of the events they push past the
    MAX_EVENTS a job keeps: its first (the submission: when, by whom) and the latest others.
    A job that runs for months and restarts every hour keeps a bounded history in etcd."""
    ops: list[Put | Delete] = []
    for e in events:
        ops.append(Put(keys.event(job_id, e.seq), _dump(e)))
        if (old := e.seq - (MAX_EVENTS - 1)) > 1:
            ops.append(Delete(keys.event(job_id, old)))
    return ops


def _first_event(job: JobRecord, now: float) -> tuple[JobRecord, EventView]:
    event = EventView(seq=1, time=now, state=JobState.PENDING, reason="submitted",
                      by=job.owner)
    return job.model_copy(update={"event_seq": 1}), event


@dataclass(slots=True)
class _JobWrite:
    """One job's change in a transaction of `write_many` (a `service.batching.TxnPart`)."""

    place: int  # in the changes given
    record: JobRecord
    expect: dict[str, int]
    ops: list[Put | Delete]


@dataclass(slots=True)
class _JobDeletion:
    """One finished job's deletion in a transaction of `delete_finished` (a `TxnPart`)."""

    job: JobRecord
    revision: int
    expect: dict[str, int]
    ops: list[Delete]
