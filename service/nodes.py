"""Registered nodes in etcd: one record per node, on a key bound to the node's lease.

A node is alive while its lease is: a heartbeat refreshes it, a clean shutdown revokes
it, and a node that goes silent vanishes when it lapses (its key with it), which the
scheduler sees as a lost node. A name is one node's while its lease lives: registering
under it again is refused (`NodeNameTaken`) unless the old lease has lapsed, an admin
drained the node, or the registration presents the live record's own credential (the same
node's agent, restarted: its credential file survived it); then the record is replaced under
a fresh lease and the old one revoked, which also ends the old credential.

A drain is stored twice: on the record (what the scheduler reads) and under the node's name
with no lease (`Keys.drain`), so it outlives the record: a node that registers again (after
its agent restarted, or after an etcd pause in which its lease lapsed) comes back DRAINING,
until an undrain deletes the name's drain, or the leader's retention loop sweeps the drain
of a node absent for `FTRAIN_DRAIN_KEEP_S` (`sweep_drains`, `service.decide.drains`).

A quarantine is a drain with a reason (`quarantine` in the stored drain): a node whose health
check failed, or whose workers' failures followed it across jobs (`service.decide.attribution`).
It is QUARANTINED on its record and again at every registration, until an admin's undrain. A
check that passes later does not clear it: a sick node that passes now and then (a flaky link,
a GPU that throws errors under load) is exactly what quarantine is for, so a person decides.

Each registration comes with a new node credential; the record keeps only its sha256, and
the credential is good while the lease it was registered under lives. A heartbeat checks
it against a small per-process map (name -> digest, lease) instead of reading the record:
while that lease is alive the record under it is the one that was read (a record changes
lease only through a new registration, which revokes the old one), and the heartbeat's
keep-alive is what says whether it is. The keep-alives themselves are batched and kept off
the request path by a `LeaseKeeper` (`service.heartbeats`).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

from service.decide import attribution
from service.decide import drains as decide_drains
from service.decide.drains import StoredDrain
from service.errors import NodeNameTaken, NodeNotFound, OutdatedCredential, StoreUnavailable
from service.heartbeats import LeaseKeeper
from service.keys import Keys
from service.models import NodeRecord, NodeState
from service.store import cas
from service.store.api import Delete, Entry, KeyValue, Put, WatchEvent

Clock = Callable[[], float]
log = logging.getLogger(__name__)
# How long the reason a node went is kept for the scheduler's event (`note_departure`): far
# longer than a scheduler pass, and gone by itself after.
DEPARTURE_KEEP_S = 60
STOPPED = "its agent stopped"
CONNECTION_CLOSED = "its agent's connection closed"


async def note_departure(kv: KeyValue, keys: Keys, name: str, lease: int, why: str) -> None:
    """Keep why node `name` (registered under `lease`) is about to go, for the job's event;
    best effort: without it the event says that its lease lapsed."""
    try:
        own = await kv.grant_lease(DEPARTURE_KEEP_S)
        await kv.put(keys.departure(name), json.dumps({"lease": lease, "why": why}).encode(), own)
    except StoreUnavailable as exc:
        log.info("could not note why node %s goes (%s)", name, exc)


async def departures(kv: KeyValue, keys: Keys, names: list[str]) -> dict[str, str]:
    """Why each of these nodes went, where a departure was noted (`note_departure`)."""
    entries = await kv.get_many([keys.departure(n) for n in names])
    return {n: json.loads(e.value)["why"] for n, e in zip(names, entries, strict=True) if e is not None}
MAX_VERIFIED = 100_000  # names in the heartbeat map; past it the map starts again (reads refill it)
# Node changes whose names the view remembers (`NodeStore.changed_since`): a scheduler pass
# after a few of them re-plans only the jobs on those nodes, not every running job.
CHANGES_KEPT = 10_000


class NodeStore:
    """Register, keep alive, list, drain and deregister nodes."""

    def __init__(self, kv: KeyValue, keys: Keys, clock: Clock = time.time, *, ttl_s: float):
        """`ttl_s`: the node lease TTL this control plane grants (every replica the same:
        `Settings.node_ttl_s`, its one default; agents learn it when they register)."""
        self.ttl_s = ttl_s
        self.kv = kv
        self.keys = keys
        self.clock = clock
        self.leases = LeaseKeeper(kv, ttl_s, clock)
        self._live: dict[str, NodeRecord] | None = None  # the watch-fed view (`follow`), once loaded
        # Which state of that view `live` gave last: a new number for every change (None
        # while there is no view), so a scheduler pass knows the nodes did not change.
        self.version: int | None = None
        self._changes = 0
        # (count, name) of the view's last changes, and the count of its last load: which
        # nodes changed between two versions (`changed_since`)
        self._changed: collections.deque[tuple[int, str]] = collections.deque(maxlen=CHANGES_KEPT)
        self._loaded_at = 0
        self._verified: dict[str, tuple[str, int]] = {}  # name -> (credential digest, lease)

    async def register(self, name: str, nproc_per_node: int, address: str | None,
                       ttl_s: int, credential_sha256: str | None = None,
                       reclaim_sha256: str | None = None, gpus: int = 0,
                       gpu_model: str | None = None, quarantine: str | None = None) -> int:
        """Store the node's record under a fresh lease of `ttl_s`; returns the lease id.

        `reclaim_sha256`: the digest of the credential the registering agent presents as its
        previous one; if it is the live record's, the name is this node's to take back.

        `quarantine`: why the node is sick (its health check failed): it registers QUARANTINED.

        Raises:
            NodeNameTaken: a node of this name is alive, not drained, and not reclaimed.
        """
        granted_at = self.clock()
        if quarantine is not None:
            await self._keep_quarantine(name, quarantine)
        stored = await self.kv.get(self.keys.drain(name))
        drained = stored is not None
        why = _quarantine_of(stored)
        lease = await self.kv.grant_lease(ttl_s)
        key = self.keys.node(name)
        record = NodeRecord(name=name, nproc_per_node=nproc_per_node, gpus=gpus, gpu_model=gpu_model,
                            address=address,
                            registered_at=self.clock(), lease_id=lease,
                            credential_sha256=credential_sha256, reason=why,
                            state=(NodeState.QUARANTINED if why is not None
                                   else NodeState.DRAINING if drained else NodeState.READY))
        value = record.model_dump_json().encode()

        def decide(old: Entry | None) -> cas.Write[Entry | None]:
            if old is not None:  # its key lives with its lease: this node is alive
                current = NodeRecord.model_validate_json(old.value)
                if not current.state.takes_no_work() and not _same_node(current, reclaim_sha256):
                    raise NodeNameTaken(name, current.registered_at, ttl_s)
            return cas.Write({key: old.mod_revision if old else 0}, [Put(key, value, lease)], old)

        try:
            old = await cas.update(self.kv, lambda: self.kv.get(key), decide, f"node {name}")
        except BaseException:
            await self.kv.revoke_lease(lease)
            raise
        self.leases.granted(lease, granted_at)
        if old is not None and old.lease and old.lease != lease:
            await self.kv.revoke_lease(old.lease)
            self.leases.ended(old.lease)
        self._remember(name, credential_sha256, lease)
        return lease

    async def heartbeat(self, name: str, lease_id: int | None) -> None:
        """Refresh the node's lease (read from its record when not given); NodeNotFound if gone."""
        if lease_id is None:
            entry, _ = await self._entry(name)
            lease_id = entry.lease
        if not await self.leases.beat(lease_id):
            raise NodeNotFound(name)

    async def heartbeat_with(self, name: str, credential_sha256: str) -> None:
        """Refresh the lease of the node this credential was issued to.

        Raises:
            NodeNotFound: no node of this name is alive (the agent registers again).
            OutdatedCredential: the name is alive under another credential.
        """
        known = self._verified.get(name)
        if known is None or not secrets.compare_digest(known[0], credential_sha256):
            record = await self.verify(name, credential_sha256)
            known = (credential_sha256, record.lease_id)
        if not await self.leases.beat(known[1]):
            self._verified.pop(name, None)
            raise NodeNotFound(name)

    async def lease_of(self, name: str, credential_sha256: str | None) -> int:
        """The lease of live node `name` (checked against its credential's digest, if given).

        Raises:
            NodeNotFound: no node of this name is alive.
            OutdatedCredential: the name is alive under another credential.
        """
        known = self._verified.get(name)
        if credential_sha256 is not None and known is not None and \
                secrets.compare_digest(known[0], credential_sha256):
            return known[1]
        if credential_sha256 is not None:
            return (await self.verify(name, credential_sha256)).lease_id
        entry, _ = await self._entry(name)
        return entry.lease

    async def verify(self, name: str, credential_sha256: str) -> NodeRecord:
        """The live record of node `name`, if this is its credential's digest (one read).

        Raises:
            NodeNotFound: no node of this name is alive.
            OutdatedCredential: the name is alive under another credential.
        """
        _, record = await self._entry(name)
        if record.credential_sha256 is None or not secrets.compare_digest(
                record.credential_sha256, credential_sha256):
            raise OutdatedCredential(name)
        self._remember(name, record.credential_sha256, record.lease_id)
        return record

    def _remember(self, name: str, digest: str | None, lease: int) -> None:
        if digest is None:
            return
        if len(self._verified) >= MAX_VERIFIED:
            self._verified.clear()
        self._verified[name] = (digest, lease)

    async def list(self) -> dict[str, NodeRecord]:
        """Every live node, by name."""
        records = [NodeRecord.model_validate_json(e.value)
                   async for e in self.kv.scan_prefix(self.keys.nodes)]
        return {r.name: r for r in records}

    async def live(self) -> dict[str, NodeRecord]:
        """Every live node, by name: from the watch-fed view while `follow` keeps one (a
        scheduler pass then parses no node record: 5,000 nodes cost 40 reads and 5,000 parses
        a pass), else read from etcd."""
        if self._live is not None:
            self.version = self._changes
            return dict(self._live)
        self.version = None
        return await self.list()

    async def current(self) -> dict[str, NodeRecord]:
        """`live`, for a reader (not a scheduler pass): the watch-fed view when there is one,
        else etcd; `version` is left as the last pass set it."""
        return dict(self._live) if self._live is not None else await self.list()

    def changed_since(self, version: int | None) -> set[str] | None:
        """The names of the nodes whose records changed (or went) between the view of
        `version` and the one `live` copied last; None where that is not known (no view,
        a load between them, or more changes than are kept)."""
        if version is None or self.version is None or self._live is None or version < self._loaded_at:
            return None
        if self._changed and self._changed[0][0] > version + 1:
            return None  # (the log does not reach back to it)
        names = set()
        for count, name in reversed(self._changed):
            if count <= version:
                break
            if count <= self.version:
                names.add(name)
        return names

    @property
    def view_changes(self) -> int:
        """How many times the watch-fed view has changed so far (`follow`), whether or not a
        pass has copied it yet (`version` is the count of the copy `live` made last)."""
        return self._changes

    async def follow(self, wake: asyncio.Event) -> None:
        """Keep the view of the live nodes (`live`) from a watch, and set `wake` on every
        change once the view has it; load again after a broken watch. Runs until cancelled."""
        prefix = self.keys.nodes
        while True:
            try:
                revision = await self.kv.revision()
                live = {r.name: r for r in [NodeRecord.model_validate_json(e.value)
                                            async for e in self.kv.scan_prefix(prefix)]}
                self._live = live
                self._changes += 1
                self._loaded_at = self._changes
                wake.set()
                while True:  # from `revision` itself: a change during the load is replayed
                    async for event in self.kv.watch_prefix(prefix, revision):
                        if event.value is None:
                            live.pop(event.key[len(prefix):], None)
                        else:
                            record = NodeRecord.model_validate_json(event.value)
                            live[record.name] = record
                        revision = event.mod_revision
                        self._changes += 1
                        self._changed.append((self._changes, event.key[len(prefix):]))
                        wake.set()
            except asyncio.CancelledError:
                self._live = None
                raise
            except StoreUnavailable:
                pass
            except Exception:  # a broken stream: load and watch again
                log.debug("node watch ended", exc_info=True)
            self._live = None  # until loaded again, passes read etcd
            await asyncio.sleep(1.0)

    async def changes(self) -> AsyncIterator[WatchEvent]:
        """Every change of a node record from now on (raises StoreUnavailable when the watch
        breaks; ends after the watch's longest session: the caller watches again)."""
        start = await self.kv.revision() + 1
        async for event in self.kv.watch_prefix(self.keys.nodes, start):
            yield event

    async def drain(self, name: str) -> NodeRecord:
        """Mark the node DRAINING (it gets no new work; its job goes on without it), and keep
        the drain under its name, so a registration of the node later is DRAINING too."""
        await self._entry(name)  # NodeNotFound: only a registered node is drained
        await self.kv.put(self.keys.drain(name), b'{"drained_at": %.3f}' % self.clock())
        return await self._set_state(name, NodeState.DRAINING)

    async def leave(self, name: str) -> NodeRecord:
        """Mark the node DRAINING on its record alone: an agent that stops (SIGTERM, `ftrain
        up`'s Ctrl-C) lets its jobs stop at a step boundary before it deregisters. Unlike an
        admin's drain nothing is kept under its name: the node comes back READY."""
        return await self._set_state(name, NodeState.DRAINING)

    async def quarantine(self, name: str, reason: str) -> NodeRecord:
        """Mark the node QUARANTINED for `reason` (as a drain: no new work, its job goes on
        without it), kept under its name until an undrain."""
        await self._entry(name)  # NodeNotFound: only a registered node is quarantined
        await self._keep_quarantine(name, reason)
        return await self._set_state(name, NodeState.QUARANTINED, reason)

    async def _keep_quarantine(self, name: str, reason: str) -> None:
        note = {"drained_at": round(self.clock(), 3), "quarantine": reason}
        await self.kv.put(self.keys.drain(name), json.dumps(note).encode())

    async def note_failure(self, name: str, job_id: str, alone: bool) -> str | None:
        """Note that node `name`'s workers of `job_id` failed (`alone`: the job ran on
        elsewhere) and quarantine the node if its failures follow it across jobs; why, if so."""
        own = await self.kv.grant_lease(int(attribution.WINDOW_S))
        note = {"at": round(self.clock(), 3), "alone": alone}
        await self.kv.put(self.keys.failure(name, job_id), json.dumps(note).encode(), own)
        prefix = self.keys.failures(name)
        failures = [attribution.Failure(name, e.key[len(prefix):], **json.loads(e.value))
                    async for e in self.kv.scan_prefix(prefix)]
        why = attribution.blame(failures, name, self.clock())
        if why is not None:
            log.warning("node %s quarantined: %s", name, why)
            await self.quarantine(name, why)
        return why

    async def undrain(self, name: str) -> NodeRecord:
        """Put a drained or quarantined node back in service (READY: it may be given work
        again). The drain, and the failures noted against the node (`note_failure`: the admin
        vouches for it, so one more failure does not quarantine it again at once), are deleted
        even when the node is not registered now (then NodeNotFound)."""
        await self.kv.delete(self.keys.drain(name))
        await self.kv.delete_prefix(self.keys.failures(name))
        return await self._set_state(name, NodeState.READY)

    async def sweep_drains(self, fence: dict[str, int], keep_s: float) -> list[str]:
        """Note, clear or delete the stored drains of absent nodes (`service.decide.drains`);
        returns the names whose drain was deleted. Each write compares the drain, the node's
        record (absent, or present for a clear) and `fence` (the leader's key)."""
        entries = [e async for e in self.kv.scan_prefix(self.keys.drain(""))]
        if not entries:
            return []
        names = [e.key[len(self.keys.drain("")):] for e in entries]
        records = await self.kv.get_many([self.keys.node(n) for n in names])
        live = {n for n, r in zip(names, records, strict=True) if r is not None}
        stored = {}
        for name, entry in zip(names, entries, strict=True):
            try:
                note = json.loads(entry.value)
            except ValueError:
                note = {}
            stored[name] = (entry, note)
        drains = [StoredDrain(n, float(note.get("drained_at") or 0), note.get("absent_since"))
                  for n, (_, note) in stored.items()]
        deleted = []
        for action in decide_drains.sweep(drains, live, self.clock(), keep_s):
            entry, note = stored[action.name]
            node_key = self.keys.node(action.name)
            if action.do == "delete":
                ops: list = [Delete(entry.key)]
            else:
                note = {k: v for k, v in note.items() if k != "absent_since"}
                if action.do == "note_absent":
                    note["absent_since"] = round(self.clock(), 3)
                ops = [Put(entry.key, json.dumps(note).encode())]
            expect = {**fence, entry.key: entry.mod_revision}
            if action.do != "clear_absent":
                expect[node_key] = 0  # still no node of that name
            if await self.kv.commit(expect, ops) and action.do == "delete":
                deleted.append(action.name)
        return deleted

    async def _set_state(self, name: str, state: NodeState, reason: str | None = None) -> NodeRecord:
        def decide(read: tuple[Entry, NodeRecord]) -> cas.Done[NodeRecord] | cas.Write[NodeRecord]:
            entry, record = read
            if record.state is state and record.reason == reason:
                return cas.Done(record)
            if record.state is NodeState.QUARANTINED and state is NodeState.DRAINING:
                return cas.Done(record)  # an agent's leave: still quarantined, as stored
            record = record.model_copy(update={"state": state, "reason": reason})
            return cas.Write({entry.key: entry.mod_revision},
                             [Put(entry.key, record.model_dump_json().encode(), entry.lease)], record)

        return await cas.update(self.kv, lambda: self._entry(name), decide, f"node {name}")

    async def deregister(self, name: str) -> None:
        """Give the node's lease back, so it is gone at once; an unknown node is already gone."""
        try:
            entry, _ = await self._entry(name)
        except NodeNotFound:
            return
        await note_departure(self.kv, self.keys, name, entry.lease, STOPPED)
        await self.kv.revoke_lease(entry.lease)
        self.leases.ended(entry.lease)

    async def get(self, name: str) -> NodeRecord:
        """The node's record (NodeNotFound: none of that name is registered)."""
        return (await self._entry(name))[1]

    async def _entry(self, name: str) -> tuple[Entry, NodeRecord]:
        entry = await self.kv.get(self.keys.node(name))
        if entry is None:
            raise NodeNotFound(name)
        return entry, NodeRecord.model_validate_json(entry.value)


def _quarantine_of(stored: Entry | None) -> str | None:
    """Why a stored drain quarantines its node; None: a plain drain, or none."""
    if stored is None:
        return None
    try:
        return json.loads(stored.value).get("quarantine")
    except (ValueError, AttributeError):
        return None


def _same_node(record: NodeRecord, reclaim_sha256: str | None) -> bool:
    """Whether the presented previous credential is the one `record` was registered with."""
    return (reclaim_sha256 is not None and record.credential_sha256 is not None
            and secrets.compare_digest(record.credential_sha256, reclaim_sha256))
