"""Riding out a control-plane outage: training goes on, membership changes are still seen.

While a group trains, torch's elastic agent talks to the rendezvous in two places, and
stock torch would end the group if the control plane were away for long:

- its monitor asks `num_nodes_waiting()` every --monitor-interval (0.1 s). Under the
  handler's heartbeat lock, the backend retries for `retry_timeout` (60 s) and then raises
  `RendezvousConnectionError`, which torch's `_invoke_run` does not catch: the agent shuts
  its workers down and torchrun exits with an error, a restart. Here the monitor's
  question gets a single try with a short read timeout (the next one comes 0.1 s later),
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
stop formed a group with one of the two, the other left paused). So, for a short settling
time after an outage (`settle_s`: long enough for every live node to land a keep-alive,
`KEEP_ALIVE_PROBE_S` plus two intervals, and at least the keep-alive window),
`refresh_stale_heartbeats` treats a heartbeat that was fresh when the outage began and was
written before it ended as due now (neither dead nor fresh): each live node's next
keep-alive writes its own. Only those: a heartbeat written after the outage ended is left
to torch, so a node that dies once the control plane is back is dropped by torch's own
rules, as fast as without any outage. And not for long: a node that died during the outage
is dropped at the end of the settling time, as if it had died when the outage ended.
Outages are those the node saw itself (its requests failed) and those the control plane
reports of itself with every state (`service.contact`: no control plane could reach etcd
or hear the nodes; its own start is not one), so a node that joins afterwards, which saw
none, reads the state the same way.
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

from .. import torch_internals
from .transport import Transport

log = logging.getLogger(__name__)

MONITOR_READ_TIMEOUT_S = 2.0  # the read timeout of the monitor's one try
KEEP_ALIVE_RETRY_S = 3.0  # a keep-alive's retry budget (torch's: the whole retry_timeout)
KEEP_ALIVE_READ_TIMEOUT_S = 3.0
KEEP_ALIVE_PROBE_S = 5.0  # keep-alives once the control plane has been away this long


class AnOutage(Protocol):
    started: float  # wall clock, s; 0 for "unknown"
    ended: float


def settle_s(interval: timedelta, window: timedelta) -> float:
    """How long after an outage the heartbeats it made stale count as due (module docstring)."""
    return max(window.total_seconds(), KEEP_ALIVE_PROBE_S + 2 * interval.total_seconds())


def refresh_stale_heartbeats(state: bytes, outage: AnOutage | None, interval: timedelta,
                             window: timedelta, now: float) -> bytes:
    """`state` (torch's pickled `_RendezvousState`) with the heartbeats an outage made stale
    moved to "due" (`now - interval`, and never past the end of the settling time), for
    `settle_s` after `outage` ended; unchanged otherwise. Left to torch: a heartbeat older
    than `window` when the outage began (a node already dead then) and one written after it
    ended. The outage is this node's (`Transport.last_outage`) or the control plane's own
    (`ControlPlaneOutage`, which a node that joins afterwards learns)."""
    settle = timedelta(seconds=settle_s(interval, window))
    if outage is None or now - outage.ended >= settle.total_seconds():
        return state
    try:
        decoded = pickle.loads(state)  # torch unpickles the same bytes right after this
    except Exception:  # noqa: BLE001 - torch raises its own RendezvousStateError for it
        return state
    beats = getattr(decoded, "last_heartbeats", None)
    if not isinstance(beats, dict):
        return state
    alive_then = datetime.fromtimestamp(outage.started, UTC) - window
    ended = datetime.fromtimestamp(outage.ended, UTC)
    # Due now; but dead (torch: older than `window`) once the settling time is over.
    due = min(datetime.fromtimestamp(now, UTC) - min(interval, window / 2), ended + settle - window)
    stale = [n for n, beat in beats.items()
             if isinstance(beat, datetime) and alive_then <= beat < ended and beat < due]
    if not stale:
        return state
    for node in stale:
        beats[node] = due
    return pickle.dumps(decoded)


def ride_out_outages(handler: Any, transport: Transport,
                     clock: Callable[[], float] = time.monotonic) -> None:
    """Make torch's `handler` keep its group through a control-plane outage (module docstring)."""
    waiting = handler.num_nodes_waiting
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

    def briefly(keep_alive: Callable[[], None]) -> Callable[[], None]:
        def keep_alive_briefly() -> None:
            away_since = transport.failing_since
            if away_since is not None and time.time() - away_since > KEEP_ALIVE_PROBE_S \
                    and clock() - last["keep_alive"] < KEEP_ALIVE_PROBE_S:
                return  # a long outage: it would fail too, and torch would log each one
            last["keep_alive"] = clock()
            with transport.briefly(KEEP_ALIVE_RETRY_S, KEEP_ALIVE_READ_TIMEOUT_S):
                keep_alive()

        return keep_alive_briefly

    handler.num_nodes_waiting = num_nodes_waiting
    torch_internals.replace_keep_alive(handler, briefly)
