"""Node-local state a SIGKILLed agent leaves: its memory-tier directory in /dev/shm is
removed by the next agent of its data directory that starts on the machine, whatever its name
(`worker.memory_dirs.remove_orphans`); a live agent's is kept, and so is another cluster's
(another data directory: /dev/shm is shared by every cluster on the host)."""

from __future__ import annotations

import pytest

from tests.helpers.elastic import submit, wait_nodes
from tests.helpers.processes import NodeAgentProc, wait_for
from worker import memory as mem

pytestmark = pytest.mark.integration


def _memory_dirs(agent) -> list:
    prefix = mem.node_root(agent.workdir, agent.name)
    return sorted(mem.SHM_ROOT.glob(f"{prefix}*"))


SLEEPER = {"command": ["python", "-c", "import time; time.sleep(120)"], "max_restarts": 0,
           "env": {"FTRAIN_FORK_SERVER": "0"}}


def test_a_killed_agents_memory_directory_is_removed_by_the_next_agent_to_start(api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    submit(api, {"name": "sleeps-a", **SLEEPER})
    submit(api, {"name": "sleeps-b", **SLEEPER})
    left = wait_for(lambda: _memory_dirs(a), 30, "n0's memory directory")
    kept = wait_for(lambda: _memory_dirs(b), 30, "n1's memory directory")
    a.kill_tree()  # SIGKILL: n0's agent removes nothing
    assert all(p.is_dir() for p in left)
    (c,) = agents(1)  # n2: another name (the same name would take back its own: remove_leftovers)
    wait_for(lambda: _registered(api, c), 30, "n2 to register (it sweeps before it registers)")
    assert not any(p.exists() for p in left), left
    assert all(p.is_dir() for p in kept), kept  # n1 is alive


def _registered(api, agent) -> bool:
    return agent.name in {n["name"] for n in api.get("/v1/nodes").json()["items"]}


def test_an_agent_leaves_another_clusters_memory_directory_alone_and_sweeps_its_own(
        api, control_plane, tmp_path):
    """Two data directories on the host (two clusters, as the sweep knows them): when the first
    one's agent is gone, a new agent of the second removes only its own cluster's leftovers."""
    first = NodeAgentProc(control_plane, "first-0", tmp_path / "first")
    second = NodeAgentProc(control_plane, "second-0", tmp_path / "second")
    later = NodeAgentProc(control_plane, "second-1", tmp_path / "second")
    try:
        first.start(), second.start()
        wait_nodes(api, 2)
        submit(api, {"name": "sleeps-first", **SLEEPER})
        submit(api, {"name": "sleeps-second", **SLEEPER})
        theirs = wait_for(lambda: _memory_dirs(first), 30, "the first cluster's memory directory")
        mine = wait_for(lambda: _memory_dirs(second), 30, "the second cluster's memory directory")
        first.kill_tree()  # SIGKILL: neither removes anything
        second.kill_tree()
        later.start()  # another name: only the sweep of orphans can take second-0's back
        wait_for(lambda: _registered(api, later), 30, "second-1 to register (it sweeps before it registers)")
        assert not any(p.exists() for p in mine), mine
        assert all(p.is_dir() for p in theirs), theirs
    finally:
        for agent in (first, second, later):
            agent.stop()  # each removes its own leftovers in /dev/shm (and only those)
