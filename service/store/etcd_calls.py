"""The calls of an `EtcdStore` (service/store/etcd.py): one client at a time, on one member of
the cluster, with a deadline; every foreign error (gRPC, timeouts, connection refused) mapped
to `StoreUnavailable`, naming the endpoint and what to do.

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
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import grpc

from service.errors import ReplyTooLarge, StoreFull, StoreUnavailable
from service.store.api import CUT_OFF_AFTER_S

log = logging.getLogger("service.store.etcd")


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


class EtcdCalls:
    """The calls of one etcd client (see the module docstring)."""

    def __init__(self, endpoints: str | Sequence[str], timeout_s: float = 3.0,
                 user: str | None = None, password: str | None = None):
        if (user is None) != (password is None):
            raise ValueError("an etcd user needs a password, and a password a user")
        self.endpoints = parse_endpoints(endpoints)
        self.user, self._password = user, password
        self.current = 0
        self.timeout_s = timeout_s
        self.client: aetcd.Client | None = None
        self._lock = asyncio.Lock()
        # Bumped whenever the client is dropped: a watch on an older client must end.
        self.generation = 0
        self._closing: set[asyncio.Task] = set()
        self.keepalive: _KeepAliveStream | None = None
        self.on_call: Callable[[float], None] | None = None  # each call's seconds (GET /metrics)
        # For check_contact: when the first call sent since etcd's last answer was sent.
        self.unanswered_since: float | None = None

    @property
    def endpoint(self) -> str:
        host, port = self.endpoints[self.current]
        return f"{host}:{port}"

    def unavailable(self, what: str, exc: BaseException | None) -> StoreUnavailable:
        detail = f": {exc}" if exc and str(exc) else ""
        return StoreUnavailable(
            f"etcd at {self.endpoint} did not answer {what} within {self.timeout_s:g} s"
            f"{detail}; is it running? Check FTRAIN_ETCD_ENDPOINTS (`ftrain up` starts its own)."
        )

    def full(self) -> StoreFull:
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

    async def connected(self) -> aetcd.Client:
        if self.client is None:
            async with self._lock:
                if self.client is None:
                    host, port = self.endpoints[self.current]
                    client = aetcd.Client(host=host, port=port, timeout=self.timeout_s,
                                          username=self.user, password=self._password)
                    await client.connect()
                    self.client = client
        return self.client

    async def drop_client(self, next_endpoint: bool = True) -> None:
        """Forget the client (the next call connects anew); close the old one in the background.

        Closing waits for the client's watch stream to shut down, which can take as long as
        the broken connection does: nobody waits for it, so no request hangs on it.
        """
        client, self.client = self.client, None
        self.generation += 1
        if self.keepalive is not None:
            self.keepalive.close()
            self.keepalive = None
        if next_endpoint and len(self.endpoints) > 1:
            self.current = (self.current + 1) % len(self.endpoints)
        if client is not None:
            task = asyncio.create_task(_close_quietly(client))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def refused(self, exc: BaseException) -> StoreUnavailable:
        """etcd refused our credentials (or wants some): say which and what to do."""
        if self.user is None:
            return StoreUnavailable(
                f"etcd at {self.endpoint} requires authentication ({exc}); give the control plane "
                "an etcd user and password (`ftrain serve --etcd-user USER --etcd-password-file "
                "FILE`, or FTRAIN_ETCD_USER and FTRAIN_ETCD_PASSWORD_FILE)")
        return StoreUnavailable(
            f"etcd at {self.endpoint} refused the user {self.user!r} ({exc}); check the password "
            "in --etcd-password-file (FTRAIN_ETCD_PASSWORD_FILE) and that the user has a role "
            "that may read and write the key prefix")

    async def reauthenticate(self, client: aetcd.Client) -> None:
        """Replace `client` (unless another caller did already): the new one authenticates."""
        if self.client is client:
            log.info("etcd at %s no longer accepts our auth token (it expired, or etcd "
                     "restarted); authenticating again", self.endpoint)
            await self.drop_client(next_endpoint=False)

    async def call(self, what: str, fn, repeatable: bool = False):
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
        hurry = repeatable and len(self.endpoints) > 1
        budget_s = 2 * self.timeout_s if hurry else self.timeout_s
        attempt_s = self.timeout_s / 2 if hurry else self.timeout_s + 0.5
        try:
            while True:
                try:
                    return await self._call_authenticated(what, fn, attempt_s)
                except StoreUnavailable as exc:
                    # No answer: its member did not give one in time, or another call dropped
                    # the client it was sent on (closing its channel cancels the calls in flight).
                    unanswered = hurry and isinstance(exc.__cause__, (TimeoutError, asyncio.CancelledError))
                    again = unanswered or _in_election(exc, repeatable) or (
                        len(self.endpoints) > 1 and _is_unreachable(exc.__cause__)
                        and (repeatable or not _said(exc.__cause__, _LEADER_LOST)))
                    if not again or time.perf_counter() + ELECTION_RETRY_S > start + budget_s:
                        raise
                    log.info("etcd did not take %s (%s); sent again", what, exc.__cause__ or exc)
                    left = start + budget_s + 0.5 - time.perf_counter()
                    attempt_s = max(ELECTION_RETRY_S, min(left, self.timeout_s / 2) if hurry else left)
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
            await self.reauthenticate(refused.client)
        try:
            return await self._call_next_member(what, fn, attempt_s)
        except _TokenRefused as refused:
            raise self.refused(refused.__cause__) from refused.__cause__

    async def _call_next_member(self, what: str, fn, attempt_s: float | None = None):
        """`_call_once`, sent once more (to the next member) if its member was unreachable."""
        try:
            return await self.call_once(what, fn, attempt_s)
        except _Unreachable as unreachable:
            log.info("etcd at %s unreachable; %s goes to %s", unreachable.endpoint, what,
                     self.endpoint)
            try:
                return await self.call_once(what, fn, attempt_s)
            except _Unreachable as again:
                raise again.error from again.__cause__

    def check_contact(self) -> None:
        since = self.unanswered_since
        if since is not None and time.monotonic() - since > CUT_OFF_AFTER_S:
            raise StoreUnavailable(
                f"this control plane has had no answer from etcd at {self.endpoint} for "
                f"{time.monotonic() - since:.1f} s: what it holds may be stale; ask another replica")

    def answered(self) -> None:
        self.unanswered_since = None

    async def call_once(self, what: str, fn, attempt_s: float | None = None):
        """`fn(client)` on the member in use, within `attempt_s` (default: the deadline and a
        half second more, gRPC's own deadline being the one that ends it)."""
        client = None
        if self.unanswered_since is None:  # (still waiting, or failed: either way no answer)
            self.unanswered_since = time.monotonic()
        try:
            client = await self.connected()
            # asyncio.timeout, not wait_for: wait_for drops a cancellation that comes as the
            # call ends (Python 3.11), and a task cancelled then never ends (a hung shutdown).
            async with asyncio.timeout(self.timeout_s + 0.5 if attempt_s is None else attempt_s):
                answer = await fn(client)
            self.answered()
            return answer
        except (aetcd.exceptions.ClientError, grpc.aio.AioRpcError) as exc:
            if not _is_connection_trouble(exc):
                self.answered()  # etcd's answer, if not the one asked for
            if _is_token_refused(exc):  # expired, or etcd restarted: authenticate again
                if self.user is None:
                    raise self.refused(exc) from exc
                raise _TokenRefused(client) from exc
            if _is_auth_refusal(exc):  # no user given, or a wrong password: not an outage
                raise self.refused(exc) from exc
            if _is_too_large(exc):  # an answer about this request, not an outage: keep the client
                raise ReplyTooLarge(f"etcd's reply to {what} would pass gRPC's 4 MiB limit; "
                                    "read fewer entries at a time") from exc
            if _is_nospace(exc):  # etcd answered: the connection is fine, the disk is not
                raise self.full() from exc
            if isinstance(exc, (aetcd.exceptions.ConnectionFailedError,
                                aetcd.exceptions.ConnectionTimeoutError, grpc.aio.AioRpcError)):
                endpoint = self.endpoint
                await self.drop_client()
                if len(self.endpoints) > 1 and _is_unreachable(exc):
                    raise _Unreachable(self.unavailable(what, exc), endpoint) from exc
            raise self.unavailable(what, exc) from exc
        except (TimeoutError, OSError) as exc:
            await self.drop_client()
            raise self.unavailable(what, exc) from exc
        except asyncio.CancelledError as exc:
            # Closing a dropped client's channel cancels the calls still in flight on it;
            # that is etcd being away for this request, not this request being cancelled.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            raise self.unavailable(what, exc) from exc

    async def close(self) -> None:
        await self.drop_client()
        if self._closing:
            await asyncio.wait(set(self._closing), timeout=2)


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
