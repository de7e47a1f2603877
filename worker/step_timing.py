"""Step timing: the memory tier's copy interval picked from it, and each rank's step time
split into compute and waiting (`StepClock`, for stragglers).

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .protocol import RankTime
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
# A copy's cost to the steps beside it is read against the steps with no copy at work; where
# copies come back to back (a GPU copy that spans the steps to the next), none is, and the
# copies read as free: a copy every step cost a 1B-parameter model's step 10% on an H200. So
# no copy starts until a step with none at work has been timed (the process's first
# QUIET_WARMUP_STEPS steps not counted: its allocator's and kernels' first runs), and again
# after every QUIET_PROBE_COPIES copies. The process's first copy sets up its buffers (on a GPU
# it page-locks them: seconds for 12 GB); its cost is not what the next copies cost.
QUIET_WARMUP_STEPS = 2
QUIET_PROBE_COPIES = 8
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
        self.steps_timed = 0  # steps whose period was read
        self.copies_unprobed = 0  # copies started since the last step timed with none at work
        self.copies_timed = 0  # copies whose steps were timed to the end

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
            self.steps_timed += 1
            self.step_s = took if self.step_s is None else 0.8 * self.step_s + 0.2 * took
            if self.copy_work is None:
                if self.steps_timed > QUIET_WARMUP_STEPS:
                    self.quiet_s = took if self.quiet_s is None else 0.8 * self.quiet_s + 0.2 * took
                    self.copies_unprobed = 0
            else:
                if self.quiet_s is not None:
                    self.copy_work += took - self.quiet_s
                w = tier.writer
                if self.copy_ending:  # the step after the copy's commit: its cost is all in
                    self.copies_timed += 1
                    # (the first sets up its buffers: 12 GB page-locked once cost seconds)
                    if self.quiet_s is not None and self.copies_timed > 1:
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
        if not self.every and self.copy_work is None \
                and (self.quiet_s is None or self.copies_unprobed >= QUIET_PROBE_COPIES):
            return COPY_NONE  # this step is timed with no copy at work (it stays due: the next copies)
        return COPY

    def started(self) -> None:
        """Rank 0 started a copy: its cost to the steps beside it is timed from here."""
        if self.copy_work is None:
            self.copy_work, self.copy_ending = 0.0, False
            self.copies_unprobed += 1

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
        marks_room = MARKS_SHARE * MEMORY_BUDGET * (self.step_s or 0.0)
        if marks.on and on_gpu and self.step_s and marks.mark_s \
                and step >= MARKS_PROBE_STEPS and marks.mark_s > marks_room:
            # Steps too short for the marks: every rank stops them at this step's broadcast.
            marks.off = True
            log.info("memory tier: no step marks (last words) from step %d: they cost %.2f ms of a "
                     "%.2f ms step, more than %.1f%%; a fault costs up to the copy interval",
                     step, marks.mark_s * 1e3, self.step_s * 1e3, MARKS_SHARE * MEMORY_BUDGET * 100)
        cost = tier.last_cost_s()
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
            # A copy that comes before the last one's exchange of replicas is over waits for
            # it: the copies come no more often than that link lets them (the commit's step,
            # then the exchange's).
            if tier.link_busy_s():
                k = max(k, min(MEMORY_EVERY_MAX, 1 + math.ceil(tier.link_busy_s() / self.step_s)))
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


# Straggler figures (docs/stragglers.md): a process's first steps (DDP's bucket rebuild, the
# allocator's first sizes, a restore's aftermath) are not timed; rank 0 gathers every rank's
# sums at most this often, with the step's control decision (`ControlChannel.agree`).
WARMUP_STEPS = 5
GATHER_EVERY_S = 2.0
SUMS = 3  # what each rank sends in a gather: steps, compute_s, wait_s


class StepClock:
    """Each rank's step time, split into compute and waiting in collectives.

    The boundary is the step's control broadcast (`ControlChannel.agree`), where every rank
    meets every step (on a GPU its `.tolist()` waits for the device, so the host clock there
    is the step's true end). From one boundary to the next, less the runtime's own work after
    it (snapshot and memory-tier copies: not the node's speed), is the step; of it, the
    waits are the gradient all-reduce's and the broadcast's own:

    - the all-reduce: a DDP communication hook (`hook`) notes when the step's last bucket of
      gradients is ready (its backward is done with them) and when its all-reduce completes;
      the time between is what this rank waited for the others (a fast rank waits long, the
      slow one hardly). On a GPU, CUDA events on the streams give the same two moments, read
      once the boundary's sync has passed; host times there would only say when work was
      queued.
    - the broadcast, on a CPU (on a GPU its time is the device's queue draining, compute).

    No collective of its own: rank 0 asks every `GATHER_EVERY_S` for the next step's
    decision to be an all-reduce that carries every rank's sums (`ControlChannel.agree`).
    """

    def __init__(self, cuda: bool, world_size: int):
        self.cuda = cuda
        self.world_size = world_size
        self.steps = 0  # steps timed (after the warm-up)
        self.compute_s = 0.0
        self.wait_s = 0.0
        self.seen = 0  # steps seen, warm-up included
        self.mark: float | None = None  # the end of the last step's boundary (and own work)
        self._ready: float | torch.cuda.Event | None = None  # this step's last bucket ready
        self._done: float | torch.cuda.Event | None = None  # its last all-reduce done
        self._boundary_s = 0.0  # this step's wait in the control broadcast
        self.gathering = False  # this step's decision carries every rank's sums (rank 0 asked)
        self.last_gather = time.monotonic()
        self.nodes: list[str | None] = []  # each rank's node (gathered at the restore)
        self.gathered: list[RankTime] = []  # rank 0: every rank's sums, as last gathered

    def hook(self, inner: Callable | None = None, state: Any = None) -> Callable:
        """A DDP communication hook that runs `inner` (by default torch's all-reduce, what DDP
        does without a hook) and notes when each bucket is ready and its all-reduce done."""
        def done(f):
            self._done = self._now()
            return f.value() if inner is not None else f.value()[0]

        def timed(hook_state, bucket):  # unannotated: DDP refuses a hook annotated otherwise than its own
            self._ready = self._now()
            if inner is not None:
                return inner(hook_state, bucket).then(done)
            # torch's allreduce_hook, with its own callback (that takes the result out of the
            # list) made one with ours: a Python callback costs the step a GIL hand-over.
            group = hook_state if hook_state is not None else dist.group.WORLD
            tensor = bucket.buffer().div_(dist.get_world_size(group))
            return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(done)

        timed.__name__ = getattr(inner, "__name__", "timed")
        return timed

    def _now(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def boundary_waited(self, seconds: float) -> None:
        """The step's control broadcast took `seconds` (a wait on a CPU)."""
        if not self.cuda:
            self._boundary_s = seconds

    def step_ended(self, now: float | None = None) -> None:
        """At the boundary (after the broadcast): add the step to the sums."""
        now = time.perf_counter() if now is None else now
        self.seen += 1
        waited = self._boundary_s + self._reduce_wait_s()
        if self.mark is not None and self.seen > WARMUP_STEPS:
            took = now - self.mark
            self.steps += 1
            self.wait_s += min(waited, took)
            self.compute_s += max(0.0, took - waited)
        self._ready = self._done = None
        self._boundary_s = 0.0
        self.mark = now

    def own_work_done(self) -> None:
        """The runtime's own work after the boundary (copies, a snapshot) is not the step's."""
        self.mark = time.perf_counter()

    def _reduce_wait_s(self) -> float:
        ready, done = self._ready, self._done
        if ready is None or done is None:
            return 0.0
        if isinstance(ready, float) and isinstance(done, float):
            return max(0.0, done - ready)
        if isinstance(ready, torch.cuda.Event) and isinstance(done, torch.cuda.Event) \
                and ready.query() and done.query():
            return max(0.0, ready.elapsed_time(done) / 1e3)
        return 0.0

    def sums(self) -> list[float]:
        return [float(self.steps), self.compute_s, self.wait_s]

    def gather_due(self) -> bool:
        """Rank 0: whether the next step's decision carries the sums (every GATHER_EVERY_S)."""
        now = time.monotonic()
        if now - self.last_gather < GATHER_EVERY_S:
            return False
        self.last_gather = now
        return True

    def take(self, values: list[float]) -> None:
        """Rank 0: every rank's sums, as the gather's all-reduce summed them (each its own slots)."""
        self.gathered = [
            RankTime(rank=r, node=self.nodes[r] if r < len(self.nodes) else None,
                     steps=int(values[SUMS * r]), compute_s=round(values[SUMS * r + 1], 6),
                     wait_s=round(values[SUMS * r + 2], 6))
            for r in range(self.world_size)]
