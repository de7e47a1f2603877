"""The cluster's contact with its nodes: outages in which no control plane could hear them.

The leading control plane notes in etcd when it last heard the nodes (`Keys.contact`, a
wall-clock time, every `liveness.HEARD_EVERY_S`; one small write every two seconds,
fenced on the leader's key like every leader-only write: `Leadership.fence`).
Every replica's scheduler loop notes when it last reached etcd itself (`reached`) and, on
each pass (`observe`), how long ago that was: when the replica has just started or comes
back from a gap of more than `GAP_S` (the process was stopped or starved, or etcd was out
of its reach), it reads that note (`settle`). An old note means an outage of the whole
cluster's control (`liveness.outage_since`), and then:

- members whose node lease lapsed in it get a grace before they count as lost
  (`graced`, per node: `service.decide.liveness`);
- the rendezvous keep-alives that torch's agents write into their state could not land
  either: the rendezvous routes tell clients of the outage for `REPORT_S` after it
  (`recent_outage`), so that every reader, a node that joins afterwards included, treats
  the heartbeats it made stale as due rather than dead for a short while
  (`worker.rendezvous.outage`).

A fresh note (another replica heard the nodes meanwhile, or the gap was too short for a
lease to lapse) or none at all (a fresh etcd) is no outage: a control plane that starts, or
a replica that was away while another served, changes nothing about how fast a node that
really died is found lost, or how fast its job's survivors re-form.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from service.decide.liveness import HEARD_EVERY_S, Outage, graced, outage_grace, outage_since
from service.errors import StaleLeader
from service.store.api import KeyValue, Put
from worker.protocol import ControlPlaneOutage

log = logging.getLogger(__name__)

GAP_S = 2.0  # longer without contact than this: look whether others heard (a pass is every 0.5 s)
REPORT_S = 60.0  # how long after an outage ended the rendezvous routes mention it


class Contact:
    """When this replica last reached etcd; the cluster's outages; the grace for lapsed nodes."""

    def __init__(self, kv: KeyValue, key: str, node_ttl_s: float,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        self.kv = kv
        self.key = key
        self.node_ttl_s = node_ttl_s
        self._clock = clock
        self._wall = wall_clock
        self._last: float | None = None  # monotonic: the last time this replica reached etcd
        self._unsure = True  # just started, or back from a gap: read the note before acting
        self._noted = float("-inf")  # monotonic: when this replica last wrote the note
        self.outage: Outage | None = None  # the cluster's last outage, as this replica knows it

    def observe(self) -> None:
        """Before a pass: a gap since the last contact makes the next `settle` look."""
        if self._last is None or self._clock() - self._last > GAP_S:
            self._unsure = True

    def reached(self) -> None:
        """A request to etcd went through."""
        self._last = self._clock()

    async def settle(self, fence: dict[str, int] | None) -> None:
        """With etcd reachable: if unsure, read the note and take in an outage it shows; while
        leading (`fence`: `Leadership.fence`, None when not), renew the note, fenced on the
        leader's key like every leader's write (StaleLeader if the lead was lost). Call before
        planning (the grace must be known by then)."""
        now = self._wall()
        if self._unsure:
            entry = await self.kv.get(self.key)
            last_heard = _parse(entry.value) if entry is not None else None
            outage = outage_since(last_heard, now, self.node_ttl_s)
            if outage is not None and (self.outage is None or outage.started >= self.outage.ended):
                self.outage = outage
                log.warning("no control plane heard the nodes for %.0f s: members whose node lease "
                            "lapsed meanwhile get until %.0f s after it to heartbeat again before "
                            "they count as lost", outage.ended - outage.started,
                            outage_grace(self.node_ttl_s))
            self._unsure = False
        if fence is not None and self._clock() - self._noted >= HEARD_EVERY_S:
            if not await self.kv.commit(fence, [Put(self.key, repr(now).encode())]):
                raise StaleLeader("this control plane no longer leads; it notes nothing")
            self._noted = self._clock()
        self.reached()

    def graced(self, missing_since: Mapping[str, float], now: float) -> frozenset[str]:
        """Of the member nodes seen missing (and since when), those not lost yet."""
        return graced(missing_since, self.outage, self.node_ttl_s, now)

    def recent_outage(self) -> ControlPlaneOutage | None:
        """The cluster's last outage, if it ended within `REPORT_S`."""
        o = self.outage
        if o is None or self._wall() - o.ended >= REPORT_S:
            return None
        return ControlPlaneOutage(started=o.started, ended=o.ended)


def _parse(value: bytes) -> float | None:
    try:
        return float(value.decode())
    except (UnicodeDecodeError, ValueError):
        return None  # not ours: as if none
