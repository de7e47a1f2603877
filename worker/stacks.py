"""Every worker's Python stacks, on the node agent's signal, for a job taken for hung.

A worker stuck in a collective (or a loop) cannot be asked anything in Python: its main
thread may sit in C++ for good, so a Python signal handler would never run. `faulthandler`
dumps every thread's stack from the signal handler itself, in C, whatever the threads are
doing. So each worker registers STACKS_SIGNAL (`register`: the fork server does it for every
worker it forks, plain scripts included, and `runtime.init` for a worker started without it)
with its output going to STACKS_FILE in its folder of output files (that of
TORCHELASTIC_ERROR_FILE, where the launcher leaves its note), whose first line names the
worker's pid. When the control plane takes an attempt for hung, the node agent signals each
pid it finds in those files (`pids`), and only those, then reads the dumps back (`read_dumps`)
before it stops the group. A worker that registered nothing (exec'd without the fork server,
never calling `runtime.init`) is not signalled, and has no stacks.

`register` also starts the thread that answers the agent's requests for the worker's
flight-recorder trace (worker/flight.py), which the agent reads back with the stacks.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import time
from pathlib import Path

from . import flight, safe_files
from .env import TORCHELASTIC_ERROR_FILE

# A real-time signal: nothing else uses it.
STACKS_SIGNAL = signal.SIGRTMIN + 6
HEADER = "ftrain-stacks pid="  # the file's first line: the worker that writes it
STACKS_FILE = "ftrain-stacks.txt"
MAX_DUMP_BYTES = 64 * 1024  # of one worker's dump read back (a dump of 100 threads is ~40 KiB)

_files: list = []  # the open dump files (faulthandler keeps only their descriptor)


def register(env: dict[str, str] | os._Environ) -> bool:
    """Dump every thread's stack into STACKS_FILE on STACKS_SIGNAL, and the flight recorder's
    trace on the agent's request (`flight.start`); False where this process has no folder of
    output files (not a worker of torchrun's, e.g. the local twin)."""
    error_file = env.get(TORCHELASTIC_ERROR_FILE)
    if not error_file or _files:
        return bool(_files)
    folder = os.path.dirname(error_file)
    try:
        fd = os.open(os.path.join(folder, STACKS_FILE),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError:
        return False
    f = os.fdopen(fd, "w")
    f.write(f"{HEADER}{os.getpid()}\n")  # faulthandler writes after it, at the file's offset
    f.flush()
    faulthandler.register(STACKS_SIGNAL, file=f, all_threads=True, chain=False)
    _files.append(f)
    flight.start(env)  # the agent asks the pids named in STACKS_FILE only
    return True


def pids(files: dict[int, Path]) -> dict[int, int]:
    """rank -> the pid of the worker that registered its STACKS_FILE (those that did)."""
    out = {}
    for rank, path in files.items():
        first = _read(path).partition("\n")[0]
        if first.startswith(HEADER) and first[len(HEADER):].isdigit():
            out[rank] = int(first[len(HEADER):])
    return out


def read_dumps(files: dict[int, Path], wait_s: float) -> dict[int, str]:
    """Each rank's dump (rank -> its STACKS_FILE), once written: a file is taken when it has
    stopped growing past its first line, and after `wait_s` whatever is there ('' for none)."""
    deadline = time.monotonic() + wait_s
    sizes: dict[int, int] = {}
    done: dict[int, str] = {}
    while True:
        for rank, path in files.items():
            text = _read(path) if rank not in done else None
            if text is None:
                continue
            dump = text.partition("\n")[2] if text.startswith(HEADER) else text
            if dump and sizes.get(rank) == len(dump):
                done[rank] = dump
            sizes[rank] = len(dump)
        if len(done) == len(files) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    return {rank: done.get(rank, "") for rank in files}


def _read(path: Path) -> str:
    try:  # the job's user's folder: never through a link
        return safe_files.read_bytes(path, MAX_DUMP_BYTES).decode("utf-8", "replace")
    except OSError:
        return ""
