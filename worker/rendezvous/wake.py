"""Waking on a change: torch's one-second poll of the rendezvous state, made a long poll.

Stock torch polls: a node waiting for others (to join, to complete the round) re-reads
the state once a second (`_delay(seconds=1)` after each `_Action.SYNC`), and its state
holder serves a cached copy for a second after each read. A restart goes through several
such waits: they were most of the time from a worker's death to the next round.
`wake_on_change` turns that one delay into a long poll of the state
(`FtrainRendezvousBackend.wait_for_change`) that ends as soon as another node writes, and
still after at most that second, so torch's timers (keep-alive, last call, deadlines) are
looked at at least as often as before; a wait that ends expires the holder's cache, so the
read after it is fresh. The cache itself stays: the agent's monitor asks
`num_nodes_waiting()` every --monitor-interval (0.1 s under the node agent), which must not become ten reads
a second per node.

dynamic_rendezvous's `_delay` is a module-level name, so the patch is process-wide; it
dispatches on a thread-local that the backend sets on each read or write, i.e. in the sync
that precedes the delay in the same thread, so each handler waits for its own state; a
thread with no such read pending (and every other delay) gets torch's own `_delay`. The
random skew (0 to 0.3 s) before a first join is skipped: it spreads joins for torch's c10d
store, and the control plane merges concurrent joins instead. Waits are at least
`MIN_WAKE_INTERVAL_S` apart (N nodes' heartbeats change the state N times a second), and a
failed wait sleeps the rest of the second. A torch whose handler lacks these internals keeps
the stock polling (a warning says so).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.elastic.rendezvous import RendezvousHandler, dynamic_rendezvous

if TYPE_CHECKING:
    from worker.rendezvous.backend import FtrainRendezvousBackend

log = logging.getLogger(__name__)

SYNC_DELAY_S = 1  # the delay torch's op executor takes after each _Action.SYNC
MIN_WAKE_INTERVAL_S = 0.05

# Per thread: (backend, token) of the state this thread last read or wrote through a backend
# that wakes on change (`synced`), and a state a wait read for the next `get_state` of this
# thread (`prefetched`, (backend, decoded state)). See the module docstring.
this_thread = threading.local()
_stock_delay: Callable[..., None] | None = None  # dynamic_rendezvous's own `_delay`
_patch_lock = threading.Lock()


def wake_on_change(handler: RendezvousHandler, backend: FtrainRendezvousBackend) -> bool:
    """Make `handler` (torch's, over `backend`) re-read the state as soon as another node
    changes it rather than once a second (module docstring); False: this torch's handler is
    not built as expected, and it keeps polling as stock torch does."""
    holder = getattr(handler, "_state_holder", None)
    executor = getattr(dynamic_rendezvous, "_DistributedRendezvousOpExecutor", None)
    run_code = getattr(getattr(executor, "run", None), "__code__", None)
    if not callable(getattr(dynamic_rendezvous, "_delay", None)) \
            or "_delay" not in getattr(run_code, "co_names", ()):
        problem = "its op executor does not call dynamic_rendezvous._delay"
    elif getattr(holder, "_backend", None) is not backend \
            or not isinstance(getattr(holder, "_last_sync_time", None), (int, float)):
        problem = "its state holder has no _backend and _last_sync_time"
    else:
        _patch_delay()
        # torch's state cache stays (the agent's monitor asks num_nodes_waiting() every
        # 0.1 s: that must not become ten reads a second per node); a wait that ends
        # expires it, so the read after the wait is a fresh one.
        backend._expire_cache = lambda: setattr(holder, "_last_sync_time", -1)
        backend._wakes_on_change = True
        return True
    log.warning("rendezvous %s: torch %s's DynamicRendezvousHandler is not built as ftrain expects "
                "(%s); it re-reads the state once a second, as stock torch does",
                backend._transport.rdzv_id, torch.__version__, problem)
    return False


def _patch_delay() -> None:
    global _stock_delay
    with _patch_lock:
        if dynamic_rendezvous._delay is not _delay_or_wait_for_change:
            _stock_delay = dynamic_rendezvous._delay
            dynamic_rendezvous._delay = _delay_or_wait_for_change


def _delay_or_wait_for_change(seconds: float | tuple[float, float]) -> None:
    """dynamic_rendezvous's `_delay`: after a SYNC of a handler over a backend that wakes on
    change, wait for that handler's state to change; any other delay is torch's."""
    synced = getattr(this_thread, "synced", None)
    this_thread.synced = None
    if isinstance(seconds, tuple):
        # torch's random skew (0 to 0.3 s) before a handler's first join spreads the joins
        # over time for its c10d store; the control plane merges concurrent joins into one
        # write per batch (worker.rdzv_state), so the skew would only delay every new
        # attempt's group (by 0.15 s on average: after a lost node, at a drain, at a start).
        return
    if synced is None or seconds != SYNC_DELAY_S:
        assert _stock_delay is not None
        _stock_delay(seconds=seconds)
        return
    backend, token = synced
    backend.wait_instead_of_poll(seconds, token)
