"""Phase marks: when each step of a re-rendezvous happened in this node's torchrun.

`bench/recovery.py` asks where the time from a fault to the new group goes, on every node:
when torchrun's monitor saw its workers fail or a node waiting, how long it took to stop its
workers, when it entered the rendezvous and when the round completed, when the new workers
were started. With `FTRAIN_PHASE_LOG` set (the agent passes its environment on to torchrun),
`mark(phase, ...)` appends one JSON line `{"t": wall clock, "phase", "node", "pid", ...}` to
that file (one `write` of an `O_APPEND` file: the lines of several processes do not mix);
unset, it does nothing, and `watch_agent` patches nothing.
"""

from __future__ import annotations

import json
import logging
import os
import time

from .. import torch_internals
from ..env import FTRAIN_NODE, FTRAIN_PHASE_LOG

log = logging.getLogger(__name__)


def enabled() -> bool:
    return bool(os.environ.get(FTRAIN_PHASE_LOG))


def mark(phase: str, **fields) -> None:
    """Note that `phase` happened now (a no-op unless FTRAIN_PHASE_LOG names a file)."""
    path = os.environ.get(FTRAIN_PHASE_LOG)
    if not path:
        return
    line = json.dumps({"t": round(time.time(), 4), "phase": phase,
                       "node": os.environ.get(FTRAIN_NODE), "pid": os.getpid(), **fields})
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
    except OSError as exc:
        log.debug("phase mark %s not written: %s", phase, exc)


def watch_agent() -> None:
    """Mark torch's agent's own steps (monitor saw a failure, stop, start, workers exited) in
    this process; only with FTRAIN_PHASE_LOG set: the patches are for measuring, never needed
    to run."""
    if not enabled():
        return
    for use, make in ((torch_internals.MONITOR_WORKERS, _marked_monitor),
                      (torch_internals.STOP_WORKERS, _marked_stop),
                      (torch_internals.START_WORKERS, _marked_start),
                      (torch_internals.SUBPROCESS_CLOSE, _marked_close)):
        torch_internals.patch(use, make)


def _marked_monitor(monitor):
    from torch.distributed.elastic.agent.server.api import WorkerState

    def _monitor_workers(self, worker_group):
        result = monitor(self, worker_group)
        if result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            mark("workers_failed", state=result.state.name)
        return result

    return _monitor_workers


def _marked_stop(stop):
    def _stop_workers(self, worker_group, *args, **kwargs):
        mark("stop_workers")
        try:
            return stop(self, worker_group, *args, **kwargs)
        finally:
            mark("workers_stopped")

    return _stop_workers


def _marked_start(start):
    def _start_workers(self, worker_group):
        try:
            return start(self, worker_group)
        finally:
            mark("workers_started")

    return _start_workers


def _marked_close(close):
    def _close(self, death_sig, timeout=30):
        try:
            return close(self, death_sig, timeout)
        finally:
            mark("workers_exited", signal=getattr(death_sig, "name", str(death_sig)))

    return _close
