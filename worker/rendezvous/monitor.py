"""torchrun's monitor woken by news: a local worker's exit, a node waiting to join.

torch's agent looks at its workers, and then asks `num_nodes_waiting()`, once every
--monitor-interval (0.1 s under the node agent), sleeping in between. Both things it looks
for are events this process can hear of as they happen: a worker (its `worker/launch.py`, a
child of torchrun) that exits sends torchrun SIGCHLD, and `follow.py`'s long poll hears of
a node joining the wait list. `wake_monitor_on_news` makes the monitor's sleep a wait that
either of them ends (a self-pipe: the SIGCHLD handler and the follow thread each write a
byte), so a dead worker or a waiting node is acted on at once instead of up to an interval
later (half of it on average, on each node that takes part in the next round). The loop
still runs at least once per interval, as before; a wake-up with nothing new costs one look.

torch's agent module imports `time` and calls `time.sleep(monitor_interval)` in its loop, and
nowhere else; the patch gives that module a `time` whose `sleep` waits on the pipe in the
main thread (anything else is the real `time`). A torch built otherwise keeps its sleep.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
import types

log = logging.getLogger(__name__)

_pipe: tuple[int, int] | None = None  # (read end, write end), non-blocking both


def wake_monitor() -> None:
    """End the monitor's current sleep (any thread, or a signal handler); a no-op unpatched."""
    if _pipe is not None:
        try:
            os.write(_pipe[1], b"!")
        except (BlockingIOError, OSError):
            pass  # full: a wake-up is pending already


def _sleep(seconds: float) -> None:
    """The monitor's sleep: `seconds`, or less when `wake_monitor` is called meanwhile."""
    if _pipe is None or threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return
    r = _pipe[0]
    try:
        ready, _, _ = select.select([r], [], [], max(0.0, seconds))
        if ready:
            while os.read(r, 512):
                pass
    except BlockingIOError:
        pass  # drained


def _on_child(signum, frame) -> None:
    wake_monitor()


def in_torchrun() -> bool:
    """Whether this process is torchrun (`python -m torch.distributed.run`, or its script)."""
    argv0 = sys.argv[0] if sys.argv else ""
    return os.path.basename(argv0) == "torchrun" \
        or argv0.endswith(os.path.join("torch", "distributed", "run.py"))


def wake_monitor_on_news() -> bool:
    """Patch torch's agent loop in this process, if it is torchrun (its main thread; a test
    or a tool that makes a handler keeps its signals); True if done."""
    global _pipe
    if _pipe is not None:
        return True
    if threading.current_thread() is not threading.main_thread() or not in_torchrun():
        return False
    try:
        from torch.distributed.elastic.agent.server import api as agent_api
    except ImportError:
        return False
    if getattr(agent_api, "time", None) is not time:
        log.info("torch's agent has no module-level time: its monitor keeps sleeping its interval")
        return False
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    try:
        if signal.getsignal(signal.SIGCHLD) not in (signal.SIG_DFL, None):
            raise ValueError("SIGCHLD has a handler already")
        signal.signal(signal.SIGCHLD, _on_child)
    except ValueError as exc:
        os.close(r)
        os.close(w)
        log.info("torchrun's monitor is not woken by its workers' exits (%s)", exc)
        return False
    _pipe = (r, w)
    shim = types.ModuleType("time")
    shim.__dict__.update({k: getattr(time, k) for k in dir(time) if not k.startswith("__")})
    shim.sleep = _sleep
    agent_api.time = shim
    return True
