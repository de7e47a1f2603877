"""`KeyValue` on etcd v3, over `aetcd`.

Every write that depends on what was read is a transaction comparing the key's
`mod_revision` (the fencing token); `mod_revision == 0` means "only if absent".
Every foreign error (gRPC, timeouts, connection refused) leaves this module as
`StoreUnavailable`, naming the endpoint and what to do, so the API can answer 503:
`StoreFull` when etcd's NOSPACE alarm refuses writes ("database space exceeded"), and
`HistoryCompacted` when a watch starts before the compacted history (neither drops the
connection, which serves everything else as before).
The calls themselves (several members, failover, etcd's authentication, deadlines and
retries) are `EtcdCalls`' (service/store/etcd_calls.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

import aetcd
import aetcd.exceptions
import grpc

from service.errors import HistoryCompacted, ReplyTooLarge, StoreUnavailable
from service.store.api import MAX_TXN_OPS, Delete, Entry, KeyValue, Put, WatchEvent
from service.store.etcd_calls import (  # noqa: F401 - parse_endpoints: for service/cli.py
    EtcdCalls,
    _KeepAliveStream,
    parse_endpoints,
)

log = logging.getLogger(__name__)


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


class EtcdStore(KeyValue):
    """Async etcd client with CAS helpers and errors mapped to `StoreUnavailable`; its calls
    (members, authentication, deadlines, retries) are `EtcdCalls`'."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 3.0,
                 user: str | None = None, password: str | None = None, probe_key: str = "\0"):
        """`probe_key`: a key that `user` may read (under ftrain's prefix: etcd's roles grant
        a prefix); the linearizable reads that ask etcd's revision and health read it."""
        self.calls = EtcdCalls(endpoints, timeout_s, user, password)
        self._probe = aetcd.rpc.RangeRequest(key=probe_key.encode(), limit=1, keys_only=True)
        self._password = password

    @property
    def endpoint(self) -> str:
        return self.calls.endpoint

    @property
    def on_call(self) -> Callable[[float], None] | None:
        """Each call's seconds (GET /metrics)."""
        return self.calls.on_call

    @on_call.setter
    def on_call(self, observe: Callable[[float], None] | None) -> None:
        self.calls.on_call = observe

    def check_contact(self) -> None:
        self.calls.check_contact()

    async def close(self) -> None:
        await self.calls.close()

    def own_connection(self) -> EtcdStore:
        """Another client on the same members (from the one this one uses now), with the same
        credentials and deadline: its own gRPC channel (connection) and keep-alive stream."""
        hosts = [(f"[{host}]" if ":" in host else host, port) for host, port in self.calls.endpoints]
        other = EtcdStore([f"http://{host}:{port}" for host, port in hosts], self.calls.timeout_s,
                          user=self.calls.user, password=self._password,
                          probe_key=self._probe.key.decode())
        other.calls.current = self.calls.current
        return other

    async def get(self, key: str) -> Entry | None:
        got = await self.calls.call(f"GET {key}", lambda c: c.get(key.encode()), repeatable=True)
        return None if got is None else _entry(got)

    async def get_many(self, keys: Sequence[str], *, page_size: int = MAX_TXN_OPS) -> list[Entry | None]:
        """Read `keys` a page at a time: a transaction of gets per page (one round trip, one
        revision) rather than a request per key; a page too large for one reply is halved."""
        size = max(1, min(page_size, MAX_TXN_OPS))
        out: list[Entry | None] = []
        i = 0
        while i < len(keys):
            chunk = keys[i:i + size]

            async def txn(c: aetcd.Client, chunk=chunk):
                _ok, responses = await c.transaction(
                    compare=[], success=[c.transactions.get(k.encode()) for k in chunk], failure=[])
                return [(_entry(r[0][1]) if r else None) for r in responses]

            try:
                out += await self.calls.call(f"GET {len(chunk)} keys", txn, repeatable=True)
            except ReplyTooLarge:
                if size == 1:
                    raise
                size //= 2
                continue
            i += len(chunk)
        return out

    async def get_range(self, prefix: str, *, limit: int, start_after: str | None = None,
                        keys_only: bool = False) -> list[Entry]:
        """One etcd Range with a limit: keys in [start, end of prefix), key order."""
        if limit < 1:
            raise ValueError("limit must be at least 1")
        start = prefix.encode() if start_after is None else start_after.encode() + b"\0"
        request = aetcd.rpc.RangeRequest(key=max(start, prefix.encode()),
                                         range_end=_prefix_end(prefix.encode()),
                                         limit=limit, keys_only=keys_only)

        async def read(c: aetcd.Client):
            return await c.kvstub.Range(request, timeout=self.calls.timeout_s, metadata=c.metadata)

        reply = await self.calls.call(f"GET {limit} keys of {prefix}*", read, repeatable=True)
        return [_entry(kv) for kv in reply.kvs]

    async def latest_revision(self, prefix: str) -> int:
        """One Range of the key under `prefix` changed last (sorted by mod_revision, keys only)."""
        request = aetcd.rpc.RangeRequest(key=prefix.encode(), range_end=_prefix_end(prefix.encode()),
                                         limit=1, keys_only=True,
                                         sort_order=aetcd.rpc.RangeRequest.DESCEND,
                                         sort_target=aetcd.rpc.RangeRequest.MOD)

        async def read(c: aetcd.Client):
            return await c.kvstub.Range(request, timeout=self.calls.timeout_s, metadata=c.metadata)

        reply = await self.calls.call(f"GET the latest change of {prefix}*", read)
        return reply.kvs[0].mod_revision if reply.kvs else 0

    async def count_prefix(self, prefix: str) -> int:
        request = aetcd.rpc.RangeRequest(key=prefix.encode(), range_end=_prefix_end(prefix.encode()),
                                         count_only=True)

        async def count(c: aetcd.Client):
            return (await c.kvstub.Range(request, timeout=self.calls.timeout_s, metadata=c.metadata)).count

        return await self.calls.call(f"COUNT {prefix}*", count, repeatable=True)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self.calls.call(f"PUT {key}", lambda c: c.put(key.encode(), value, lease=lease))

    async def delete_prefix(self, prefix: str) -> None:
        await self.calls.call(f"DELETE {prefix}*", lambda c: c.delete_prefix(prefix.encode()))

    async def delete(self, key: str) -> None:
        await self.calls.call(f"DELETE {key}", lambda c: c.delete(key.encode()))

    async def commit(
        self, expect: dict[str, int], ops: Sequence[Put | Delete]
    ) -> bool:
        """Apply `ops` atomically iff every key in `expect` has that mod_revision (0: absent)."""

        async def txn(c: aetcd.Client):
            ok, _ = await c.transaction(compare=_compares(c, expect), success=_requests(c, ops),
                                        failure=[])
            return ok

        return await self.calls.call("a transaction", txn)

    async def commit_read(
        self, expect: dict[str, int], ops: Sequence[Put | Delete], read: str
    ) -> tuple[bool, Entry | None]:
        """Like `commit`, and read `read` in the same transaction (after `ops` if they applied).

        A compare-and-set that must return the fencing token it wrote, or what won the race,
        gets both atomically instead of with a second, racy read.
        """

        async def txn(c: aetcd.Client):
            get = c.transactions.get(read.encode())
            ok, responses = await c.transaction(compare=_compares(c, expect),
                                                success=[*_requests(c, ops), get], failure=[get])
            found = responses[-1]
            return ok, (_entry(found[0][1]) if found else None)

        return await self.calls.call("a transaction", txn)

    async def revision(self) -> int:
        """The store's current revision (for starting a watch after a read)."""
        async def status(c: aetcd.Client):
            resp = await c.kvstub.Range(self._probe, timeout=self.calls.timeout_s, metadata=c.metadata)
            return resp.header.revision

        return await self.calls.call("a status request", status, repeatable=True)

    async def compact(self, revision: int) -> None:
        """Compact etcd's history to `revision`; one at or below an earlier compaction is a no-op."""
        async def compact(c: aetcd.Client) -> None:
            try:
                await c.compact(revision)
            except aetcd.exceptions.ClientError as exc:
                if "required revision has been compacted" not in str(exc):
                    raise
                log.debug("etcd history was compacted past %d already", revision)

        await self.calls.call(f"a compaction to revision {revision}", compact, repeatable=True)

    async def check_ready(self) -> None:
        """etcd answers a read and has no alarm raised (NOSPACE: StoreFull)."""
        async def alarms(c: aetcd.Client) -> list[int]:
            await c.kvstub.Range(self._probe, timeout=self.calls.timeout_s, metadata=c.metadata)
            reply = await c.maintenancestub.Alarm(
                aetcd.rpc.AlarmRequest(action=aetcd.rpc.AlarmRequest.GET, memberID=0,
                                       alarm=aetcd.rpc.NONE),
                timeout=self.calls.timeout_s, metadata=c.metadata)
            return [a.alarm for a in reply.alarms]

        raised = await self.calls.call("a status request", alarms, repeatable=True)
        if aetcd.rpc.NOSPACE in raised:
            raise self.calls.full()
        if aetcd.rpc.CORRUPT in raised:
            raise StoreUnavailable(
                f"etcd at {self.endpoint} has its CORRUPT alarm raised: a member's data differ "
                "from the others'. Replace that member (restore it from a healthy one's snapshot); "
                "ftrain waits until etcd is healthy.")

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self.calls.call("a lease grant", lambda c: c.lease(ttl_s))
        return lease.id

    async def refresh_lease(self, lease_id: int) -> bool:
        """Keep a lease alive; False if it has already expired.

        Every refresh goes over one keep-alive stream per client: opening a stream per
        heartbeat (what `aetcd.Client.refresh_lease` does) costs more than the refresh.
        """
        if not 0 < lease_id < 2**63:  # etcd's ids are positive int64s: no such lease
            return False

        async def refresh(c: aetcd.Client) -> int:
            if self.calls.keepalive is None or self.calls.keepalive.client is not c or self.calls.keepalive.dead:
                if self.calls.keepalive is not None:
                    self.calls.keepalive.close()
                self.calls.keepalive = _KeepAliveStream(c)
            return await self.calls.keepalive.refresh(lease_id)

        return await self.calls.call("a lease keep-alive", refresh, repeatable=True) > 0

    async def revoke_lease(self, lease_id: int) -> None:
        async def revoke(c: aetcd.Client) -> None:
            try:
                await c.revoke_lease(lease_id)
            except aetcd.exceptions.ClientError as exc:
                if not _is_not_found(exc):
                    raise
                log.debug("lease %x already gone", lease_id)  # nothing to do

        await self.calls.call("a lease revoke", revoke)

    async def watch_prefix(self, prefix: str, start_revision: int,
                           max_session_s: float = 60.0) -> AsyncIterator[WatchEvent]:
        """Yield every change under `prefix` from `start_revision` on.

        Raises StoreUnavailable when the stream breaks, when the client it runs on was
        dropped (etcd went away), or after `max_session_s`: the caller re-reads and
        re-watches, so a stream that stalls without an error cannot leave it stale for long.
        """
        key = prefix.encode()
        queue: asyncio.Queue = asyncio.Queue()
        for attempt in (1, 2):
            generation = self.calls.generation
            client = await self.calls.call("a watch", lambda c: asyncio.sleep(0, c))
            try:
                async with asyncio.timeout(self.calls.timeout_s):  # not wait_for: see _call_once
                    watch = await client.watch(key, range_end=_prefix_end(key),
                                               start_revision=start_revision)
            except aetcd.exceptions.RevisionCompactedError as exc:
                raise _compacted(start_revision, exc) from exc
            except (TimeoutError, aetcd.exceptions.ClientError, grpc.aio.AioRpcError, OSError) as exc:
                await self.calls.drop_client()
                raise self.calls.unavailable("a watch", exc) from exc
            if watch.watch_id != _REFUSED_WATCH_ID:
                break
            # etcd refused to create it (it says why only in a field aetcd drops): the
            # watch stream's token expired, or there is none and etcd wants one.
            refused = _StaleToken(f"etcd refused to watch {prefix}* (permission denied)")
            if self.calls.user is None or attempt == 2:
                raise self.calls.refused(refused)
            await self.calls.reauthenticate(client)

        async def pump():
            try:
                async for ev in watch:
                    await queue.put(ev)
                await queue.put(EOFError("the watch ended"))
            except Exception as exc:  # handed to the reader, which raises StoreUnavailable
                await queue.put(exc)

        pumping = asyncio.create_task(pump())
        deadline = asyncio.get_running_loop().time() + max_session_s
        try:
            while True:
                try:
                    # asyncio.timeout, not wait_for: wait_for drops a cancellation that comes
                    # as an event arrives (Python 3.11), and a cancelled watcher never ends.
                    async with asyncio.timeout(1.0):
                        ev = await queue.get()
                except TimeoutError:
                    if self.calls.generation != generation:
                        raise self.calls.unavailable("a watch", None) from None
                    if asyncio.get_running_loop().time() > deadline:
                        return
                    continue
                if isinstance(ev, aetcd.exceptions.RevisionCompactedError):
                    raise _compacted(start_revision, ev) from ev  # the client is fine
                if isinstance(ev, BaseException):
                    await self.calls.drop_client()
                    raise self.calls.unavailable("a watch", ev) from ev
                kv = ev.kv
                yield WatchEvent(key=kv.key.decode(), value=None if ev.kind == "DELETE" else kv.value,
                                 mod_revision=kv.mod_revision)
        finally:
            pumping.cancel()
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(watch.cancel(), 1)


# The id etcd gives a watch it refused to create (WatchResponse.canceled, permission denied).
_REFUSED_WATCH_ID = -1


class _StaleToken(Exception):
    """etcd refused a watch: our token expired (or there is none and etcd wants one)."""


def _compacted(start_revision: int, exc: aetcd.exceptions.RevisionCompactedError) -> HistoryCompacted:
    return HistoryCompacted(f"etcd compacted its history to revision {exc.compacted_revision}; a "
                            f"watch from {start_revision} must re-read first", exc.compacted_revision)


def _is_not_found(exc: aetcd.exceptions.ClientError) -> bool:
    """etcd answered NOT_FOUND (e.g. "requested lease not found"): an answer, not an outage."""
    cause = exc.__cause__
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.NOT_FOUND


def _compares(c: aetcd.Client, expect: dict[str, int]) -> list:
    """Each key's mod_revision must be as given (0: the key must not exist)."""
    return [c.transactions.mod(k.encode()) == rev for k, rev in expect.items()]


def _requests(c: aetcd.Client, ops: Sequence[Put | Delete]) -> list:
    out = []
    for op in ops:
        key = op.key.encode()
        if isinstance(op, Put):
            out.append(c.transactions.put(key, op.value, lease=op.lease))
        else:
            out.append(c.transactions.delete(key, range_end=_prefix_end(key) if op.prefix else None))
    return out


def _entry(kv) -> Entry:
    return Entry(
        key=kv.key.decode(),
        value=kv.value,
        mod_revision=kv.mod_revision,
        create_revision=kv.create_revision,
        lease=kv.lease,
    )
