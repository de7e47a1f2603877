"""Fixtures that start real processes, and the rule that marks the tests using them.

Layout: tests/service and tests/worker test the two packages (pure logic, and what one
process does); tests/contract runs one suite against every implementation of a seam;
tests/integration and tests/faults run the real thing (etcd, uvicorn, agents, torchrun).
A test that starts a process is marked `integration`: every test under integration/ and
faults/, and every test that uses the `etcd` fixture (the control plane and the agents
stand on it). Any other test that starts a process must say so with the marker; the
guard below fails it otherwise, so `-m "not integration"` is always the quick, process-free
run.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.helpers.netns import fabric_up, netns_unavailable
from tests.helpers.processes import ControlPlane, EtcdProcess, NodeAgentProc, stop_agents

TESTS = Path(__file__).resolve().parent
PROCESS_DIRS = {"integration", "faults"}
PROCESS_FIXTURES = {"etcd"}


def pytest_configure(config):
    config.addinivalue_line("markers", "shared_control_plane: the etcd and control_plane fixtures give "
                            "the module's one (its tests each work on jobs of their own)")
    config.addinivalue_line("markers", "own_control_plane: in a shared_control_plane module, this test "
                            "gets its own (it stops, restarts or registers nodes on it)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        if folder in PROCESS_DIRS or PROCESS_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _own_config_dir(tmp_path, monkeypatch):
    """Each test its own user config directory: `ftrain up` records its cluster there
    (`client.remember_local_cluster`), and the CLI of a later test must not find it."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "user-config"))


@pytest.fixture(autouse=True)
def _processes_only_in_integration_tests(request, monkeypatch):
    """Fail a test that starts a process without being marked `integration`."""
    if request.node.get_closest_marker("integration") is not None:
        return

    def refuse(self, args, *rest, **kwargs):
        pytest.fail(f"{request.node.nodeid} starts a process ({args!r}) but is not marked "
                    "integration: mark it, or move it to tests/integration", pytrace=False)

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


def _shares(request) -> bool:
    """Whether the test takes its module's shared etcd and control plane: marked
    `shared_control_plane` (its module's tests each work on jobs of their own) and not
    `own_control_plane` (it stops, restarts or registers nodes on it), nor given more
    environment."""
    node = request.node
    return (node.get_closest_marker("shared_control_plane") is not None
            and node.get_closest_marker("own_control_plane") is None
            and not hasattr(request, "param"))


def _started_etcd(directory: Path) -> EtcdProcess:
    return EtcdProcess(directory / "etcd-data", log_path=directory / "etcd.log").start()


def _stop_etcd(server: EtcdProcess) -> None:
    server.kill()
    # etcd preallocates 64 MB of WAL: kept, one per test, they came to 15 GB a run
    shutil.rmtree(server.data_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def _module_etcd(tmp_path_factory):
    server = _started_etcd(tmp_path_factory.mktemp("shared-etcd"))
    yield server
    _stop_etcd(server)


@pytest.fixture(scope="module")
def _module_control_plane(_module_etcd, tmp_path_factory):
    cp = ControlPlane(_module_etcd.endpoint, tmp_path_factory.mktemp("shared-cp")).start()
    yield cp
    cp.stop()


@pytest.fixture
def etcd(tmp_path, request):
    """A real etcd on free loopback ports with its own data directory (the module's shared
    one for a test marked `shared_control_plane`)."""
    if _shares(request):
        yield request.getfixturevalue("_module_etcd")
        return
    server = _started_etcd(tmp_path)
    yield server
    _stop_etcd(server)


@pytest.fixture
def control_plane(etcd, tmp_path, request):
    """A real control plane (uvicorn subprocess) on that etcd, with user and node tokens (the
    module's shared one for a test marked `shared_control_plane`: a start saved per test).

    Indirect parametrization passes it more environment (`{"FTRAIN_NODE_TTL_S": "60"}`)."""
    if _shares(request):
        yield request.getfixturevalue("_module_control_plane")
        return
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", env=getattr(request, "param", None)).start()
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
    stop_agents(started)
    # On a shared control plane the next test's agents take the same names: a node this test
    # quarantined (its faults followed it across jobs: service/decide/attribution.py) is
    # undrained, which also forgets its failures.
    if started and control_plane.proc is not None and control_plane.proc.poll() is None:
        with control_plane.client("user") as admin, contextlib.suppress(httpx.HTTPError):
            for agent in started:  # (a test may have stopped its control plane: nothing to undo)
                admin.post(f"/v1/nodes/{agent.name}/undrain")


@pytest.fixture
def fabric():
    """A bridge in a network namespace of its own (tests/helpers/netns.py), or a skip where
    namespaces cannot be made; removed afterwards."""
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    with fabric_up() as f:
        yield f
