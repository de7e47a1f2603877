"""torch's pickled `_RendezvousState` to and from `worker.rdzv_state.RdzvDoc`, the form the
control plane reads to merge joins (that module says why and how).

Only a state that converts both ways without loss travels as a `RdzvDoc`: the pickle must be
exactly a `_RendezvousState` with the attributes `worker.torch_internals` checks, its nodes `_NodeDesc`s
(of a string address and integer pid and local id), its round and ranks integers, its flags
booleans and its times aware datetimes; each of those converts back to an equal value, so the
whole state does. Anything else (a torch that added a field, the contract suite's arbitrary
bytes) travels as the pickle, sealed as version 1, and is only ever compare-and-set, as before.

Both directions run at every read and write of every node, on a state of up to N nodes, so
they are kept lean (a 1,024-node round is 1,024 nodes each converting a few such states): a
node's `_NodeDesc` is made once per process and the same object is used in every map of the
state (`_desc`), which also lets torch's pickle refer back to it instead of repeating it.
"""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta
from typing import Any

from .. import torch_internals
from ..rdzv_state import Node, RdzvDoc

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def to_doc(state: bytes) -> RdzvDoc | None:
    """The pickled torch state as a `RdzvDoc`, or None if it does not convert without loss."""
    try:
        obj = pickle.loads(state)  # torch's own pickle, made a moment ago in this process
    except Exception:
        return None
    state_type, desc_type = torch_internals.rendezvous_state_types()
    if type(obj) is not state_type or set(vars(obj)) != torch_internals.STATE_FIELDS:
        return None

    def node(n: Any) -> Node:
        return _node(n, desc_type)

    try:
        doc = RdzvDoc(round=_int(obj.round), complete=_bool(obj.complete),
                      deadline_us=None if obj.deadline is None else _us(obj.deadline),
                      closed=_bool(obj.closed),
                      participants={node(n): _int(r) for n, r in obj.participants.items()},
                      wait_list={node(n) for n in obj.wait_list},
                      redundancy_list={node(n) for n in obj.redundancy_list},
                      last_heartbeats={node(n): _us(t) for n, t in obj.last_heartbeats.items()})
    except (TypeError, ValueError, AttributeError):
        return None
    return doc


def from_doc(doc: RdzvDoc) -> bytes:
    """The `RdzvDoc` as torch's pickle."""
    return pickle.dumps(_state_of(doc))


def _state_of(doc: RdzvDoc) -> Any:
    state = torch_internals.rendezvous_state_types()[0]()
    state.round = doc.round
    state.complete = doc.complete
    state.deadline = None if doc.deadline_us is None else _time(doc.deadline_us)
    state.closed = doc.closed
    state.participants = {_desc(n): r for n, r in doc.participants.items()}
    state.wait_list = {_desc(n) for n in doc.wait_list}
    state.redundancy_list = {_desc(n) for n in doc.redundancy_list}
    state.last_heartbeats = {_desc(n): _time(t) for n, t in doc.last_heartbeats.items()}
    return state


_descs: dict[Node, Any] = {}
MAX_DESCS = 1 << 16  # nodes remembered (a few MiB at most); forgotten all at once past it


def _desc(node: Node) -> Any:
    """The one `_NodeDesc` of `node` in this process (a frozen dataclass: safe to share)."""
    desc = _descs.get(node)
    if desc is None:
        if len(_descs) >= MAX_DESCS:
            _descs.clear()
        desc = _descs[node] = torch_internals.rendezvous_state_types()[1](*node)
    return desc


def _us(moment: Any) -> int:
    if type(moment) is not datetime or moment.tzinfo is None:
        raise ValueError(f"{moment!r} is not an aware datetime")
    return (moment - _EPOCH) // timedelta(microseconds=1)


def _time(us: int) -> datetime:
    return _EPOCH + timedelta(microseconds=us)


def _node(node: Any, desc_type: type) -> Node:
    if type(node) is not desc_type or not isinstance(node.addr, str):
        raise ValueError(f"{node!r} is not a node")
    return node.addr, _int(node.pid), _int(node.local_id)


def _int(value: Any) -> int:
    if type(value) is not int:
        raise ValueError(f"{value!r} is not an integer")
    return value


def _bool(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{value!r} is not a boolean")
    return value
