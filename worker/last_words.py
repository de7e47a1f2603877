"""A survivor's last words: the rule that says whether a worker whose process group broke may
copy its state into its node's memory tier, and under which step.

The memory tier copies the state every K steps (worker/step_timing.py picks K to keep the copies
within their budget), so a fault costs up to K steps. When a peer dies, the survivors are
still alive for a moment (gloo raises at their next collective); a survivor whose state is
exactly that of its last completed step can copy it then, and the restart resumes from it
(the restore takes the newest step some surviving copy holds). The state must be that of a
step, or the copy would be labelled step N and hold something else: silent corruption, far
worse than a lost step. What the runtime notes at each step boundary (`Boundary`, in
`step_done` right after its step count moves on) and what it finds at the failure decide it:

- the optimizer has not begun a step since the boundary (a step pre-hook counts them; a step
  begun and not finished, or finished, has changed the parameters and optimizer state);
- no tensor of the state that the optimizer does not own (buffers: a forward pass may change
  them, DDP broadcasts them) has changed since, by torch's version counters, unless the
  runtime kept a copy of them at the boundary (small buffers, BatchNorm's statistics: it
  copies them at each step's end, and the last words take that copy);
- the objects around the tensors (sampler position, LR scheduler, param groups) are taken
  as they were at the boundary (`Boundary.skeleton`, pickled there), not as the next step's
  first half left them (the sampler has already handed out the next batch);
- the node's tier does not hold that step or a newer one already.

A failure found inside `step_done` after the count moved on (its broadcast, a snapshot's
gather) passes: the optimizer's step of that step is done and nothing has begun since.

Pure: no torch, no I/O; tests/worker/test_last_words.py is its table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Boundary:
    """What a worker noted at the end of a step: which step, how many optimizer steps had
    begun by then, the version counters of the state's tensors that an optimizer step does
    not change, the rest of the state pickled as it was, and its RNG states then (objects
    made for the mark that nothing changes after)."""

    step: int
    optimizer_steps: int
    versions: tuple[int, ...]
    skeleton: bytes
    rng: Any = None


def last_words_step(mark: Boundary | None, optimizer_steps: int, versions: tuple[int, ...] | None,
                    held: int, buffers_kept: bool = False) -> tuple[int | None, str]:
    """The step a last-words copy may be labelled with, or None; and why, in words.

    `optimizer_steps`, `versions`: counted and read now, at the failure (`versions` None: the
    state's tensors are no longer those the boundary noted). `held`: the newest step the
    node's memory tier holds (-1: none). `buffers_kept`: the buffers as they were at the
    boundary are kept apart (a copy made there), so a change of the live ones since does not
    matter."""
    if mark is None:
        return None, "no step completed in this run"
    if optimizer_steps != mark.optimizer_steps:
        return None, (f"the optimizer began a step after step {mark.step}: the state is not "
                      f"that of a step")
    if versions is None:
        return None, f"the state's tensors were replaced after step {mark.step}"
    if versions != mark.versions and not buffers_kept:
        return None, (f"a buffer changed after step {mark.step} (a forward pass ran): the state "
                      f"is not that of a step")
    if held >= mark.step:
        return None, f"the node's memory tier holds step {held} already"
    return mark.step, f"the state is that of step {mark.step}; the node's memory tier holds step {held}"


# ---------------------------------------------------------------- on a GPU
#
# With NCCL the host runs ahead of the GPU: when a peer dies, a survivor's host may have
# queued the next step's forward, backward and optimizer step, and its counters (optimizer
# steps begun, buffers' version counters) say what was queued, not what ran. What ran is
# told by CUDA events, recorded on the training stream in the order of the work: at each
# step boundary one before the boundary's own GPU work (the copy of small buffers aside,
# `begun`) and one after it (`done`); at each optimizer step one before its kernels. A
# survivor's training stream stops at the collective its dead peer never joins (DDP's
# gradient all-reduce of the next step, or the runtime's broadcast in `step_done`), so its
# parameters and optimizer state are those of the last boundary whose `done` event has
# completed, as long as no optimizer step queued after that boundary has begun on the GPU
# and the next boundary's work has not begun either (it overwrites the buffers kept aside).
# The runtime reads the events before its copy and again after it: the same answer both
# times means the stream did not move past the boundary while the copy read the state.


@dataclass(frozen=True)
class GpuMark:
    """A step boundary as the GPU's events tell it at one moment: the step, the optimizer
    steps begun (on the host) by the boundary, and whether the boundary's GPU work has begun
    and is done."""

    step: int
    optimizer_steps: int
    begun: bool
    done: bool


def gpu_settled_step(marks: list[GpuMark], optimizer_begun: list[tuple[int, bool]]) -> tuple[int | None, str]:
    """The step whose state a GPU holds now, if the events prove it; and why, in words.

    `marks`: the last boundaries, oldest first. `optimizer_begun`: (the optimizer step's
    count, whether its event has completed) for the last optimizer steps queued, oldest
    first. None: no boundary is done, or the stream is between a boundary and the next
    one's end with an optimizer step or the next boundary's work begun (the state is moving:
    a later look may find the next boundary done)."""
    done = [i for i, m in enumerate(marks) if m.done]
    if not done:
        return None, "no step boundary has completed on the GPU"
    i = done[-1]
    mark = marks[i]
    stepped = [n for n, ran in optimizer_begun if n > mark.optimizer_steps and ran]
    if stepped:
        return None, (f"the GPU began optimizer step {stepped[0]} after step {mark.step}: the state "
                      f"is not that of a step")
    if any(m.begun for m in marks[i + 1:]):
        return None, f"the GPU began the boundary after step {mark.step}"
    return mark.step, f"the GPU's state is that of step {mark.step}"
