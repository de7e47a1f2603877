"""Process-tree helpers for the node agent (and the tests that check it): no orphans.

torch's elastic agent starts each worker in a session of its own, so a process group
does not reach them. Two guards keep workers from outliving their owners:

* every process the agent starts is launched through `pdeathsig_argv`: a tiny
  `python -S -c` shim that asks the kernel for a signal when its parent dies
  (PR_SET_PDEATHSIG survives execve), then execs the real program. torchrun gets SIGTERM
  when the agent dies (it then stops its workers itself);
* every worker torchrun starts goes through `worker/launch.py` (`worker_launch_prefix`),
  which does the same with SIGKILL, then takes a worker forked by the job's fork
  server (`worker/fork_server.py`) or execs the command; a forked worker dies with its
  launcher;
* `descendants(pid)` finds the whole tree from /proc, so a stop can kill what is left.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

# prctl(PR_SET_PDEATHSIG = 1, sig); if the parent is already gone (adopted by init or a
# subreaper before prctl ran), exit instead of running unowned.
_SHIM = (
    "import ctypes,os,sys\n"
    "ppid=int(sys.argv[1])\n"
    "ctypes.CDLL(None).prctl(1,int(sys.argv[2]))\n"
    "os.getppid()!=ppid and os._exit(70)\n"
    "os.execvp(sys.argv[3],sys.argv[3:])\n"
)


def pdeathsig_argv(argv: list[str], sig: int = signal.SIGKILL, parent_pid: int | None = None) -> list[str]:
    """`argv` wrapped so the process gets `sig` when the process that starts it dies."""
    ppid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-S", "-c", _SHIM, str(ppid), str(int(sig)), *argv]


LAUNCH = Path(__file__).with_name("launch.py")
FORK_SERVER = Path(__file__).with_name("fork_server.py")


def worker_launch_prefix(sig: int = signal.SIGKILL) -> list[str]:
    """For torchrun --no-python: `worker/launch.py` guards the worker, then runs it."""
    return [sys.executable, "-S", str(LAUNCH), str(int(sig))]


def is_launcher(argv: list[bytes]) -> bool:
    """True for the argv (from /proc/PID/cmdline) of a `worker/launch.py` stand-in."""
    return len(argv) > 2 and argv[1] == b"-S" and argv[2].endswith(b"/launch.py")


def is_fork_server(argv: list[bytes]) -> bool:
    """True for the argv of a `worker/fork_server.py` (its forked workers keep that argv too)."""
    return any(a.endswith(b"/fork_server.py") for a in argv[:3])


# The name (comm) of a fork server's standby until it is handed a worker's request
# (worker/fork_server.py); kept apart from the FORK_SERVER file so the agent needs no import.
STANDBY_NAME = b"ftrain-standby"


def is_standby(pid: int) -> bool:
    """True for a fork server's standby (no part of any group: a stop leaves it be)."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().strip() == STANDBY_NAME
    except OSError:
        return False


def cmdline(pid: int) -> list[bytes]:
    """The process's argv from /proc, [] if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return []


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (state, ppid, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_of(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if fields else None


def descendants(*roots: int) -> list[int]:
    """Every live descendant of the `roots`, from one read of /proc (parents before children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(entry)):
            children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def is_alive(pid: int) -> bool:
    """True for a running process; a zombie counts as dead."""
    return state_of(pid) not in (None, "Z")


def state_of(pid: int) -> str | None:
    """The process's state letter from /proc (R, S, D, T for stopped, Z...), None if gone."""
    fields = _stat(pid)
    return fields[0] if fields else None


def kill_all(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
