"""Fast loss detection: a node agent's dropped connection.

The node lease (`node_ttl_s`, 6 s) is what tells a control plane that a node has gone
silent, and it has to be long enough to ride out a slow heartbeat. Yet an agent that dies is
visible at once: the kernel closes its connections. So every agent keeps one presence
request open (`GET /v1/nodes/{name}/presence`), which the control plane holds for
`presence_hold_s` (a second, `worker.protocol.Timeouts`) and then answers, and the agent
asks again at once. A connection that closes while it is held is a dropped connection. A
dropped connection alone may be a network blip (an agent that reconnects), so it takes a
second signal before the control plane revokes the node's lease: a survivor's report of a
broken peer (a worker of a job the node is a member of saw its process group break, or the
node leaders' ring of connections saw the node's end close: worker/peer_watch.py;
`suspect`), and then the node is lost at once, the two signals agreeing (`GRACE_S`, 0); or,
without a report, the drop outlasting `BLIP_S` (5 s). A drop and a report agree only when
they are about the same node within `SUSPECT_WINDOW_S`; a blip that also broke the job's
process group (a partition of the node) costs the node its membership, which it takes back
by registering again, where waiting a second for it to reconnect would have saved one round:
the group had to form again anyway.

A dead process needs no second signal: it closes every connection it holds at once, where a
blip (the agent's own timeout, a proxy's cut) closes one. So every agent holds its presence
request on two connections of their own, half a hold apart (worker/agent.py): while one is
between two requests the other is held. When a drop leaves no request of the node held here
and none opened within `RECONNECT_S` (a live agent asks again within milliseconds), although
this replica held two connections of the node's a moment before (`PAIR_S`), every connection
of the agent closed: a dead process, lost at once, without a survivor's report. This is what
confirms the loss of a plain script's node, whose workers report nothing (an NCCL worker
blocked in a collective with a dead peer prints nothing). An agent whose two connections go to
two replicas shows each of them one connection: there the blip bound stays.

A revoke is exactly what a lapsed lease does (the node
record goes, the scheduler treats the node as lost and its jobs move on), only seconds
sooner. A report alone revokes nothing: a peer whose connection is held is alive (its worker
died, not its agent); one whose agent is between two presence requests (it asks again within
milliseconds) gets `REASK_S` to do so. The lease stays the backstop for a node that goes
silent without closing anything (power, a partition, a stopped agent).

Suspicions are shared: the replica that gets a broken-peer report need not be the one that
holds the suspect's presence request (an agent talks to one replica, a survivor's worker may
report to another). Each report is also written to etcd (`Keys.suspect`, bound to the node's
lease, with the reporter's wall-clock time), and a replica whose held connection dropped reads
it every `SHARED_POLL_S` while it waits for a second signal, so a report to replica B and a
drop on replica A confirm each other in either order, as they do on one replica
(tests/service/test_presence.py). What is not shared: a suspect whose agent died between two
presence requests (it dropped nothing while held) is checked at once only by the replica
that owns its presence if the report came there; elsewhere the lease is the backstop.

With several control planes an agent may reconnect to another replica: the first request
a replica holds for a node writes the presence key (`Keys.presence`, bound to the node's
lease) with the replica's id, and a replica revokes only if that key still names it. The
lease revoked is the one the node had when the connection dropped: an agent that
registered again since (a new lease) is not touched. A control plane that stops (or is
killed) revokes nothing: its held requests end normally, or not at all.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Awaitable, Callable

from service.keys import Keys
from service.nodes import CONNECTION_CLOSED, note_departure
from service.store.api import KeyValue

log = logging.getLogger(__name__)

GRACE_S = 0.0  # a dropped connection confirmed by a broken-peer report, not back within this: lost
REASK_S = 0.3  # a suspect whose agent held no presence request here: lost unless it asks within this
BLIP_S = 5.0  # a dropped connection not back within this is lost without a second signal
SUSPECT_WINDOW_S = 3.0  # a broken-peer report confirms a drop from this long before it on
RECONNECT_S = 0.5  # every connection closed and none back within this: a dead process, lost
PAIR_S = 5.0  # how recently two connections of a node must have been held here for that
SHARED_POLL_S = 0.2  # how often a drop waiting for a second signal reads the shared suspicions
REPORTED = "a survivor reported a broken peer"
ALL_CLOSED = "every connection of its agent closed: a dead process"


class Presence:
    """This replica's presence requests and the checks after dropped ones."""

    def __init__(self, kv: KeyValue, keys: Keys, grace_s: float = GRACE_S, blip_s: float = BLIP_S,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time):
        self.kv = kv
        self.keys = keys
        self.grace_s = grace_s
        self.blip_s = max(blip_s, grace_s)
        self.clock = clock
        self.wall = wall  # the clock of the suspicions shared with other replicas
        self._suspected: dict[str, float] = {}  # node -> when a survivor last reported it broken
        self._holding: dict[str, int] = {}  # node -> its presence requests held here now
        self.replica = secrets.token_hex(8)
        self._opened: dict[str, float] = {}  # node -> when its latest presence request came here
        self._conns: dict[str, dict[str, float]] = {}  # node -> its connections held here -> when
        self._owned: dict[str, int] = {}  # node -> the lease under which the presence key names us
        self._checks: set[asyncio.Task] = set()
        self._wake: dict[str, set[asyncio.Event]] = {}  # node -> its waiting checks' events (`suspect`)
        self.revoked: list[str] = []  # nodes this replica found lost (for tests and logs)

    async def hold(self, name: str, lease: int, receive: Callable[[], Awaitable[dict]],
                   hold_s: float, conn: str | None = None) -> bool:
        """Hold node `name`'s presence request (on connection `conn`, the client's address)
        for `hold_s`; False if its connection dropped meanwhile (then the check for a second
        signal is started)."""
        opened = self.clock()
        self._opened[name] = opened
        self._note_conn(name, conn, opened)
        if self._owned.get(name) != lease:
            value = json.dumps({"replica": self.replica}).encode()
            await self.kv.put(self.keys.presence(name), value, lease=lease)
            self._owned[name] = lease
        self._holding[name] = self._holding.get(name, 0) + 1
        try:
            async with asyncio.timeout(hold_s):
                while (await receive())["type"] != "http.disconnect":
                    pass
        except TimeoutError:
            return True
        finally:
            self._holding[name] -= 1
        self._start_check(name, lease, self.clock())
        return False

    def _note_conn(self, name: str, conn: str | None, now: float) -> None:
        seen = self._conns.setdefault(name, {})
        if conn is not None:
            seen[conn] = now
        for old in [c for c, t in seen.items() if now - t > PAIR_S]:
            del seen[old]

    def _all_closed(self, name: str, dropped: float) -> bool:
        """Every connection of `name`'s agent closed at `dropped`: none held here or opened
        since, `RECONNECT_S` on, where two were held a moment before (a dead process)."""
        paired = sum(1 for t in self._conns.get(name, {}).values() if dropped - t <= PAIR_S) >= 2
        return (paired and self.clock() - dropped >= RECONNECT_S and not self._holding.get(name)
                and self._opened.get(name, 0.0) <= dropped)

    def _start_check(self, name: str, lease: int, dropped: float, grace_s: float | None = None) -> None:
        self._spawn(self._check(name, lease, dropped, self.grace_s if grace_s is None else grace_s))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def suspect(self, nodes: list[str]) -> None:
        """A survivor's report of a broken peer: each of `nodes` whose connection dropped (or
        drops soon) is lost: at once, or after REASK_S if it held no request here."""
        now = self.clock()
        for name in nodes:
            self._suspected[name] = now
            if waiting := self._wake.get(name):
                for wake in waiting:
                    wake.set()  # a drop waiting for its second signal: this is it
            # An agent that died between two presence requests dropped nothing while held:
            # a suspect whose presence this replica owns but holds no request of is checked
            # as if it had dropped now, after the moment a live agent takes to ask again.
            elif name in self._owned and not self._holding.get(name):
                self._start_check(name, self._owned[name], now, grace_s=max(self.grace_s, REASK_S))
        for name, when in list(self._suspected.items()):  # forget the old ones
            if now - when > SUSPECT_WINDOW_S:
                del self._suspected[name]
        if nodes:
            self._spawn(self._share(list(nodes), self.wall()))

    async def _share(self, nodes: list[str], at: float) -> None:
        """Write each suspicion to etcd, bound to the node's lease, for whichever replica holds
        (or will hold) the node's presence request."""
        value = json.dumps({"at": at, "by": self.replica}).encode()
        for name in nodes:
            try:
                record = await self.kv.get(self.keys.node(name))
                if record is not None and record.lease:
                    await self.kv.put(self.keys.suspect(name), value, lease=record.lease)
            except Exception as exc:  # noqa: BLE001 - the blip bound and the lease remain
                log.warning("could not share the suspicion of node %s (%s)", name, exc)

    async def _shared_confirms(self, name: str, dropped: float) -> bool:
        """A suspicion of `name` shared by any replica confirms a drop at `dropped` (this
        replica's clock): reported from SUSPECT_WINDOW_S before it on, in wall-clock time."""
        try:
            entry = await self.kv.get(self.keys.suspect(name))
        except Exception:  # noqa: BLE001 - read again at the next poll
            return False
        if entry is None:
            return False
        dropped_wall = self.wall() - (self.clock() - dropped)
        return json.loads(entry.value).get("at", float("-inf")) >= dropped_wall - SUSPECT_WINDOW_S

    def _is_confirmed(self, name: str, dropped: float) -> bool:
        return self._suspected.get(name, float("-inf")) >= dropped - SUSPECT_WINDOW_S

    async def _second_signal(self, name: str, dropped: float, wake: asyncio.Event) -> str | None:
        """Wait for a broken-peer report of `name` (here: at once; through etcd: within
        `SHARED_POLL_S`), or for every connection of its agent to be closed (`_all_closed`),
        until the drop outlasts `blip_s` or the node asks again; the signal that came, if one did."""
        read_at = self.clock()
        while True:
            wake.clear()  # (before the checks: a report while they await wakes the wait below)
            if self._is_confirmed(name, dropped):
                return REPORTED
            if self._all_closed(name, dropped):
                return ALL_CLOSED
            now = self.clock()
            if now - dropped >= self.blip_s or self._opened.get(name, 0.0) > dropped:
                return None  # the bound, or it asked again here (the caller sees which)
            if now >= read_at:  # a report to another replica confirms it too
                read_at = now + SHARED_POLL_S
                if await self._shared_confirms(name, dropped):
                    return REPORTED
            until = min(read_at, dropped + self.blip_s)
            if now < dropped + RECONNECT_S:
                until = min(until, dropped + RECONNECT_S)
            try:
                async with asyncio.timeout(max(0.0, until - self.clock())):
                    await wake.wait()
            except TimeoutError:
                pass

    async def _check(self, name: str, lease: int, dropped: float, grace_s: float) -> None:
        """Revoke the node's lease unless it comes back: once a broken-peer report or the close
        of every connection of its agent confirms the drop (and `grace_s` has passed since it),
        or when the drop outlasts `blip_s` unconfirmed."""
        wake = asyncio.Event()
        self._wake.setdefault(name, set()).add(wake)
        try:
            confirmed = await self._second_signal(name, dropped, wake)
        finally:
            waiting = self._wake[name]
            waiting.discard(wake)
            if not waiting:
                del self._wake[name]
        if confirmed and grace_s > 0:
            await asyncio.sleep(max(0.0, dropped + grace_s - self.clock()))
        if self._opened.get(name, 0.0) > dropped:
            return  # it asked again here
        signal = confirmed or f"no second signal, but it outlasted {self.blip_s:g} s"
        try:
            presence = await self.kv.get(self.keys.presence(name))
            if presence is None or json.loads(presence.value).get("replica") != self.replica:
                return  # gone with its lease already, or another replica holds it now
            record = await self.kv.get(self.keys.node(name))
            if record is None or record.lease != lease:
                return  # deregistered, or registered again under a new lease
            log.warning("node %s lost: its agent's connection dropped and did not come back (%s); "
                        "its lease is revoked", name, signal)
            self._owned.pop(name, None)
            self.revoked.append(name)
            await note_departure(self.kv, self.keys, name, lease, CONNECTION_CLOSED)
            await self.kv.revoke_lease(lease)
        except Exception as exc:  # noqa: BLE001 - the lease is the backstop
            log.warning("could not act on node %s's dropped connection (%s); its lease will", name, exc)

    async def close(self) -> None:
        """Cancel the checks in flight (a control plane stopping revokes nothing)."""
        for task in list(self._checks):
            task.cancel()
