"""worker/deathsig.py: torchrun acts on the first death signal only (pure logic; the
handler is torch's own, called in this process)."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing import api as mp_api

from worker import deathsig

DEATH_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


@pytest.fixture
def saved_handlers():
    saved = {sig: signal.getsignal(sig) for sig in DEATH_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_first_death_signal_raises_as_torch_does_and_later_ones_are_ignored(saved_handlers):
    deathsig.act_on_first_death_signal()
    assert mp_api._terminate_process_handler is deathsig._first_death_signal
    for sig in DEATH_SIGNALS:  # what torch's PContext.start() registers
        signal.signal(sig, mp_api._terminate_process_handler)
    with pytest.raises(mp_api.SignalException) as raised:
        signal.raise_signal(signal.SIGTERM)
    assert raised.value.sigval == signal.SIGTERM
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in DEATH_SIGNALS)
    signal.raise_signal(signal.SIGTERM)  # a second one (another agent thread's) is ignored
    deathsig.act_on_first_death_signal()  # idempotent: torch's handler stays wrapped once
    assert deathsig._stock_handler is not deathsig._first_death_signal
