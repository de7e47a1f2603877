"""How long a node agent keeps its copy of each job's torchrun output (`<data-dir>/logs/<job>`).

The control plane's log root is what `GET /logs` serves and has its own retention; the
agent's copy is for someone on the node, and without a bound it grows for as long as the
node lives. The agent keeps the folders of the last `keep_jobs` jobs (by last write) and
none older than `max_age_s`, and never one of a job it runs now or one written to in the
last `MIN_IDLE_S` (another agent sharing the data directory may be running that job, or
the job is between two attempts on this node).

`to_delete` decides (pure, a table test); `prune` reads the folder and deletes.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from . import safe_files

log = logging.getLogger("ftrain.agent")

KEEP_JOBS = 20
MAX_AGE_S = 7 * 24 * 3600.0
MIN_IDLE_S = 3600.0


@dataclass(frozen=True)
class JobLogs:
    job_id: str
    last_write: float  # unix time of the newest write in the folder


def to_delete(folders: list[JobLogs], running: Collection[str], now: float,
              keep_jobs: int = KEEP_JOBS, max_age_s: float = MAX_AGE_S,
              min_idle_s: float = MIN_IDLE_S) -> list[str]:
    """The job ids whose folders go: past the newest `keep_jobs`, or idle over `max_age_s`."""
    gone = []
    newest_first = sorted(folders, key=lambda f: f.last_write, reverse=True)
    for rank, f in enumerate(newest_first):
        idle = now - f.last_write
        if f.job_id in running or idle < min_idle_s:
            continue
        if rank >= keep_jobs or idle > max_age_s:
            gone.append(f.job_id)
    return gone


def prune(logs_dir: Path, running: Collection[str], keep_jobs: int = KEEP_JOBS,
          max_age_s: float = MAX_AGE_S, now: float | None = None) -> list[str]:
    """Delete the folders of `logs_dir` that `to_delete` picks; returns their job ids."""
    now = time.time() if now is None else now
    try:
        entries = [e for e in os.scandir(logs_dir) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    folders = [JobLogs(e.name, _last_write(Path(e.path))) for e in entries]
    gone = to_delete(folders, running, now, keep_jobs, max_age_s)
    for job_id in gone:
        try:  # torchrun's folders in it are the job's user's: nothing below followed (safe_files)
            safe_files.remove_tree(logs_dir / job_id)
        except OSError as exc:
            log.warning("could not remove all of the local logs of job %s: %s", job_id, exc)
    if gone:
        log.info("deleted the local logs of %d job(s) no longer run here (keeping %d jobs, %.0f days): %s",
                 len(gone), keep_jobs, max_age_s / 86400, ", ".join(gone[:10]))
    return gone


def _last_write(folder: Path) -> float:
    """The newest modification time of `folder` and of everything in it: the workers write
    their output deep in its `torchrun/` (`<run>/attempt_<n>/<local rank>/stdout.log`), and a
    long run may write nothing else for hours. Walked without recursion and through no link:
    below `torchrun/` the folders are the job's user's, who may make them deep or swap them."""
    newest = folder.lstat().st_mtime
    todo = [folder]
    while todo:
        here = todo.pop()
        try:
            with safe_files.folder(here) as fd:
                for name in os.listdir(fd):
                    try:
                        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                    except OSError:
                        continue
                    newest = max(newest, st.st_mtime)
                    if stat.S_ISDIR(st.st_mode):
                        todo.append(here / name)
        except OSError:
            continue
    return newest
