"""A node's monitor that sees a waiting node at once: the rendezvous state followed by a long poll.

torch's agent asks `num_nodes_waiting()` every --monitor-interval, and the handler answers
from a copy of the state that it re-reads at most once a second (a read per node per monitor
tick would be too many). A node that joins the wait list (its worker died, it was restarted,
it is new) is therefore seen by the others up to a second plus a tick later; on GPUs, where a
survivor's worker stuck in an NCCL collective never fails by itself, that wait is the whole
time until the group re-forms. `follow_changes` keeps one long poll of the state open per
node (a thread), which sleeps through other nodes' keep-alives (it gives the state's `shape`)
and, when the state really changes, expires the handler's copy, so the next monitor tick reads
it: one read per change, not per tick.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from torch.distributed.elastic.rendezvous import RendezvousHandler

from ..protocol import StateChange, StateNotSealed, open_state, state_version
from ..rdzv_state import NotAState, RdzvDoc
from . import marks
from .monitor import wake_monitor
from .transport import RendezvousGoneError

if TYPE_CHECKING:
    from .backend import FtrainRendezvousBackend

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 1.0  # after a failed poll: torch's own once-a-second look still goes on


def follow_changes(handler: RendezvousHandler, backend: FtrainRendezvousBackend) -> None:
    """From `handler`'s first `num_nodes_waiting()` on (the agent's monitor, once its group
    formed), expire its cached state whenever the stored one changes (module docstring)."""
    asked = handler.num_nodes_waiting
    started = threading.Event()

    def num_nodes_waiting() -> int:
        if not started.is_set():
            started.set()
            threading.Thread(target=_follow, args=(backend,), name="ftrain-rdzv-follow",
                             daemon=True).start()
        return asked()

    handler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]


def _follow(backend: FtrainRendezvousBackend) -> None:
    after, shape = backend._seen_token or "0", None
    while True:
        wait_s = backend._transport.long_poll_s  # one long poll, as long as the control plane holds it
        params = {"after": after, "wait_s": f"{wait_s:.3f}"}
        if shape is not None:
            params["shape"] = shape
        try:
            change = StateChange.model_validate(backend._transport.call(
                "GET", "/state", params=params,
                deadline=backend._transport.deadline(), wait_s=wait_s))
        except RendezvousGoneError:
            return  # the attempt is over: so is this torchrun
        except Exception as exc:  # noqa: BLE001 - never worse than torch's own look once a second
            log.debug("following rendezvous %s: %s", backend._transport.rdzv_id, exc)
            threading.Event().wait(RETRY_PAUSE_S)
            continue
        if change.changed:
            backend._expire_cache()
            marks.mark("follow_change", token=change.token)
            wake_monitor()  # its next look reads the new state now, not an interval later
        if change.token is None or change.state is None:
            after, shape = "0", None
            continue
        after, shape = change.token, _shape(change.state)


def _shape(sealed: bytes) -> str | None:
    """The state's shape (everything but heartbeats), or None for a state that has none."""
    try:
        if state_version(sealed) != 2:
            return None
        return RdzvDoc.from_json(open_state(sealed)).shape()
    except (StateNotSealed, NotAState):
        return None
