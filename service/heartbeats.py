"""Node heartbeats answered from memory; the leases' keep-alives sent in batches.

A node is alive while its etcd lease is (`service.nodes`). A heartbeat used to be one
keep-alive, awaited before the answer: at the default TTL (6 s, a beat every 1.5 s) 5,000
nodes ask for 3,333 a second, each request waiting on etcd. Instead each control plane
keeps, per lease, when etcd last confirmed it alive (`confirmed`: when the keep-alive that
etcd answered was sent, or the grant), and

* a heartbeat on a lease confirmed less than `FAST_WITHIN` of a TTL ago is answered at once
  and noted; nothing goes to etcd;
* a flush, every `FLUSH_S`, sends one keep-alive for each noted lease that was confirmed at
  least `REFRESH_AFTER` of a TTL ago, all of them at once on the shared keep-alive stream
  (a noted lease confirmed later than that waits for a later flush), and learns which
  leases lapsed or were revoked: their next heartbeat answers 404 and the agent registers
  again;
* a heartbeat on a lease not confirmed lately (this replica's first beat of that node, a
  node back from a pause, a replica back from a gap, flushes failing because etcd is away)
  refreshes it at once, as before: 404 if it lapsed, 503 if etcd does not answer within
  `BEAT_WAIT` of a TTL;
* a heartbeat to a replica that seems cut off from etcd (`KeyValue.check_contact`: a request
  unanswered for a second) is 503 at once, so that the node takes its beats to another
  replica while its lease still has time (tests/faults/test_leader_cut.py, the etcd link cut).

Why a beating node's lease cannot lapse: a lease noted at `t` was confirmed at `c > t -
TTL/2`, and is refreshed by the first flush after `c + TTL/3`, that is before `c + TTL/3 +
FLUSH_S`, well inside its TTL (TTL >= 2 s). Why a node that stops is still lost: nothing
refreshes its lease after its last beat's flush, so it lapses at most a TTL and a flush
after that beat (the scheduler's `service.decide.liveness` margins cover a flush). Each
lease gets a keep-alive about every TTL/3 instead of every TTL/4.

What it costs: a lease revoked through another replica (a drained name registered again, a
restarted agent taking its name back there, an agent's leaving) is known here only at this
replica's next keep-alive of it, at most TTL/3 + FLUSH_S later; until then that node's
old heartbeats still answer 200 (they keep nothing alive: the lease is gone).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from service.errors import StoreUnavailable
from service.store.api import KeyValue

log = logging.getLogger(__name__)

FLUSH_S = 0.5
FAST_WITHIN = 1 / 2  # of a TTL: a beat on a lease confirmed this lately is answered from memory
REFRESH_AFTER = 1 / 3  # of a TTL: a noted lease confirmed this long ago is refreshed at the flush
BEAT_WAIT = 1 / 4  # of a TTL: the longest a heartbeat waits for etcd to confirm its lease
BATCH = 1000  # keep-alives in flight at once during a flush
REMEMBERED_LAPSES = 100_000


class LeaseKeeper:
    """Keeps the leases of heartbeating nodes alive with few keep-alives, none on the request
    path; knows which leases it found lapsed."""

    def __init__(self, kv: KeyValue, ttl_s: float, clock: Callable[[], float] = time.time):
        self._kv = kv
        self.ttl_s = ttl_s
        self._clock = clock
        self._confirmed: dict[int, float] = {}  # lease -> when etcd last said it was alive
        self._noted: set[int] = set()  # leases heard since their last keep-alive was sent
        self._lapsed: OrderedDict[int, None] = OrderedDict()
        self.keepalives = 0  # sent, by flushes and beats (for tests and the bench)
        # Told how long each flush waited for etcd's answers (service.admission sheds user
        # load when node work runs late).
        self.on_flush: Callable[[float], None] | None = None

    def granted(self, lease_id: int, at: float) -> None:
        """A lease this replica granted at `at` (asked then): alive for a TTL from then."""
        self._confirmed[lease_id] = at

    def ended(self, lease_id: int) -> None:
        """A lease this replica revoked (or found lapsed): its heartbeats answer 404."""
        self._confirmed.pop(lease_id, None)
        self._noted.discard(lease_id)
        self._lapsed[lease_id] = None
        while len(self._lapsed) > REMEMBERED_LAPSES:
            self._lapsed.popitem(last=False)

    async def beat(self, lease_id: int) -> bool:
        """A heartbeat on `lease_id`: False if the lease has lapsed (the node must register
        again). Raises StoreUnavailable only when it had to ask etcd and etcd did not answer."""
        if lease_id in self._lapsed:
            return False
        # A replica cut off from etcd answers 503 at once (the node goes to another replica
        # while its lease still has time), rather than 200 from memory. The lease is noted as
        # for any beat, so the flush goes on sending its keep-alives: if etcd was only slow
        # (a starved machine), they keep it alive as before.
        try:
            self._kv.check_contact()
        except StoreUnavailable:
            self._noted.add(lease_id)
            raise
        now = self._clock()
        confirmed = self._confirmed.get(lease_id)
        if confirmed is not None and now - confirmed < self.ttl_s * FAST_WITHIN:
            self._noted.add(lease_id)
            return True
        self.keepalives += 1
        try:
            # Bounded: a beat held for etcd's whole timeout (3.5 s) by a replica cut off just
            # after it came would leave the node too little of its lease to go elsewhere.
            async with asyncio.timeout(self.ttl_s * BEAT_WAIT):
                alive = await self._kv.refresh_lease(lease_id)
        except TimeoutError:
            self._noted.add(lease_id)  # the flush tries it again
            raise StoreUnavailable(f"etcd did not confirm the node's lease within "
                                   f"{self.ttl_s * BEAT_WAIT:g} s; try another replica") from None
        if alive:
            self._confirmed[lease_id] = now
            self._noted.discard(lease_id)
            return True
        self.ended(lease_id)
        return False

    async def flush(self) -> int:
        """Send the keep-alives that are due; returns how many were sent."""
        now = self._clock()
        due = [lease for lease in self._noted
               if now - self._confirmed.get(lease, 0.0) >= self.ttl_s * REFRESH_AFTER]
        # Leases nobody beat for a TTL: lapsed, or kept by another replica (a beat here
        # then refreshes at once).
        for lease in [lease for lease, at in self._confirmed.items() if now - at > self.ttl_s]:
            del self._confirmed[lease]
        for i in range(0, len(due), BATCH):
            chunk = due[i:i + BATCH]
            self._noted.difference_update(chunk)
            self.keepalives += len(chunk)
            results = await asyncio.gather(*(self._kv.refresh_lease(lease) for lease in chunk),
                                           return_exceptions=True)
            for lease, alive in zip(chunk, results, strict=True):
                if isinstance(alive, BaseException):
                    self._noted.add(lease)  # try again next flush (a beat past FAST_WITHIN asks etcd)
                    if not isinstance(alive, StoreUnavailable):
                        log.error("keep-alive of lease %x failed: %r", lease, alive)
                elif alive:
                    self._confirmed[lease] = now
                else:
                    self.ended(lease)
        if due and self.on_flush is not None:
            self.on_flush(self._clock() - now)
        return len(due)

    async def run(self, flush_s: float = FLUSH_S) -> None:
        """Flush every `flush_s` until cancelled."""
        while True:
            await asyncio.sleep(flush_s)
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lease keep-alive flush failed; trying again")
