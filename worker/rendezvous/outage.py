"""Riding out a control-plane outage: training goes on, membership changes are still seen.

While a group trains, torch's elastic agent talks to the rendezvous in two places, and
stock torch would end the group if the control plane were away for long:

- its monitor asks `num_nodes_waiting()` every --monitor-interval (0.2 s). Under the
  handler's heartbeat lock, the backend retries for `retry_timeout` (60 s) and then raises
  `RendezvousConnectionError`, which torch's `_invoke_run` does not catch: the agent shuts
  its workers down and torchrun exits with an error, a restart. Here the monitor's
  question gets a single try with a short read timeout (the next one comes 0.2 s later),
  and one that gets no answer is answered from the last answer that came (0 until a node
  waits: a waiting node makes the agent restart the group at once, so a later question is
  only asked after a 0). A node that joins while the control plane is away is seen when
  it answers again.
- the keep-alive timer (every `keep_alive_interval`) writes this node's heartbeat into
  the state. torch logs a failed one and carries on, but the try held the heartbeat lock
  (and so the monitor) for the whole `retry_timeout`; here it is retried for a few
  seconds, and once the control plane has been away for `KEEP_ALIVE_PROBE_S`, tried once
  every `KEEP_ALIVE_PROBE_S`.

After the outage, every heartbeat in the stored state is as old as the outage, and torch
drops a node whose heartbeat is older than `keep_alive_interval * keep_alive_max_attempt`
from its view of the state (`_sanitize`, on every read), this node included. It would
then never send a keep-alive again (it only refreshes a heartbeat it finds), the first
write of any node would drop the others for good, and a node that joins would find a
rendezvous of nobody: it would start a round of its own instead of waiting to be let in,
and the others would never see it waiting (measured: a third node joining after a 20 s
stop formed a group with one of the two, the other left paused). So, for `SETTLE_S` after
an outage, `refresh_stale_heartbeats` treats every heartbeat that was fresh when the
outage began as due now (neither dead nor fresh): each live node's next keep-alive writes
its own, and a node that died meanwhile is dropped a keep-alive window after the settling
ends, as torch would have dropped it. Outages are those the node saw itself (its
requests failed) and those the control plane reports of itself with every state
(`service.contact`: it was down, stopped or cut off from etcd), so a node that joins
afterwards, which saw none, reads the state the same way.
"""

from __future__ import annotations

import logging
import pickle
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from worker.rendezvous.transport import Transport

log = logging.getLogger(__name__)

MONITOR_READ_TIMEOUT_S = 2.0  # the read timeout of the monitor's one try
KEEP_ALIVE_RETRY_S = 3.0  # a keep-alive's retry budget (torch's: the whole retry_timeout)
KEEP_ALIVE_READ_TIMEOUT_S = 3.0
KEEP_ALIVE_PROBE_S = 5.0  # keep-alives once the control plane has been away this long
SETTLE_S = 30.0  # how long after an outage stale heartbeats count as due rather than dead


class AnOutage(Protocol):
    started: float  # wall clock, s; 0 for "unknown"
    ended: float


def refresh_stale_heartbeats(state: bytes, outage: AnOutage | None, interval: timedelta,
                             window: timedelta, now: float) -> bytes:
    """`state` (torch's pickled `_RendezvousState`) with the heartbeats an outage made stale
    moved to "due" (`now - interval`), for `SETTLE_S` after `outage` ended; unchanged
    otherwise. A heartbeat older than `window` when the outage began (a node already dead
    then) is left to torch. The outage is this node's (`Transport.last_outage`) or the
    control plane's own (`ControlPlaneOutage`, which a node that joins afterwards learns)."""
    if outage is None or now - outage.ended > SETTLE_S:
        return state
    try:
        decoded = pickle.loads(state)  # torch unpickles the same bytes right after this
    except Exception:  # noqa: BLE001 - torch raises its own RendezvousStateError for it
        return state
    beats = getattr(decoded, "last_heartbeats", None)
    if not isinstance(beats, dict):
        return state
    alive_then = datetime.fromtimestamp(outage.started, UTC) - window
    due = datetime.fromtimestamp(now, UTC) - min(interval, window / 2)
    stale = [n for n, beat in beats.items() if isinstance(beat, datetime) and alive_then <= beat < due]
    if not stale:
        return state
    for node in stale:
        beats[node] = due
    return pickle.dumps(decoded)


def ride_out_outages(handler: Any, transport: Transport,
                     clock: Callable[[], float] = time.monotonic) -> bool:
    """Make torch's `handler` keep its group through a control-plane outage (module
    docstring); False if this torch's handler lacks the internals it wraps."""
    settings = getattr(handler, "_settings", None)
    keep_alive = getattr(handler, "_keep_alive", None)
    waiting = getattr(handler, "num_nodes_waiting", None)
    if settings is None or not callable(keep_alive) or not callable(waiting) \
            or not isinstance(getattr(settings, "keep_alive_interval", None), timedelta):
        log.warning("rendezvous %s: torch's handler is not built as ftrain expects; a control-plane "
                    "outage longer than retry_timeout restarts the group", transport.rdzv_id)
        return False
    last = {"waiting": 0, "keep_alive": -KEEP_ALIVE_PROBE_S, "told": False}
    lock = threading.Lock()

    def num_nodes_waiting() -> int:
        try:
            with transport.briefly(0.0, MONITOR_READ_TIMEOUT_S):
                n = waiting()
        except RendezvousConnectionError as exc:
            with lock:
                if not last["told"]:
                    last["told"] = True
                    log.warning("rendezvous %s: the control plane does not answer (%s); the workers "
                                "train on, and nodes that join are seen once it answers again",
                                transport.rdzv_id, exc)
            return last["waiting"]
        with lock:
            last["waiting"], last["told"] = n, False
        return n

    def keep_alive_briefly() -> None:
        away_since = transport.failing_since
        if away_since is not None and time.time() - away_since > KEEP_ALIVE_PROBE_S \
                and clock() - last["keep_alive"] < KEEP_ALIVE_PROBE_S:
            return  # a long outage: it would fail too, and torch would log each one
        last["keep_alive"] = clock()
        with transport.briefly(KEEP_ALIVE_RETRY_S, KEEP_ALIVE_READ_TIMEOUT_S):
            keep_alive()

    handler.num_nodes_waiting = num_nodes_waiting
    handler._keep_alive = keep_alive_briefly
    return True
