"""Memory-tier directories of agents that are gone (SIGKILLed: they removed nothing) are
removed by any agent of their data directory that starts on the machine; a live agent's, and
another data directory's (another cluster on the host), are never touched
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


def _owned(shm: Path, data_dir: Path, name: str, owner: str) -> Path:
    path = shm / f"{mem.cluster_root(data_dir)}{name}"
    path.mkdir()
    (path / mem.OWNER_FILE).write_text(owner)
    return path


def _gone_pid() -> int:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) - 1
    assert not Path(f"/proc/{pid}").exists()
    return pid


def test_only_the_directories_of_gone_agents_are_removed(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    cluster = tmp_path / "a"
    live = mem.make_job_dir(cluster, "n0", "job1", shm=shm)  # this process: a live agent
    pid, start, namespace = (live / mem.OWNER_FILE).read_text().split()
    assert int(pid) == os.getpid()
    gone_pid = _gone_pid()
    dead = _owned(shm, cluster, "dead", f"{gone_pid} 1 {namespace}")
    reused = _owned(shm, cluster, "reused", f"{pid} {int(start) + 1} {namespace}")  # its PID, another process
    elsewhere = _owned(shm, cluster, "elsewhere", f"{gone_pid} 1 pid:[1]")  # another PID namespace
    old_empty = shm / f"{mem.cluster_root(cluster)}old-empty"  # made before owners were noted
    old_full = shm / f"{mem.cluster_root(cluster)}old-full"
    fresh_empty = shm / f"{mem.cluster_root(cluster)}fresh-empty"
    for p in (old_empty, old_full, fresh_empty):
        p.mkdir()
    (old_full / "slot0.bin").write_bytes(b"x")
    hours_ago = time.time() - 2 * mem.UNOWNED_AGE_S
    for p in (old_empty, old_full):
        os.utime(p, (hours_ago, hours_ago))
    other = shm / "not-ours"
    other.mkdir()

    removed = mem.remove_orphans(cluster, shm)

    assert sorted(removed) == sorted([dead, reused, old_empty])
    assert not any(p.exists() for p in removed)
    assert all(p.exists() for p in (live, elsewhere, old_full, fresh_empty, other))
    assert mem.remove_orphans(cluster, shm) == []


def test_an_agent_leaves_another_data_directorys_directories_alone_even_when_their_agent_is_gone(tmp_path):
    """/dev/shm is shared by every cluster on the host: another cluster's agents sweep its own."""
    shm = tmp_path / "shm"
    shm.mkdir()
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    namespace = mem._owner_of(os.getpid()).split()[2]
    gone = f"{_gone_pid()} 1 {namespace}"
    my_dead = _owned(shm, mine, "n0.job1.aaaa", gone)
    their_dead = _owned(shm, theirs, "n0.job1.bbbb", gone)
    their_old_empty = shm / f"{mem.cluster_root(theirs)}old-empty"
    their_old_empty.mkdir()
    hours_ago = time.time() - 2 * mem.UNOWNED_AGE_S
    os.utime(their_old_empty, (hours_ago, hours_ago))

    assert mem.remove_orphans(mine, shm) == [my_dead]
    assert their_dead.is_dir() and their_old_empty.is_dir()
    assert sorted(mem.remove_orphans(theirs, shm)) == sorted([their_dead, their_old_empty])


@pytest.mark.integration
def test_the_node_agent_starts_without_importing_torch():
    """The agent only makes and removes the memory tier's directories (worker/memory_dirs.py):
    importing torch would cost every agent's start a second or more and some 200 MB."""
    probe = ("import sys, worker.agent, service.cli; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout[-500:], done.stderr[-2000:])
