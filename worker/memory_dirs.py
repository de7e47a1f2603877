"""The memory tier's directories, the node agent's side of worker/memory.py: made for a job
when its group starts, removed when the node leaves the job or when the agent that made
them is gone.

Apart from worker/memory.py (which needs torch) so that the agent, which only makes and
removes these directories, starts without importing torch: a second or more of CPU and
some 200 MB of memory per agent.
"""

from __future__ import annotations

import fcntl
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


# ---------------------------------------------------------------- a survivor's last words
# The node's writer holds a POSIX lock on this file of its tier while it may say last words
# (worker/last_words.py): from its first step on CPU until it exits. The kernel lets go of
# the lock when the process dies (SIGKILL included), and a fork does not inherit it.
LAST_WORDS_LOCK = "last-words.lock"
LAST_WORDS_POLL_S = 0.005


def hold_last_words(directory: str | Path) -> int | None:
    """Take the tier's last-words lock for this process; its fd (keep it open: closing it lets
    go), or None where it cannot be had (another live writer holds it, no such directory)."""
    try:
        fd = os.open(Path(directory) / LAST_WORDS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def wait_for_last_words(directory: str | Path, timeout_s: float) -> float | None:
    """Wait until no process holds the tier's last-words lock (its writer has said them and
    exited), at most `timeout_s`; the seconds waited, None where nobody held it."""
    began = time.monotonic()
    try:
        fd = os.open(Path(directory) / LAST_WORDS_LOCK, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    held = False
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.lockf(fd, fcntl.LOCK_UN)
                return time.monotonic() - began if held else None
            except OSError:
                held = True
                if time.monotonic() - began >= timeout_s:
                    return time.monotonic() - began
                time.sleep(LAST_WORDS_POLL_S)
    finally:
        os.close(fd)  # this process's locks on the file go with it (it holds none now)


def last_words_held(directory: str | Path) -> bool:
    """Whether a process holds the tier's last-words lock now."""
    return wait_for_last_words(directory, 0.0) is not None
