"""The rendezvous state as data, and the ops the control plane merges (worker.rdzv_state), with
the conversion from and to torch's pickle (worker.rendezvous.merge)."""

from __future__ import annotations

import pickle
from datetime import UTC, datetime, timedelta

import pytest
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from worker.rdzv_state import (
    ENDED_LAST_CALL_US,
    MergeSpec,
    NotAState,
    Op,
    RdzvDoc,
    apply_ops,
    end_last_call,
    infer_ops,
    refresh_ops,
)
from worker.rendezvous.merge import from_doc, to_doc

A, B, C = ("a", 1, 0), ("b", 2, 0), ("c", 3, 0)
LAST_CALL_US = 30_000_000


def joined(doc: RdzvDoc, node, at: int, min_nodes: int, max_nodes: int) -> RdzvDoc:
    """What torch's `_add_to_participants` writes (the reference the ops must rebuild)."""
    doc = doc.copy()
    doc.wait_list.discard(node)
    doc.participants[node] = 0
    doc.last_heartbeats[node] = at
    if len(doc.participants) == min_nodes:
        doc.deadline_us = at + LAST_CALL_US
    if len(doc.participants) == max_nodes:
        doc.complete, doc.deadline_us = True, None
        for rank, n in enumerate(sorted(doc.participants)):
            doc.participants[n] = rank
    return doc


def test_a_join_found_on_one_state_merges_into_a_newer_one():
    base = RdzvDoc()
    spec_a = infer_ops(base, joined(base, A, 10, 3, 3), 3, 3, LAST_CALL_US)
    spec_b = infer_ops(base, joined(base, B, 11, 3, 3), 3, 3, LAST_CALL_US)
    assert spec_a is not None and [op.kind for op in spec_a.ops] == ["join"]
    after_a = apply_ops(base, spec_a)
    after_ab = apply_ops(after_a, spec_b)  # b's token is stale: merged, not lost
    assert set(after_ab.participants) == {A, B} and not after_ab.complete
    assert after_ab.last_heartbeats == {A: 10, B: 11}


def test_the_join_that_reaches_max_completes_the_round_with_ranks_in_node_order():
    base = RdzvDoc()
    state = base
    for node, at in ((C, 1), (A, 2), (B, 3)):  # each found on the empty state
        state = apply_ops(state, infer_ops(base, joined(base, node, at, 2, 3), 2, 3, LAST_CALL_US))
    assert state.complete and state.deadline_us is None
    assert state.participants == {A: 0, B: 1, C: 2}


def test_the_join_that_reaches_min_sets_the_last_call_deadline():
    base = RdzvDoc()
    one = apply_ops(base, infer_ops(base, joined(base, A, 5, 2, 4), 2, 4, LAST_CALL_US))
    assert one.deadline_us is None
    two = apply_ops(one, infer_ops(base, joined(base, B, 7, 2, 4), 2, 4, LAST_CALL_US))
    assert two.deadline_us == 7 + LAST_CALL_US


@pytest.mark.parametrize("current, why", [
    (RdzvDoc(complete=True, participants={A: 0}, last_heartbeats={A: 1}), "round complete, room left"),
    (RdzvDoc(closed=True), "closed"),
    (RdzvDoc(participants={B: 0}, last_heartbeats={B: 1}), "already a participant"),
    (RdzvDoc(redundancy_list={B}, last_heartbeats={B: 1}), "redundant"),
])
def test_a_join_torch_would_not_decide_again_is_not_merged(current, why):
    spec = MergeSpec(ops=[Op(kind="join", node=B, at_us=9, deadline_us=99)], min_nodes=1, max_nodes=2)
    assert apply_ops(current, spec) is None, why


def test_a_keep_alive_of_a_node_dropped_meanwhile_is_not_merged():
    spec = MergeSpec(ops=[Op(kind="keep_alive", node=A, at_us=9)], min_nodes=1, max_nodes=2)
    assert apply_ops(RdzvDoc(), spec) is None
    assert apply_ops(RdzvDoc(last_heartbeats={A: 1}), spec).last_heartbeats == {A: 9}


def test_a_dead_node_is_dropped_only_if_it_has_not_beaten_since():
    stale = RdzvDoc(participants={A: 0, B: 0}, deadline_us=50, last_heartbeats={A: 1, B: 5})
    new = joined(RdzvDoc(participants={B: 0}, last_heartbeats={B: 5}), C, 9, 2, 3)
    # torch's sanitizer dropped A (below min: deadline cleared), then C's join set it again.
    spec = infer_ops(stale, new, 2, 3, LAST_CALL_US)
    assert spec is not None and [op.kind for op in spec.ops] == ["expire", "join"]
    beaten = RdzvDoc(participants={A: 0, B: 0}, last_heartbeats={A: 7, B: 5})  # A beat meanwhile
    assert A in apply_ops(beaten, MergeSpec(ops=spec.ops[:1], min_nodes=2, max_nodes=3)).participants


def test_heartbeats_an_outage_made_stale_and_a_reader_refreshed_are_written_with_its_keep_alive():
    """After a control-plane outage a node reads the stored state with every member's heartbeat
    moved to due (worker.rendezvous.outage); its merged keep-alive carries those refreshed
    heartbeats too, as its whole-state write did before merges, so a member whose own keep-alive
    comes later is not left with a stale heartbeat in the stored state. One that beat since
    keeps its own."""
    stored = RdzvDoc(participants={A: 0, B: 1}, complete=True, last_heartbeats={A: 1, B: 2})
    refreshed = RdzvDoc(participants={A: 0, B: 1}, complete=True, last_heartbeats={A: 50, B: 50})
    ops = refresh_ops(stored, refreshed)
    assert [(op.kind, op.was_us, op.before_us, op.at_us) for op in ops] == [("refresh_stale", 1, 3, 50)]
    kept_alive = refreshed.copy()
    kept_alive.last_heartbeats[A] = 60
    spec = infer_ops(refreshed, kept_alive, 2, 2, LAST_CALL_US)
    spec.ops[:0] = ops
    assert apply_ops(stored, spec).last_heartbeats == {A: 60, B: 50}
    beaten = RdzvDoc(participants={A: 0, B: 1}, complete=True, last_heartbeats={A: 1, B: 55})
    assert apply_ops(beaten, spec).last_heartbeats == {A: 60, B: 55}


def test_a_change_that_is_not_a_join_wait_or_keep_alive_is_compare_and_set():
    read = RdzvDoc(participants={A: 0, B: 0}, deadline_us=5, last_heartbeats={A: 1, B: 1})
    completed = read.copy()
    completed.complete, completed.deadline_us, completed.participants = True, None, {A: 0, B: 1}
    assert infer_ops(read, completed, 2, 3, LAST_CALL_US) is None  # completed at the deadline
    left = RdzvDoc(participants={B: 0}, last_heartbeats={B: 1})
    assert infer_ops(read, left, 1, 3, LAST_CALL_US) is None  # a node left


def test_json_round_trip_and_refusal_of_other_json():
    doc = RdzvDoc(round=2, complete=True, participants={A: 1, B: 0}, wait_list={C},
                  last_heartbeats={A: 1, B: 2, C: 3})
    assert RdzvDoc.from_json(doc.to_json()) == doc
    with pytest.raises(NotAState):
        RdzvDoc.from_json(b'{"round": "2"}')


def test_torch_state_converts_both_ways_without_loss():
    state = _RendezvousState()
    now = datetime.now(UTC)
    state.round, state.deadline = 3, now + timedelta(seconds=30)
    state.participants = {_NodeDesc("h1", 10, 0): 0, _NodeDesc("h2", 11, 1): 0}
    state.wait_list = {_NodeDesc("h3", 12, 0)}
    state.last_heartbeats = {n: now for n in [*state.participants, *state.wait_list]}
    doc = to_doc(pickle.dumps(state))
    assert doc is not None and doc.participants == {("h1", 10, 0): 0, ("h2", 11, 1): 0}
    assert vars(pickle.loads(from_doc(doc))) == vars(state)


def test_anything_else_stays_an_opaque_pickle():
    assert to_doc(b"\x00\x01") is None
    assert to_doc(pickle.dumps({"round": 1})) is None
    state = _RendezvousState()
    state.extra = 1  # a torch with a field this version does not know
    assert to_doc(pickle.dumps(state)) is None


def test_a_thousand_expired_nodes_are_dropped_by_one_op_of_a_few_bytes():
    """After a stall in which every heartbeat expired, the first node's write drops the others
    (torch's sanitizer). It goes as one `expire` op, not a drop per node (1,023 of those were
    over the control plane's 64 KiB body limit: HTTP 413); a node that beat meanwhile stays."""
    nodes = [(f"h{i}", i, 0) for i in range(1024)]
    me = nodes[0]
    read = RdzvDoc(participants={n: 0 for n in nodes}, deadline_us=5,
                   last_heartbeats={n: 100 + i for i, n in enumerate(nodes)} | {me: 2_000})
    sanitized = RdzvDoc(participants={me: 0}, last_heartbeats={me: 2_000})
    new = sanitized.copy()
    new.last_heartbeats[me] = 9_000  # its keep-alive
    spec = infer_ops(read, new, 1024, 1024, LAST_CALL_US)
    assert spec is not None and [op.kind for op in spec.ops] == ["expire", "keep_alive"]
    assert len(spec.model_dump_json()) < 400
    assert apply_ops(read, spec) == new
    beaten = read.copy()
    beaten.last_heartbeats[nodes[7]] = 8_000
    assert set(apply_ops(beaten, spec).participants) == {me, nodes[7]}


def test_expired_nodes_that_are_not_the_oldest_are_dropped_one_by_one():
    read = RdzvDoc(participants={A: 0, B: 0, C: 0}, last_heartbeats={A: 1, B: 5, C: 3})
    new = RdzvDoc(participants={A: 0, C: 0}, last_heartbeats={A: 9, C: 3})  # B dropped, A beat
    spec = infer_ops(read, new, 3, 3, LAST_CALL_US)
    assert spec is not None and [(op.kind, op.node) for op in spec.ops] == [("drop", B), ("keep_alive", A)]


def test_an_outage_refresh_of_a_thousand_heartbeats_is_one_op():
    nodes = [(f"h{i}", i, 0) for i in range(1000)]
    stored = RdzvDoc(participants={n: 0 for n in nodes}, complete=True,
                     last_heartbeats={n: 10 + i for i, n in enumerate(nodes)})
    refreshed = stored.copy()
    refreshed.last_heartbeats = {n: 5_000 for n in nodes}
    ops = refresh_ops(stored, refreshed)
    assert [(op.kind, op.was_us, op.before_us, op.at_us) for op in ops] == [
        ("refresh_stale", 10, 1010, 5_000)]
    beaten = stored.copy()
    beaten.last_heartbeats[nodes[3]] = 6_000  # beat after the outage: keeps its own
    after = apply_ops(beaten, MergeSpec(ops=ops, min_nodes=1000, max_nodes=1000))
    assert after.last_heartbeats[nodes[3]] == 6_000
    assert {t for n, t in after.last_heartbeats.items() if n != nodes[3]} == {5_000}


@pytest.mark.parametrize("op", [
    {"kind": "expire", "node": ["a", 1, 0], "at_us": 5},
    {"kind": "join", "at_us": 5},
    {"kind": "refresh_stale", "at_us": 5, "was_us": 1, "before_us": 9},
    {"kind": "refresh_stale", "at_us": 5},
])
def test_ops_with_the_wrong_fields_for_their_kind_are_refused(op):
    with pytest.raises(ValueError):
        Op.model_validate(op)


def test_a_node_leaving_a_large_round_is_merged_not_sent_whole():
    """torch's rollback after a join timeout removes the node from the participants: a whole
    1,024-node state was over the control plane's 64 KiB body limit (HTTP 413); as ops it is
    a drop of the leaver (with the sanitizer's expired nodes as one op before it)."""
    nodes = [(f"h{i}", i, 0) for i in range(1024)]
    read = RdzvDoc(participants={n: 0 for n in nodes},
                   last_heartbeats={n: 1_000 + i for i, n in enumerate(nodes)})
    me = nodes[500]
    new = read.copy()
    for n in (*nodes[:3], me):  # three expired, then it leaves
        del new.participants[n], new.last_heartbeats[n]
    spec = infer_ops(read, new, 1024, 1024, LAST_CALL_US)
    assert spec is not None and [(op.kind, op.node) for op in spec.ops] == [("expire", None), ("drop", me)]
    assert len(spec.model_dump_json()) < 400 and apply_ops(read, spec) == new


@pytest.mark.parametrize("participants, expected, min_nodes, complete, deadline, ends", [
    ((A,), 1, 1, False, 99, True),          # every member in, past min: the last call ends
    ((A, B), 2, 1, False, 99, True),
    ((A,), 2, 1, False, 99, False),         # a member still to come: torch's deadline stands
    ((A, B), 2, 3, False, None, False),     # below min: no deadline to move
    ((A,), 0, 1, False, 99, False),         # members unknown: never
    ((A, B), 2, 1, True, None, False),      # complete already
    ((A,), 1, 1, False, ENDED_LAST_CALL_US, False),  # ended already: no second write
])
def test_end_last_call_only_once_every_expected_member_has_joined(participants, expected, min_nodes,
                                                                 complete, deadline, ends):
    doc = RdzvDoc(complete=complete, deadline_us=deadline,
                  participants={n: 0 for n in participants}, last_heartbeats={n: 1 for n in participants})
    assert end_last_call(doc, expected, min_nodes) is ends
    assert doc.deadline_us == (ENDED_LAST_CALL_US if ends else deadline)


def test_a_round_whose_last_call_ended_is_one_torch_completes_at_once():
    """torch's join op, on the state after `end_last_call`, marks the round complete."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        RendezvousSettings,
        RendezvousTimeout,
        _Action,
        _RendezvousContext,
        _RendezvousJoinOp,
    )
    me = _NodeDesc("a", 1, 0)
    doc = RdzvDoc(participants={("a", 1, 0): 0}, last_heartbeats={("a", 1, 0): 1},
                  deadline_us=int((datetime.now(UTC) + timedelta(seconds=30)).timestamp() * 1e6))
    settings = RendezvousSettings("r", min_nodes=1, max_nodes=2, timeout=RendezvousTimeout(),
                                  keep_alive_interval=timedelta(seconds=1), keep_alive_max_attempt=3)

    def action(d: RdzvDoc):
        ctx = _RendezvousContext(me, pickle.loads(from_doc(d)), settings)
        ctx.state.last_heartbeats[me] = datetime.now(UTC)  # not due for a keep-alive
        return _RendezvousJoinOp()(ctx, deadline=float("inf"))

    assert action(doc) is _Action.SYNC  # torch's last call: wait for a second node
    assert end_last_call(doc, 1, 1)
    assert action(doc) is _Action.MARK_RENDEZVOUS_COMPLETE
