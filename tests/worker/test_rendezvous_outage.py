"""Riding out a control-plane outage in torch's handler (`worker/rendezvous/outage.py`):
the heartbeats an outage made stale, and the monitor's question while no one answers."""

from __future__ import annotations

import pickle
import time
from datetime import UTC, datetime, timedelta

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from tests.helpers.processes import free_port
from worker.rendezvous import create_ftrain_handler
from worker.rendezvous.outage import refresh_stale_heartbeats, settle_s
from worker.rendezvous.transport import Outage

INTERVAL, WINDOW = timedelta(seconds=1), timedelta(seconds=3)
SETTLE_S = settle_s(INTERVAL, WINDOW)  # 7 s: a probe (5 s) and two intervals
T0 = 1_700_000_000.0  # the outage began; it ended 90 s later
OUTAGE = Outage(started=T0, ended=T0 + 90)


def at(t: float) -> datetime:
    return datetime.fromtimestamp(t, UTC)


def state_with(**beats: float) -> bytes:
    state = _RendezvousState()
    for name, t in beats.items():
        state.last_heartbeats[_NodeDesc(name, 1, 0)] = at(t)
    return pickle.dumps(state)


def beats_of(state: bytes) -> dict[str, datetime]:
    return {n.addr: t for n, t in pickle.loads(state).last_heartbeats.items()}


def test_heartbeats_an_outage_made_stale_count_as_due_while_it_settles():
    now = OUTAGE.ended + 2
    before = state_with(alive=T0 - 0.5, dead_before=T0 - 10, fresh=now - 0.2)
    after = beats_of(refresh_stale_heartbeats(before, OUTAGE, INTERVAL, WINDOW, now))
    assert after["alive"] == at(now) - INTERVAL  # due for a keep-alive, not dead
    assert after["dead_before"] == at(T0 - 10)  # dead before the outage: torch drops it
    assert after["fresh"] == at(now - 0.2)  # written since: left alone
    # torch's own rules, on the refreshed state a moment later:
    later = at(now + 0.1)
    assert after["alive"] <= later - INTERVAL  # _should_keep_alive: yes
    assert not after["alive"] < later - WINDOW  # _sanitize: not dead


@pytest.mark.parametrize("outage,now", [
    (None, T0 + 92),  # no outage seen
    (OUTAGE, OUTAGE.ended + SETTLE_S),  # settled: torch's rules again
])
def test_outside_the_settling_time_the_state_is_handed_on_unchanged(outage, now):
    state = state_with(alive=T0 - 0.5)
    assert refresh_stale_heartbeats(state, outage, INTERVAL, WINDOW, now) is state


def test_a_heartbeat_written_after_the_outage_is_left_to_torch():
    """A node that dies once the control plane is back is dropped by torch's rules, as fast as
    without an outage: its last heartbeat came after the outage ended."""
    now = OUTAGE.ended + 4
    state = state_with(died_after=OUTAGE.ended + 0.5)
    assert refresh_stale_heartbeats(state, OUTAGE, INTERVAL, WINDOW, now) is state
    assert at(OUTAGE.ended + 0.5) < at(now) - WINDOW  # _sanitize drops it now


def test_a_node_that_died_in_the_outage_is_dropped_when_the_settling_time_ends():
    late = OUTAGE.ended + SETTLE_S - 0.5
    beat = beats_of(refresh_stale_heartbeats(state_with(gone=T0 - 0.5), OUTAGE, INTERVAL, WINDOW, late))
    assert beat["gone"] == at(OUTAGE.ended + SETTLE_S) - WINDOW  # never later than that
    assert not beat["gone"] < at(late) - WINDOW  # still kept now
    assert beat["gone"] < at(OUTAGE.ended + SETTLE_S + 0.1) - WINDOW  # dropped right after


def test_a_state_that_is_not_torchs_is_left_to_torch():
    for state in (b"not a pickle", pickle.dumps({"x": 1})):
        assert refresh_stale_heartbeats(state, OUTAGE, INTERVAL, WINDOW, OUTAGE.ended + 1) is state


def test_the_monitors_question_is_answered_at_once_while_no_control_plane_answers(monkeypatch):
    """torch's agent asks num_nodes_waiting() every 0.2 s and does not catch its error: after
    retry_timeout (60 s here) it used to raise, and the agent stopped the workers."""
    monkeypatch.setenv("FTRAIN_JOB_TOKEN", "t")
    params = RendezvousParameters(backend="ftrain", endpoint=f"http://127.0.0.1:{free_port()}",
                                  run_id="job-abcdef-a1", min_nodes=1, max_nodes=2,
                                  local_addr="127.0.0.1", retry_timeout=60, keep_alive_interval=1)
    handler = create_ftrain_handler(params)
    start = time.monotonic()
    assert [handler.num_nodes_waiting() for _ in range(5)] == [0] * 5
    assert time.monotonic() - start < 5
    transport = handler._state_holder._backend._transport
    assert transport.failing_since is not None and transport.last_outage is None
