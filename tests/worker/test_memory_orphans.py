"""Memory-tier directories of agents that are gone (SIGKILLed: they removed nothing) are
removed by any agent that starts on the machine; a live agent's are never touched
(`worker.memory_dirs.remove_orphans`, by the owner each directory notes); and the agent,
which only makes and removes these directories, does not import torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.processes import REPO
from worker import memory_dirs as mem


def _owned(shm: Path, name: str, owner: str) -> Path:
    path = shm / f"{mem._PREFIX}{name}"
    path.mkdir()
    (path / mem.OWNER_FILE).write_text(owner)
    return path


def test_only_the_directories_of_gone_agents_are_removed(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    live = mem.make_job_dir(tmp_path / "a", "n0", "job1", shm=shm)  # this process: a live agent
    pid, start, namespace = (live / mem.OWNER_FILE).read_text().split()
    assert int(pid) == os.getpid()
    gone_pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    assert not Path(f"/proc/{gone_pid}").exists()
    dead = _owned(shm, "dead", f"{gone_pid} 1 {namespace}")
    reused = _owned(shm, "reused", f"{pid} {int(start) + 1} {namespace}")  # its PID, another process
    elsewhere = _owned(shm, "elsewhere", f"{gone_pid} 1 pid:[1]")  # another PID namespace
    old_empty = shm / f"{mem._PREFIX}old-empty"  # made before owners were noted
    old_full = shm / f"{mem._PREFIX}old-full"
    fresh_empty = shm / f"{mem._PREFIX}fresh-empty"
    for p in (old_empty, old_full, fresh_empty):
        p.mkdir()
    (old_full / "slot0.bin").write_bytes(b"x")
    hours_ago = time.time() - 2 * mem.UNOWNED_AGE_S
    for p in (old_empty, old_full):
        os.utime(p, (hours_ago, hours_ago))
    other = shm / "not-ours"
    other.mkdir()

    removed = mem.remove_orphans(shm)

    assert sorted(removed) == sorted([dead, reused, old_empty])
    assert not any(p.exists() for p in removed)
    assert all(p.exists() for p in (live, elsewhere, old_full, fresh_empty, other))
    assert mem.remove_orphans(shm) == []


@pytest.mark.integration
def test_the_node_agent_starts_without_importing_torch():
    """The agent only makes and removes the memory tier's directories (worker/memory_dirs.py):
    importing torch would cost every agent's start a second or more and some 200 MB."""
    probe = ("import sys, worker.agent, service.cli; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout[-500:], done.stderr[-2000:])
