"""Step timing, and the memory tier's copy interval picked from it.

With FTRAIN_MEMORY_EVERY unset, rank 0 spaces the memory tier's copies so that they cost at
most MEMORY_BUDGET of the step time: after each copy it waits ceil(cost / room) steps, the
room being MEMORY_AIM of the budget of a step with no copy at work, less what the step marks
(worker/step_marks.py) cost every step. The cost is the larger of what the last copies cost
the steps beside them (`CopySchedule.time_step`) and the last copy's own figure.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

from .tiers.memory import MEMORY_EVERY_MAX, MemoryTier

if TYPE_CHECKING:
    from .step_marks import StepMarks

log = logging.getLogger("ftrain.runtime")

# The memory tier's share of a step that its copies may cost, when it picks its own
# interval (FTRAIN_MEMORY_EVERY unset), and the longest interval it picks (MEMORY_EVERY_MAX).
MEMORY_BUDGET = 0.05
# The share of MEMORY_BUDGET the picked interval aims at: a copy's cost varies from copy to
# copy (its commit 0.6-1.1 ms for the same 10M model on an H100 host) and the interval is
# picked from an average of the last few, so an interval aimed at the whole budget went over it
# about half the time (5.7%, 5.7%, 6.4% by means in three runs).
MEMORY_AIM = 0.8
COPY_COSTS_KEPT = 16  # the copies whose cost to the steps beside them the interval is picked from
# With the copy interval picked by the runtime (no FTRAIN_MEMORY_EVERY), a GPU job's step marks
# stay on while they cost at most this share of MEMORY_BUDGET of the step (measured over the
# first MARKS_PROBE_STEPS steps at least): on shorter steps, a lost step costs less than the
# marks would over a few hundred steps, and the copies keep the whole budget.
MARKS_SHARE = 0.8
MARKS_PROBE_STEPS = 20

# Rank 0's word on the memory tier, broadcast with the control decision each step.
COPY_NONE, COPY, COPY_SKIPPED = 0, 1, 2


class CopySchedule:
    """When the memory tier copies: every `every` steps, or (None) at the interval picked
    from the step timing (see the module docstring). Rank 0's decision; every node follows."""

    def __init__(self, every: int | None):
        self.every = every
        self.interval = 1  # the interval in use (every, or the one picked)
        self.next = 0  # the step of the next copy
        self.missed = -1  # the last step whose due copy was skipped (a copy in flight)
        self.step_s: float | None = None  # the step period (moving average)
        self.quiet_s: float | None = None  # the same over the steps with no copy at work
        self.copy_work: float | None = None  # the copy at work's cost so far (None: no copy at work)
        self.copy_ending = False  # the copy at work was committed: its last step is being timed
        # what the last COPY_COSTS_KEPT copies cost the steps beside them (`copy_cost_s`: their mean)
        self.copy_costs: list[float] = []
        self.told_interval: tuple[int, float] | None = None  # the interval the log last heard of, when
        self.last_step_t: float | None = None

    def time_step(self, tier: MemoryTier, now: float | None = None) -> None:
        """The step period (moving average), and what a copy costs the steps it runs beside:
        the steps from its start to the one after its commit, each less the period of the
        steps with no copy at work. (The training thread's own time in a copy, which the
        interval was picked from alone, was about half of what the copies cost the step time
        on an H100 host: the commit's Python, the GPU's staging copy beside the step's
        kernels, the host's other threads.)"""
        now = time.perf_counter() if now is None else now
        if self.last_step_t is not None:
            took = now - self.last_step_t
            self.step_s = took if self.step_s is None else 0.8 * self.step_s + 0.2 * took
            if self.copy_work is None:
                self.quiet_s = took if self.quiet_s is None else 0.8 * self.quiet_s + 0.2 * took
            else:
                if self.quiet_s is not None:
                    self.copy_work += took - self.quiet_s
                w = tier.writer
                if self.copy_ending:  # the step after the copy's commit: its cost is all in
                    if self.quiet_s is not None:
                        # Each copy's own figure is its steps' noise as much as its cost (one
                        # 10M copy on an H100 read -2 to +4.6 ms): the mean of the last few.
                        self.copy_costs.append(max(0.0, self.copy_work))
                        del self.copy_costs[:-COPY_COSTS_KEPT]
                    self.copy_work, self.copy_ending = None, False
                elif w is None or not w.busy():
                    self.copy_ending = True
        self.last_step_t = now

    @property
    def copy_cost_s(self) -> float | None:
        """What a copy costs the steps beside it: the mean over the last copies (None: none yet)."""
        return sum(self.copy_costs) / len(self.copy_costs) if self.copy_costs else None

    def decide(self, step: int, tier: MemoryTier) -> int:
        """Rank 0: does the memory tier copy this step (COPY), was the copy due but skipped
        because rank 0's previous copy is still in flight (COPY_SKIPPED), or neither. Rank 0
        follows its own writer's cost (`plan_next`); every node copies when it says so."""
        if tier.writer is None:  # no writer here (its node's tier is elsewhere): a fixed interval
            return COPY if step % (self.every or 1) == 0 else COPY_NONE
        self.time_step(tier)
        due = step % self.every == 0 if self.every else step >= self.next
        if not due:
            return COPY_NONE
        if tier.writer.busy():  # the GPU's previous copy is in flight: skipped (see finish)
            tier.writer.skipped += 1
            return COPY_SKIPPED
        return COPY

    def started(self) -> None:
        """Rank 0 started a copy: its cost to the steps beside it is timed from here."""
        if self.copy_work is None:
            self.copy_work, self.copy_ending = 0.0, False

    def plan_next(self, step: int, tier: MemoryTier, marks: StepMarks, on_gpu: bool) -> None:
        """Without a fixed interval: copy again after as many steps as keep the copies'
        cost within MEMORY_BUDGET of the step time, less what the step boundaries' marks cost
        every step (for last words: with them a fault loses at most a step whatever the
        interval, so the copies get what the marks leave, down to one every MEMORY_EVERY_MAX
        steps). The cost is the training thread's time in the copy, plus on a CPU the copy
        thread's whole time (it takes a core); on a GPU the copy runs on the copy engine, and
        a copy still in flight skips the next (`decide`)."""
        if self.every:
            self.interval = self.every
            return
        w = tier.writer
        assert w is not None
        marks_room = MARKS_SHARE * MEMORY_BUDGET * (self.step_s or 0.0)
        if marks.on and on_gpu and self.step_s and marks.mark_s \
                and step >= MARKS_PROBE_STEPS and marks.mark_s > marks_room:
            # Steps too short for the marks: every rank stops them at this step's broadcast.
            marks.off = True
            log.info("memory tier: no step marks (last words) from step %d: they cost %.2f ms of a "
                     "%.2f ms step, more than %.1f%%; a fault costs up to the copy interval",
                     step, marks.mark_s * 1e3, self.step_s * 1e3, MARKS_SHARE * MEMORY_BUDGET * 100)
        cost = w.last_cost_s() + tier.rng_s  # every rank's RNG capture comes with a copy
        if self.copy_cost_s is not None:  # what the copies cost the steps beside them
            cost = max(cost, self.copy_cost_s)
        k = 1
        if self.step_s:
            mark_s = (marks.mark_s or 0.0) if marks.on and not marks.off else 0.0
            # Of the steps with no copy at work where known: the budget is a share of the step
            # the job would take without the tier.
            room = MEMORY_AIM * MEMORY_BUDGET * (self.quiet_s or self.step_s) - mark_s
            if room <= 0:
                k = MEMORY_EVERY_MAX
            elif cost > room:
                k = min(MEMORY_EVERY_MAX, math.ceil(cost / room))
        self._tell(k, cost, marks)
        self.interval = k
        self.next = step + k

    def _tell(self, k: int, cost: float, marks: StepMarks) -> None:
        """The job's log hears of the interval when it is first picked, then at most once a
        minute if it moved; the step-to-step wobble (it was a third of a job's log) goes to
        debug."""
        now = time.monotonic()
        told = self.told_interval
        if k != self.interval or told is None:
            loud = told is None or (k != told[0] and now - told[1] >= 60.0)
            log.log(logging.INFO if loud else logging.DEBUG,
                    "memory tier: a copy every %d step(s) (copy %.1f ms, step %.1f ms, step marks %.2f "
                    "ms, budget %.0f%%)", k, cost * 1e3, (self.step_s or 0) * 1e3,
                    (marks.mark_s or 0.0) * 1e3 if marks.on else 0.0, MEMORY_BUDGET * 100)
            if loud:
                self.told_interval = (k, now)
