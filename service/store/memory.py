"""`KeyValue` in memory, with etcd's semantics for everything ftrain uses.

One global revision, bumped once per write transaction that changes something (a delete
of nothing changes nothing, as in etcd); each entry keeps its mod and create revisions;
a transaction compares mod revisions (0: absent) and applies all its operations at one
revision or none. Every change is kept in a history, so a watch from a past revision
replays what happened since, then follows live changes; `compact` drops the history before
a revision, and a watch from before it raises HistoryCompacted, as etcd's does.

Replies are capped as gRPC caps etcd's (4 MiB by default, `max_reply_bytes`): a range or a
page of `get_many` whose keys and values pass the cap raises ReplyTooLarge, so a test of a
reader on this store sees what it would see on etcd.

Leases run on an injectable clock (`time.monotonic` by default): a test advances its own
clock instead of sleeping. A lease lapses when the clock passes its deadline; the store
notices on its next call (and a watch every second), deletes the lease's keys at one
revision, and the watchers see those deletes, as etcd's lease expiry would show them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from service.errors import HistoryCompacted, ReplyTooLarge, StoreUnavailable
from service.store.api import MAX_TXN_OPS, Delete, Entry, KeyValue, Op, Put, WatchEvent

Clock = Callable[[], float]
GRPC_MAX_REPLY_BYTES = 4 * 1024 * 1024


@dataclass
class _Lease:
    ttl_s: int
    deadline: float
    keys: set[str] = field(default_factory=set)


class _Closed:
    """Put in a watcher's queue by `close`: the watch ends as if the connection broke."""


class MemoryStore(KeyValue):
    """An in-process `KeyValue` (tests, and decisions tried without etcd)."""

    def __init__(self, clock: Clock = time.monotonic, max_reply_bytes: int = GRPC_MAX_REPLY_BYTES):
        self._clock = clock
        self._max_reply_bytes = max_reply_bytes
        self._revision = 1  # a new etcd is at revision 1
        self._data: dict[str, Entry] = {}
        self._history: list[WatchEvent] = []
        self._compacted = 0  # history before this revision is gone
        self._leases: dict[int, _Lease] = {}
        self._lease_ids = itertools.count(0x694D0000)
        self._watchers: list[tuple[str, asyncio.Queue]] = []

    @property
    def endpoint(self) -> str:
        return "memory"

    # -- reads ---------------------------------------------------------------------------

    async def get(self, key: str) -> Entry | None:
        self._expire()
        return self._data.get(key)

    async def get_many(self, keys: Sequence[str], *, page_size: int = MAX_TXN_OPS) -> list[Entry | None]:
        self._expire()
        size = max(1, min(page_size, MAX_TXN_OPS))
        out: list[Entry | None] = []
        i = 0
        while i < len(keys):
            page = [self._data.get(k) for k in keys[i:i + size]]
            try:
                self._check_reply([e for e in page if e is not None], f"GET {len(page)} keys")
            except ReplyTooLarge:
                if size == 1:
                    raise
                size //= 2
                continue
            out += page
            i += len(page)
        return out

    async def get_range(self, prefix: str, *, limit: int, start_after: str | None = None,
                        keys_only: bool = False) -> list[Entry]:
        if limit < 1:
            raise ValueError("limit must be at least 1")
        self._expire()
        keys = sorted(k for k in self._data
                      if k.startswith(prefix) and (start_after is None or k > start_after))
        page = [self._data[k] for k in keys[:limit]]
        if keys_only:
            page = [dataclasses.replace(e, value=b"") for e in page]
        self._check_reply(page, f"GET {limit} keys of {prefix}*")
        return page

    async def count_prefix(self, prefix: str) -> int:
        self._expire()
        return sum(1 for k in self._data if k.startswith(prefix))

    async def revision(self) -> int:
        self._expire()
        return self._revision

    # -- writes --------------------------------------------------------------------------

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        self._expire()
        self._apply([Put(key, value, lease)])

    async def delete(self, key: str) -> None:
        self._expire()
        self._apply([Delete(key)])

    async def delete_prefix(self, prefix: str) -> None:
        self._expire()
        self._apply([Delete(prefix, prefix=True)])

    async def commit(self, expect: dict[str, int], ops: Sequence[Op]) -> bool:
        self._expire()
        self._check_size(len(expect), len(ops))
        if not self._matches(expect):
            return False
        self._apply(ops)
        return True

    async def commit_read(self, expect: dict[str, int], ops: Sequence[Op],
                          read: str) -> tuple[bool, Entry | None]:
        self._expire()
        self._check_size(len(expect), len(ops) + 1)  # the read is one more operation
        ok = self._matches(expect)
        if ok:
            self._apply(ops)
        return ok, self._data.get(read)

    async def compact(self, revision: int) -> None:
        self._expire()
        if revision <= self._compacted:
            return
        self._compacted = min(revision, self._revision)
        self._history = [e for e in self._history if e.mod_revision >= self._compacted]

    async def check_ready(self) -> None:
        self._expire()

    # -- leases --------------------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        self._expire()
        lease_id = next(self._lease_ids)
        self._leases[lease_id] = _Lease(ttl_s, self._clock() + ttl_s)
        return lease_id

    async def refresh_lease(self, lease_id: int) -> bool:
        self._expire()
        lease = self._leases.get(lease_id)
        if lease is None:
            return False
        lease.deadline = self._clock() + lease.ttl_s
        return True

    async def revoke_lease(self, lease_id: int) -> None:
        self._expire()
        self._end_lease(lease_id)

    # -- watches -------------------------------------------------------------------------

    async def watch_prefix(self, prefix: str, start_revision: int,
                           max_session_s: float = 60.0) -> AsyncIterator[WatchEvent]:
        self._expire()
        queue: asyncio.Queue = asyncio.Queue()
        if start_revision <= 0:  # as etcd: no start revision means "from now on"
            start_revision = self._revision + 1
        if start_revision < self._compacted:
            raise HistoryCompacted(f"the history before revision {self._compacted} was compacted; "
                                   f"a watch from {start_revision} must re-read first",
                                   self._compacted)
        for event in self._history:  # replay, then follow: nothing can land in between
            if event.mod_revision >= start_revision and event.key.startswith(prefix):
                queue.put_nowait(event)
        watcher = (prefix, queue)
        self._watchers.append(watcher)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max_session_s
        try:
            while True:
                try:
                    async with asyncio.timeout(1.0):  # not wait_for: see EtcdStore.watch_prefix
                        event = await queue.get()
                except TimeoutError:
                    self._expire()  # leases lapse while nobody calls; their deletes are events
                    if loop.time() > deadline:
                        return
                    continue
                if isinstance(event, _Closed):
                    raise StoreUnavailable("the in-memory store was closed; its watches ended")
                yield event
        finally:
            self._watchers.remove(watcher)

    async def close(self) -> None:
        """End every open watch (as a dropped etcd client does); the data stays."""
        for _prefix, queue in self._watchers:
            queue.put_nowait(_Closed())

    # -- internals -----------------------------------------------------------------------

    def _check_reply(self, entries: Sequence[Entry], what: str) -> None:
        if sum(len(e.key) + len(e.value) for e in entries) > self._max_reply_bytes:
            raise ReplyTooLarge(f"the reply to {what} would pass the {self._max_reply_bytes}-byte "
                                "limit; read fewer entries at a time")

    def _check_size(self, compares: int, ops: int) -> None:
        """etcd refuses a transaction over its limit; so does this store, so tests catch it."""
        if compares > MAX_TXN_OPS or ops > MAX_TXN_OPS:
            raise StoreUnavailable(f"a transaction of {compares} compares and {ops} operations "
                                   f"is more than the {MAX_TXN_OPS} one may hold")

    def _matches(self, expect: dict[str, int]) -> bool:
        for key, revision in expect.items():
            entry = self._data.get(key)
            if (entry.mod_revision if entry else 0) != revision:
                return False
        return True

    def _apply(self, ops: Sequence[Op]) -> None:
        """Apply `ops` at the next revision; the revision moves only if something changed."""
        _check_overlaps(ops)
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self._leases:
                raise StoreUnavailable(f"lease {op.lease:x} not found (it expired or was revoked)")
        revision = self._revision + 1
        events: list[WatchEvent] = []
        for op in ops:
            if isinstance(op, Put):
                old = self._data.get(op.key)
                self._detach(old)
                entry = Entry(key=op.key, value=op.value, mod_revision=revision,
                              create_revision=old.create_revision if old else revision,
                              lease=op.lease or 0)
                self._data[op.key] = entry
                if entry.lease:
                    self._leases[entry.lease].keys.add(op.key)
                events.append(WatchEvent(op.key, op.value, revision))
            else:
                gone = [k for k in self._data if k.startswith(op.key)] if op.prefix else (
                    [op.key] if op.key in self._data else [])
                for key in sorted(gone):
                    self._detach(self._data.pop(key))
                    events.append(WatchEvent(key, None, revision))
        if events:
            self._revision = revision
            self._publish(events)

    def _detach(self, entry: Entry | None) -> None:
        if entry is not None and entry.lease in self._leases:
            self._leases[entry.lease].keys.discard(entry.key)

    def _end_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None and lease.keys:
            self._apply([Delete(k) for k in sorted(lease.keys)])

    def _expire(self) -> None:
        now = self._clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.deadline <= now]:
            self._end_lease(lease_id)

    def _publish(self, events: list[WatchEvent]) -> None:
        self._history.extend(events)
        for prefix, queue in self._watchers:
            for event in events:
                if event.key.startswith(prefix):
                    queue.put_nowait(event)


def _check_overlaps(ops: Sequence[Op]) -> None:
    """etcd refuses a transaction that puts a key twice, or puts a key it also deletes."""
    puts = [op.key for op in ops if isinstance(op, Put)]
    deletes = [op for op in ops if isinstance(op, Delete)]
    for i, key in enumerate(puts):
        if key in puts[:i] or any(key.startswith(d.key) if d.prefix else key == d.key
                                  for d in deletes):
            raise StoreUnavailable(f"duplicate key given in a transaction: {key!r} is written "
                                   "twice, or written and deleted")
