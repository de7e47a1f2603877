"""The leader compacts etcd's history, whatever etcd's own settings.

etcd keeps every revision of every key until it is compacted; a control plane that runs
for months on an etcd without `--auto-compaction-*` would fill its quota with history.
Every `interval_s` the leading control plane compacts to the revision it saw one interval
earlier, so a watch at most one interval behind still finds its history (and one further
behind gets HistoryCompacted, re-reads and watches again). A replica that is not the
leader, or has just become it, only observes: the first compaction comes one interval
after it took the lead.
"""

from __future__ import annotations

import asyncio
import logging

from service.errors import StoreUnavailable
from service.scheduler import Leadership
from service.store.api import KeyValue

log = logging.getLogger(__name__)


class Compactor:
    """Compacts to the revision seen one step earlier; `step` once per interval."""

    def __init__(self, kv: KeyValue):
        self.kv = kv
        self.seen: int | None = None  # the revision at the previous step, while leading

    async def step(self, leading: bool) -> int | None:
        """Compact to the revision of the previous step (if it was leading too) and note the
        current one; returns the revision compacted to, if any."""
        if not leading:
            self.seen = None
            return None
        target, self.seen = self.seen, await self.kv.revision()
        if target is None:
            return None
        await self.kv.compact(target)
        return target


async def run(kv: KeyValue, leadership: Leadership, interval_s: float) -> None:
    """Compact every `interval_s` while this replica leads. Runs until cancelled."""
    compactor = Compactor(kv)
    while True:
        await asyncio.sleep(interval_s)
        try:
            compacted = await compactor.step(leadership.leading)
        except StoreUnavailable as exc:
            compactor.seen = None  # the next step only observes again
            log.warning("compaction skipped: %s", exc.message)
            continue
        if compacted is not None:
            log.debug("compacted etcd's history to revision %d", compacted)
