"""Real processes for integration tests: etcd, the control plane (uvicorn), node agents.

The harness is `bench/harness.py`, shared with the benchmarks; the tests keep importing
these names from here.
"""

import os
from pathlib import Path

from bench.harness import REPO as REPO
from bench.harness import ControlPlane as ControlPlane
from bench.harness import EtcdProcess as EtcdProcess
from bench.harness import NodeAgentProc as NodeAgentProc
from bench.harness import descendants as descendants
from bench.harness import free_port as free_port
from bench.harness import pid_alive as pid_alive
from bench.harness import stop_agents as stop_agents
from bench.harness import stop_tree as stop_tree
from bench.harness import wait_for as wait_for


def _tcp_listening_inodes() -> dict[int, str]:
    """inode -> "address:port" of every listening TCP socket (IPv4 and IPv6) on this host."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                out[int(fields[9])] = fields[1]
    return out


def tcp_ports_listened_on(pid: int) -> list[int]:
    """The TCP ports process `pid` listens on."""
    listening = _tcp_listening_inodes()
    ports = []
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inode = int(target[len("socket:["):-1])
            if inode in listening:
                ports.append(int(listening[inode].rsplit(":", 1)[1], 16))
    return sorted(ports)
