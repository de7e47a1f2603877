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
import time
from pathlib import Path

from . import safe_files

log = logging.getLogger("ftrain.memory")

SHM_ROOT = Path(os.path.realpath("/dev/shm"))  # resolved: safe_files walks no link (a /run/shm link)
_PREFIX = "ftrain-mem."


def cluster_root(data_dir: str | Path) -> str:
    """The name prefix of the memory directories of every agent of the data directory
    `data_dir` (a cluster's, on this machine): /dev/shm is shared by every cluster on the
    host, and an agent sweeps only names under its own prefix."""
    tag = hashlib.sha256(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]
    return f"{_PREFIX}{tag}."


def node_root(data_dir: str | Path, node: str, shm: Path = SHM_ROOT) -> str:
    """The name prefix of this agent's memory directories: its data directory and name
    (agents of one name in different data directories share the machine in tests)."""
    return f"{cluster_root(data_dir)}{node}."


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
            if p.name.startswith(prefix) and _remove(p):
                removed.append(p)
    return removed


# A memory directory's owner: the agent that made it, as "pid start-time pid-namespace"
# (`/proc`), so that any agent of its data directory can tell a directory whose agent is gone
# (SIGKILLed: it removed nothing) from a live one's, a reused PID included (`remove_orphans`).
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


def _remove(path: Path) -> bool:
    """Remove memory directory `path` (its job's user's under `--run-as`: safe_files walks it)."""
    try:
        safe_files.remove_tree(path)
    except OSError as exc:
        log.warning("could not remove the memory directory %s: %s", path, exc)
        return False
    return True


def _orphaned(path: Path, now: float) -> bool:
    """Whether memory directory `path` belongs to no live agent (see OWNER_FILE)."""
    try:  # written by the agent, in a folder its job's user may change: read through no link
        owner = safe_files.read_bytes(path / OWNER_FILE, 256, owner=None).decode(errors="replace").split()
    except FileNotFoundError:
        try:
            empty = not safe_files.listdir(path)
            return empty and now - safe_files.lstat(path).st_mtime > UNOWNED_AGE_S
        except OSError:
            return False
    except OSError:
        return False
    if len(owner) != 3 or not owner[0].isdigit():
        return False  # not ours to judge
    if owner[2] != (_owner_of(os.getpid()) or "").split(" ")[-1]:
        return False  # an agent in another PID namespace: its PIDs mean nothing here
    return _owner_of(int(owner[0])) != " ".join(owner)


def remove_orphans(data_dir: str | Path, shm: Path = SHM_ROOT) -> list[Path]:
    """Remove the memory directories under `shm` of every agent of this data directory that
    is gone (killed, so it removed nothing; an agent of another name would never take them
    back: `remove_leftovers`); never a live agent's, nor another data directory's (another
    cluster on the host: its own agents sweep those). Called by the agent when it starts."""
    removed = []
    now = time.time()
    prefix = cluster_root(data_dir)
    try:
        found = [p for p in shm.iterdir() if p.name.startswith(prefix) and safe_files.is_dir(p)]
    except OSError:
        return removed
    for p in found:
        if _orphaned(p, now) and _remove(p):
            removed.append(p)
    if removed:
        log.info("removed %d memory directories of agents that are gone: %s", len(removed),
                 ", ".join(p.name for p in removed))
    return removed


# ---------------------------------------------------------------- a survivor's last words
# Each worker of a node that may say last words (worker/last_words.py) holds a POSIX lock on
# one byte of this file of its tier, byte `local_rank`, from its start (the writer, local rank
# 0: from `init`) until it exits; byte 0 is the writer's, the right to write the tier. The
# kernel lets go of a process's locks when it dies (SIGKILL included), and a fork does not
# inherit them. A sibling whose writer is gone takes byte 0 too (`take_writer`) before it
# writes: two live processes never write the tier at once. torchrun's stop of a broken group
# waits until no byte is held (`wait_for_last_words`).
LAST_WORDS_LOCK = "last-words.lock"
LAST_WORDS_POLL_S = 0.005
WRITER_BYTE = 0


def hold_last_words(directory: str | Path, byte: int = WRITER_BYTE) -> int | None:
    """Take byte `byte` (a worker's local rank) of the tier's last-words lock for this
    process; its fd (keep it open: closing it lets go of every byte this process holds), or
    None where it cannot be had (another live process holds it, no such directory)."""
    try:
        fd = os.open(Path(directory) / LAST_WORDS_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, byte)
    except OSError:
        os.close(fd)
        return None
    return fd


def take_writer(fd: int, timeout_s: float) -> bool:
    """A sibling (it holds its own byte through `fd`): take the writer's byte, waiting up to
    `timeout_s` for the writer that holds it to exit (it says its own last words first, or
    its death has not yet let go of it). True: this process is the tier's only writer now."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, WRITER_BYTE)
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(LAST_WORDS_POLL_S)


# While a worker says its last words (`FailureFlush.say`, worker/failure_flush.py) it holds byte SPEAKING +
# local_rank as well: the node agent's stop of a replaced attempt, whose grace is short, waits
# past it only for those (`wait_for_speakers`), not for a worker that may speak but is stuck
# (a collective with a silent peer: its SIGTERM handler never runs).
SPEAKING = 1 << 20
SPEAKING_SPAN = 1 << 20
# How long a stop waits for them at most (worker/failure_flush.py LAST_WORDS_S, and a margin for the
# worker's exit): torchrun's stop of a broken group (worker/rendezvous/monitor.py), the node
# agent's of a replaced attempt (worker/torchrun.py `stop`).
LAST_WORDS_WAIT_S = 2.5


def start_speaking(fd: int, local_rank: int) -> bool:
    """Take this worker's speaking byte through `fd` (its lock's fd); True if taken."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, SPEAKING + local_rank)
        return True
    except OSError:
        return False


def stop_speaking(fd: int, local_rank: int) -> None:
    try:
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, SPEAKING + local_rank)
    except OSError:
        pass


def wait_for_speakers(directory: str | Path, timeout_s: float) -> float | None:
    """Wait until no worker of the tier is saying its last words, at most `timeout_s`; the
    seconds waited, None where none was."""
    return wait_for_last_words(directory, timeout_s, SPEAKING, SPEAKING_SPAN)


def wait_for_last_words(directory: str | Path, timeout_s: float, start: int = 0,
                        length: int = 0) -> float | None:
    """Wait until no process holds any byte of the tier's last-words lock (its workers have
    said them and exited), at most `timeout_s`; the seconds waited, None where nobody held it.
    `start`, `length`: only those bytes (0: to the end)."""
    began = time.monotonic()
    try:  # the agent's wait (root under `--run-as`) in the job's user's folder: through no link
        fd = safe_files.open_file(Path(directory) / LAST_WORDS_LOCK, os.O_RDWR)
    except OSError:
        return None
    held = False
    try:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, length, start)
                fcntl.lockf(fd, fcntl.LOCK_UN, length, start)
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
