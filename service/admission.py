"""Admission control: node traffic first; user requests beyond what the control plane can
serve now are answered 429 with `Retry-After`.

One control plane serves users and nodes on one event loop. A burst of user requests (a
script submitting thousands of jobs, a dashboard left polling) fills that loop, and the
heartbeats of healthy nodes wait behind it until their leases lapse: nodes lost to user
load, their jobs restarted. So the two are told apart before anything else is done with a
request (`Admission`, the outermost ASGI layer):

* node traffic is never refused nor counted: every route that takes a node's token, a
  node's credential or a job's token (registration, heartbeats, reports, rendezvous,
  snapshot commits, progress, log shipments; the security schemes of the app's OpenAPI
  say which, `node_traffic`), and the health probes (a load balancer must not take a
  busy replica out of rotation);
* a user request (submissions, reads, cancels, the dashboard, anything else) is served
  while fewer than `UserLimit.limit` user requests are waiting for their answer; otherwise
  it waits for a place, in order of arrival, for up to `wait_s`, and is answered 429 with
  `Retry-After` if none came. The wait costs nothing but a parked task, and it is what
  slows a client that ignores `Retry-After`: answered 429 at once, such a client (a
  script's loop, wrk) comes back at once, and the cheap refusals then took the cores from
  the heartbeats (bench/api.py: more requests a second with 429s than without). A
  request leaves the count when its answer starts, so a log follow that streams for
  minutes holds no place.

The limit adapts to how late the control plane does the nodes' work, from two signals:
how late the event loop runs (`watch_lag`: a timer that should fire every `PROBE_S`
measures how much later it does), which covers every cause of a slow answer inside this
process (the requests' own work, what they set off in the background such as the
scheduler's passes over the jobs they queued, a machine whose cores other processes
took); and how long etcd takes to answer a flush of the nodes' lease keep-alives
(`service.heartbeats`), which a flood of user writes slows down. The limit is halved when
either is later than `target_lag_s` (at most once per `CUT_EVERY_S`, so that one long
pause cuts it once), and raised by one for each observation on time once nothing was late
for `CALM_S` (a late flush every half second is not outvoted by the loop's probes on
time between), up to `max_in_flight`: a burst is shed within a second or two, and a
control plane that keeps up serves as many at once as it may.
"""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

PROBE_S = 0.05  # how often the loop's lateness is measured
CUT_EVERY_S = 1.0  # the limit is halved at most this often (its effect takes a moment to show)
CALM_S = 1.0  # the limit grows again only after this long with nothing late
RETRY_AFTER_S = 1  # what a 429 asks the client to wait (whole seconds, as HTTP says)
MAX_WAITING = 4  # requests waiting for a place, at most, per place of `max_in_flight`
# The security schemes (service.deps) of a node's and a job's tokens: a route that takes
# only these is node traffic. A route that takes a user's token too (GET snapshots) is not.
NODE_SCHEMES = frozenset({"nodeToken", "nodeCredential", "jobToken"})
PROBE_TAG = "health"  # the routes of service.routes.health


class UserLimit:
    """How many user requests may wait for their answer at once, from how late node work
    runs (the lateness is told, the clock injected), and the requests waiting for a place."""

    def __init__(self, max_in_flight: int, target_lag_s: float, wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_in_flight = max_in_flight
        self.target_lag_s = target_lag_s
        self.wait_s = wait_s  # how long a request waits for a place before its 429
        self.limit = max_in_flight
        self.in_flight = 0
        self.refused = 0  # user requests answered 429 (GET /metrics)
        self._clock = clock
        self._cut_at = float("-inf")
        self._late_at = float("-inf")
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    async def admit(self) -> bool:
        """Take a place for a user request, waiting up to `wait_s` for one (in order of
        arrival); False: none came (answer 429, counted in `refused`)."""
        if self.in_flight < self.limit and not self._waiting:
            self.in_flight += 1
            return True
        if self.wait_s <= 0 or len(self._waiting) >= MAX_WAITING * self.max_in_flight:
            self.refused += 1
            return False
        place = asyncio.get_running_loop().create_future()
        self._waiting.append(place)
        try:
            async with asyncio.timeout(self.wait_s):
                await place
            return True
        except TimeoutError:
            if place.done() and not place.cancelled():  # handed over as the wait ran out
                return True
            self.refused += 1
            return False
        finally:
            if not place.done():
                place.cancel()  # (skipped when places are handed on)

    def release(self) -> None:
        """A user request's answer has started: its place is free."""
        self.in_flight -= 1
        self._hand_on()

    def _hand_on(self) -> None:
        """Give the free places to the requests waiting longest."""
        while self._waiting and self.in_flight < self.limit:
            place = self._waiting.popleft()
            if not place.done():
                self.in_flight += 1
                place.set_result(None)

    def observe_lateness(self, late_s: float) -> None:
        """Node work ran `late_s` late (the loop's lag, a keep-alive flush's wait on etcd):
        halve the limit if that is too late; raise it by one if nothing was for `CALM_S`."""
        now = self._clock()
        if late_s > self.target_lag_s:
            self._late_at = now
            if now - self._cut_at >= CUT_EVERY_S:
                self._cut_at = now
                self.limit = max(1, self.limit // 2)
        elif now - self._late_at >= CALM_S and self.limit < self.max_in_flight:
            self.limit += 1
            self._hand_on()


async def watch_lag(limit: UserLimit, probe_s: float = PROBE_S) -> None:
    """Tell `limit` how late the event loop runs, every `probe_s`, until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + probe_s
        await asyncio.sleep(probe_s)
        limit.observe_lateness(max(0.0, loop.time() - due))


def node_traffic(paths: dict) -> re.Pattern[str]:
    """A pattern of `"METHOD /path"` that matches the requests of node traffic, from the
    app's OpenAPI `paths`: the operations whose tokens are all of `NODE_SCHEMES`, and the
    health probes."""
    alternatives = []
    for path, operations in paths.items():
        # A path parameter is one segment (no operation of node traffic takes a `:path` one).
        pattern = "[^/]+".join(re.escape(p) for p in re.split(r"\{[^}]+\}", path))
        for method, op in operations.items():
            if _is_node_operation(op):
                methods = ("GET", "HEAD") if method == "get" else (method.upper(),)
                alternatives += [f"{m} {pattern}" for m in methods]
    return re.compile(f"^(?:{'|'.join(alternatives)})$" if alternatives else r"(?!)")


def _is_node_operation(op: dict) -> bool:
    if PROBE_TAG in op.get("tags", ()):
        return True
    schemes = {name for requirement in op.get("security", ()) for name in requirement}
    return bool(schemes) and schemes <= NODE_SCHEMES


class Admission:
    """Node traffic straight through; a user request through while `limit` has a place for
    it, else 429 with `Retry-After` (pure ASGI, the outermost layer; the module doc)."""

    def __init__(self, app: ASGIApp, limit: UserLimit, openapi: Callable[[], dict]):
        self.app = app
        self.limit = limit
        self._openapi = openapi  # () -> the app's OpenAPI (its routes come after this layer)
        self._node: re.Pattern[str] | None = None

    def is_node_traffic(self, method: str, path: str) -> bool:
        if self._node is None:
            self._node = node_traffic(self._openapi().get("paths", {}))
        return self._node.match(f"{method} {path}") is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_node_traffic(scope["method"], scope["path"]):
            return await self.app(scope, receive, send)
        if not await self.limit.admit():
            return await _too_many(send, self.limit.limit)
        held = True

        async def send_then_release(message) -> None:
            nonlocal held
            if held and message["type"] == "http.response.start":
                held = False
                self.limit.release()
            await send(message)

        try:
            await self.app(scope, receive, send_then_release)
        finally:
            if held:
                self.limit.release()


async def _too_many(send: Send, limit: int) -> None:
    body = json.dumps({"detail": f"the control plane is serving as many user requests as it can "
                                 f"now ({limit} at once; node traffic goes first); try again in "
                                 f"{RETRY_AFTER_S} s (Retry-After)"}).encode()
    await send({"type": "http.response.start", "status": 429,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body})
