from __future__ import annotations

import pytest

from tests.harness import ControlPlane, EtcdProcess


@pytest.fixture
def etcd(tmp_path):
    """A real etcd on free loopback ports with its own data directory."""
    server = EtcdProcess(tmp_path / "etcd-data", log_path=tmp_path / "etcd.log").start()
    yield server
    server.kill()


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
