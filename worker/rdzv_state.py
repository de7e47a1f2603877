"""torch's rendezvous state in a form the control plane can read, and the joins it merges.

torch's `DynamicRendezvousHandler` keeps one shared `_RendezvousState` and changes it by
compare-and-set: a node reads the state, decides one action (join, keep-alive, wait for the
next round), writes the whole state back on the token it read, and on a lost race reads again
and re-decides. With N nodes joining at once that is N winners out of about N^2/2 attempts,
each an HTTP request and an etcd transaction. Here the control plane merges instead.

The client (`worker.rendezvous.merge`) turns torch's pickle into a `RdzvDoc` (plain data:
nodes are (addr, pid, local_id), times are integer microseconds since the epoch) and sends it
as JSON, sealed as version 2 (`worker.protocol.seal_state`); the control plane never unpickles
anything. Where its change is one of the ops below, it sends the ops instead of the state
(`infer_ops`: a diff of its new state against the state it read, accepted only if
`apply_ops(read, ops)` rebuilds the new state exactly; so a join costs a few hundred bytes,
not the N nodes' state). The control plane applies the ops of every request in a batch to the state as
it is (`service.rendezvous`), so requests whose token went stale in the meantime are merged,
not refused: one etcd write per batch. An op applies only where torch, re-reading the state,
would have decided the same action (`apply_ops`'s rules); otherwise that request loses as
before and the client re-decides.

The ops are torch's own actions of `_DistributedRendezvousOpExecutor` (torch 2.11 to 2.13, the
versions `worker.torch_internals` is tested with):

- `refresh_stale`: the heartbeats that a control-plane outage made stale, moved to "due" by
  the client as it read the state (`worker.rendezvous.outage.refresh_stale_heartbeats`):
  every heartbeat in [`was_us`, `before_us`) becomes `at_us` (after `before_us`), so one
  member's write carries the others' refreshed heartbeats, as a whole-state write did, in
  one op whatever the number of nodes; a node that beat since is past the range and keeps
  its own. (`refresh`: the same for one node, where the moved heartbeats are not one range.)
- `expire`: the sanitizer's removal of every node whose heartbeat is older than `at_us`
  (the newest expired heartbeat of the state it read, plus 1 µs; a node that beat since is
  not dropped); one op however many expired, so the write that follows an outage of
  heartbeats (a thousand nodes dropped at once) is as small as a join. (`drop`: one node, by
  the heartbeat the client read, where the expired ones are not all the oldest; and a node's
  own leave, `_remove_from_participants` or `_remove_from_wait_list`.)
- `join` (`_add_to_participants`): valid while the round is open and the node is neither a
  participant nor redundant; at `min_nodes` participants the last-call deadline is set, at
  `max_nodes` the round completes and ranks are given in node order;
- `wait` (`_add_to_wait_list`): valid while a complete round has room;
- `wait_if_room`: the same, sent with a node's `drop` as it leaves a complete round to join
  the next (torch's exit op, then its join op would add it to the wait list): where it is not
  valid (the other nodes left too, and the round reopened) it changes nothing instead of
  failing the write, and torch's join op goes on from the state it gets back;
- `keep_alive`: valid while the node has a heartbeat.
Any other change (a round completed at its deadline, closing) is a plain compare-and-set, as
before. (`expire`, `refresh_stale` and `wait_if_room` are newer than the others: a control
plane that predates them refuses such a write with 422, so upgrade the control planes before
the nodes, as for any change of this wire contract.)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field, field_validator, model_validator

from .jsontypes import JsonBody, JsonInt, integral

MAX_OPS = 2048  # ops in one merged write
Node = tuple[str, int, int]  # torch's _NodeDesc: (addr, pid, local_id); sorted as torch sorts them


class NotAState(ValueError):
    """A version-2 state whose JSON is not a rendezvous state."""


@dataclass
class RdzvDoc:
    """torch's `_RendezvousState` as plain data (times: microseconds since the epoch, UTC)."""

    round: int = 0
    complete: bool = False
    deadline_us: int | None = None
    closed: bool = False
    participants: dict[Node, int] = field(default_factory=dict)
    wait_list: set[Node] = field(default_factory=set)
    redundancy_list: set[Node] = field(default_factory=set)
    last_heartbeats: dict[Node, int] = field(default_factory=dict)

    def copy(self) -> RdzvDoc:
        return RdzvDoc(self.round, self.complete, self.deadline_us, self.closed,
                       dict(self.participants), set(self.wait_list), set(self.redundancy_list),
                       dict(self.last_heartbeats))

    def shape(self) -> str:
        """A digest of everything but the heartbeats: what a node waiting for its round decides
        on (torch looks at heartbeats only against the clock, at least once a second anyway),
        so a long poll can sleep through other nodes' keep-alives (`service.rendezvous`)."""
        beats, self.last_heartbeats = self.last_heartbeats, {}
        try:
            return hashlib.sha256(self.to_json()).hexdigest()[:16]
        finally:
            self.last_heartbeats = beats

    def progress(self) -> str:
        """A digest of the round's progress only (round, complete, closed, last-call deadline):
        all a node that already joined an open round waits for, besides the clock (its own
        keep-alive, the deadline), so its long poll sleeps through the other nodes' joins
        (`FtrainRendezvousBackend.wait_instead_of_poll`)."""
        return hashlib.sha256(json.dumps(["progress", self.round, self.complete, self.closed,
                                          self.deadline_us]).encode()).hexdigest()[:16]

    def to_json(self) -> bytes:
        return json.dumps({
            "round": self.round, "complete": self.complete, "deadline_us": self.deadline_us,
            "closed": self.closed,
            "participants": [[*n, r] for n, r in sorted(self.participants.items())],
            "wait_list": [list(n) for n in sorted(self.wait_list)],
            "redundancy_list": [list(n) for n in sorted(self.redundancy_list)],
            "last_heartbeats": [[*n, t] for n, t in sorted(self.last_heartbeats.items())],
        }, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> RdzvDoc:
        try:
            raw = json.loads(data)
            doc = cls(round=_int(raw["round"]), complete=_bool(raw["complete"]),
                      deadline_us=None if raw["deadline_us"] is None else _int(raw["deadline_us"]),
                      closed=_bool(raw["closed"]),
                      participants={_node(e[:3]): _int(e[3]) for e in _rows(raw["participants"], 4)},
                      wait_list={_node(e) for e in _rows(raw["wait_list"], 3)},
                      redundancy_list={_node(e) for e in _rows(raw["redundancy_list"], 3)},
                      last_heartbeats={_node(e[:3]): _int(e[3]) for e in _rows(raw["last_heartbeats"], 4)})
        except (ValueError, KeyError, TypeError) as exc:
            raise NotAState(f"not a rendezvous state: {exc}") from None
        return doc


def _int(value) -> int:
    if type(value) is not int:
        raise ValueError(f"{value!r} is not an integer")
    return value


def _bool(value) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{value!r} is not a boolean")
    return value


def _rows(value, width: int) -> list[list]:
    if not isinstance(value, list) or not all(isinstance(e, list) and len(e) == width for e in value):
        raise ValueError(f"expected rows of {width}")
    return value


def _node(row) -> Node:
    addr, pid, local_id = row
    if not isinstance(addr, str):
        raise ValueError(f"{addr!r} is not a node address")
    return addr, _int(pid), _int(local_id)


NODELESS = ("expire", "refresh_stale")  # ops on every node they match, not on one


class Op(JsonBody):
    """One node's change to the state, replayable on a newer state (module docstring)."""

    kind: Literal["refresh", "drop", "join", "wait", "wait_if_room", "keep_alive", "expire", "refresh_stale"]
    node: tuple[str, JsonInt, JsonInt] | None = Field(None, description="The node it changes; none "
                                                                        "for expire and refresh_stale.")
    at_us: JsonInt = Field(..., description="The node's heartbeat it writes (drop: the expired one; "
                                            "expire: older heartbeats are dropped; refresh_stale: "
                                            "the heartbeat the stale ones get).")
    was_us: JsonInt | None = Field(None, description="refresh: the heartbeat it replaces (an outage "
                                                     "made it stale; the new one is 'due'); "
                                                     "refresh_stale: the oldest it replaces.")
    before_us: JsonInt | None = Field(None, description="refresh_stale: heartbeats before this one "
                                                        "(and from was_us on) are replaced; "
                                                        "refresh_stale needs was_us <= before_us "
                                                        "<= at_us.")
    deadline_us: JsonInt | None = Field(None, description="join: the last-call deadline it sets at "
                                                          "min_nodes participants.")

    @field_validator("node", mode="before")
    @classmethod
    def _integral_node(cls, v):
        return [integral(x) for x in v] if isinstance(v, (list, tuple)) else v

    @model_validator(mode="after")
    def _fields_of_kind(self) -> Op:
        if (self.node is None) != (self.kind in NODELESS):
            raise ValueError(f"a {self.kind} op {'takes no' if self.kind in NODELESS else 'needs a'} node")
        if self.kind == "refresh_stale" and (self.was_us is None or self.before_us is None
                                             or not self.was_us <= self.before_us <= self.at_us):
            raise ValueError("a refresh_stale op needs was_us <= before_us <= at_us")
        return self


class MergeSpec(JsonBody):
    """A state write the control plane may merge into a newer state (`apply_ops`)."""

    ops: list[Op] = Field(..., min_length=1, max_length=MAX_OPS)
    min_nodes: JsonInt = Field(..., ge=1)
    max_nodes: JsonInt = Field(..., ge=1)


def apply_ops(doc: RdzvDoc, merge: MergeSpec, in_place: bool = False) -> RdzvDoc | None:
    """`doc` with `merge`'s ops applied, or None if one of them is not valid on `doc` (then
    torch, re-reading `doc`, would have decided otherwise; see the module docstring).

    `in_place`: change `doc` itself where that is safe (one op, checked before it changes
    anything; the control plane's batches, where a copy per write would cost N per join)."""
    if not (in_place and len(merge.ops) == 1):
        doc = doc.copy()
    for op in merge.ops:
        if not _apply(doc, op, merge):
            return None
    return doc


def _apply(doc: RdzvDoc, op: Op, merge: MergeSpec) -> bool:
    """Apply one op to `doc` if it is valid there (checked before any change); else False."""
    if op.kind == "expire":
        for node in [n for n, t in doc.last_heartbeats.items() if t < op.at_us]:
            _drop(doc, node, merge.min_nodes)
        return True
    if op.kind == "refresh_stale":
        beats = doc.last_heartbeats
        for node, t in beats.items():
            if op.was_us <= t < op.before_us:
                beats[node] = op.at_us
        return True
    node = tuple(op.node)
    if op.kind == "refresh":
        if doc.last_heartbeats.get(node) == op.was_us:
            doc.last_heartbeats[node] = op.at_us
        return True
    if op.kind == "drop":
        if doc.last_heartbeats.get(node) == op.at_us:
            _drop(doc, node, merge.min_nodes)
        return True
    if op.kind == "keep_alive":
        if node not in doc.last_heartbeats:
            return False
    elif op.kind == "join":
        if doc.closed or doc.complete or node in doc.participants or node in doc.redundancy_list \
                or len(doc.participants) >= merge.max_nodes:
            return False
        doc.wait_list.discard(node)
        doc.participants[node] = 0
    elif op.kind == "wait":
        if doc.closed or not doc.complete or len(doc.participants) >= merge.max_nodes \
                or node in doc.wait_list or node in doc.participants:
            return False
        doc.redundancy_list.discard(node)
        doc.wait_list.add(node)
    elif op.kind == "wait_if_room":
        if doc.closed or not doc.complete or len(doc.participants) >= merge.max_nodes \
                or node in doc.wait_list or node in doc.participants or node in doc.redundancy_list:
            return True  # nothing: the node re-decides on the state it gets back (torch's join op)
        doc.wait_list.add(node)
    doc.last_heartbeats[node] = op.at_us
    if op.kind == "join":
        if len(doc.participants) == merge.min_nodes:
            doc.deadline_us = op.deadline_us
        if len(doc.participants) == merge.max_nodes:
            doc.complete = True
            doc.deadline_us = None
            for rank, member in enumerate(sorted(doc.participants)):
                doc.participants[member] = rank
    return True


# The deadline of a round whose last call the control plane ended (`end_last_call`): past
# on every node's clock, however far apart the clocks are.
ENDED_LAST_CALL_US = 1


def end_last_call(doc: RdzvDoc, expected_nodes: int, min_nodes: int) -> bool:
    """End an open round's last call once the `expected_nodes` nodes that the control plane
    gave the job's attempt have all joined; True if the deadline moved.

    torch waits `last_call_timeout` past `min_nodes` for latecomers, but only the job's member
    nodes may join its rendezvous, and all of them are in: the wait only delays the group (1 s
    of every agent SIGKILL's recovery, with ftrain's settings). The deadline moves into the
    past; the next participant to look marks the round complete, as torch does at its deadline.
    Never later than torch: a round short of its members keeps torch's deadline."""
    if doc.closed or doc.complete or doc.deadline_us is None or expected_nodes < 1:
        return False
    if len(doc.participants) < max(expected_nodes, min_nodes) or doc.deadline_us <= ENDED_LAST_CALL_US:
        return False
    doc.deadline_us = ENDED_LAST_CALL_US
    return True


def _drop(doc: RdzvDoc, node: Node, min_nodes: int) -> None:
    """torch's sanitizer on one dead node, with `_remove_participant_epilogue`."""
    del doc.last_heartbeats[node]
    doc.wait_list.discard(node)
    doc.redundancy_list.discard(node)
    if doc.participants.pop(node, None) is None:
        return
    if doc.complete:
        if not doc.participants:
            doc.complete = False
            doc.round += 1
    elif len(doc.participants) < min_nodes:
        doc.deadline_us = None


def refresh_ops(stored: RdzvDoc, refreshed: RdzvDoc) -> list[Op]:
    """The ops that turn the heartbeats of `stored` into those of `refreshed` (the same state
    after `refresh_stale_heartbeats`: only heartbeats moved, none added or gone): one
    `refresh_stale` where the moved ones are every heartbeat of a range, moved to one time
    (as an outage's refresh moves them), else a `refresh` per node."""
    moved = {n: (stored.last_heartbeats[n], t) for n, t in refreshed.last_heartbeats.items()
             if n in stored.last_heartbeats and stored.last_heartbeats[n] != t}
    if not moved:
        return []
    if len({t for _, t in moved.values()}) == 1:
        at = next(iter(moved.values()))[1]
        lo, hi = min(w for w, _ in moved.values()), max(w for w, _ in moved.values()) + 1
        if hi <= at and all(n in moved for n, t in stored.last_heartbeats.items() if lo <= t < hi):
            return [Op(kind="refresh_stale", at_us=at, was_us=lo, before_us=hi)]
    return [Op(kind="refresh", node=n, at_us=t, was_us=w) for n, (w, t) in sorted(moved.items())]


def _expire_ops(read: RdzvDoc, gone: dict[Node, int]) -> list[Op]:
    """The ops that drop the nodes `gone` (node -> its heartbeat in `read`; torch's sanitizer:
    expired heartbeats): one `expire` where they are exactly the heartbeats older than some
    time, else a `drop` per node."""
    if not gone:
        return []
    cutoff = max(gone.values()) + 1
    if all(t >= cutoff for n, t in read.last_heartbeats.items() if n not in gone):
        return [Op(kind="expire", at_us=cutoff)]
    return [Op(kind="drop", node=n, at_us=t) for n, t in sorted(gone.items())]


def infer_ops(read: RdzvDoc, new: RdzvDoc, min_nodes: int, max_nodes: int,
              last_call_us: int) -> MergeSpec | None:
    """The ops that turn `read` into `new`, if the change is one the control plane may merge
    (expired nodes dropped, then one node's join, wait or keep-alive, or its leave); else None."""
    gone = {n: t for n, t in read.last_heartbeats.items() if n not in new.last_heartbeats}
    changed = [n for n, t in new.last_heartbeats.items() if read.last_heartbeats.get(n) != t]
    if not changed and gone:
        # A node leaving (torch's _remove_from_participants / _remove_from_wait_list, with the
        # sanitizer's drops before it): the leaver is the freshest of those gone. As ops, a
        # round of N nodes does not send its N-node state (over the body limit past ~700).
        leaver = max(gone, key=gone.__getitem__)
        expired = {n: t for n, t in gone.items() if n != leaver}
        ops = [*_expire_ops(read, expired), Op(kind="drop", node=leaver, at_us=gone[leaver])]
        spec = MergeSpec(ops=ops, min_nodes=min_nodes, max_nodes=max_nodes)
        return spec if apply_ops(read, spec) == new else None
    drops = _expire_ops(read, gone)
    if len(changed) != 1:
        return None
    node, at_us = changed[0], new.last_heartbeats[changed[0]]
    deadline_us = new.deadline_us if new.deadline_us is not None and new.deadline_us != read.deadline_us \
        else at_us + last_call_us
    for kind in ("join", "keep_alive", "wait"):
        spec = MergeSpec(ops=[*drops, Op(kind=kind, node=node, at_us=at_us,
                                         deadline_us=deadline_us if kind == "join" else None)],
                         min_nodes=min_nodes, max_nodes=max_nodes)
        if apply_ops(read, spec) == new:
            return spec
    return None
