"""Network namespaces for tests: a switch, nodes on it, a link cut (`Fabric`).

Used by tests/integration/test_multihost.py (nodes partitioned) and
tests/faults/test_leader_cut.py (a control plane cut from etcd, or from etcd alone: a node
with a second link to the root namespace, `add_client_link`). Needs root and iproute2.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from tests.helpers.processes import wait_for


def netns_unavailable() -> str | None:
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
        self.client_links: list[str] = []
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

    def add_client_link(self, i: int) -> str:
        """A second link of node i (after `add_node`), straight to the root namespace, on a
        subnet of its own: node i's address on it (inside, `eth1`). Cutting node i's switch
        port (`cut`) then leaves this link up: what is on the switch (etcd) is cut off, what
        is in the root namespace (agents, clients) still reaches node i."""
        ns = f"{self.prefix}-n{i}"
        net = _free_subnet()
        root_addr, node_addr = (str(a) for a in list(net.hosts())[:2])
        _ip("link", "add", self.client_veth(i), "type", "veth", "peer", "name", "eth1", "netns", ns)
        self.client_links.append(self.client_veth(i))
        _ip("addr", "add", f"{root_addr}/{net.prefixlen}", "dev", self.client_veth(i))
        _ip("link", "set", self.client_veth(i), "up")
        _ip("-n", ns, "addr", "add", f"{node_addr}/{net.prefixlen}", "dev", "eth1")
        _ip("-n", ns, "link", "set", "eth1", "up")
        return node_addr

    def client_veth(self, i: int) -> str:
        return f"{self.prefix}c{i}"

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
        # A pair with an end in the root namespace is deleted from there: a namespace that
        # something still pins (a socket closing) keeps its end, and with it ours, after
        # `ip netns del` (seen once: the root end still up a minute later).
        for link in self.client_links:
            _ip("link", "del", link, check=False)
        for ns in self.namespaces:  # deleting a namespace deletes its end of the pair, and so both
            _ip("netns", "del", ns, check=False)
        if self.created_switch:
            _ip("link", "del", self.uplink, check=False)
            _ip("netns", "del", self.switch, check=False)

    def leftovers(self) -> list[str]:
        names = _ip("-o", "link", "show").stdout + _ip("netns", "list").stdout
        return sorted({w.rstrip(":@") for w in names.split() if w.startswith(self.prefix)})


@contextmanager
def fabric_up() -> Iterator[Fabric]:
    """A Fabric, taken down (and waited for: no link or namespace of it left) at the end."""
    f = Fabric()
    try:
        yield f.up()
    finally:
        f.down()
        # The kernel finishes removing a namespace's devices after `ip netns del` returns.
        wait_for(lambda: not f.leftovers(), 15,
                 f"the test's links and namespaces to be gone: {f.leftovers()}")
