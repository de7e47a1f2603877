"""The agent's bound on its local copies of torchrun output (`<data-dir>/logs/<job>`)."""

from __future__ import annotations

import os
import time

import pytest

from worker import log_retention
from worker.log_retention import JobLogs, prune, to_delete

NOW = 1_000_000_000.0
H = 3600.0
D = 24 * H


@pytest.mark.parametrize(("ages_h", "running", "keep", "max_age_d", "gone"), [
    # (age in hours of jobs j0, j1, ...), running, keep_jobs, max_age_days, deleted
    ((2, 3, 4), (), 2, 7, ["j2"]),                 # past the newest 2
    ((2, 3, 4), (), 5, 7, []),                     # within both bounds
    ((2, 8 * 24, 3), (), 20, 7, ["j1"]),           # older than 7 days
    ((2, 3, 4), ("j2",), 1, 7, ["j1"]),            # a running job's folder stays
    ((0.5, 0.2, 0.1), (), 1, 7, []),               # written in the last hour: kept
    ((2, 3, 4), (), 0, 7, ["j0", "j1", "j2"]),     # keep none that is idle
    ((9 * 24, 2), ("j0",), 20, 7, []),             # running and old: kept
])
def test_which_folders_go(ages_h, running, keep, max_age_d, gone):
    folders = [JobLogs(f"j{i}", NOW - a * H) for i, a in enumerate(ages_h)]
    assert sorted(to_delete(folders, running, NOW, keep, max_age_d * D)) == gone


def test_prune_deletes_the_folders_and_keeps_the_rest(tmp_path):
    logs = tmp_path / "logs"
    for i, age_h in enumerate((2, 3, 4, 5)):
        d = logs / f"j{i}"
        d.mkdir(parents=True)
        out = d / "n0-attempt0.stdout"
        out.write_text("x")
        os.utime(out, (NOW - age_h * H,) * 2)
        os.utime(d, (NOW - age_h * H,) * 2)
    # j3 is the oldest folder, but a file in it was written a minute ago: its last write counts
    os.utime(logs / "j3" / "n0-attempt0.stdout", (NOW - 60,) * 2)
    # and so does a worker's output file deep in torchrun's folder of j1 (with old folders above it)
    worker = logs / "j1" / "torchrun" / "j1-a1_x" / "attempt_0" / "0"
    worker.mkdir(parents=True)
    (worker / "stdout.log").write_text("x")
    os.utime(worker / "stdout.log", (NOW - 60,) * 2)
    for d in (worker, *worker.parents[:4]):
        os.utime(d, (NOW - 3 * H,) * 2)
    assert sorted(prune(logs, running=("j2",), keep_jobs=1, max_age_s=7 * D, now=NOW)) == ["j0"]
    assert sorted(p.name for p in logs.iterdir()) == ["j1", "j2", "j3"]
    assert prune(tmp_path / "none", running=(), now=NOW) == []


def test_a_job_folder_deeper_than_the_interpreters_recursion_does_not_crash_the_pruning(tmp_path):
    """Below `torchrun/` the folders are the job's user's (`--run-as`): one a thousand levels
    deep must not crash the agent's pruning (a RecursionError ended the agent), and a link in
    it is not followed."""
    logs = tmp_path / "logs"
    deep = logs / "j-deep" / "torchrun"
    deep.mkdir(parents=True)
    (tmp_path / "keep").write_text("not the job's\n")
    old = time.time() - 30 * 86400
    try:
        _make_chain(deep, 1200, tmp_path / "keep")  # past Python's recursion limit
        os.utime(logs / "j-deep", (old, old))
        assert log_retention._last_write(logs / "j-deep") > old  # what is deep inside counts
        log_retention.prune(logs, running=(), now=time.time() + 60 * 86400)  # (too deep: left, said)
        assert (tmp_path / "keep").read_text() == "not the job's\n"
    finally:
        if deep.exists():
            _remove_chain(deep)


def _make_chain(top, depth, target):
    """Folders `top/d/d/...` `depth` deep, a link to `target` at the bottom (each level made
    through a fd: the path would pass PATH_MAX)."""
    fd = os.open(top, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            nfd = os.open("d", os.O_RDONLY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        os.symlink(str(target), "link", dir_fd=fd)
    finally:
        os.close(fd)


def _remove_chain(top):
    """Remove a chain of folders `d/d/...` a level at a time (pytest's own removal of tmp_path
    recurses, and would not get through it)."""
    while (top / "d").exists():
        os.rename(top / "d", top / "x")
        for name in os.listdir(top / "x"):
            if name == "d":
                os.rename(top / "x" / "d", top / "d")
            else:
                os.unlink(top / "x" / name)
        os.rmdir(top / "x")
