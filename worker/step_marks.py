"""Step marks: what each rank notes at every step boundary, so that a worker whose group
breaks can say its last words (worker/failure_flush.py, the rule in worker/last_words.py).

At the end of each step (`StepMarks.mark`, before any collective): this rank's RNG states
into its ring in the node's memory tier (whichever step a copy ends up holding, each rank
has its own states of it), and on a rank that may speak the `Boundary`: the step, the
optimizer steps begun, the version counters of the tensors an optimizer step leaves alone,
the state's skeleton. On a GPU the host runs ahead of the GPU, so the boundaries and the
optimizer steps also record CUDA events, which tell what ran (`gpu_state`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from . import memory as mem
from . import rng as rngs
from .last_words import Boundary, GpuMark, gpu_settled_step
from .tiers.api import SNAPSHOT_FORMAT
from .tiers.memory import MemoryTier

# Buffers (BatchNorm's statistics: a forward changes them) of at most this many bytes in all
# are copied aside at each step's end, so that last words said after the next forward still
# hold the step's own (`StepMarks.mark`); larger ones are not, and a forward since the
# boundary then means no last words.
KEEP_BUFFERS_BYTES = 1 << 20
# On a GPU: the step boundaries and optimizer steps whose CUDA events are kept (the host is at
# most a step ahead of the GPU: `step_done` reads rank 0's broadcast every step).
GPU_RING = 4


class EventPool:
    """CUDA events used in turn (a new one each time cost ~80 us a step on an H100 host in a
    busy loop, its creation and an old one's destruction): more than the runtime keeps
    (GPU_RING boundaries with two each, GPU_RING optimizer steps), so that none is recorded
    again while it is still looked at."""

    def __init__(self, size: int):
        self._events: list[torch.cuda.Event] = []
        self._size = size
        self._next = 0
        self._stream: tuple | None = None  # (the current stream's ids, its Stream)

    def _current(self) -> torch.cuda.Stream | None:
        """The current stream, as a `Stream` made again only when it changed (`record()`
        without one looked it up in Python: 40 us a call on a busy H100 host, 3 us with it)."""
        try:
            ids = torch._C._cuda_getCurrentStream(torch.cuda.current_device())
        except (AttributeError, RuntimeError, TypeError):
            return None
        if self._stream is None or self._stream[0] != ids:
            self._stream = (ids, torch.cuda.Stream(stream_id=ids[0], device_index=ids[1], device_type=ids[2]))
        return self._stream[1]

    def record(self) -> torch.cuda.Event:
        """An event recorded on the current stream now."""
        if len(self._events) < self._size:
            self._events.append(torch.cuda.Event())
        event = self._events[self._next % len(self._events)]
        self._next += 1
        event.record(self._current())
        return event


class StepMarks:
    """One rank's step marks; see the module docstring. `on` while they are taken (a memory
    tier, last words on; off for good once rank 0 finds them too dear: `off`)."""

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self.on = False
        self.off = False  # on a GPU, rank 0 found the marks too dear for the steps (worker/step_timing.py)
        self.optimizer_steps = 0  # optimizer steps begun (a step pre-hook counts them)
        self.boundary: Boundary | None = None
        self.plan: Any = None  # the StatePlan whose tensors `boundary.skeleton` refers to
        self.rng: dict | None = None  # this rank's RNG states at the last step boundary
        self.watched: list = []  # the plan's tensors an optimizer step leaves alone
        self.watched_plan: Any = None  # the plan `watched` was taken from
        self.kept: list | None = None  # copies of `watched` as at the last boundary (small buffers only)
        # On a GPU: the last boundaries with their CUDA events (Boundary, plan, begun, done, host
        # copies) and the last optimizer steps' (count, event), oldest first (`gpu_state`)
        self.gpu_marks: list = []
        self.gpu_steps: list = []
        self.events = EventPool(4 * GPU_RING)
        # On a GPU: the plan's tensors in host memory (an optimizer's step counts), copied at each
        # boundary into a ring of copies (`_host_copies`): the host changes them as soon as it runs
        # the next optimizer step, long before the GPU does.
        self.host_plan: Any = None
        self.host_tensors: list = []
        self._host_ring: list | None = None
        self._host_next = 0
        self.boundary_s: list[float] = []  # per step: `mark`'s time (bench)
        self.mark_s: float | None = None  # `mark`'s time (moving average): taken from the copies' budget

    def count_optimizer_step(self, *_args, **_kwargs) -> None:
        """An optimizer's step pre-hook."""
        self.optimizer_steps += 1
        if self.on and self.on_gpu:  # before the step's kernels, in stream order
            self.gpu_steps.append((self.optimizer_steps, self.events.record()))
            del self.gpu_steps[:-GPU_RING]

    def stop(self) -> None:
        """Rank 0 found the marks too dear: no more marks, no last words from these."""
        self.off = True
        self.on = False
        self.boundary = None
        self.gpu_marks.clear()

    def mark(self, step: int, world_size: int, tier: MemoryTier, objects: Mapping[str, Any],
             speaks: bool) -> None:
        """The end of a step (`step_done`, before any collective); see the module docstring."""
        began = time.perf_counter()
        # before the boundary's GPU work (its buffers copied aside), if it has any
        begun = self.events.record() if self.on_gpu and self.kept is not None else None
        rng = rngs.rng_state()
        tier.keep_rng(step, rng)
        self.rng = rng
        if speaks and self.optimizer_steps:
            plan = tier.plan_of(objects)
            self.plan = plan
            if plan is None:
                self.boundary = None
            else:
                header = {"format": SNAPSHOT_FORMAT, "step": step, "world_size": world_size}
                versions = self.versions(plan)
                if self.kept is not None:  # the buffers as they are at this boundary, aside
                    torch._foreach_copy_(self.kept, self.watched)
                self.boundary = Boundary(step, self.optimizer_steps, versions,
                                         mem.freeze({**header, **plan.state()}), rng)
                if self.on_gpu:
                    self.gpu_marks.append((self.boundary, plan, begun, self.events.record(),
                                           self._host_copies(plan)))
                    del self.gpu_marks[:-GPU_RING]
        took = time.perf_counter() - began
        self.mark_s = took if self.mark_s is None else 0.8 * self.mark_s + 0.2 * took
        self.boundary_s.append(took)
        if len(self.boundary_s) > 1000:
            del self.boundary_s[:500]

    def versions(self, plan: mem.StatePlan) -> tuple[int, ...]:
        """The version counters of the plan's tensors that an optimizer step does not change
        (buffers: a few; read every step). Whether the plan still holds the state's tensors is
        checked at the failure and again before the copy is committed (`StatePlan.check`)."""
        if self.watched_plan is not plan:
            self.watched_plan = plan
            self.watched = [t for t in plan.tensors if t.untyped_storage().data_ptr() not in plan.later]
            size = sum(t.numel() * t.element_size() for t in self.watched)
            self.kept = [t.clone() for t in self.watched] if 0 < size <= KEEP_BUFFERS_BYTES else None
        return tuple(t._version for t in self.watched)

    def _host_copies(self, plan: mem.StatePlan) -> list | None:
        """On a GPU, at a boundary: the plan's host tensors copied into the next slot of a ring
        (one more slot than boundaries kept); None where they are too large to copy every step
        (then no last words)."""
        if self.host_plan is not plan:
            self.host_plan = plan
            self.host_tensors = [t for t in plan.tensors if t.device.type != "cuda"]
            size = sum(t.numel() * t.element_size() for t in self.host_tensors)
            self._host_ring = None if size > KEEP_BUFFERS_BYTES else \
                [[t.clone() for t in self.host_tensors] for _ in range(GPU_RING + 1)]
        if self._host_ring is None:
            return None
        if not self.host_tensors:
            return []
        slot = self._host_ring[self._host_next % len(self._host_ring)]
        self._host_next += 1
        torch._foreach_copy_(slot, self.host_tensors)
        return slot

    def gpu_state(self) -> tuple[tuple | None, str]:
        """On a GPU: the (Boundary, plan, its host tensors' copies) whose state the GPU holds
        now, as its events prove (`gpu_settled_step`), or None; and why."""
        marks, steps = list(self.gpu_marks), list(self.gpu_steps)
        seen = [GpuMark(b.step, b.optimizer_steps, begun is not None and begun.query(), done.query())
                for b, _, begun, done, _ in marks]
        step, why = gpu_settled_step(seen, [(n, ev.query()) for n, ev in steps])
        if step is None:
            return None, why
        entry = next(e for e in marks if e[0].step == step)
        return (entry[0], entry[1], entry[4]), why

    def words_parts(self, mark: Boundary, plan: mem.StatePlan, kept: list | None, first_rank: bool,
                    host: list = ()) -> tuple[dict, list]:
        """The last words' skeleton and tensors: the boundary's skeleton (the RNG states a
        restore may fall back to are the node's first rank's, `first_rank`), the plan's
        tensors with the buffers as they were at the boundary (not as a forward left them) and,
        on a GPU, its host tensors as they were then (not as the host's next optimizer step
        left them)."""
        state = {**mem.thaw(mark.skeleton), "rng": mark.rng if first_rank else None}
        swap = {id(t): k for t, k in zip(self.watched, kept)} if kept is not None else {}
        swap.update({id(t): k for t, k in zip(self.host_tensors, host)})
        return state, [swap.get(id(t), t) for t in plan.tensors] if swap else plan.tensors
