"""torchrun under ftrain acts on the first death signal and ignores the ones after it.

The node agent starts torchrun with a parent-death signal, SIGTERM (worker/procs.py).
Linux sends it each time the thread that is torchrun's parent exits and torchrun passes
to another thread of the agent. An agent with several threads that is SIGKILLed therefore
sends torchrun several SIGTERMs, one per thread. torch's handler turns each one into a
SignalException. A second one that arrives while torch's agent is closing its
workers aborts that close before it stops its log-tail threads. torchrun then waits on
those threads at exit for ever: an orphan, its launchers unreaped zombies (docs/runtime.md,
"Stopping a group"). The agent's own graceful stop sends SIGTERM twice as well (to
torchrun, then to its tree).

`act_on_first_death_signal()` replaces torch's handler with one that ignores the death
signals from then on and raises as torch's does: torchrun stops once and cleanly.
"""

from __future__ import annotations

import signal
from types import FrameType

from . import torch_internals

_stock_handler = None  # torch's _terminate_process_handler, once replaced


def act_on_first_death_signal() -> None:
    """Install the handler (idempotent)."""
    global _stock_handler
    _stock_handler = torch_internals.patch(torch_internals.TERMINATE_HANDLER, lambda stock: _first_death_signal)


def _first_death_signal(signum: int, frame: FrameType | None) -> None:
    # Ignore every signal torch registered this handler for (its TORCHELASTIC_SIGNALS_TO_HANDLE).
    for sig in signal.valid_signals():
        if signal.getsignal(sig) is _first_death_signal:
            signal.signal(sig, signal.SIG_IGN)
    assert _stock_handler is not None
    _stock_handler(signum, frame)  # raises SignalException, as torch's handler does
