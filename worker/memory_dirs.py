"""The memory tier's directories, the node agent's side of worker/memory.py: made for a job
when its group starts, removed when the node leaves the job or when the agent that made
them is gone.

Apart from worker/memory.py (which needs torch) so that the agent, which only makes and
removes these directories, starts without importing torch: a second or more of CPU and
some 200 MB of memory per agent.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger("ftrain.memory")

SHM_ROOT = Path("/dev/shm")
_PREFIX = "ftrain-mem."


def node_root(data_dir: str | Path, node: str, shm: Path = SHM_ROOT) -> str:
    """The name prefix of this agent's memory directories: its data directory and name
    (agents of one name in different data directories share the machine in tests)."""
    tag = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]
    return f"{_PREFIX}{tag}.{node}."


def make_job_dir(data_dir: str | Path, node: str, job_id: str, shm: Path = SHM_ROOT) -> Path:
    """A fresh memory directory for `job_id` on this node (0700), under /dev/shm when it
    is there, else the data directory (then it is disk, and only outlives the worker)."""
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(data_dir) / "memory"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = base / f"{node_root(data_dir, node, shm)}{job_id}.{os.urandom(4).hex()}"
    path.mkdir(mode=0o700)
    (path / OWNER_FILE).write_text(_owner_of(os.getpid()) or "")
    return path


def remove_leftovers(data_dir: str | Path, node: str, shm: Path = SHM_ROOT) -> list[Path]:
    """Remove the memory directories a previous agent of this name and data directory left
    (it was killed); called by the agent when it starts."""
    prefix = node_root(data_dir, node, shm)
    removed = []
    for base in (shm, Path(data_dir) / "memory"):
        if not base.is_dir():
            continue
        for p in base.iterdir():
            if p.name.startswith(prefix):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed


# A memory directory's owner: the agent that made it, as "pid start-time pid-namespace"
# (`/proc`), so that any agent can tell a directory whose agent is gone (SIGKILLed: it
# removed nothing) from a live one's, a reused PID included (`remove_orphans`).
OWNER_FILE = ".owner"
# A directory without an owner file (made before owners were noted) is removed only when
# it is empty and untouched for this long: it then holds nothing a live job could need.
UNOWNED_AGE_S = 3600.0


def _owner_of(pid: int) -> str | None:
    """"pid start-time pid-namespace" of a live process, None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        return None
    start = stat.rsplit(")", 1)[1].split()[19]  # field 22, after the command's parentheses
    return f"{pid} {start} {namespace}"


def _orphaned(path: Path, now: float) -> bool:
    """Whether memory directory `path` belongs to no live agent (see OWNER_FILE)."""
    try:
        owner = (path / OWNER_FILE).read_text().split()
    except FileNotFoundError:
        try:
            return next(path.iterdir(), None) is None and now - path.stat().st_mtime > UNOWNED_AGE_S
        except OSError:
            return False
    except OSError:
        return False
    if len(owner) != 3 or not owner[0].isdigit():
        return False  # not ours to judge
    if owner[2] != (_owner_of(os.getpid()) or "").split(" ")[-1]:
        return False  # an agent in another PID namespace: its PIDs mean nothing here
    return _owner_of(int(owner[0])) != " ".join(owner)


def remove_orphans(shm: Path = SHM_ROOT) -> list[Path]:
    """Remove the memory directories under `shm` of every agent that is gone (killed, so it
    removed nothing; its data directory may be gone too, so no agent of its name and data
    directory would ever take them back: `remove_leftovers`); never a live agent's. Called
    by the agent when it starts."""
    removed = []
    now = time.time()
    try:
        found = [p for p in shm.iterdir() if p.name.startswith(_PREFIX) and p.is_dir()]
    except OSError:
        return removed
    for p in found:
        if _orphaned(p, now):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    if removed:
        log.info("removed %d memory directories of agents that are gone: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed
