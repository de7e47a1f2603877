"""Three "hosts" on one machine: network namespaces on a bridge, a partition by link cut.

Layout. etcd stays on 127.0.0.1 in the root namespace and the control plane listens on
the uplink's address in the root namespace (the switch's gateway), so only the control
plane is reachable from the nodes, as on a real cluster (etcd is never exposed to nodes;
DESIGN.md), the test itself talks to both without entering a namespace, and no long-lived
process has to be started inside a namespace that the test then has to reach into. The
switch is a bridge in a namespace of its own (see `Fabric` for why). Each node agent runs
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

import ipaddress
import os
import shutil
import subprocess

import pytest

from tests.helpers.elastic import events, job, job_spec, steps, submit, wait_nodes, wait_state, wait_step
from tests.helpers.faults import check_steps
from tests.helpers.processes import ControlPlane, NodeAgentProc, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.netns]


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces, veth pairs and bridges need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.231.0.0/16 that no interface or route here overlaps."""
    used = _ip("-4", "addr").stdout + _ip("-4", "route").stdout
    taken = [ipaddress.ip_network(w, strict=False) for w in used.split() if "/" in w and w[0].isdigit()]
    for i in range(os.getpid() % 250, os.getpid() % 250 + 250):
        net = ipaddress.ip_network(f"10.231.{i % 250}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /24 in 10.231.0.0/16")


class Fabric:
    """A switch (a bridge in its own namespace), an uplink to the root namespace, and one
    namespace per node on a veth pair whose other end is a port of the switch.

    The switch has a namespace of its own so that it forwards between its ports whatever
    the host's firewall says: with br_netfilter loaded, bridged frames go through the
    iptables FORWARD chain of the bridge's namespace, and a host where Docker ran has
    `FORWARD DROP` there, which drops every node-to-node packet (the control plane, an
    INPUT of the root namespace, stays reachable: agents register, workers never meet).
    A fresh namespace's tables are empty and accept.
    """

    def __init__(self) -> None:
        self.prefix = f"ft{os.getpid()}"
        self.net = _free_subnet()
        self.switch = f"{self.prefix}-sw"
        self.uplink = f"{self.prefix}up"
        self.hosts = list(self.net.hosts())
        self.gateway = str(self.hosts[0])
        self.namespaces: list[str] = []
        self.created_switch = False

    def up(self) -> Fabric:
        _ip("netns", "add", self.switch)
        self.created_switch = True
        sw = ("-n", self.switch)
        _ip(*sw, "link", "add", "name", "sw0", "type", "bridge")
        _ip(*sw, "link", "set", "dev", "sw0", "up")
        _ip("link", "add", self.uplink, "type", "veth", "peer", "name", "uplink0", "netns", self.switch)
        _ip(*sw, "link", "set", "dev", "uplink0", "master", "sw0")
        _ip(*sw, "link", "set", "dev", "uplink0", "up")
        _ip("addr", "add", f"{self.gateway}/{self.net.prefixlen}", "dev", self.uplink)
        _ip("link", "set", self.uplink, "up")
        return self

    def veth(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def add_node(self, i: int) -> tuple[str, str]:
        """Namespace and address of node i; inside, its interface is `eth0`."""
        ns = f"{self.prefix}-n{i}"
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        addr = str(self.hosts[10 + i])
        _ip("link", "add", self.veth(i), "netns", self.switch, "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.switch, "link", "set", "dev", self.veth(i), "master", "sw0")
        _ip("-n", self.switch, "link", "set", "dev", self.veth(i), "up")
        _ip("-n", ns, "addr", "add", f"{addr}/{self.net.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        return ns, addr

    def link_is_up(self, i: int) -> bool:
        """The switch-side end of node i's pair is administratively up."""
        shown = _ip("-n", self.switch, "-o", "link", "show", "dev", self.veth(i)).stdout
        flags = shown.split("<", 1)[1].split(">", 1)[0]
        return "UP" in flags.split(",")

    def cut(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", "dev", self.veth(i), "down")

    def restore(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", "dev", self.veth(i), "up")

    def down(self) -> None:
        for ns in self.namespaces:  # deleting a namespace deletes its end of the pair, and so both
            _ip("netns", "del", ns, check=False)
        if self.created_switch:
            _ip("link", "del", self.uplink, check=False)
            _ip("netns", "del", self.switch, check=False)

    def leftovers(self) -> list[str]:
        names = _ip("-o", "link", "show").stdout + _ip("netns", "list").stdout
        return sorted({w.rstrip(":@") for w in names.split() if w.startswith(self.prefix)})


@pytest.fixture
def fabric():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    f = Fabric()
    try:
        yield f.up()
    finally:
        f.down()
        # The kernel finishes removing a namespace's devices after `ip netns del` returns.
        wait_for(lambda: not f.leftovers(), 15,
                 f"the test's links and namespaces to be gone: {f.leftovers()}")


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
