"""The control channel: rank 0 hears the control plane's word on its job (a thread polls its
control endpoint, every 0.5 s, and sends the progress reports, worker/progress.py), and
every step all ranks agree on it ("decide once, broadcast"): one broadcast of rank 0's
decision (`agree`), so every rank acts at the same step; every few seconds that broadcast is
an all-reduce that also brings rank 0 every rank's step times (worker/step_timing.py).
`checkpoint_stop` snapshots there and exits 0; `checkpoint_pause` snapshots there and waits
to be restarted by its agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .links import ControlRequest, LinkError, ServiceLink
from .progress import Progress
from .step_timing import SUMS, StepClock
from .tiers.api import Worker

log = logging.getLogger("ftrain.runtime")

ACTIONS = {"none": 0, "checkpoint_pause": 1, "checkpoint_stop": 2}
ACTION_NAMES = {v: k for k, v in ACTIONS.items()}


class ControlChannel:
    """Rank 0's poller thread, and the decision every rank gets each step."""

    def __init__(self, worker: Worker, progress: Progress, poll_s: float = 0.5, report_every_s: float = 1.0):
        self.worker = worker
        self.progress = progress
        self.poll_s = poll_s
        self.report_every_s = report_every_s
        self.request = ControlRequest()  # what the poller last heard
        self.handled = 0  # the control id last obeyed
        self._thread: threading.Thread | None = None
        self.stop_poll = threading.Event()
        # Wakes the poller: to stop, or to report the run's first step at once (the control plane
        # records a recovery's end, "training again", at the new group's first report).
        self.wake_poll = threading.Event()

    def start(self) -> None:
        """Rank 0 of a job under the service: the poller starts."""
        worker = self.worker
        if not worker.is_chief or not isinstance(worker.link, ServiceLink) or self._thread is not None:
            return
        self.stop_poll.clear()
        self._thread = threading.Thread(target=self.run, name="ftrain-control", daemon=True)
        self._thread.start()

    def stop(self) -> bool:
        """Stop rank 0's poller (after its final progress report); False if it did not end
        within 5 s (a call to a control plane that does not answer)."""
        ended = True
        if self._thread is not None:
            self.stop_poll.set()
            self.wake_poll.set()
            self._thread.join(timeout=5)
            ended = not self._thread.is_alive()
            self._thread = None
        return ended

    def run(self) -> None:
        """The poller: the control endpoint every `poll_s`, progress every `report_every_s`,
        and the final report of the step the run ended at, before the job can finish."""
        link, progress = self.worker.link, self.progress
        assert link is not None
        last_report = 0.0
        while not self.stop_poll.is_set():
            try:
                self.request = link.control()
            except LinkError as exc:
                log.debug("control poll failed: %s", exc)
            now = time.monotonic()
            if progress.latest is not None and now - last_report >= self.report_every_s:
                last_report = now
                progress.report()
            self.wake_poll.wait(self.poll_s)
            self.wake_poll.clear()
        if progress.unreported():
            progress.report(final=True)

    def agree(self, decide_copy: Callable[[], int], marks_off: bool,
              clock: StepClock | None = None) -> tuple[str, int, int, bool]:
        """Rank 0 decides from what its poller last heard, and whether the memory tier copies
        this step (`decide_copy`) and the step marks stop; every rank gets the same answer:
        (action, control id, copy, marks off). With a `clock`, rank 0 also says whether the
        next step's answer carries every rank's step times (`StepClock`): that one is an
        all-reduce in place of the broadcast, so the figures cost no collective of their own."""
        worker = self.worker
        code, control_id, copy = 0, 0, 0
        gather_next = 0
        if worker.is_chief:
            ctl = self.request
            if ctl.id > self.handled and ctl.action in ACTIONS:
                code, control_id = ACTIONS[ctl.action], ctl.id
            copy = decide_copy()
            gather_next = int(clock is not None and clock.gather_due())
        off = int(marks_off)
        if worker.distributed:
            began = time.perf_counter()
            if clock is not None and clock.gathering:
                words = self._all_reduce([code, control_id, copy, off, gather_next], clock)
            else:
                t = torch.tensor([code, control_id, copy, off, gather_next], dtype=torch.int64,
                                 device=worker.device)
                dist.broadcast(t, src=0)
                words = [int(v) for v in t.tolist()]
            code, control_id, copy, off, gather_next = words
            if clock is not None:
                clock.boundary_waited(time.perf_counter() - began)
        if clock is not None:
            clock.gathering = bool(gather_next)
        return ACTION_NAMES.get(code, "none"), control_id, copy, bool(off)

    def _all_reduce(self, words: list[int], clock: StepClock) -> list[int]:
        """The decision (rank 0's words; the others add zeros) and every rank's step-time sums
        (each rank in its own slots), summed over the group: every rank gets the decision,
        rank 0 keeps the sums."""
        worker = self.worker
        n = len(words)
        t = torch.zeros(n + SUMS * worker.world_size, dtype=torch.float64)
        if worker.is_chief:
            t[:n] = torch.tensor(words, dtype=torch.float64)
        at = n + SUMS * worker.rank
        t[at:at + SUMS] = torch.tensor(clock.sums(), dtype=torch.float64)
        t = t.to(worker.device)
        dist.all_reduce(t)
        values = t.tolist()
        if worker.is_chief:
            clock.take(values[n:])
        return [int(v) for v in values[:n]]
