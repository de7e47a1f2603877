"""Three "hosts" on one machine: network namespaces on a bridge, a partition by link cut.

Layout. etcd stays on 127.0.0.1 in the root namespace and the control plane listens on
the uplink's address in the root namespace (the switch's gateway), so only the control
plane is reachable from the nodes, as on a real cluster (etcd is never exposed to nodes:
docs/architecture.md), the test itself talks to both without entering a namespace, and no long-lived
process has to be started inside a namespace that the test then has to reach into. The
switch is a bridge in a namespace of its own (`tests/helpers/netns.py` says why). Each node agent runs
in its own namespace (`ip netns exec`) behind a veth pair whose other end is a port of the
switch; it advertises its own address (torchrun's --local-addr), and gloo is told to use
the namespace's interface (GLOO_SOCKET_IFNAME: the host name resolves to no address
inside a namespace, and gloo would fall back to loopback).

A partition is `ip link set <veth> down` on the switch's side: the node's processes live
on but reach nothing, exactly as when a cable or a switch port fails.

Every name is prefixed with `ft<pid>`; the finalizer removes the namespaces (which takes
their veth ends with them), the uplink and every process, also when the test fails.
"""

from __future__ import annotations

import time

import pytest

from tests.helpers.elastic import (
    SCRIPT,
    events,
    job,
    job_spec,
    log_items,
    steps,
    submit,
    wait_nodes,
    wait_state,
    wait_step,
)
from tests.helpers.faults import check_steps
from tests.helpers.processes import ControlPlane, NodeAgentProc, pid_alive, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.netns]


@pytest.fixture
def cluster(fabric, etcd, tmp_path):
    """The control plane on the bridge and three agents, each in its own namespace."""
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", host=fabric.gateway)
    agents: list[NodeAgentProc] = []
    try:
        cp.start()
        for i in range(3):
            ns, addr = fabric.add_node(i)
            agents.append(NodeAgentProc(cp, f"h{i}", tmp_path / "nodes", address=addr, netns=ns).start())
        yield cp, agents
    finally:
        for a in agents:
            a.stop()
        cp.stop()


def test_partitioned_node_leaves_the_job_and_rejoins_when_the_link_returns(cluster, fabric):
    cp, agents = cluster
    with cp.client() as api:
        wait_nodes(api, 3)
        addresses = {n["name"]: n["address"] for n in api.get("/v1/nodes").json()["items"]}
        assert addresses == {f"h{i}": str(fabric.hosts[10 + i]) for i in range(3)}
        job_id = submit(api, job_spec("multihost", "--steps", "100000", "--step-time", "0.05",
                                      "--snapshot-every", "5", mn=2, mx=3, max_restarts=10,
                                      env={"GLOO_SOCKET_IFNAME": "eth0"}))
        wait_step(api, job_id, 5, world=3, timeout_s=120)
        assert sorted(job(api, job_id)["nodes"]) == ["h0", "h1", "h2"]

        # Partition h2: its agent and workers live on, cut off from everything.
        fabric.cut(2)
        assert not fabric.link_is_up(2)
        assert agents[2].proc.poll() is None
        before = len(steps(api, job_id))
        wait_step(api, job_id, 1, world=2, after=before, timeout_s=90)
        j = wait_for(lambda: sorted((j := job(api, job_id))["nodes"]) == ["h0", "h1"] and j, 30,
                     "h2 to leave the job")
        assert j["state"] in ("RUNNING", "RECOVERING")
        assert agents[2].proc.poll() is None  # a partition, not a kill

        # Heal it: h2's heartbeat gets 404, it stops its old workers, registers again and
        # is given back to the job, which scales up to three.
        fabric.restore(2)
        assert fabric.link_is_up(2)
        before = len(steps(api, job_id))
        wait_step(api, job_id, 1, world=3, after=before, timeout_s=120)
        j = job(api, job_id)
        assert sorted(j["nodes"]) == ["h0", "h1", "h2"] and j["world_size"] == 3

        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        done = wait_state(api, job_id, ("CANCELLED", "FAILED", "SUCCEEDED"), timeout_s=60)
        assert done["state"] == "CANCELLED", events(api, job_id)
        trace = check_steps(api, job_id, every=5)
        assert len(trace.resumes) >= 2, trace.resumes
        reasons = [e["reason"] for e in events(api, job_id)]
        assert any("node h2 lost" in r for r in reasons), reasons


@pytest.mark.slow  # 20-40 s on 2 busy cores (two torchrun starts in namespaces): left out by default
def test_a_node_killed_on_another_host_is_reported_by_the_peer_watch_and_lost_at_once(fabric, etcd, tmp_path):
    """Two hosts (a namespace each), a runtime job whose workers stop stepping and sleep, as a
    survivor blocked in an NCCL collective does: no collective is in flight, so no worker of
    the survivor ever errors, and the survivor's torchrun does not restart. Host h1's agent
    is SIGKILLed with its whole tree: the node leaders' ring (worker/peer_watch.py), a TCP
    connection between the hosts, closes without a goodbye, h0's worker reports the broken
    peer, and with h1's dropped presence connection the control plane loses h1 at once
    (service/presence.py): not after its 60 s lease nor the 30 s bound on a drop alone. The
    job goes on on h0 under a new attempt."""
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", host=fabric.gateway,
                      env={"FTRAIN_NODE_TTL_S": "60", "FTRAIN_PRESENCE_BLIP_S": "30"})
    agents: list[NodeAgentProc] = []
    try:
        cp.start()
        for i in range(2):
            ns, addr = fabric.add_node(i)
            agents.append(NodeAgentProc(cp, f"h{i}", tmp_path / "nodes", address=addr, netns=ns).start())
        with cp.client() as api:
            wait_nodes(api, 2)
            job_id = submit(api, job_spec("peerwatch", "--steps", "3", "--step-time", "0.05",
                                          script=SCRIPT.with_name("stops_stepping.py"), mn=1, mx=2,
                                          env={"GLOO_SOCKET_IFNAME": "eth0"}))
            wait_for(lambda: any("hanging at step=3 attempt=1" in i["line"] for i in log_items(api, job_id)),
                     120, "the two-host group to train 3 steps, then sleep")
            assert sorted(job(api, job_id)["nodes"]) == ["h0", "h1"]

            killed = time.monotonic()
            pids = agents[1].kill_tree()
            wait_for(lambda: not any(pid_alive(p) for p in pids), 10, "h1's tree to die")
            wait_for(lambda: "h1" not in [n["name"] for n in api.get("/v1/nodes").json()["items"]], 25,
                     "h1 to be lost (its lease has 60 s to live, its dropped connection alone 30 s)")
            lost_after_s = time.monotonic() - killed
            log = (cp.workdir / f"control-plane-{cp.port}.log").read_text()
            assert "node h1 lost: its agent's connection dropped and did not come back (a survivor " \
                   "reported a broken peer)" in log, log[-3000:]
            assert lost_after_s < 10, f"h1 lost {lost_after_s:.1f} s after the kill"
            wait_for(lambda: any("hanging at step=3 attempt=2" in i["line"] for i in log_items(api, job_id)),
                     60, "the job to go on on h0 under a new attempt")
            assert job(api, job_id)["nodes"] == ["h0"]
    finally:
        for a in agents:
            a.stop()
        cp.stop()
