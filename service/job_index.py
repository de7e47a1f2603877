"""A read cache of the jobs, fed by an etcd watch (the Kubernetes API server's pattern).

Node heartbeats ask "which job is mine?" every second; answering that from etcd would
cost a range read of every job per heartbeat. The scheduler asks it which jobs are not
finished (and then reads those from etcd), so finished jobs, which pile up, are not read
on every tick. The index is read once, then kept current
by a watch from the revision of that read; a broken watch, or one whose history was
compacted away (HistoryCompacted), re-reads and re-watches. It is
only used where a slightly stale answer is harmless (assignments are re-sent on the next
heartbeat); every write still goes to etcd as a compare-and-set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from service.errors import HistoryCompacted, StoreUnavailable
from service.keys import Keys
from service.models import JobRecord
from service.store.api import KeyValue

log = logging.getLogger(__name__)


class JobIndex:
    """Which jobs are unfinished, and which job each node works for, kept current by a watch."""

    def __init__(self, kv: KeyValue, keys: Keys):
        self._kv = kv
        self._keys = keys
        self._jobs: dict[str, JobRecord] = {}
        self._by_node: dict[str, str] = {}
        self.ready = asyncio.Event()
        self.changed = asyncio.Condition()
        self._wakes: list[asyncio.Event] = []

    def wake_on_change(self, event: asyncio.Event) -> None:
        """Set `event` whenever the index has applied a change (so whoever waits on it reads
        an index that already has that change)."""
        self._wakes.append(event)

    def active_ids(self) -> list[str]:
        """The jobs not yet finished, oldest first (submission order)."""
        active = [j for j in self._jobs.values() if not j.state.is_terminal()]
        return [j.id for j in sorted(active, key=lambda j: (j.created_at, j.id))]

    def job_of_node(self, node: str) -> JobRecord | None:
        """The active job in which `node` is a live member, if any."""
        job_id = self._by_node.get(node)
        return self._jobs.get(job_id) if job_id else None

    def get(self, job_id: str) -> JobRecord | None:
        """The job as the index last saw it (it may lag etcd by a watch event)."""
        return self._jobs.get(job_id)

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `predicate` holds on the index (checked after every change it applies),
        at most `timeout_s`; returns whether it holds."""
        async with self.changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout_s)
            return predicate()

    def _apply(self, job: JobRecord | None, job_id: str) -> None:
        old = self._jobs.pop(job_id, None)
        if old is not None:
            for n in old.members:
                if self._by_node.get(n) == job_id:
                    del self._by_node[n]
        if job is not None:
            self._jobs[job_id] = job
            if job.state.is_active():
                for n, m in job.members.items():
                    if m.is_live():
                        self._by_node[n] = job_id

    async def _notify(self) -> None:
        """Tell the scheduler and every waiter that the index changed (a re-read after a
        broken or compacted watch included: what it missed may be what they wait for)."""
        for event in self._wakes:
            event.set()
        async with self.changed:
            self.changed.notify_all()

    async def run(self) -> None:
        """Read every job, then follow the watch; re-read after a broken watch. Runs until cancelled."""
        prefix = self._keys.jobs
        while True:
            try:
                revision = await self._kv.revision()
                entries = await self._kv.get_prefix(prefix)
                self._jobs.clear()
                self._by_node.clear()
                for e in entries:
                    self._apply(JobRecord.model_validate_json(e.value), e.key[len(prefix):])
                self.ready.set()
                await self._notify()
                async for ev in self._kv.watch_prefix(prefix, revision + 1):
                    job = None if ev.value is None else JobRecord.model_validate_json(ev.value)
                    self._apply(job, ev.key[len(prefix):])
                    await self._notify()
            except HistoryCompacted as exc:  # not an outage: read again at once
                log.info("job index: %s", exc.message)
                continue
            except StoreUnavailable as exc:
                log.debug("job index: %s", exc.message)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job index watch failed; re-reading")
            self.ready.clear()
            await asyncio.sleep(0.5)
