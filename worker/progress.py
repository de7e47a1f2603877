"""Progress reporting: rank 0's step, loss, samples/s and logged scalars, sent to the control
plane by the control channel's thread (worker/control.py) about once a second, and the final
report of a run; what does not land at the end is left to the node agent (worker/handoff.py),
as is the node's word that its workers finished the run."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .links import LinkError, ServiceLink
from .protocol import MAX_METRICS, METRIC_NAME, RankTime
from .tiers.api import Worker

log = logging.getLogger("ftrain.runtime")


class Progress:
    """What rank 0 reports of its run; see the module docstring."""

    def __init__(self, worker: Worker, total_steps: int | None = None,
                 leave: Callable[..., Any] | None = None):
        self.worker = worker
        self.total_steps = total_steps  # the steps the script means to make: percent and ETA
        self.leave = leave  # what the node agent takes over (worker/handoff.py)
        self.latest: tuple | None = None  # (step, loss, samples, monotonic time) of the last step
        self.samples = 0
        self.scalars: dict[str, Any] = {}  # rt.log's latest, reported with the progress
        self._refused: set[str] = set()  # scalars warned about (not reported)
        self._last: tuple[int | None, float | None] = (None, None)  # (samples, time) last reported
        self.reported: int | None = None  # the step last reported (and stored)
        self.ranks: list[RankTime] = []  # every rank's step times, as last gathered (worker/step_timing.py)

    def step_done(self, step: int, loss: float | torch.Tensor | None, samples: int) -> bool:
        """Note a step (rank 0); True if it is the run's first (reported at once)."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        first = self.latest is None
        self.latest = (step, loss, self.samples, time.monotonic())
        return first

    def log(self, **scalars: float | torch.Tensor) -> None:
        for name, value in scalars.items():
            self.scalars[name] = value.detach() if isinstance(value, torch.Tensor) else value

    def report(self, final: bool = False) -> None:
        """Send the latest step's progress (the rate since the last report)."""
        link = self.worker.link
        assert link is not None and self.latest is not None
        step, _loss, samples, at = self.latest
        last_samples, last_t = self._last
        rate = None
        if last_t is not None and at > last_t and samples >= last_samples:
            rate = (samples - last_samples) / (at - last_t)
        self._last = (samples, at)
        loss_value, metrics = self.loss_and_metrics()
        try:
            held = link.report_progress(step, loss_value, rate, final=final, metrics=metrics,
                                        total_steps=self.total_steps, ranks=self.ranks)
            if held is None or held == step:  # else not stored (the rate limit): the final one goes
                self.reported = step
        except LinkError as exc:
            log.debug("progress report failed: %s", exc)
            if final:
                self.leave_final(rate)

    def unreported(self) -> bool:
        """Whether the run's latest step is not yet reported (the final report goes)."""
        return self.latest is not None and self.latest[0] != self.reported

    def leave_final(self, rate: float | None = None) -> None:
        """The final progress report did not land (the control plane is away): the node agent
        sends it before it reports the end (worker/handoff.py)."""
        link = self.worker.link
        if self.leave is None or self.latest is None or not isinstance(link, ServiceLink):
            return
        step = self.latest[0]
        loss, metrics = self.loss_and_metrics()
        body = link.progress_request(step, loss, rate, True, metrics, self.total_steps)
        try:
            self.leave(progress=body)
        except OSError as exc:
            log.warning("the final progress report (step %d) could not be left to the node agent: %s",
                        step, exc)

    def say_finished(self) -> None:
        """This node's workers finished the run: said by its first worker to the control plane
        (or left to its node agent when none answers, worker/handoff.py), so that the node
        counts as finished even if its agent dies before it sees their exit (torchrun's exit
        barrier, the agent's report: seconds in which a SIGKILL made a finished job FAILED or
        run again; service/decide/outcome.py `vanished`). Only after every rank's last
        barrier, rank 0's final snapshot committed or handed over and its final progress sent:
        nothing of the run is left to do but the exit."""
        worker, link, node = self.worker, self.worker.link, self.worker.node
        if worker.local_rank != 0 or not isinstance(link, ServiceLink) or not node:
            return
        try:
            if not link.report_finished(node):
                log.info("the control plane did not take node %s's word that the run finished "
                         "(not a live member of attempt %d)", node, worker.attempt)
            return
        except LinkError as exc:
            if exc.status is not None and exc.status < 500:
                log.warning("node %s's word that the run finished was refused: %s", node, exc)
                return
            log.info("node %s's word that the run finished did not land (%s): left to the node agent",
                     node, exc)
        if self.leave is not None:
            try:
                self.leave(finished=True)
            except OSError as exc:
                log.warning("node %s's word that the run finished could not be left to the node "
                            "agent: %s", node, exc)

    def loss_and_metrics(self) -> tuple[float | None, dict[str, float]]:
        """What a progress report of `latest` carries: the loss (`step_done`'s, else a logged
        `loss`) and the other logged scalars."""
        assert self.latest is not None
        metrics = self.scalar_values()
        logged_loss = metrics.pop("loss", None)
        loss = self.latest[1]
        return (float(loss) if loss is not None else logged_loss), metrics

    def scalar_values(self) -> dict[str, float]:
        """The logged scalars as floats; a name or value the control plane would refuse
        (not finite, more than MAX_METRICS) is left out, with a warning once."""
        values: dict[str, float] = {}
        for name, value in list(self.scalars.items()):
            number = float(value)
            if not math.isfinite(number) or not METRIC_NAME.match(name) or len(values) >= MAX_METRICS:
                if name not in self._refused:
                    self._refused.add(name)
                    log.warning("metric %r = %s is not reported (names: letters, digits, _ . / -; "
                                "finite values; at most %d metrics)", name, number, MAX_METRICS)
                continue
            values[name] = number
        return values
