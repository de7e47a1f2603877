"""Every worker's flight-recorder trace, on the node agent's request, for a job taken for hung.

torch's flight recorder keeps, in each process, a ring of the last collectives its process
groups were asked for (gloo's and NCCL's alike): each entry's sequence number in its group
(`collective_seq_id`), its op (`gloo:all_reduce`), and per group the last one enqueued and the
last one completed. A group records only when TORCH_FR_BUFFER_SIZE (or NCCL's older name,
TORCH_NCCL_TRACE_BUFFER_SIZE) is above 0 when it is created, so the agent sets a modest
size in every worker's environment (`default_env`) unless the job's or the node's
environment sets one; 0 turns it off. Recording costs a few hundred bytes per collective in a
fixed ring, nothing on the wire.

Where ranks hang, the recorder says which collective each one entered last: a rank whose last
enqueued collective is behind the others' never reached the one they wait in.

The dump must be taken from inside the worker, while its main thread may sit in C++ for good
(a collective that waits for a peer). A Python signal handler would never run there, and
`faulthandler` writes only stacks. So `start` (called by `stacks.register`: the fork server
for every worker it forks, `runtime.init` otherwise) runs a small daemon thread that looks for
a request file (FLIGHT_REQUEST) in the worker's folder of output files every REQUEST_POLL_S
and answers it with a dump (FLIGHT_FILE): the dump call is C++ that does not need the main
thread, and the thread gets the GIL because a blocked collective releases it. A request file,
rather than a signal or a FIFO: a signal's Python handler runs only on the main thread (and
`signal.set_wakeup_fd`, the one C-level path to another thread, is a single process-wide slot
that asyncio and user code take over); a FIFO in a folder the job's user can write is what
the agent's `safe_files` refuses to open (an open can block). The agent writes the request
with `safe_files.replace_file` like any other file there, and the poll is one stat a quarter
second. The dump is written under a temporary name and renamed, so the agent never reads half
of one, and it keeps only the last MAX_ENTRIES entries, so it stays small (the agent reads at
most MAX_DUMP_BYTES of it, through `safe_files`, never through a link).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from . import safe_files

log = logging.getLogger(__name__)

BUFFER_SIZE_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
DEFAULT_BUFFER_SIZE = "2000"  # entries per process (a ring: the oldest go first)
FLIGHT_FILE = "ftrain-flight.json"
FLIGHT_REQUEST = "ftrain-flight.request"
REQUEST_POLL_S = 0.25
MAX_ENTRIES = 64  # of the newest, kept in a dump (the last few per group are what tell)
MAX_DUMP_BYTES = 256 * 1024  # of one worker's dump read back (64 entries are ~40 KiB)

_started: list[threading.Thread] = []


def default_env(env: dict[str, str]) -> None:
    """Turn the flight recorder on in a worker's environment `env`, unless it says otherwise."""
    if not any(name in env for name in BUFFER_SIZE_VARS):
        env[BUFFER_SIZE_VARS[0]] = DEFAULT_BUFFER_SIZE


def is_on(env: Mapping[str, str]) -> bool:
    """The environment asks torch to record collectives (a buffer size above 0)."""
    sizes = [env.get(name, "").strip() for name in BUFFER_SIZE_VARS]
    return any(s.isdigit() and int(s) > 0 for s in sizes)


def start(folder: str | Path, env: Mapping[str, str]) -> bool:
    """Answer the agent's requests for this process's flight recorder in `folder` (a daemon
    thread, once per process); False where the recorder is off."""
    if _started or not is_on(env):
        return bool(_started)
    folder = Path(folder)
    for name in (FLIGHT_FILE, FLIGHT_REQUEST):  # an earlier process's, never answered by this one
        _unlink(folder / name)
    t = threading.Thread(target=_serve, args=(folder,), name="ftrain-flight-recorder", daemon=True)
    t.start()
    _started.append(t)
    return True


def _serve(folder: Path) -> None:
    request = folder / FLIGHT_REQUEST
    while True:
        time.sleep(REQUEST_POLL_S)
        if not os.path.lexists(request):
            continue
        _unlink(request)
        try:
            write_dump(folder / FLIGHT_FILE, dump())
        except Exception as exc:  # noqa: BLE001 - the worker goes on whatever a dump does
            log.warning("the flight recorder's dump failed: %s", exc)


def dump() -> dict[str, Any]:
    """This process's flight-recorder trace (its newest MAX_ENTRIES entries)."""
    from . import torch_internals

    raw = torch_internals.get(torch_internals.FR_DUMP_JSON)(includeCollectives=True, onlyActive=False)
    trace = json.loads(raw)
    trace["entries"] = trace.get("entries", [])[-MAX_ENTRIES:]
    return trace


def write_dump(path: Path, trace: dict[str, Any]) -> None:
    """`trace` as JSON at `path`, whole or not at all (a temporary name, then a rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(trace, f)
    os.replace(tmp, path)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ------------------------------------------------------------------ the agent's side
def request(folders: list[Path]) -> None:
    """Ask the worker of each folder for a dump (a fresh one: an earlier dump is removed)."""
    for folder in folders:
        try:
            safe_files.unlink(folder / FLIGHT_FILE)
            safe_files.replace_file(folder / FLIGHT_REQUEST, b"")
        except OSError as exc:
            log.debug("no flight-recorder request in %s: %s", folder, exc)


def read_dumps(files: dict[int, Path], wait_s: float) -> dict[int, dict[str, Any]]:
    """Each rank's dump (rank -> its FLIGHT_FILE) that came within `wait_s`; the others left out."""
    deadline = time.monotonic() + wait_s
    done: dict[int, dict[str, Any]] = {}
    while True:
        for rank, path in files.items():
            if rank not in done and (trace := _read(path)) is not None:
                done[rank] = trace
        if len(done) == len(files) or time.monotonic() >= deadline:
            return done
        time.sleep(0.05)


def _read(path: Path) -> dict[str, Any] | None:
    try:  # the job's user's folder: never through a link
        trace = json.loads(safe_files.read_bytes(path, MAX_DUMP_BYTES))
    except (OSError, ValueError):
        return None
    return trace if isinstance(trace, dict) else None


def groups(trace: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per process group of a dump: its name, the last collective enqueued and completed (their
    sequence numbers, -1 for none) and the op of the last enqueued (None when not recorded)."""
    names = {str(e["process_group"][0]): str(e["process_group"][1])
             for e in trace.get("entries", []) if _is_pair(e.get("process_group"))}
    ops = {(str(e["process_group"][0]), e.get("collective_seq_id")): str(e.get("profiling_name", ""))
           for e in trace.get("entries", []) if _is_pair(e.get("process_group"))}
    out = []
    for pg_id, status in (trace.get("pg_status") or {}).items():
        if not isinstance(status, dict):
            continue
        enqueued = _int(status.get("last_enqueued_collective"))
        out.append({"pg": names.get(str(pg_id), str(pg_id)), "last_enqueued": enqueued,
                    "last_completed": _int(status.get("last_completed_collective")),
                    "op": ops.get((str(pg_id), enqueued)) or None})
    return out


def _is_pair(v: Any) -> bool:
    return isinstance(v, list) and len(v) == 2


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1


def summary(rank: int, found: list[dict[str, Any]] | None) -> str:
    """One line of the job's log on a rank's flight recorder (`groups` of its dump)."""
    head = f"ftrain: rank {rank}'s flight recorder (the job was taken for hung): "
    if found is None:
        return head + "no dump (the recorder is off, or the worker did not answer)"
    if not found:
        return head + "no collectives recorded"
    return head + "; ".join(f"group {g['pg']}: last enqueued #{g['last_enqueued']}"
                            + (f" {g['op']}" if g["op"] else "")
                            + f", last completed #{g['last_completed']}" for g in found)
