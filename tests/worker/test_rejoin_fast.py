"""The re-rendezvous after a worker's death, made shorter (worker/rendezvous/): a node leaving
a complete round waits for the next in the same write; torchrun's monitor woken by news; a
broken group stopped without SIGTERM's grace; the 'joining'
report off the round's path; the master address published in one store call. Pure: fakes for
the control plane, torch's agent and its store; no process is started."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from worker.protocol import RdzvState, SetStateResult, open_state, seal_state
from worker.rdzv_state import MergeSpec, RdzvDoc, apply_ops
from worker.rendezvous import monitor
from worker.rendezvous.backend import FtrainRendezvousBackend
from worker.rendezvous.merge import to_doc
from worker.rendezvous.rounds import RoundReporter

A, B = _NodeDesc("a", 1, 0), _NodeDesc("b", 2, 0)
NOW = datetime.now(UTC)


class FakeControlPlane:
    """One rendezvous state as the control plane keeps it: merges written ops (apply_ops)."""

    rdzv_id, base_url, last_outage = "job-a1", "http://cp", None

    def __init__(self, state: _RendezvousState):
        self.doc, self.token, self.merges = to_doc(pickle.dumps(state)), 1, []

    def _answer(self, model, **extra) -> dict:
        return model(state=seal_state(self.doc.to_json(), version=2), token=str(self.token),
                     **extra).model_dump(mode="json")

    def call(self, method: str, path: str, body=None, **kwargs) -> dict:
        if method == "GET":
            return self._answer(RdzvState)
        self.merges.append([op.kind for op in body.merge.ops])
        merged = apply_ops(self.doc, body.merge)
        if merged is not None:
            self.doc, self.token = merged, self.token + 1
        return self._answer(SetStateResult, written=merged is not None)


def complete_round(*nodes: _NodeDesc) -> _RendezvousState:
    state = _RendezvousState()
    state.round, state.complete = 3, True
    for rank, node in enumerate(nodes):
        state.participants[node] = rank
        state.last_heartbeats[node] = NOW
    return state


def leave(nodes: tuple, max_nodes: int = 2, rejoining: bool = True) -> tuple[FakeControlPlane, RdzvDoc]:
    """Node A's torch exit op on a complete round of `nodes`, through the ftrain backend."""
    cp = FakeControlPlane(complete_round(*nodes))
    backend = FtrainRendezvousBackend(cp)
    backend.merge_settings = (1, max_nodes, timedelta(seconds=1))
    backend.this_node = ((A.addr, A.pid, A.local_id), timedelta(seconds=1))
    state, token = backend.get_state()
    left = pickle.loads(state)
    del left.participants[A], left.last_heartbeats[A]
    if not left.participants:  # torch's _remove_participant_epilogue
        left.complete, left.round = False, left.round + 1
    backend.rejoining = rejoining
    written = backend.set_state(pickle.dumps(left), token)
    assert written is not None and written[2]
    return cp, RdzvDoc.from_json(open_state(seal_state(cp.doc.to_json(), version=2)))


def test_a_node_leaving_a_complete_round_to_rejoin_waits_in_the_same_write():
    cp, doc = leave((A, B))
    assert cp.merges == [["drop", "wait_if_room"]]  # one write: torch's join op then just waits
    node = (A.addr, A.pid, A.local_id)
    assert node in doc.wait_list and node not in doc.participants and doc.complete


@pytest.mark.parametrize("nodes,max_nodes,rejoining", [
    ((A,), 2, True),  # the last one out: the round reopens, torch joins it (no wait list)
    ((A, B), 1, True),  # no room for a wait (torch puts it on the redundancy list)
    ((A, B), 2, False),  # a leave outside next_rendezvous (a shutdown): no wait
])
def test_a_leave_torch_would_not_follow_with_a_wait_is_sent_alone(nodes, max_nodes, rejoining):
    cp, _ = leave(nodes, max_nodes, rejoining)
    assert cp.merges == [["drop"]]


@pytest.fixture
def torchrun_monitor(monkeypatch):
    """`wake_monitor_on_news` as in torchrun, undone afterwards (pipe, SIGCHLD, torch's module)."""
    from torch.distributed.elastic.agent.server import api as agent_api

    monkeypatch.setattr(sys, "argv", [os.path.join("x", "torch", "distributed", "run.py")])
    real_time, old_handler = agent_api.time, signal.getsignal(signal.SIGCHLD)
    assert monitor.wake_monitor_on_news()
    yield agent_api.time
    agent_api.time = real_time
    signal.signal(signal.SIGCHLD, old_handler)
    for fd in monitor._pipe:
        os.close(fd)
    monitor._pipe = None


def _slept(sleep, wake) -> float:
    threading.Timer(0.05, wake).start()
    start = time.monotonic()
    sleep(5.0)
    return time.monotonic() - start


@pytest.mark.parametrize("news", ["worker_exit", "node_waiting"])
def test_torchruns_monitor_wakes_at_the_news_not_at_its_interval(torchrun_monitor, news):
    wake = (lambda: os.kill(os.getpid(), signal.SIGCHLD)) if news == "worker_exit" else monitor.wake_monitor
    assert _slept(torchrun_monitor.sleep, wake) < 2.0
    start = time.monotonic()
    torchrun_monitor.sleep(0.2)  # no news: the whole interval (a wake-up already read is gone)
    assert time.monotonic() - start >= 0.19


def test_the_monitor_is_left_alone_outside_torchrun(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["pytest"])
    assert not monitor.wake_monitor_on_news()


class FakeAgent:
    def __init__(self):
        self.signals = []

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
        self.signals.append(death_sig)


def test_a_broken_group_is_stopped_with_sigkill_a_planned_restart_as_torch_does(monkeypatch):
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monkeypatch.setattr(LocalElasticAgent, "_stop_workers", lambda self, g: self._shutdown())
    monitor.stop_broken_groups_at_once()
    stop = LocalElasticAgent._stop_workers
    members, waiting = complete_round(A, B), _NodeDesc("new", 3, 0)
    handler = SimpleNamespace(_state_holder=SimpleNamespace(state=members))
    handler.next_rendezvous = lambda: "info"
    handler.num_nodes_waiting = lambda: len(handler._state_holder.state.wait_list)
    monitor.note_broken_groups(handler)
    handler.next_rendezvous()  # the group {A, B} formed
    agent, healthy = FakeAgent(), SimpleNamespace(state=WorkerState.HEALTHY)

    members.wait_list = {waiting}  # a new node: a planned scale-up
    assert handler.num_nodes_waiting() == 1
    stop(agent, healthy)
    members.wait_list = {waiting, B}  # a member that left first beside it: still planned
    assert handler.num_nodes_waiting() == 2
    stop(agent, healthy)
    members.wait_list = {B}  # a member left to re-form the group: its workers died
    assert handler.num_nodes_waiting() == 1
    stop(agent, healthy)
    stop(agent, SimpleNamespace(state=WorkerState.FAILED))  # its own workers failed
    assert agent.signals == [signal.SIGTERM, signal.SIGTERM, signal.SIGKILL, signal.SIGKILL]


def test_the_joining_report_does_not_hold_up_the_round_and_the_joined_one_follows_it():
    reporter = RoundReporter("http://cp", "token", "job", 1, "n0")
    answer, sent = threading.Event(), []

    def call(method, path, body, **kwargs):
        if body.phase == "joining":
            answer.wait(5)
        sent.append(body.phase)

    reporter._client = SimpleNamespace(call=call)
    start = time.monotonic()
    reporter.report_soon("joining", 0)
    assert time.monotonic() - start < 1.0 and sent == []
    threading.Timer(0.1, answer.set).start()
    reporter.report("joined", 0)
    assert sent == ["joining", "joined"]


class CountingStore(dist.Store):
    def __init__(self):
        super().__init__()
        self.data, self.calls = {}, []

    def multi_set(self, keys, values):
        self.calls.append("multi_set")
        self.data.update(zip(keys, values))

    def multi_get(self, keys):
        self.calls.append("multi_get")
        return [self.data[k] for k in keys]

    def has_extended_api(self):
        return True


def test_the_master_address_is_published_and_read_in_one_store_call_each():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from worker.rendezvous.store import publish_master_in_one_call

    publish_master_in_one_call()
    build = dynamic_rendezvous.RendezvousStoreInfo.build
    store = CountingStore()
    prefixed = dist.PrefixStore("torch.rendezvous.job-a1.3", store)
    master = build(0, prefixed, local_addr="10.0.0.7")
    assert build(1, dist.PrefixStore("torch.rendezvous.job-a1.3", store), local_addr="10.0.0.8") == master
    assert master.master_addr == "10.0.0.7" and master.master_port > 0
    assert store.calls == ["multi_set", "multi_get"]


def test_a_leave_whose_round_reopened_meanwhile_is_written_without_the_wait():
    """Both nodes leave at once: the second's drop empties the round (torch reopens it), where
    a wait is not valid; the leave is still written, and torch's join op joins the new round."""
    node = ["a", 1, 0]
    doc = RdzvDoc(round=3, complete=True, participants={tuple(node): 0},
                  last_heartbeats={tuple(node): 5})
    spec = MergeSpec.model_validate({"ops": [{"kind": "drop", "node": node, "at_us": 5},
                                             {"kind": "wait_if_room", "node": node, "at_us": 9}],
                                     "min_nodes": 1, "max_nodes": 2})
    merged = apply_ops(doc, spec)
    assert merged is not None and merged.round == 4 and not merged.complete
    assert not merged.participants and not merged.wait_list and not merged.last_heartbeats
