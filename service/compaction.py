"""The leader compacts etcd's history, whatever etcd's own settings.

etcd keeps every revision of every key until it is compacted; a control plane that runs
for months on an etcd without `--auto-compaction-*` would fill its quota with history.
Every `interval_s` the leading control plane compacts to the revision it saw one interval
earlier, so a watch at most one interval behind still finds its history (and one further
behind gets HistoryCompacted, re-reads and watches again). A replica that is not the
leader, or has just become it, only observes: the first compaction comes one interval
after it took the lead (a new lead, a new fence, starts over).

Fenced like the scheduler's writes: etcd's compaction is not an operation a transaction
can hold, so each one follows a transaction that compares the leader's key
(`Leadership.fence`) and writes the revision about to be compacted to
(`Keys.compacted`); a replica that lost the lead fails that transaction and compacts
nothing (StaleLeader), and the record says who compacted how far.
"""

from __future__ import annotations

import asyncio
import logging

from service.errors import StaleLeader, StoreUnavailable
from service.scheduler import Leadership
from service.store.api import KeyValue, Put

log = logging.getLogger(__name__)


class Compactor:
    """Compacts to the revision seen one step earlier; `step` once per interval."""

    def __init__(self, kv: KeyValue, record_key: str):
        self.kv = kv
        self.record_key = record_key  # where the leader notes how far it compacted
        self.seen: int | None = None  # the revision at the previous step, under `lead`
        self.lead: dict[str, int] | None = None  # the fence of that step

    async def step(self, fence: dict[str, int] | None) -> int | None:
        """Compact to the revision of the previous step (if it was under the same lead) and
        note the current one; returns the revision compacted to, if any. `fence`: this
        replica's `Leadership.fence()` (None: not leading). Raises StaleLeader if the lead
        was lost meanwhile (nothing compacted)."""
        if fence is None or fence != self.lead:
            self.seen, self.lead = None, fence
            if fence is None:
                return None
        target, self.seen = self.seen, await self.kv.revision()
        if target is None:
            return None
        if not await self.kv.commit(fence, [Put(self.record_key, str(target).encode())]):
            self.seen = self.lead = None
            raise StaleLeader("this control plane no longer leads; it compacts nothing")
        await self.kv.compact(target)
        return target


async def run(kv: KeyValue, leadership: Leadership, interval_s: float, record_key: str) -> None:
    """Compact every `interval_s` while this replica leads. Runs until cancelled."""
    compactor = Compactor(kv, record_key)
    while True:
        await asyncio.sleep(interval_s)
        try:
            compacted = await compactor.step(leadership.fence())
        except StaleLeader as exc:
            log.info("compaction: %s", exc.message)
            continue
        except StoreUnavailable as exc:
            compactor.seen = None  # the next step only observes again
            log.warning("compaction skipped: %s", exc.message)
            continue
        if compacted is not None:
            log.debug("compacted etcd's history to revision %d", compacted)
