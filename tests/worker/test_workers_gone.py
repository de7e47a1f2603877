"""worker/torchrun.py `Torchrun.workers_gone`: a replaced group whose workers have all exited
is killed without the SIGTERM grace (worker/agent.py). Nothing but a process forked by the
job's fork server (torchrun itself) or a standby (`ftrain-standby`) under the group counts as no
worker; anything else does."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import pid_alive, wait_for
from worker.procs import descendants, is_standby, kill_all
from worker.torchrun import Torchrun, WorkerGroup

pytestmark = pytest.mark.integration  # real processes stand for torchrun and its workers

# The group's process: starts one child with the given argv, reaps it when it dies, then waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen(sys.argv[1:])
print(child.pid, flush=True)
child.wait()
time.sleep(60)
"""


class Shipper:
    def add(self, *args) -> None:
        pass


def _group(tmp_path: Path, child: list[str]) -> tuple[Torchrun, int]:
    t = Torchrun("n1", "http://cp", tmp_path, None, Shipper())
    proc = subprocess.Popen([sys.executable, "-c", PARENT, *child], stdout=subprocess.PIPE, text=True)
    t.group = WorkerGroup("j", 1, proc)
    return t, int(proc.stdout.readline())


def _end(t: Torchrun) -> None:
    assert t.group is not None
    kill_all([t.group.proc.pid, *descendants(t.group.proc.pid)])
    t.group.proc.wait()


def test_a_live_worker_counts_until_it_has_exited(tmp_path):
    t, child = _group(tmp_path, [sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not t.workers_gone()
        kill_all([child])
        wait_for(lambda: not pid_alive(child), 10, "the worker to exit and be reaped")
        assert t.workers_gone()
    finally:
        _end(t)


def test_torchrun_forked_by_the_fork_server_is_no_worker(tmp_path):
    stand_in = tmp_path / "fork_server.py"  # its argv is what a forked process keeps
    stand_in.write_text("import time\ntime.sleep(60)\n")
    t, _ = _group(tmp_path, [sys.executable, str(stand_in)])
    try:
        assert t.workers_gone()
    finally:
        _end(t)


def test_a_standby_is_no_part_of_the_group_and_its_stop_leaves_the_standby_be(tmp_path):
    """A fork server's standby (named `ftrain-standby` until it is handed a worker) is neither
    a worker that keeps the group alive nor killed by the group's stop: the next group's
    worker starts in it."""
    named = ("import ctypes, time; ctypes.CDLL(None).prctl(15, b'ftrain-standby'); "
             "print('named', flush=True); time.sleep(60)")
    t, child = _group(tmp_path, [sys.executable, "-c", named])
    try:
        wait_for(lambda: is_standby(child), 10, "the stand-in to name itself")
        assert child not in t.group_tree(t.group) and t.workers_gone()
        t.stop("a new round", grace_s=0)
        assert pid_alive(child)
    finally:
        kill_all([child])
        if t.group is not None:
            _end(t)
