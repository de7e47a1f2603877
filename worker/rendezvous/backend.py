"""torch's `RendezvousBackend` kept by the control plane: the pickled rendezvous state,
written by compare-and-set on a fencing token (the state key's etcd revision), and read
either at once or, to wake a waiting node as soon as another one writes, by a long poll
(`wait_for_change`, answered by an etcd watch on the server; see `wake.py`).

The state travels and rests sealed (`worker.protocol.seal_state`: a header and its SHA-256):
a stored state that does not open (damaged in etcd, or not written by a rendezvous client)
raises `RendezvousStateError`, as torch's own backends do for a state they cannot decode,
instead of being handed to torch's unpickler as if it were valid."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend

from ..protocol import (
    RdzvState,
    SetStateRequest,
    SetStateResult,
    StateChange,
    StateNotSealed,
    open_state,
    seal_state,
    state_version,
)
from ..rdzv_state import MAX_OPS, MergeSpec, NotAState, Op, RdzvDoc, infer_ops, refresh_ops
from . import marks
from .merge import from_doc, to_doc
from .outage import refresh_stale_heartbeats
from .transport import ControlPlaneUnreachable, RendezvousGoneError, Transport
from .wake import MIN_WAKE_INTERVAL_S, this_thread

log = logging.getLogger(__name__)
Reply = TypeVar("Reply", bound=BaseModel)

NO_STATE_TOKEN = "0"  # the long poll's token for "no state yet"
# A joined node's wait for its round's progress (`_quiet_s`) lasts at most as long as the
# control plane holds a long poll (`Transport.long_poll_s`): what torch's join timeout may be
# overrun by. This much while the control plane keeps the node alive (it writes the node's
# keep-alives while the node polls; `service.rendezvous`): torch then has nothing to do
# until the round moves.
MAX_KEPT_QUIET_S = 30.0
# The most refreshed heartbeats a merged write carries one by one (`refresh` ops, ~100 bytes
# each, under the control plane's 64 KiB body limit); past it, each node's own keep-alive
# refreshes its own. An outage's refresh is usually one `refresh_stale` op, whatever N.
MAX_REFRESH_OPS = 256


class LongPollUnsupported(RendezvousError):
    """The control plane answers a state long poll as a plain read (it predates the long poll)."""


class FtrainRendezvousBackend(RendezvousBackend):
    """torch's `RendezvousBackend` kept by the control plane (etcd compare-and-set)."""

    def __init__(self, transport: Transport):
        self._transport = transport
        self._seen_token: str | None = None  # of the last state read or written, any thread
        self._wakes_on_change = False  # set by `wake_on_change`
        self._expire_cache: Callable[[], None] = lambda: None  # the handler's cache, ditto
        self._long_poll = True  # False once the control plane turned out not to have it
        self._last_wake = -MIN_WAKE_INTERVAL_S
        # torch's keep-alive interval and window (interval x max attempts), set by
        # `create_ftrain_handler`: with them, heartbeats an outage made stale count as due
        # (`outage.refresh_stale_heartbeats`); without, states are handed on as they are.
        self.keep_alive: tuple[timedelta, timedelta] | None = None
        # torch's (min_nodes, max_nodes, last_call) of the handler, set by
        # `create_ftrain_handler`: with them, a join, wait or keep-alive is sent as ops the
        # control plane merges (worker.rdzv_state); without, every write is compare-and-set.
        self.merge_settings: tuple[int, int, timedelta] | None = None
        # token -> the state handed to torch, as data, and the `refresh` ops that made it from
        # the stored state (heartbeats an outage made stale, moved to due: `outage.py`)
        self._read_docs: dict[str, tuple[RdzvDoc, list[Op]]] = {}
        # This handler's node (addr, pid, local_id) and torch's keep-alive interval, set by
        # `dynamic_handler`: with them, a node that joined an open round waits for the round's
        # progress only, until its own keep-alive or the deadline is due (`_quiet_s`).
        self.this_node: tuple[tuple[str, int, int], timedelta] | None = None
        # Set by `dynamic_handler` as `next_rendezvous` begins, cleared by its first write
        # (`_wait_after_leaving`).
        self.rejoining = False

    @property
    def name(self) -> str:
        return "ftrain"

    def get_state(self) -> tuple[bytes, Any] | None:
        prefetched = getattr(this_thread, "prefetched", None)
        this_thread.prefetched = None
        if prefetched is not None and prefetched[0] is self:
            decoded = prefetched[1]  # read by this thread's wait a moment ago
        else:
            decoded = self._decode(self._read(RdzvState, self._call("GET", "/state")))
        self._saw(None if decoded is None else decoded[1])
        return decoded

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        this_thread.prefetched = None
        # A token that is not ours (torch only hands back what we gave it) cannot match.
        token = None if token is None else str(token)
        doc = to_doc(state) if self.merge_settings is not None else None
        merge = self._merge_of(doc, token) if doc is not None else None
        if self.rejoining:
            self.rejoining = False
            if merge is not None:
                self._wait_after_leaving(merge, doc, token)
        if merge is not None:  # the ops rebuild the state from the state at `token`
            body = SetStateRequest.model_construct(state=None, token=token, merge=merge)
        elif doc is not None:
            body = SetStateRequest(state=seal_state(doc.to_json(), version=2), token=token)
        else:
            body = SetStateRequest(state=seal_state(state), token=token)
        result = self._read(SetStateResult, self._call("PUT", "/state", body))
        marks.mark("state_set", written=result.written, token=result.token,
                   ops=None if merge is None else [op.kind for op in merge.ops])
        decoded = self._decode(result)
        self._saw(None if decoded is None else decoded[1])
        if decoded is None:
            return None
        return decoded[0], decoded[1], result.written

    def _merge_of(self, doc: RdzvDoc, token: str | None) -> MergeSpec | None:
        """`doc`'s change from the state read at `token`, as ops the control plane merges, with
        the heartbeats this node refreshed after an outage; None: send the whole state."""
        read, refreshed = (RdzvDoc(), []) if token is None else self._read_docs.get(token, (None, []))
        if read is None:
            return None
        min_nodes, max_nodes, last_call = self.merge_settings
        merge = infer_ops(read, doc, min_nodes, max_nodes, last_call // timedelta(microseconds=1))
        if merge is None:
            return None
        if len(refreshed) > MAX_REFRESH_OPS:
            refreshed = []  # each node's own keep-alive refreshes it (a body limit)
        if len(merge.ops) + len(refreshed) > MAX_OPS:
            return None  # too many to merge: the whole state, compare-and-set
        # The refreshed heartbeats go too (the others' as well as this node's): a reader after
        # this write sees the group alive, as after a whole-state write.
        merge.ops[:0] = refreshed
        return merge

    def _wait_after_leaving(self, merge: MergeSpec, doc: RdzvDoc, token: str | None) -> None:
        """A node that leaves a complete round to join the next one (torch's exit op, the first
        write of `next_rendezvous`) joins its wait list in the same write, when torch's join op
        would put it there right after (the round stays complete without it, and has room):
        one round trip fewer before the others see it waiting. torch then finds itself on the
        wait list, as after its own `ADD_TO_WAIT_LIST`, and waits. `wait_if_room`, not `wait`:
        where the others left meanwhile and the round reopened, the leave is written alone (a
        `wait` would fail the write, and torch would send the leave again)."""
        read = self._read_docs.get(token) if token is not None else None
        if read is None or self.this_node is None:
            return
        node = self.this_node[0]
        last = merge.ops[-1]
        if last.kind != "drop" or last.node is None or tuple(last.node) != node:
            return
        before = read[0]
        if not (before.complete and node in before.participants) or before.closed:
            return
        if not doc.complete or doc.closed or not doc.participants or node in doc.participants \
                or len(doc.participants) >= merge.max_nodes or node in doc.wait_list \
                or node in doc.redundancy_list or len(merge.ops) >= MAX_OPS:
            return
        merge.ops.append(Op(kind="wait_if_room", node=node, at_us=int(time.time() * 1e6)))

    def wake_on_change(self, expire_cache: Callable[[], None]) -> None:
        """From now on each read or write is followed by a wait for a change, not torch's
        one-second poll, and a wait that ends calls `expire_cache` (`wake.wake_on_change`)."""
        self._expire_cache = expire_cache
        self._wakes_on_change = True

    def wait_for_change(self, timeout_s: float, after: str | None = None) -> bool:
        """Wait until the state's token is no longer `after` (default: the last one this
        backend read or wrote) or `timeout_s` has passed; True if it changed.

        The state that came back is handed to this thread's next `get_state`, which then
        makes no request of its own.

        Raises:
            LongPollUnsupported: the control plane predates the long poll.
        """
        return self._wait(timeout_s, after)[0]

    def _wait(self, timeout_s: float, after: str | None) -> tuple[bool, bool]:
        """`wait_for_change`, and whether the control plane keeps this node alive and nothing
        it waits for changed (then no state came, and none is handed to `get_state`)."""
        after = after if after is not None else (self._seen_token or NO_STATE_TOKEN)
        timeout_s = max(0.0, timeout_s)
        params = {"after": after, "wait_s": f"{timeout_s:.3f}"}
        read = self._read_docs.get(after)
        if read is not None and self._joined_open_round(read[0]):
            params["progress"] = read[0].progress()  # other nodes' joins do not end the wait
            (addr, pid, local_id), interval = self.this_node
            params["alive"] = f"{pid},{local_id},{addr}"  # its keep-alives written for it
            params["beat_s"] = f"{interval.total_seconds():g}"
        elif read is not None:  # other nodes' keep-alives alone do not end the wait
            params["shape"] = read[0].shape()
        result = self._call("GET", "/state", params=params,
                            deadline=time.monotonic() + timeout_s, wait_s=timeout_s)
        if "changed" not in result:
            raise LongPollUnsupported(f"the control plane at {self._transport.base_url} has no "
                                      "long poll on the rendezvous state; upgrade it")
        change = self._read(StateChange, result)
        if change.kept_alive and not change.changed and change.state is None:
            return False, True
        decoded = self._decode(change)
        this_thread.prefetched = (self, decoded)
        return change.changed, False

    def wait_instead_of_poll(self, seconds: float, after: str | None) -> None:
        """What torch's `_delay(seconds=1)` after a SYNC does for a handler over this backend:
        return when the state changes, after at most `seconds`; a node that joined an open
        round waits for the round's progress (`_quiet_s`), polling again while the control
        plane keeps it alive and nothing changed."""
        clock = time.monotonic
        start = clock()
        deadline = start + max(seconds, self._quiet_s(after))
        pause = self._last_wake + MIN_WAKE_INTERVAL_S - start
        if pause > 0:
            time.sleep(pause)
        try:
            if self._long_poll:
                while True:
                    _, kept = self._wait(deadline - clock(), after or NO_STATE_TOKEN)
                    if kept:  # its keep-alive is not due: as long as the round's deadline allows
                        deadline = max(deadline, start + self._quiet_s(after, kept=True))
                    if not kept or clock() >= deadline - MIN_WAKE_INTERVAL_S:
                        return
        except LongPollUnsupported as exc:
            self._long_poll = False
            log.warning("rendezvous %s: %s; re-reading the state once a second instead",
                        self._transport.rdzv_id, exc)
        except RendezvousGoneError:
            return  # the next read raises it at once
        except Exception as exc:  # never worse than torch's own poll
            log.info("rendezvous %s: waiting for a state change failed (%s: %s); re-reading "
                     "it in a second instead", self._transport.rdzv_id, type(exc).__name__, exc)
        finally:
            self._last_wake = clock()
            self._expire_cache()
            marks.mark("woke", waited_s=round(self._last_wake - start, 4))
        time.sleep(max(0.0, deadline - clock()))

    def _joined_open_round(self, doc: RdzvDoc) -> bool:
        return self.this_node is not None and self.this_node[0] in doc.participants \
            and not doc.complete and not doc.closed

    def _quiet_s(self, after: str | None, kept: bool = False) -> float:
        """How long a node that joined an open round (in the state at `after`) has nothing to
        do but wait for the round's progress: until its own keep-alive is due (torch: its
        heartbeat `keep_alive_interval` old) or the last-call deadline, at most
        the control plane's long poll; while the control plane keeps it alive (`kept`), until the deadline,
        at most `MAX_KEPT_QUIET_S`. 0 for any other node, which keeps torch's one-second look."""
        read = None if after is None else self._read_docs.get(after)
        if read is None or not self._joined_open_round(read[0]):
            return 0.0
        doc, (node, interval) = read[0], self.this_node
        beat = doc.last_heartbeats.get(node)
        if beat is None:
            return 0.0
        now_us = time.time() * 1e6
        longest = MAX_KEPT_QUIET_S if kept else self._transport.long_poll_s
        due_us = now_us + longest * 1e6 if kept else beat + interval / timedelta(microseconds=1)
        if doc.deadline_us is not None:
            due_us = min(due_us, doc.deadline_us)
        return min(longest, max(0.0, (due_us - now_us) / 1e6))

    def _saw(self, token: Any) -> None:
        self._seen_token = None if token is None else str(token)
        if self._wakes_on_change:
            this_thread.synced = (self, self._seen_token)

    def _call(self, method: str, path: str, body: Any = None, **kwargs) -> dict:
        try:
            return self._transport.call(method, path, body, **kwargs)
        except ControlPlaneUnreachable as exc:
            raise RendezvousConnectionError(str(exc)) from exc

    @staticmethod
    def _read(model: type[Reply], result: dict) -> Reply:
        try:
            return model.model_validate(result)
        except ValidationError as exc:
            raise RendezvousStateError("the control plane sent a corrupt rendezvous state") from exc

    def _decode(self, result: RdzvState) -> tuple[bytes, Any] | None:
        if result.state is None:
            return None
        doc = None
        try:
            state = open_state(result.state)
            if state_version(result.state) == 2:
                doc = RdzvDoc.from_json(state)
                state = from_doc(doc)
        except (StateNotSealed, NotAState) as exc:
            raise RendezvousStateError(
                f"the rendezvous state of {self._transport.rdzv_id} on {self._transport.base_url} is "
                f"corrupt ({exc}); the control plane's etcd holds a damaged or foreign value at its "
                "key. Restarting the job's attempt gives it a fresh rendezvous.") from exc
        stored = doc
        if self.keep_alive is not None:  # outages this node saw, and the control plane's own
            now = time.time()
            for outage in (self._transport.last_outage, result.outage):
                refreshed = refresh_stale_heartbeats(state, outage, *self.keep_alive, now=now)
                if refreshed is not state:
                    state, doc = refreshed, to_doc(refreshed)
        if doc is not None and self.merge_settings is not None and result.token is not None:
            if len(self._read_docs) >= 4:
                self._read_docs.pop(next(iter(self._read_docs)))
            refreshed = refresh_ops(stored, doc) if stored is not None and stored is not doc else []
            self._read_docs[result.token] = (doc, refreshed)
        return state, result.token
