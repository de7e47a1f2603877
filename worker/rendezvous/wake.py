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
failed wait sleeps the rest of the second. The internals it uses (`_delay`, the holder's cache)
are checked by `worker.torch_internals`, which raises for a torch that changed them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from torch.distributed.elastic.rendezvous import RendezvousHandler

from .. import torch_internals

SYNC_DELAY_S = 1  # the delay torch's op executor takes after each _Action.SYNC
MIN_WAKE_INTERVAL_S = 0.05

# Per thread: (backend, token) of the state this thread last read or wrote through a backend
# that wakes on change (`synced`), and a state a wait read for the next `get_state` of this
# thread (`prefetched`, (backend, decoded state)). See the module docstring.
this_thread = threading.local()
_stock_delay: Callable[..., None] | None = None  # dynamic_rendezvous's own `_delay`


class WakingBackend(Protocol):
    """What a backend does for a handler that waits for a change (`FtrainRendezvousBackend`)."""

    def wait_instead_of_poll(self, seconds: float, after: str | None) -> None: ...

    def wake_on_change(self, expire_cache: Callable[[], None]) -> None: ...


def wake_on_change(handler: RendezvousHandler, backend: WakingBackend) -> None:
    """Make `handler` (torch's, over `backend`) re-read the state as soon as another node
    changes it rather than once a second (module docstring)."""
    global _stock_delay
    if torch_internals.backend_of(handler) is not backend:
        raise ValueError("the handler does not read its state through this backend")
    _stock_delay = torch_internals.patch(torch_internals.DELAY, lambda stock: _delay_or_wait_for_change)
    # torch's state cache stays (the agent's monitor asks num_nodes_waiting() every 0.1 s:
    # that must not become ten reads a second per node); a wait that ends expires it, so
    # the read after the wait is a fresh one.
    backend.wake_on_change(lambda: torch_internals.expire_cached_state(handler))


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
