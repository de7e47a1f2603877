"""`KeyValue` on etcd v3, over `aetcd`.

Every write that depends on what was read is a transaction comparing the key's
`mod_revision` (the fencing token); `mod_revision == 0` means "only if absent".
Every foreign error (gRPC, timeouts, connection refused) leaves this module as
`StoreUnavailable`, naming the endpoint and what to do, so the API can answer 503:
`StoreFull` when etcd's NOSPACE alarm refuses writes ("database space exceeded"), and
`HistoryCompacted` when a watch starts before the compacted history (neither drops the
connection, which serves everything else as before).
Several endpoints may be given (the members of one cluster): on a connection failure the
next one is used, and a request that found its member's port closed (a member killed or
restarting: the request never reached it) is sent to the next member at once, so a lost
member costs no failed request; a timeout is not resent (it may have been applied), except
for a read (or a keep-alive): with other members to ask, a member gets half the deadline
and the read twice the deadline in all, so that one that does not answer (a stopped member;
a follower whose read waits while the members elect a new leader, seconds on a loaded
machine) is left for the next, and the read is answered once a leader is there.

With etcd's own authentication (a user and password; `ftrain up` turns it on for its
etcd), the client authenticates when it connects and sends the token etcd gave it with
every request. etcd forgets a simple token after `--auth-token-ttl` seconds without use
(300 by default) and every token when it restarts: a request then fails UNAUTHENTICATED
and a new watch is created already cancelled (watch id -1, which `aetcd` does not treat
as an error). Either way the client is replaced by a new one, which authenticates again,
and the request is tried once more.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import grpc

from service.errors import HistoryCompacted, ReplyTooLarge, StoreFull, StoreUnavailable
from service.store.api import CUT_OFF_AFTER_S, MAX_TXN_OPS, Delete, Entry, KeyValue, Put, WatchEvent

log = logging.getLogger(__name__)


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key greater than every key starting with `prefix`."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\0"


def parse_endpoints(endpoints: str | Sequence[str]) -> list[tuple[str, int]]:
    """'http://h1:2379,http://h2:2379' -> [('h1', 2379), ('h2', 2379)]."""
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    out = []
    for item in items:
        item = item.strip()
        if not item:
            continue
        parts = urlsplit(item if "://" in item else f"http://{item}")
        if not parts.hostname:
            raise ValueError(f"etcd endpoint {item!r} has no host; expected http://HOST:PORT")
        out.append((parts.hostname, parts.port or 2379))
    if not out:
        raise ValueError("no etcd endpoint given; expected http://HOST:PORT[,...]")
    return out


class EtcdStore(KeyValue):
    """Async etcd client with CAS helpers and errors mapped to `StoreUnavailable`."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 3.0,
                 user: str | None = None, password: str | None = None, probe_key: str = "\0"):
        """`probe_key`: a key that `user` may read (under ftrain's prefix: etcd's roles grant
        a prefix); the linearizable reads that ask etcd's revision and health read it."""
        if (user is None) != (password is None):
            raise ValueError("an etcd user needs a password, and a password a user")
        self._probe = aetcd.rpc.RangeRequest(key=probe_key.encode(), limit=1, keys_only=True)
        self._endpoints = parse_endpoints(endpoints)
        self._user, self._password = user, password
        self._current = 0
        self._timeout_s = timeout_s
        self._client: aetcd.Client | None = None
        self._lock = asyncio.Lock()
        # Bumped whenever the client is dropped: a watch on an older client must end.
        self._generation = 0
        self._closing: set[asyncio.Task] = set()
        self._keepalive: _KeepAliveStream | None = None
        self.on_call: Callable[[float], None] | None = None  # each call's seconds (GET /metrics)
        # For check_contact: when the first call sent since etcd's last answer was sent.
        self._unanswered_since: float | None = None

    def own_connection(self) -> EtcdStore:
        """Another client on the same members (from the one this one uses now), with the same
        credentials and deadline: its own gRPC channel (connection) and keep-alive stream."""
        hosts = [(f"[{host}]" if ":" in host else host, port) for host, port in self._endpoints]
        other = EtcdStore([f"http://{host}:{port}" for host, port in hosts], self._timeout_s,
                          user=self._user, password=self._password,
                          probe_key=self._probe.key.decode())
        other._current = self._current
        return other

    @property
    def endpoint(self) -> str:
        host, port = self._endpoints[self._current]
        return f"{host}:{port}"

    def _unavailable(self, what: str, exc: BaseException | None) -> StoreUnavailable:
        detail = f": {exc}" if exc and str(exc) else ""
        return StoreUnavailable(
            f"etcd at {self.endpoint} did not answer {what} within {self._timeout_s:g} s"
            f"{detail}; is it running? Check FTRAIN_ETCD_ENDPOINTS (`ftrain up` starts its own)."
        )

    def _full(self) -> StoreFull:
        ep = f"http://{self.endpoint}"
        return StoreFull(
            f"etcd at {self.endpoint} refuses writes: its NOSPACE alarm is raised (the database "
            "reached its --quota-backend-bytes); reads still work. To recover, compact its history "
            f"(`etcdctl --endpoints={ep} compact REV`, REV the revision that `etcdctl "
            f"--endpoints={ep} endpoint status -w json` shows; the leading control plane also "
            f"compacts by itself), defragment (`etcdctl --endpoints={ep} defrag`), then clear "
            f"the alarm (`etcdctl --endpoints={ep} alarm disarm`). If live data alone fill the "
            "quota, delete finished jobs or restart etcd with a larger --quota-backend-bytes."
        )

    async def _connected(self) -> aetcd.Client:
        if self._client is None:
            async with self._lock:
                if self._client is None:
                    host, port = self._endpoints[self._current]
                    client = aetcd.Client(host=host, port=port, timeout=self._timeout_s,
                                          username=self._user, password=self._password)
                    await client.connect()
                    self._client = client
        return self._client

    async def _drop_client(self, next_endpoint: bool = True) -> None:
        """Forget the client (the next call connects anew); close the old one in the background.

        Closing waits for the client's watch stream to shut down, which can take as long as
        the broken connection does: nobody waits for it, so no request hangs on it.
        """
        client, self._client = self._client, None
        self._generation += 1
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        if next_endpoint and len(self._endpoints) > 1:
            self._current = (self._current + 1) % len(self._endpoints)
        if client is not None:
            task = asyncio.create_task(_close_quietly(client))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _refused(self, exc: BaseException) -> StoreUnavailable:
        """etcd refused our credentials (or wants some): say which and what to do."""
        if self._user is None:
            return StoreUnavailable(
                f"etcd at {self.endpoint} requires authentication ({exc}); give the control plane "
                "an etcd user and password (`ftrain serve --etcd-user USER --etcd-password-file "
                "FILE`, or FTRAIN_ETCD_USER and FTRAIN_ETCD_PASSWORD_FILE)")
        return StoreUnavailable(
            f"etcd at {self.endpoint} refused the user {self._user!r} ({exc}); check the password "
            "in --etcd-password-file (FTRAIN_ETCD_PASSWORD_FILE) and that the user has a role "
            "that may read and write the key prefix")

    async def _reauthenticate(self, client: aetcd.Client) -> None:
        """Replace `client` (unless another caller did already): the new one authenticates."""
        if self._client is client:
            log.info("etcd at %s no longer accepts our auth token (it expired, or etcd "
                     "restarted); authenticating again", self.endpoint)
            await self._drop_client(next_endpoint=False)

    async def _call(self, what: str, fn, repeatable: bool = False):
        """Run `fn(client)` with a deadline; map every failure to StoreUnavailable.

        A call that etcd refuses because our auth token expired is tried once more, on a
        client that authenticated again. A call that etcd answered with "no leader" (its
        members are electing one, after the leader was lost: nothing was done) is sent again
        until it is answered or `timeout_s` has passed, and so is a `repeatable` one (a read,
        a keep-alive: doing it twice does no harm) answered "leader changed", and one whose
        member (and the next) could not be reached, so that losing one member of three, the
        leader included, fails no request. A `repeatable` call with other members to ask gets
        half the deadline on a member and twice the deadline in all (module docstring): one
        that gives no answer (stopped, or a follower waiting while the members elect a leader)
        is left for the next, and an election longer than the deadline fails no read.
        """
        start = time.perf_counter()
        hurry = repeatable and len(self._endpoints) > 1
        budget_s = 2 * self._timeout_s if hurry else self._timeout_s
        attempt_s = self._timeout_s / 2 if hurry else self._timeout_s + 0.5
        try:
            while True:
                try:
                    return await self._call_authenticated(what, fn, attempt_s)
                except StoreUnavailable as exc:
                    # No answer: its member did not give one in time, or another call dropped
                    # the client it was sent on (closing its channel cancels the calls in flight).
                    unanswered = hurry and isinstance(exc.__cause__, (TimeoutError, asyncio.CancelledError))
                    again = unanswered or _in_election(exc, repeatable) or (
                        len(self._endpoints) > 1 and _is_unreachable(exc.__cause__)
                        and (repeatable or not _said(exc.__cause__, _LEADER_LOST)))
                    if not again or time.perf_counter() + ELECTION_RETRY_S > start + budget_s:
                        raise
                    log.info("etcd did not take %s (%s); sent again", what, exc.__cause__ or exc)
                    left = start + budget_s + 0.5 - time.perf_counter()
                    attempt_s = max(ELECTION_RETRY_S, min(left, self._timeout_s / 2) if hurry else left)
                    if not unanswered:  # (a member that did not answer was left: ask the next now)
                        await asyncio.sleep(ELECTION_RETRY_S)
        finally:
            if self.on_call is not None:
                self.on_call(time.perf_counter() - start)

    async def _call_authenticated(self, what: str, fn, attempt_s: float | None = None):
        """`_call_next_member`, once more on a new client if etcd refused our auth token."""
        try:
            return await self._call_next_member(what, fn, attempt_s)
        except _TokenRefused as refused:
            await self._reauthenticate(refused.client)
        try:
            return await self._call_next_member(what, fn, attempt_s)
        except _TokenRefused as refused:
            raise self._refused(refused.__cause__) from refused.__cause__

    async def _call_next_member(self, what: str, fn, attempt_s: float | None = None):
        """`_call_once`, sent once more (to the next member) if its member was unreachable."""
        try:
            return await self._call_once(what, fn, attempt_s)
        except _Unreachable as unreachable:
            log.info("etcd at %s unreachable; %s goes to %s", unreachable.endpoint, what,
                     self.endpoint)
            try:
                return await self._call_once(what, fn, attempt_s)
            except _Unreachable as again:
                raise again.error from again.__cause__

    def check_contact(self) -> None:
        since = self._unanswered_since
        if since is not None and time.monotonic() - since > CUT_OFF_AFTER_S:
            raise StoreUnavailable(
                f"this control plane has had no answer from etcd at {self.endpoint} for "
                f"{time.monotonic() - since:.1f} s: what it holds may be stale; ask another replica")

    def _answered(self) -> None:
        self._unanswered_since = None

    async def _call_once(self, what: str, fn, attempt_s: float | None = None):
        """`fn(client)` on the member in use, within `attempt_s` (default: the deadline and a
        half second more, gRPC's own deadline being the one that ends it)."""
        client = None
        if self._unanswered_since is None:  # (still waiting, or failed: either way no answer)
            self._unanswered_since = time.monotonic()
        try:
            client = await self._connected()
            # asyncio.timeout, not wait_for: wait_for drops a cancellation that comes as the
            # call ends (Python 3.11), and a task cancelled then never ends (a hung shutdown).
            async with asyncio.timeout(self._timeout_s + 0.5 if attempt_s is None else attempt_s):
                answer = await fn(client)
            self._answered()
            return answer
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError) as exc:
            if not _is_connection_trouble(exc):
                self._answered()  # etcd's answer, if not the one asked for
            if _is_token_refused(exc):  # expired, or etcd restarted: authenticate again
                if self._user is None:
                    raise self._refused(exc) from exc
                raise _TokenRefused(client) from exc
            if _is_auth_refusal(exc):  # no user given, or a wrong password: not an outage
                raise self._refused(exc) from exc
            if _is_too_large(exc):  # an answer about this request, not an outage: keep the client
                raise ReplyTooLarge(f"etcd's reply to {what} would pass gRPC's 4 MiB limit; "
                                    "read fewer entries at a time") from exc
            if _is_nospace(exc):  # etcd answered: the connection is fine, the disk is not
                raise self._full() from exc
            if isinstance(exc, (aetcd.exceptions.ConnectionFailedError,
                                aetcd.exceptions.ConnectionTimeoutError, grpc.aio.AioRpcError)):
                endpoint = self.endpoint
                await self._drop_client()
                if len(self._endpoints) > 1 and _is_unreachable(exc):
                    raise _Unreachable(self._unavailable(what, exc), endpoint) from exc
            raise self._unavailable(what, exc) from exc
        except (TimeoutError, OSError) as exc:
            await self._drop_client()
            raise self._unavailable(what, exc) from exc
        except asyncio.CancelledError as exc:
            # Closing a dropped client's channel cancels the calls still in flight on it;
            # that is etcd being away for this request, not this request being cancelled.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise self._unavailable(what, exc) from exc

    async def close(self) -> None:
        await self._drop_client()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=2)

    async def get(self, key: str) -> Entry | None:
        got = await self._call(f"GET {key}", lambda c: c.get(key.encode()), repeatable=True)
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
                out += await self._call(f"GET {len(chunk)} keys", txn, repeatable=True)
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
            return await c.kvstub.Range(request, timeout=self._timeout_s, metadata=c.metadata)

        reply = await self._call(f"GET {limit} keys of {prefix}*", read, repeatable=True)
        return [_entry(kv) for kv in reply.kvs]

    async def latest_revision(self, prefix: str) -> int:
        """One Range of the key under `prefix` changed last (sorted by mod_revision, keys only)."""
        request = aetcd.rpc.RangeRequest(key=prefix.encode(), range_end=_prefix_end(prefix.encode()),
                                         limit=1, keys_only=True,
                                         sort_order=aetcd.rpc.RangeRequest.DESCEND,
                                         sort_target=aetcd.rpc.RangeRequest.MOD)

        async def read(c: aetcd.Client):
            return await c.kvstub.Range(request, timeout=self._timeout_s, metadata=c.metadata)

        reply = await self._call(f"GET the latest change of {prefix}*", read)
        return reply.kvs[0].mod_revision if reply.kvs else 0

    async def count_prefix(self, prefix: str) -> int:
        request = aetcd.rpc.RangeRequest(key=prefix.encode(), range_end=_prefix_end(prefix.encode()),
                                         count_only=True)

        async def count(c: aetcd.Client):
            return (await c.kvstub.Range(request, timeout=self._timeout_s, metadata=c.metadata)).count

        return await self._call(f"COUNT {prefix}*", count, repeatable=True)

    async def put(self, key: str, value: bytes, lease: int | None = None) -> None:
        await self._call(f"PUT {key}", lambda c: c.put(key.encode(), value, lease=lease))

    async def delete_prefix(self, prefix: str) -> None:
        await self._call(f"DELETE {prefix}*", lambda c: c.delete_prefix(prefix.encode()))

    async def delete(self, key: str) -> None:
        await self._call(f"DELETE {key}", lambda c: c.delete(key.encode()))

    async def commit(
        self, expect: dict[str, int], ops: Sequence[Put | Delete]
    ) -> bool:
        """Apply `ops` atomically iff every key in `expect` has that mod_revision (0: absent)."""

        async def txn(c: aetcd.Client):
            ok, _ = await c.transaction(compare=_compares(c, expect), success=_requests(c, ops),
                                        failure=[])
            return ok

        return await self._call("a transaction", txn)

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

        return await self._call("a transaction", txn)

    async def revision(self) -> int:
        """The store's current revision (for starting a watch after a read)."""
        async def status(c: aetcd.Client):
            resp = await c.kvstub.Range(self._probe, timeout=self._timeout_s, metadata=c.metadata)
            return resp.header.revision

        return await self._call("a status request", status, repeatable=True)

    async def compact(self, revision: int) -> None:
        """Compact etcd's history to `revision`; one at or below an earlier compaction is a no-op."""
        async def compact(c: aetcd.Client) -> None:
            try:
                await c.compact(revision)
            except aetcd.exceptions.ClientError as exc:
                if "required revision has been compacted" not in str(exc):
                    raise
                log.debug("etcd history was compacted past %d already", revision)

        await self._call(f"a compaction to revision {revision}", compact, repeatable=True)

    async def check_ready(self) -> None:
        """etcd answers a read and has no alarm raised (NOSPACE: StoreFull)."""
        async def alarms(c: aetcd.Client) -> list[int]:
            await c.kvstub.Range(self._probe, timeout=self._timeout_s, metadata=c.metadata)
            reply = await c.maintenancestub.Alarm(
                aetcd.rpc.AlarmRequest(action=aetcd.rpc.AlarmRequest.GET, memberID=0,
                                       alarm=aetcd.rpc.NONE),
                timeout=self._timeout_s, metadata=c.metadata)
            return [a.alarm for a in reply.alarms]

        raised = await self._call("a status request", alarms, repeatable=True)
        if aetcd.rpc.NOSPACE in raised:
            raise self._full()
        if aetcd.rpc.CORRUPT in raised:
            raise StoreUnavailable(
                f"etcd at {self.endpoint} has its CORRUPT alarm raised: a member's data differ "
                "from the others'. Replace that member (restore it from a healthy one's snapshot); "
                "ftrain waits until etcd is healthy.")

    async def grant_lease(self, ttl_s: int) -> int:
        lease = await self._call("a lease grant", lambda c: c.lease(ttl_s))
        return lease.id

    async def refresh_lease(self, lease_id: int) -> bool:
        """Keep a lease alive; False if it has already expired.

        Every refresh goes over one keep-alive stream per client: opening a stream per
        heartbeat (what `aetcd.Client.refresh_lease` does) costs more than the refresh.
        """
        if not 0 < lease_id < 2**63:  # etcd's ids are positive int64s: no such lease
            return False

        async def refresh(c: aetcd.Client) -> int:
            if self._keepalive is None or self._keepalive.client is not c or self._keepalive.dead:
                if self._keepalive is not None:
                    self._keepalive.close()
                self._keepalive = _KeepAliveStream(c)
            return await self._keepalive.refresh(lease_id)

        return await self._call("a lease keep-alive", refresh, repeatable=True) > 0

    async def revoke_lease(self, lease_id: int) -> None:
        async def revoke(c: aetcd.Client) -> None:
            try:
                await c.revoke_lease(lease_id)
            except aetcd.exceptions.ClientError as exc:
                if not _is_not_found(exc):
                    raise
                log.debug("lease %x already gone", lease_id)  # nothing to do

        await self._call("a lease revoke", revoke)

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
            generation = self._generation
            client = await self._call("a watch", lambda c: asyncio.sleep(0, c))
            try:
                async with asyncio.timeout(self._timeout_s):  # not wait_for: see _call_once
                    watch = await client.watch(key, range_end=_prefix_end(key),
                                               start_revision=start_revision)
            except aetcd.exceptions.RevisionCompactedError as exc:
                raise _compacted(start_revision, exc) from exc
            except (TimeoutError, aetcd.exceptions.ClientError, grpc.aio.AioRpcError, OSError) as exc:
                await self._drop_client()
                raise self._unavailable("a watch", exc) from exc
            if watch.watch_id != _REFUSED_WATCH_ID:
                break
            # etcd refused to create it (it says why only in a field aetcd drops): the
            # watch stream's token expired, or there is none and etcd wants one.
            refused = _StaleToken(f"etcd refused to watch {prefix}* (permission denied)")
            if self._user is None or attempt == 2:
                raise self._refused(refused)
            await self._reauthenticate(client)

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
                    if self._generation != generation:
                        raise self._unavailable("a watch", None) from None
                    if asyncio.get_running_loop().time() > deadline:
                        return
                    continue
                if isinstance(ev, aetcd.exceptions.RevisionCompactedError):
                    raise _compacted(start_revision, ev) from ev  # the client is fine
                if isinstance(ev, BaseException):
                    await self._drop_client()
                    raise self._unavailable("a watch", ev) from ev
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


class _Unreachable(Exception):
    """A member refused the connection (`error`, the StoreUnavailable to raise if the next
    member does too): the request never reached it, so it may go to the next member."""

    def __init__(self, error: StoreUnavailable, endpoint: str):
        super().__init__(error.message)
        self.error, self.endpoint = error, endpoint


# etcd's answers while its members elect a leader. "no leader": refused before anything was
# done; the others may follow a write that was applied, so only a read or a keep-alive
# (`repeatable`) is sent again on them.
_NO_LEADER = ("etcdserver: no leader",)
_LEADER_LOST = ("etcdserver: leader changed", "possibly due to previous leader failure")
ELECTION_RETRY_S = 0.1


def _in_election(exc: BaseException, repeatable: bool) -> bool:
    """`exc` (a StoreUnavailable) is etcd's answer during an election that may be sent again."""
    return _said(exc.__cause__, _NO_LEADER + (_LEADER_LOST if repeatable else ()))


def _said(exc: BaseException | None, phrases: tuple[str, ...]) -> bool:
    """`exc` or one of its causes says one of `phrases`."""
    said = []
    while exc is not None and len(said) < 10:
        said.append(str(exc))
        if isinstance(exc, grpc.aio.AioRpcError):
            said.append(exc.details() or "")
        exc = exc.__cause__
    text = " ".join(said)
    return any(p in text for p in phrases)


def _is_connection_trouble(exc: BaseException) -> bool:
    """No answer from etcd: the member unreachable, or the deadline passed."""
    if isinstance(exc, aetcd.exceptions.ConnectionTimeoutError):
        return True
    return _is_unreachable(exc) or (isinstance(exc, grpc.aio.AioRpcError)
                                    and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED)


def _is_unreachable(exc: BaseException) -> bool:
    """gRPC could not reach the member (UNAVAILABLE: connection refused or reset), as opposed
    to a deadline that passed (the request may have been applied)."""
    if isinstance(exc, aetcd.exceptions.ConnectionFailedError):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAVAILABLE


class _TokenRefused(Exception):
    """etcd refused `client`'s auth token; a new client, authenticating anew, may succeed."""

    def __init__(self, client: aetcd.Client | None):
        super().__init__("etcd refused the auth token")
        self.client = client


def _is_token_refused(exc: BaseException) -> bool:
    """etcd answered UNAUTHENTICATED: it no longer knows the token we sent."""
    if isinstance(exc, aetcd.exceptions.UnauthenticatedError):
        return True
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED


def _is_auth_refusal(exc: BaseException) -> bool:
    """etcd refused us for want of credentials, or for wrong ones (INVALID_ARGUMENT)."""
    text = str(exc)
    return any(s in text for s in ("user name is empty", "authentication failed",
                                   "permission denied"))


class _KeepAliveStream:
    """One LeaseKeepAlive stream that carries the refreshes of many leases.

    etcd answers each request with the lease's ID and its TTL (0 once expired); the
    reader hands each answer to everyone waiting on that lease.
    """

    def __init__(self, client: aetcd.Client):
        self.client = client
        self._ended = False
        self._call = client.leasestub.LeaseKeepAlive(metadata=client.metadata)
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self._write_lock = asyncio.Lock()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        error: BaseException = EOFError("the keep-alive stream ended")
        try:
            while True:
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    break
                for fut in self._waiters.pop(reply.ID, []):
                    if not fut.done():
                        fut.set_result(reply.TTL)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as exc:
            error = exc
        finally:
            self._ended = True
            waiters, self._waiters = self._waiters, {}
            for futs in waiters.values():
                for fut in futs:
                    if not fut.done():
                        fut.set_exception(ConnectionError(f"lease keep-alive stream broke: {error!r}"))

    @property
    def dead(self) -> bool:
        """The stream ended, or was closed (its reader may not have run since)."""
        return self._ended or self._call.done()

    async def refresh(self, lease_id: int) -> int:
        fut = asyncio.get_running_loop().create_future()
        waiting = self._waiters.setdefault(lease_id, [])
        waiting.append(fut)
        try:
            async with self._write_lock:
                await self._call.write(aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id))
        except BaseException as exc:
            # Not sent (e.g. an id outside int64 that protobuf refuses): no answer will come
            # for this future, so it must not wait in the map for ever (nor be failed later
            # with nobody to see it).
            fut.cancel()
            with contextlib.suppress(ValueError):
                waiting.remove(fut)
            if not waiting and self._waiters.get(lease_id) is waiting:
                del self._waiters[lease_id]
            if isinstance(exc, asyncio.InvalidStateError):
                # The stream was closed under this write (the client dropped by another
                # call's failure): etcd away for this request (503), not a server error (500).
                raise ConnectionError("lease keep-alive stream already closed") from exc
            raise
        return await fut

    def close(self) -> None:
        self._ended = True
        self._call.cancel()
        self._reader.cancel()


async def _close_quietly(client: aetcd.Client) -> None:
    with contextlib.suppress(Exception, asyncio.CancelledError):
        await asyncio.wait_for(client.close(), 5)


def _is_too_large(exc: BaseException) -> bool:
    """gRPC refused a reply over its receive limit ("Received message larger than max").

    etcd's own RESOURCE_EXHAUSTED answers (no space, too many requests) are other errors.
    """
    cause = exc if isinstance(exc, grpc.aio.AioRpcError) else exc.__cause__
    return (isinstance(cause, grpc.aio.AioRpcError)
            and cause.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "larger than max" in (cause.details() or ""))


def _is_nospace(exc: BaseException) -> bool:
    """etcd's answer to a write while its NOSPACE alarm is raised (gRPC RESOURCE_EXHAUSTED)."""
    return "database space exceeded" in str(exc) or (
        isinstance(exc.__cause__, grpc.aio.AioRpcError)
        and "database space exceeded" in (exc.__cause__.details() or ""))


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
