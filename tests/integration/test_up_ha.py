"""`ftrain up --replicas N --etcd-members M`: a local HA cluster of real processes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest

from service.up import is_port_free
from tests.helpers.processes import descendants, free_port, pid_alive, tcp_ports_listened_on, wait_for
from tests.integration.test_up import FALLBACK_SPEC, Up

pytestmark = pytest.mark.integration


def two_free_ports() -> int:
    """A port p with p and p+1 both free (the replicas listen on --port and --port+1)."""
    def pair() -> int | None:
        port = free_port()
        return port if is_port_free(port + 1) else None

    return wait_for(pair, 5, "two free ports")


def _argv(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


@pytest.fixture
def ha_up(tmp_path):
    """`ftrain up --replicas 2 --etcd-members 3`, stopped (and what it left) after the test."""
    started: list[Up] = []

    def start(port: int, nodes: int = 1) -> Up:
        up = Up(tmp_path / "data", port, nodes, ("--replicas", "2", "--etcd-members", "3"))
        started.append(up)
        return up.start()

    yield start
    for up in started:
        up.kill()


def test_up_with_two_replicas_and_three_etcd_members_serves_from_both(ha_up):
    port = two_free_ports()
    up = ha_up(port)
    urls = [f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}"]
    both = ",".join(urls)
    out = up.output()
    assert f"--server {both}" in out and f"FTRAIN_SERVER={both}" in out, out
    assert "etcd of 3 member(s)" in out and "local nodes registered: local-0" in out, out
    assert (up.data_dir / "server").read_text().strip() == both  # what the CLI reads

    assert up.proc is not None
    children = descendants(up.proc.pid)
    etcds = [p for p in children if Path(_argv(p)[0].decode() or "x").name == "etcd"]
    data_dirs = {_argv(p)[_argv(p).index(b"--data-dir") + 1] for p in etcds}
    assert len(etcds) == 3 and len(data_dirs) == 3, data_dirs  # three members, a data dir each
    agents = [p for p in children if b"node" in _argv(p)]
    assert len(agents) == 1 and both.encode() in _argv(agents[0])  # the agent has every replica

    # Closed: each member refuses a read without credentials (etcd's auth is cluster-wide),
    # and listens on TCP for its clients alone: the members' peer traffic is on unix sockets.
    ports = [m["client"] for m in json.loads((up.data_dir / "etcd-ports").read_text())["members"]]
    assert sorted(p for pid in etcds for p in tcp_ports_listened_on(pid)) == sorted(ports)
    for client in ports:
        req = urllib.request.Request(f"http://127.0.0.1:{client}/v3/kv/range",
                                     data=json.dumps({"key": "Lw=="}).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=5)
        assert b"user name is empty" in refused.value.read()

    token = (up.data_dir / "token").read_text().strip()
    headers = {"Authorization": f"Bearer {token}"}
    job = httpx.post(f"{urls[0]}/v1/jobs", json={**FALLBACK_SPEC, "command": ["true"]},
                     headers=headers, timeout=10)
    assert job.status_code == 201, job.text
    job_id = job.json()["id"]
    for url in urls:  # either replica serves the job and the node
        assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
        got = httpx.get(f"{url}/v1/jobs/{job_id}", headers=headers, timeout=10)
        assert got.status_code == 200 and got.json()["id"] == job_id
        nodes = httpx.get(f"{url}/v1/nodes", headers=headers, timeout=10).json()["items"]
        assert [n["name"] for n in nodes] == ["local-0"]
    # ... and the job runs on the local node and succeeds (a leader scheduled it).
    wait_for(lambda: httpx.get(f"{urls[1]}/v1/jobs/{job_id}", headers=headers, timeout=10)
             .json()["state"] == "SUCCEEDED", 60, "the job to succeed")

    assert up.interrupt() == 0
    wait_for(lambda: not any(pid_alive(p) for p in children), 15, "every child of `up` to be gone")
