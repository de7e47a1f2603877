from __future__ import annotations

import shutil

import pytest

from tests.harness import ControlPlane, EtcdProcess, NodeAgentProc


@pytest.fixture
def etcd(tmp_path):
    """A real etcd on free loopback ports with its own data directory."""
    server = EtcdProcess(tmp_path / "etcd-data", log_path=tmp_path / "etcd.log").start()
    yield server
    server.kill()
    # etcd preallocates 64 MB of WAL: kept, one per test, they came to 15 GB a run
    shutil.rmtree(server.data_dir, ignore_errors=True)


@pytest.fixture
def control_plane(etcd, tmp_path):
    """A real control plane (uvicorn subprocess) on that etcd, with user and node tokens."""
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp").start()
    yield cp
    cp.stop()


@pytest.fixture
def api(control_plane):
    with control_plane.client("user") as client:
        yield client


@pytest.fixture
def agents(control_plane, tmp_path):
    """Start real node agents (n0, n1, ...) on the control plane; all are stopped at the end."""
    started: list[NodeAgentProc] = []

    def start(n: int = 1, nproc: int = 1) -> list[NodeAgentProc]:
        new = [NodeAgentProc(control_plane, f"n{len(started) + i}", tmp_path / "nodes",
                             nproc_per_node=nproc).start() for i in range(n)]
        started.extend(new)
        return new

    yield start
    for agent in started:
        agent.stop()
