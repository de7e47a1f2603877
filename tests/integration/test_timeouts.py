"""The timing contract between the control plane and its nodes (`worker.protocol.Timeouts`) is
stated once, in the control plane's settings, and given to every node when it registers: the
agent heartbeats, holds its presence request, waits out a leave and hands torchrun its long
poll by the values of the control plane it talks to, never by defaults of its own.

Real etcd, a real control plane configured through FTRAIN_<FIELD>, a real agent."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters

import worker.rendezvous as ftrain_rdzv
from tests.helpers.processes import wait_for
from worker.node_link import REQUEST_TIMEOUT_S, NodeLink
from worker.protocol import Timeouts
from worker.torchrun import rdzv_conf

pytestmark = pytest.mark.integration

# Every value unlike its default; the presence hold longer than an agent's own request timeout.
STATED = Timeouts(node_ttl_s=2, long_poll_s=1.5, presence_hold_s=REQUEST_TIMEOUT_S + 1,
                  control_ack_timeout_s=20)
CONTRACT = {f"FTRAIN_{name.upper()}": str(value) for name, value in STATED.model_dump().items()
            if name in Timeouts.model_fields}


@pytest.fixture
def link(control_plane):
    node = NodeLink(control_plane.url, control_plane.node_token, "n0")
    yield node
    node.close()


@pytest.mark.parametrize("control_plane", [CONTRACT], indirect=True)
def test_a_registration_gives_the_node_the_control_planes_timeouts(control_plane, link):
    with control_plane.client("node") as c:
        reply = c.post("/v1/nodes/register", json={"name": "other"}).json()
    assert reply["timeouts"] == {**STATED.model_dump(), "heartbeat_interval_s": 0.5}
    link.register()
    assert link.timeouts == STATED
    assert link.heartbeat_interval_s == 0.5  # a quarter of the 2 s lease
    assert link.heartbeat(wait_s=60) is None  # a long poll of at most that interval


@pytest.mark.parametrize("control_plane", [CONTRACT], indirect=True)
def test_a_presence_request_is_held_as_long_as_the_control_plane_holds_it(control_plane, link):
    """Held past the agent's own request timeout: answered, not cut off by the agent (a cut
    connection is what the control plane takes for a dead agent)."""
    link.register()
    started = time.monotonic()
    link.hold_presence()
    assert time.monotonic() - started >= STATED.presence_hold_s


@pytest.mark.parametrize("control_plane", [CONTRACT], indirect=True)
def test_torchrun_long_polls_the_rendezvous_as_long_as_the_control_plane_holds_a_poll(
        control_plane, link, api):
    """The agent hands the control plane's long poll to torchrun (--rdzv-conf); the "ftrain"
    backend's blocking reads ask for no more than that at a time."""
    link.register()
    resp = api.post("/v1/jobs", json={"name": "polls", "command": ["true"], "nodes": {"min": 2, "max": 2}})
    assert resp.status_code == 201, resp.text
    job = resp.json()
    conf = dict(item.split("=", 1) for item in rdzv_conf(link.timeouts).split(","))
    params = RendezvousParameters(backend="ftrain", endpoint=control_plane.url,
                                  run_id=f"{job['id']}-a{job['attempt']}", min_nodes=1, max_nodes=2,
                                  **conf)
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ftrain_rdzv.TOKEN_ENV, control_plane.job_token_of(job["id"]))
        backend, store = ftrain_rdzv.create_backend(params)
    transport = store._transport
    assert transport is backend._transport and transport.long_poll_s == STATED.long_poll_s
    waits: list[float] = []
    call = transport.call

    def noting(*args, **kwargs):
        waits.append(kwargs.get("wait_s", 0.0))
        return call(*args, **kwargs)

    transport.call = noting
    try:
        with pytest.raises(dist.DistStoreError):
            store.wait(["never-set"], timedelta(seconds=3 * STATED.long_poll_s))
    finally:
        transport.close()
    assert len(waits) >= 3 and max(waits) <= STATED.long_poll_s


@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "2"}], indirect=True)
def test_an_idle_agent_heartbeats_at_the_interval_its_control_plane_states(control_plane, agents, api):
    """A 2 s lease: a beat every 0.5 s, not every 1.5 s (the interval of the default 6 s lease)."""
    def beats() -> float:
        text = api.get("/metrics").text
        return next(float(line.rpartition(" ")[2]) for line in text.splitlines()
                    if line.startswith("ftrain_node_heartbeat_seconds_count"))

    agents(1)
    wait_for(lambda: beats() >= 1, 30, "the agent's first heartbeat")
    first, started = beats(), time.monotonic()
    wait_for(lambda: beats() >= first + 12, 60, "12 more heartbeats", interval_s=0.1)
    interval = (time.monotonic() - started) / 12
    assert interval < Timeouts().heartbeat_interval_s, f"a heartbeat every {interval:.2f} s"
