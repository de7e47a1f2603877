"""Every worker's flight-recorder trace, on the node agent's request, for a job taken for hung.

torch's flight recorder keeps, in each process, a ring of the last collectives its process
groups were asked for (gloo's in one recorder, NCCL's in one of its own: `dump` reads both):
each entry's sequence number in its group (`collective_seq_id`), its op (`gloo:all_reduce`),
and per group the last one enqueued and the last one completed. A group records only when TORCH_FR_BUFFER_SIZE (or NCCL's older name,
TORCH_NCCL_TRACE_BUFFER_SIZE) is above 0 when it is created, so the agent sets a modest
size in every worker's environment (`default_env`) unless the job's or the node's
environment sets one; 0 turns it off. Recording costs a few hundred bytes per collective in a
fixed ring, nothing on the wire.

Where ranks hang, the recorder says which collective each one entered last: a rank whose last
enqueued collective is behind the others' never reached the one they wait in.

The dump must be taken from inside the worker, while its main thread may sit in C++ for good
(a collective that waits for a peer). A Python signal handler would never run there, and
`faulthandler` writes only stacks. So `start` (called by `stacks.register`: the fork server
for every worker it forks, `runtime.init` otherwise) listens on an abstract unix socket named
after the worker's pid (`socket_name`) and runs a small daemon thread that blocks in
`accept`; for each connection of the agent it sends the dump as JSON and closes it. The dump
call is C++ that does not need the main thread, and the thread gets the GIL because a blocked
collective releases it.

Why a socket: the agent must be answered at once. When the control plane takes an attempt
for hung, torchrun may stop the workers a few tens of milliseconds after the agent asks (the
attempt's rendezvous ends with it), and a worker that is exiting answers nothing: a request
file looked for on a timer lost that race, a connection wakes the thread as it arrives. A
signal cannot wake a thread other than the main one (Python runs handlers there only, and
`signal.set_wakeup_fd`, the one C-level path, is a single process-wide slot that asyncio and
user code take over). An abstract socket has no file in a folder the job's user can write, so
nothing there can be swapped for a link; each side checks the other with SO_PEERCRED: the
agent that the listener is the pid it asked (a process of this group, from `stacks.pids`),
the worker that the caller is root or its own user. The dump keeps only the last MAX_ENTRIES
entries, so it stays small, and the agent reads at most MAX_DUMP_BYTES of it.

A worker already exiting (its interpreter finalizing, where daemon threads no longer run)
still gives its stacks, from C, but no trace; the hang's event then names the missing ranks
by the stacks.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

from .env import TORCH_FR_BUFFER_SIZE, TORCH_NCCL_TRACE_BUFFER_SIZE


log = logging.getLogger(__name__)

BUFFER_SIZE_VARS = (TORCH_FR_BUFFER_SIZE, TORCH_NCCL_TRACE_BUFFER_SIZE)
DEFAULT_BUFFER_SIZE = "2000"  # entries per process (a ring: the oldest go first)
MAX_ENTRIES = 64  # of the newest, kept in a dump (the last few per group are what tell)
MAX_DUMP_BYTES = 256 * 1024  # of one worker's dump read back (64 entries are ~40 KiB)
_CRED = struct.Struct("3i")  # SO_PEERCRED's struct ucred: pid, uid, gid

_listening: list[socket.socket] = []


def socket_name(pid: int) -> str:
    """The abstract unix socket that the worker `pid` answers on."""
    return f"\0ftrain-flight-{pid}"


def default_env(env: dict[str, str]) -> None:
    """Turn the flight recorder on in a worker's environment `env`, unless it says otherwise."""
    if not any(name in env for name in BUFFER_SIZE_VARS):
        env[BUFFER_SIZE_VARS[0]] = DEFAULT_BUFFER_SIZE


def is_on(env: Mapping[str, str]) -> bool:
    """The environment asks torch to record collectives (a buffer size above 0)."""
    sizes = [env.get(name, "").strip() for name in BUFFER_SIZE_VARS]
    return any(s.isdigit() and int(s) > 0 for s in sizes)


def start(env: Mapping[str, str]) -> bool:
    """Answer the agent's requests for this process's flight recorder (a socket and a daemon
    thread, once per process); False where the recorder is off or the socket is taken."""
    if _listening or not is_on(env):
        return bool(_listening)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        sock.bind(socket_name(os.getpid()))
        sock.listen(8)
    except OSError as exc:
        sock.close()
        log.warning("the flight recorder's trace will not be given on a hang: %s", exc)
        return False
    threading.Thread(target=_serve, args=(sock,), name="ftrain-flight-recorder", daemon=True).start()
    _listening.append(sock)
    return True


def _serve(sock: socket.socket) -> None:
    while True:
        conn, _ = sock.accept()
        with conn:
            if _peer(conn)[1] not in (0, os.getuid()):
                continue  # only the agent (root, or this worker's user) is answered
            try:
                conn.sendall(json.dumps(dump()).encode())
            except Exception as exc:  # noqa: BLE001 - the worker goes on whatever a dump does
                log.warning("the flight recorder's dump failed: %s", exc)


def _peer(conn: socket.socket) -> tuple[int, int, int]:
    """The (pid, uid, gid) of the process at the other end of `conn`."""
    return _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def dump() -> dict[str, Any]:
    """This process's flight-recorder trace: gloo's (and every other CPU backend's) recorder
    and, where torch has NCCL, NCCL's own, as one trace (the newest MAX_ENTRIES entries)."""
    from . import torch_internals

    uses = (torch_internals.FR_DUMP_JSON, torch_internals.NCCL_FR_DUMP_JSON)
    return merge([json.loads(torch_internals.get_one(use)(includeCollectives=True, onlyActive=False))
                  for use in uses if use.applies()])


def merge(traces: list[Mapping[str, Any]]) -> dict[str, Any]:
    """One trace of a process's recorders: their entries in the order they were created, and per
    process group the status of the recorder that saw it furthest (a group with a CPU and a
    CUDA backend is in both)."""
    entries = sorted((e for t in traces for e in t.get("entries", []) if isinstance(e, dict)),
                     key=lambda e: _int(e.get("time_created_ns")))
    status: dict[str, Any] = {}
    for trace in traces:
        for pg_id, s in (trace.get("pg_status") or {}).items():
            seen = status.get(pg_id)
            if isinstance(s, dict) and (seen is None or _enqueued(s) > _enqueued(seen)):
                status[pg_id] = s
    return {"entries": entries[-MAX_ENTRIES:], "pg_status": status}


def _enqueued(status: Mapping[str, Any]) -> int:
    return _int(status.get("last_enqueued_collective"))


# ------------------------------------------------------------------ the agent's side
def ask(pids: dict[int, int]) -> dict[int, socket.socket]:
    """Ask each worker (rank -> pid) for its trace: a connection to each that listens as that
    pid (the kernel queues it at once; `read_dumps` takes the answers)."""
    asked = {}
    for rank, pid in pids.items():
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.connect(socket_name(pid))
            if _peer(sock)[0] != pid:  # another process took the name: not asked
                raise ConnectionRefusedError(f"the socket of pid {pid} is another process's")
        except OSError as exc:
            log.debug("no flight recorder of rank %d (pid %d): %s", rank, pid, exc)
            sock.close()
            continue
        asked[rank] = sock
    return asked


def read_dumps(asked: dict[int, socket.socket], wait_s: float) -> dict[int, dict[str, Any]]:
    """Each asked rank's trace that came whole within `wait_s`; the others left out. Closes
    the connections."""
    deadline = time.monotonic() + wait_s
    out = {}
    for rank, sock in asked.items():
        with sock:
            if (trace := _receive(sock, deadline)) is not None:
                out[rank] = trace
    return out


def _receive(sock: socket.socket, deadline: float) -> dict[str, Any] | None:
    data = bytearray()
    try:
        while len(data) <= MAX_DUMP_BYTES:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            if not chunk:
                trace = json.loads(data)
                return trace if isinstance(trace, dict) else None
            data += chunk
    except (OSError, ValueError):
        pass
    return None


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
