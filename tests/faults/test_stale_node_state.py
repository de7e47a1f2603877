"""Node-local state a SIGKILLed agent leaves: its memory-tier directory in /dev/shm is
removed by the next agent that starts on the machine, whatever its name and data directory
(`worker.memory_dirs.remove_orphans`), and a live agent's is kept."""

from __future__ import annotations

import pytest

from tests.helpers.elastic import submit, wait_nodes
from tests.helpers.processes import wait_for
from worker import memory as mem

pytestmark = pytest.mark.integration


def _memory_dirs(agent) -> list:
    prefix = mem.node_root(agent.workdir, agent.name)
    return sorted(mem.SHM_ROOT.glob(f"{prefix}*"))


def test_a_killed_agents_memory_directory_is_removed_by_the_next_agent_to_start(api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    sleeper = {"command": ["python", "-c", "import time; time.sleep(120)"], "max_restarts": 0,
               "env": {"FTRAIN_FORK_SERVER": "0"}}
    submit(api, {"name": "sleeps-a", **sleeper})
    submit(api, {"name": "sleeps-b", **sleeper})
    left = wait_for(lambda: _memory_dirs(a), 30, "n0's memory directory")
    kept = wait_for(lambda: _memory_dirs(b), 30, "n1's memory directory")
    a.kill_tree()  # SIGKILL: n0's agent removes nothing
    assert all(p.is_dir() for p in left)
    (c,) = agents(1)  # n2: another name (the same name would take back its own: remove_leftovers)
    wait_for(lambda: c.name in {n["name"] for n in api.get("/v1/nodes").json()["items"]}, 30,
             "n2 to register (it sweeps before it registers)")
    assert not any(p.exists() for p in left), left
    assert all(p.is_dir() for p in kept), kept  # n1 is alive
