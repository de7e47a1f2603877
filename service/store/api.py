"""The storage seam: the key-value operations ftrain's stores use, and nothing more.

`KeyValue` is what etcd v3 offers ftrain: keys with a global revision, each key carrying
the revision of its last change (`mod_revision`, the fencing token of every compare-and-set)
and of its creation; transactions that apply only if each compared key is still at the
revision read (0: only if absent); leases that delete their keys when they lapse;
watches that replay every change under a prefix from a given revision on; and compaction,
which forgets the history before a revision (a watch from before it raises
`HistoryCompacted`: the watcher re-reads and watches from the revision of that read).

Every read of many keys is bounded. gRPC caps one reply at 4 MiB (its default receive
limit, which aetcd keeps) and a cluster's history has no cap, so there is no "read the whole
prefix" here: `get_range` reads at most `limit` entries after a key, `scan_prefix` pages
through a prefix with it, `count_prefix` counts without reading values, and `get_many`
reads its keys a page at a time. A caller picks a page size from the size of its records,
so that a page stays near 1 MiB; a page that still does not fit a reply (`ReplyTooLarge`)
is read again in halves.

Two implementations: `service.store.etcd.EtcdStore` (production) and
`service.store.memory.MemoryStore` (tests of the stores and decisions without a server).
`tests/contract/test_kv.py` runs one suite against both, so they cannot drift apart.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from service.errors import ReplyTooLarge

# The most operations one transaction may hold on either branch: etcd's default
# --max-txn-ops. Callers with more split them (and say where that costs atomicity).
MAX_TXN_OPS = 128

# Entries per page of a read of small records (events, nodes, snapshot records, keys only;
# each well under 8 KiB, so a page stays under 1 MiB). Job records, up to about 64 KiB
# each, are read in smaller pages (service.jobs.JOB_PAGE_SIZE).
PAGE_SIZE = 128


@dataclass(frozen=True)
class Entry:
    key: str
    value: bytes
    mod_revision: int
    create_revision: int
    lease: int  # 0: not attached to a lease


@dataclass(frozen=True)
class WatchEvent:
    key: str
    value: bytes | None  # None for a delete
    mod_revision: int


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


Op = Put | Delete


class Fence(dict[str, int]):
    """What a leader-only write compares: {the leader's key: the revision at which this
    replica wrote it} (`service.scheduler.Leadership.fence`), and who holds it: `holder`,
    the replica's identity as the key names it, and `term`, that revision (a later lead
    has a larger one), which the events such a write adds carry (`service.jobs`).
    `lapsed()`: True once the holder no longer counts itself leader (its lease may have
    lapsed in etcd), so that it sends no write after that (`service.jobs.JobStore.update`)."""

    def __init__(self, key: str, term: int, holder: str, lapsed: Callable[[], bool] = lambda: False):
        super().__init__({key: term})
        self.term = term
        self.holder = holder
        self.lapsed = lapsed


# A request to the store unanswered for this long, with no answer to any request since it was
# sent: this process is cut off (`KeyValue.check_contact`). Every control plane sends etcd a
# request at least every second (its leadership check), so a cut is known within about
# 1 + CUT_OFF_AFTER_S, well inside a node's lease (6 s by default).
CUT_OFF_AFTER_S = 1.0


class KeyValue(abc.ABC):
    """A key-value store with revisions, compare-and-set transactions, leases and watches.

    Every failure to reach the store is raised as `service.errors.StoreUnavailable`.
    """

    @property
    @abc.abstractmethod
    def endpoint(self) -> str:
        """Where the store is, for messages and /readyz."""

    @abc.abstractmethod
    async def get(self, key: str) -> Entry | None:
        """The entry at `key`, or None."""

    @abc.abstractmethod
    async def get_many(self, keys: Sequence[str], *, page_size: int = MAX_TXN_OPS) -> list[Entry | None]:
        """The entries at `keys`, in order (None where absent).

        Read `page_size` keys (at most MAX_TXN_OPS) per request, each page at one revision;
        a page too large for one reply is read again in halves.
        """

    @abc.abstractmethod
    async def get_range(self, prefix: str, *, limit: int, start_after: str | None = None,
                        keys_only: bool = False) -> list[Entry]:
        """At most `limit` entries under `prefix` whose keys come after `start_after`, in key order.

        With `keys_only` the entries' values are empty (b""). Raises ReplyTooLarge when the
        entries do not fit one reply: read fewer.
        """

    @abc.abstractmethod
    async def count_prefix(self, prefix: str) -> int:
        """How many keys start with `prefix` (counted by the store; nothing is read)."""

    async def scan_prefix(self, prefix: str, *, page_size: int = PAGE_SIZE,
                          keys_only: bool = False) -> AsyncIterator[Entry]:
        """Every entry under `prefix`, in key order, read `page_size` entries at a time.

        Each page is read at the store's revision of that moment: an entry written during
        the scan may or may not be seen, never twice. A page too large for one reply is
        read again with half as many entries (down to one).
        """
        if page_size < 1:
            raise ValueError("page_size must be at least 1")
        after: str | None = None
        while True:
            try:
                page = await self.get_range(prefix, limit=page_size, start_after=after,
                                            keys_only=keys_only)
            except ReplyTooLarge:
                if page_size == 1:
                    raise
                page_size //= 2
                continue
            for entry in page:
                yield entry
            if len(page) < page_size:
                return
            after = page[-1].key

    async def latest_revision(self, prefix: str) -> int:
        """The highest mod_revision of a key under `prefix` (0: none): a cache fed by a watch
        of `prefix` that has applied it has every entry there as it is now (a deletion aside).
        (Here every key is read; the etcd store asks for the one most recently changed.)"""
        latest = 0
        async for entry in self.scan_prefix(prefix, keys_only=True):
            latest = max(latest, entry.mod_revision)
        return latest

    @abc.abstractmethod
    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        """Write `key` unconditionally (attached to `lease` if given)."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Delete `key` (nothing happens if it is absent)."""

    @abc.abstractmethod
    async def delete_prefix(self, prefix: str) -> None:
        """Delete every key starting with `prefix`."""

    @abc.abstractmethod
    async def commit(self, expect: dict[str, int], ops: Sequence[Op]) -> bool:
        """Apply `ops` atomically iff every key in `expect` has that mod_revision (0: absent)."""

    @abc.abstractmethod
    async def commit_read(self, expect: dict[str, int], ops: Sequence[Op],
                          read: str) -> tuple[bool, Entry | None]:
        """Like `commit`, and read `read` in the same transaction (after `ops` if they applied).

        A compare-and-set that must return the fencing token it wrote, or what won the race,
        gets both atomically instead of with a second, racy read.
        """

    @abc.abstractmethod
    async def revision(self) -> int:
        """The store's current revision (for starting a watch after a read)."""

    @abc.abstractmethod
    async def compact(self, revision: int) -> None:
        """Forget the history before `revision` (at most the current one); the data stay.

        A watch from an earlier revision raises HistoryCompacted afterwards. Compacting at
        or below an earlier compaction changes nothing.
        """

    @abc.abstractmethod
    async def check_ready(self) -> None:
        """Return if the store serves reads and writes; else raise StoreUnavailable saying why
        (StoreFull while etcd's NOSPACE alarm is raised, although reads still work)."""

    def check_contact(self) -> None:
        """Raise StoreUnavailable if this process seems cut off from the store: a request has
        waited CUT_OFF_AFTER_S with no answer from the store since it was sent. For what is
        answered from memory (watch-fed caches, heartbeats), which would otherwise be
        answered as if fresh by a replica that no longer hears etcd; its clients then fail
        over to a replica that does. (An in-process store is never cut off.)"""
        return None

    def own_connection(self) -> KeyValue:
        """The same store for a caller whose few calls must not queue behind this one's many
        (the scheduler leader's lease: `service.scheduler.Leadership`). etcd: a client of its
        own, on its own connection, with its own keep-alive stream (the nodes' keep-alives,
        a thousand at a flush, go on this one's: `service.heartbeats`); the caller closes it.
        An in-process store: itself (nothing queues)."""
        return self

    @abc.abstractmethod
    async def grant_lease(self, ttl_s: int) -> int:
        """A new lease of `ttl_s` seconds; returns its id."""

    @abc.abstractmethod
    async def refresh_lease(self, lease_id: int) -> bool:
        """Keep a lease alive for another TTL; False if it has already expired (or never was)."""

    @abc.abstractmethod
    async def revoke_lease(self, lease_id: int) -> None:
        """End a lease now, deleting its keys; an unknown lease is already gone."""

    @abc.abstractmethod
    def watch_prefix(self, prefix: str, start_revision: int,
                     max_session_s: float = 60.0) -> AsyncIterator[WatchEvent]:
        """Yield every change under `prefix` from `start_revision` on.

        Ends quietly after `max_session_s` and raises StoreUnavailable when the stream
        breaks (HistoryCompacted when `start_revision` was compacted away): either way the
        caller re-reads and re-watches.
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; a later call may connect again."""
