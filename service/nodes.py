"""Registered nodes in etcd: one record per node, on a key bound to the node's lease.

A node is alive while its lease is: a heartbeat refreshes it, a clean shutdown revokes
it, and a node that goes silent vanishes when it lapses (its key with it), which the
scheduler sees as a lost node. Registering again replaces the record under a fresh
lease and revokes the old one, so a restarted agent is never alive twice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from service.errors import NodeNotFound
from service.keys import Keys
from service.models import NodeRecord, NodeState
from service.store import cas
from service.store.api import Entry, KeyValue, Put, WatchEvent

Clock = Callable[[], float]


class NodeStore:
    """Register, keep alive, list, drain and deregister nodes."""

    def __init__(self, kv: KeyValue, keys: Keys, clock: Clock = time.time):
        self.kv = kv
        self.keys = keys
        self.clock = clock

    async def register(self, name: str, nproc_per_node: int, address: str | None,
                       ttl_s: int) -> int:
        """Store the node's record under a fresh lease of `ttl_s`; returns the lease id."""
        lease = await self.kv.grant_lease(ttl_s)
        key = self.keys.node(name)
        record = NodeRecord(name=name, nproc_per_node=nproc_per_node, address=address,
                            registered_at=self.clock(), lease_id=lease)
        value = record.model_dump_json().encode()
        old = await cas.update(
            self.kv, lambda: self.kv.get(key),
            lambda old: cas.Write({key: old.mod_revision if old else 0}, [Put(key, value, lease)], old),
            f"node {name}")
        if old is not None and old.lease and old.lease != lease:
            await self.kv.revoke_lease(old.lease)
        return lease

    async def heartbeat(self, name: str, lease_id: int | None) -> None:
        """Refresh the node's lease (read from its record when not given); NodeNotFound if gone."""
        if lease_id is None:
            entry, _ = await self._entry(name)
            lease_id = entry.lease
        if not await self.kv.refresh_lease(lease_id):
            raise NodeNotFound(name)

    async def list(self) -> dict[str, NodeRecord]:
        """Every live node, by name."""
        records = [NodeRecord.model_validate_json(e.value)
                   async for e in self.kv.scan_prefix(self.keys.nodes)]
        return {r.name: r for r in records}

    async def changes(self) -> AsyncIterator[WatchEvent]:
        """Every change of a node record from now on (raises StoreUnavailable when the watch
        breaks; ends after the watch's longest session: the caller watches again)."""
        start = await self.kv.revision() + 1
        async for event in self.kv.watch_prefix(self.keys.nodes, start):
            yield event

    async def drain(self, name: str) -> NodeRecord:
        """Mark the node DRAINING (it gets no new work; its job goes on without it)."""

        def decide(read: tuple[Entry, NodeRecord]) -> cas.Done[NodeRecord] | cas.Write[NodeRecord]:
            entry, record = read
            if record.state is NodeState.DRAINING:
                return cas.Done(record)
            record = record.model_copy(update={"state": NodeState.DRAINING})
            return cas.Write({entry.key: entry.mod_revision},
                             [Put(entry.key, record.model_dump_json().encode(), entry.lease)], record)

        return await cas.update(self.kv, lambda: self._entry(name), decide, f"node {name}")

    async def deregister(self, name: str) -> None:
        """Give the node's lease back, so it is gone at once; an unknown node is already gone."""
        try:
            entry, _ = await self._entry(name)
        except NodeNotFound:
            return
        await self.kv.revoke_lease(entry.lease)

    async def _entry(self, name: str) -> tuple[Entry, NodeRecord]:
        entry = await self.kv.get(self.keys.node(name))
        if entry is None:
            raise NodeNotFound(name)
        return entry, NodeRecord.model_validate_json(entry.value)
