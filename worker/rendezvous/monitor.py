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
main thread (anything else is the real `time`). `worker.torch_internals` checks that torch's
agent is still built so.
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
from collections.abc import Callable

from .. import torch_internals
from ..env import FTRAIN_MEMORY_DIR
from ..memory_dirs import LAST_WORDS_WAIT_S, last_words_held, wait_for_last_words

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
    torch_internals.patch(torch_internals.AGENT_TIME, _time_that_wakes)
    return True


def _time_that_wakes(stock: types.ModuleType) -> types.ModuleType:
    """The `time` module with `sleep` that `wake_monitor` ends early (for torch's agent module)."""
    shim = types.ModuleType("time")
    shim.__dict__.update({k: getattr(stock, k) for k in dir(stock) if not k.startswith("__")})
    shim.sleep = _sleep
    return shim


# Set when this node's torchrun sees a node of its own current group waiting for the next
# round: that node's workers died, so this group's collectives are broken (`_stop_workers`).
_peer_left = threading.Event()


def note_broken_groups(handler) -> None:
    """Tell a restart for a broken group from a planned one: `handler` (torch's) remembers the
    nodes of each round it completes, and its `num_nodes_waiting()` notes when only such nodes
    are on the wait list (they left the group to re-form it: their workers failed). A new node
    waiting (a scale-up) is not that: its restart keeps torch's SIGTERM and grace."""
    members: set = set()
    inner_next, inner_waiting = handler.next_rendezvous, handler.num_nodes_waiting

    def next_rendezvous():
        members.clear()
        _peer_left.clear()
        info = inner_next()
        members.update(torch_internals.cached_state(handler).participants)
        return info

    def num_nodes_waiting() -> int:
        waiting = inner_waiting()
        # Only members waiting: a member's workers failed. A new node among them is a planned
        # scale-up, whose members leave the round one after the other (the first to leave
        # waits beside the new node): not broken.
        wait_list = torch_internals.cached_state(handler).wait_list
        if waiting and members and wait_list and wait_list <= members:
            _peer_left.set()
        return waiting

    handler.next_rendezvous = next_rendezvous
    handler.num_nodes_waiting = num_nodes_waiting


# How long a broken group's stop waits for the node's last words: LAST_WORDS_WAIT_S (2.5 s,
# worker/memory_dirs.py).


def let_them_say_last_words(agent) -> None:
    """Before a broken group's SIGKILL: where the node's memory-tier writer holds its last-words
    lock (a CPU runtime worker that may copy the state of its last step as it exits,
    worker/last_words.py), SIGTERM the workers (the writer says them on SIGTERM, or on its
    collective's error if that comes first; the others end as before) and wait until it has
    exited, at most LAST_WORDS_WAIT_S. Nobody holds it (a GPU, a plain script, no tier): no
    wait at all."""
    directory = os.environ.get(FTRAIN_MEMORY_DIR)
    if not directory or not last_words_held(directory):
        return
    for pid in torch_internals.worker_pids(agent).values():
        try:
            os.kill(pid, signal.SIGTERM)  # the launcher passes it on to its worker
        except ProcessLookupError:
            pass
    waited = wait_for_last_words(directory, LAST_WORDS_WAIT_S)
    log.info("waited %.3f s for the node's writer's last words before stopping the group", waited or 0.0)


def stop_broken_groups_at_once() -> None:
    """Patch torch's agent (this process) to stop a broken group with SIGKILL, not SIGTERM and
    up to 30 s of grace: its own workers failed (torch's FAILED or UNHEALTHY state: the local
    workers left have lost a rank), or a node of its group is waiting to re-form it
    (`note_broken_groups`). Either way no collective of that group can complete, and the
    workers' chain of a SIGTERM (torchrun, the launcher, the worker, the fork server's reaping,
    the launcher's exit, torchrun's poll of it) took 0.2 s on 2 busy cores, on the path to the
    next round. A planned restart (a new node waiting) keeps torch's stop."""
    torch_internals.patch(torch_internals.STOP_WORKERS, _stop_broken_at_once)


def _stop_broken_at_once(stock: Callable[..., None]) -> Callable[..., None]:
    """torch's agent's `_stop_workers` (`stock`), with a broken group stopped by SIGKILL."""
    from torch.distributed.elastic.agent.server.api import WorkerState

    def _stop_workers(self, worker_group, *args, **kwargs):
        broken = worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY) or _peer_left.is_set()
        _peer_left.clear()
        if not broken:
            return stock(self, worker_group, *args, **kwargs)
        let_them_say_last_words(self)
        torch_internals.shutdown_workers(self, signal.SIGKILL)

    return _stop_workers
