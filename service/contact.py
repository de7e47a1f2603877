"""This control plane's contact with etcd: its own outages, and what follows from them.

Every replica notes when it last reached etcd (`reached`, after a request that went
through) and looks, before acting (`observe`), at how long ago that was. A start, or a gap
of more than `GAP_S` (the process was stopped or starved, or etcd was out of its reach),
is an outage of its own, in which nobody's heartbeats could be heard through this replica:

- node leases lapsed meanwhile are not the nodes' fault: members whose node is gone get a
  grace before they count as lost (`service.decide.liveness.outage_grace`);
- the rendezvous keep-alives that torch's agents write into their state could not land
  either: the rendezvous routes tell clients of the outage (`recent_outage`), so that every
  reader, a node that joins afterwards included, treats the heartbeats it made stale as
  due rather than dead (`worker.rendezvous.outage`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from service.decide.liveness import outage_grace
from worker.protocol import ControlPlaneOutage

log = logging.getLogger(__name__)

GAP_S = 2.0  # longer without contact than this is an outage (the scheduler ticks every 0.5 s)
REPORT_S = 60.0  # how long after an outage ended the rendezvous routes mention it


class Contact:
    """When this replica last reached etcd; the outages between; the grace for lapsed nodes."""

    def __init__(self, node_ttl_s: float, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.node_ttl_s = node_ttl_s
        self._clock = clock
        self._wall = wall_clock
        self._last: float | None = None
        self.grace_until = 0.0  # wall clock: members whose node is gone are not lost before
        self.last_outage: ControlPlaneOutage | None = None

    def observe(self) -> None:
        """Before acting on etcd: note a start, or a gap since the last contact."""
        since = None if self._last is None else self._clock() - self._last
        now = self._wall()
        if since is None or since > GAP_S:
            # (each observe while etcd stays away moves `ended`; the last one is when it came back)
            began = 0.0 if since is None else now - since  # 0: unknown (this process just started)
            self.last_outage = ControlPlaneOutage(started=began, ended=now)
        grace = outage_grace(since, self.node_ttl_s)
        if grace is not None and now + grace.seconds > self.grace_until:
            if self.grace_until <= now:
                log.warning("%s: nodes whose leases lapsed get %.0f s to heartbeat again before they "
                            "count as lost", grace.reason, grace.seconds)
            self.grace_until = now + grace.seconds

    def reached(self) -> None:
        """A request to etcd went through."""
        self._last = self._clock()

    def recent_outage(self) -> ControlPlaneOutage | None:
        """This replica's last outage, if it ended within `REPORT_S`."""
        outage = self.last_outage
        return outage if outage is not None and self._wall() - outage.ended < REPORT_S else None
