"""Goodput: where jobs' and nodes' time went, read from what the control plane keeps.

A job's ledger (`service.decide.goodput.ledger`) is a pure function of its record and its
events; `job_goodput` reads both for `GET /v1/jobs/{id}/goodput`. For `/metrics`, the
`GoodputBook` of each replica keeps every job's events (re-read only when the record's
`event_seq` moves) and a finished job's ledger (it never changes again), so a scrape reads
etcd only for jobs that changed since the last one.

Cluster totals must not shrink when retention deletes a finished job: the leader adds each
deleted job's ledger to one small key (`keys.goodput_retired`) in the very transaction that
deletes the job (`retire`), so a job is counted there exactly once, whichever replica leads
and however often the control plane restarts. `ftrain_job_seconds_total` is that key plus
the ledgers of the jobs that still exist.

A node's seconds by state (`node_cause`: busy, idle, draining, drained, quarantined) are
sampled by each replica at every scrape: the time since the last scrape goes to the state the
node had then. Like the other per-replica counters, they start again from 0 when a control
plane restarts (Prometheus's `rate` and `increase` allow for that).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, Field

from service.decide.goodput import CAUSES, Goodput, ledger
from service.jobs import JobStore, Retire
from service.models import EventView, JobRecord, NodeRecord

# A node's state (its record's, by value: QUARANTINED once it exists) -> its cause; any other
# state is `busy` while the node is a live member of an active job, else `idle`.
NODE_CAUSES = {"DRAINING": "draining", "QUARANTINED": "quarantined"}
NODE_STATES = ("busy", "idle", "draining", "drained", "quarantined")


class RetiredGoodput(BaseModel):
    """What `keys.goodput_retired` holds: the ledgers of the jobs retention deleted, added up."""

    jobs: int = 0
    seconds: dict[str, float] = Field(default_factory=dict)

    def plus(self, ledgers: Iterable[Goodput]) -> RetiredGoodput:
        seconds = dict(self.seconds)
        n = self.jobs
        for g in ledgers:
            n += 1
            for cause, s in g.seconds.items():
                seconds[cause] = round(seconds.get(cause, 0.0) + s, 3)
        return RetiredGoodput(jobs=n, seconds=seconds)


def node_cause(node: NodeRecord, job: JobRecord | None) -> str:
    """What a node's time is now: its state's cause, else busy (in a job) or idle."""
    if (cause := NODE_CAUSES.get(node.state.value)) is not None:
        return cause if cause != "draining" or job is not None else "drained"
    return "busy" if job is not None else "idle"


async def events_of(jobs: JobStore, job_id: str) -> list[EventView]:
    """The job's events, oldest first (none for a job that is gone)."""
    events = [EventView.model_validate_json(e.value)
              async for e in jobs.kv.scan_prefix(jobs.keys.events(job_id))]
    return sorted(events, key=lambda e: e.seq)


async def job_goodput(jobs: JobStore, job_id: str) -> Goodput:
    """The job's ledger as of now (JobNotFound for a job that does not exist)."""
    job = await jobs.get(job_id)
    return ledger(job, await events_of(jobs, job_id), jobs.clock())


async def retired(jobs: JobStore) -> tuple[RetiredGoodput, int]:
    """The deleted jobs' totals, and the key's revision (0: none deleted yet)."""
    entry = await jobs.kv.get(jobs.keys.goodput_retired)
    if entry is None:
        return RetiredGoodput(), 0
    return RetiredGoodput.model_validate_json(entry.value), entry.mod_revision


def retire(jobs: JobStore, ledgers: dict[str, Goodput]) -> Retire:
    """For `JobStore.delete_finished`: the write that adds the ledgers of a batch of jobs (of
    `ledgers`, computed before the deletion) to the deleted jobs' totals, with the revision
    it must compare (the deletion's transaction carries both)."""

    async def write(batch: Sequence[JobRecord]) -> tuple[str, int, bytes]:
        totals, revision = await retired(jobs)
        added = totals.plus(ledgers[j.id] for j in batch if j.id in ledgers)
        return jobs.keys.goodput_retired, revision, added.model_dump_json().encode()

    return write


class GoodputBook:
    """One replica's view of every job's ledger and every node's seconds, for `/metrics`."""

    def __init__(self, jobs: JobStore):
        self._jobs = jobs
        self._events: dict[str, tuple[int, list[EventView]]] = {}  # active: (event_seq, events)
        self._done: dict[str, Goodput] = {}  # finished jobs' ledgers, final
        self._records: dict[str, JobRecord] = {}
        self.retired = RetiredGoodput()
        self.node_seconds: dict[tuple[str, str], float] = {}  # (node, cause) -> seconds
        self._nodes: dict[str, str] = {}  # node -> its cause at the last sample
        self._sampled_at: float | None = None

    async def refresh(self, records: Sequence[JobRecord]) -> None:
        """Read what changed since the last refresh: the events of jobs whose `event_seq`
        moved, and the deleted jobs' totals."""
        self.retired = (await retired(self._jobs))[0]
        self._records = {j.id: j for j in records}
        for gone in set(self._events) - self._records.keys():
            del self._events[gone]
        for gone in set(self._done) - self._records.keys():
            del self._done[gone]
        now = self._jobs.clock()
        for job in records:
            if job.id in self._done:
                continue
            seen = self._events.get(job.id)
            events = seen[1] if seen is not None and seen[0] == job.event_seq \
                else await events_of(self._jobs, job.id)
            if job.state.is_terminal():  # final: its events are not needed again
                self._done[job.id] = ledger(job, events, now)
                self._events.pop(job.id, None)
            else:
                self._events[job.id] = (job.event_seq, events)

    def totals(self, now: float) -> dict[str, float]:
        """Every cause's seconds: the deleted jobs' and the ledgers of those that exist."""
        seconds = dict.fromkeys(CAUSES, 0.0) | self.retired.seconds
        ledgers = list(self._done.values()) + [ledger(self._records[i], events, now)
                                               for i, (_, events) in self._events.items()]
        for g in ledgers:
            for cause, s in g.seconds.items():
                seconds[cause] = seconds.get(cause, 0.0) + s
        return seconds

    def jobs(self) -> int:
        """The jobs the totals count: those that exist and those retention deleted."""
        return len(self._done) + len(self._events) + self.retired.jobs

    def sample_nodes(self, causes: dict[str, str], now: float) -> None:
        """Note each node's cause now (`node_cause`); the time since the last sample goes to
        the cause each node had then."""
        if self._sampled_at is not None:
            elapsed = max(0.0, now - self._sampled_at)
            for node, cause in self._nodes.items():
                key = (node, cause)
                self.node_seconds[key] = self.node_seconds.get(key, 0.0) + elapsed
        # A node gone is dropped (names come and go); one new shows its state at once, at 0 s.
        self.node_seconds = {k: s for k, s in self.node_seconds.items() if k[0] in causes}
        for node in causes:
            self.node_seconds.setdefault((node, causes[node]), 0.0)
        self._nodes, self._sampled_at = dict(causes), now
