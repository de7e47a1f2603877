"""The flush at a failure: what a worker on its way out (its group broke, or it was sent
SIGTERM) leaves in its node's memory tier.

First the copy in flight is settled (it is consistent: the optimizer waits for a copy before
it changes the state), then the last words: if the state is exactly that of the last step
boundary (worker/step_marks.py; the rule in worker/last_words.py) and the tier holds an
older step, that state is copied there. The node's writer says them, or a sibling once the
writer is gone (it takes the writer's byte of the tier's last-words lock,
worker/memory_dirs.py). All within LAST_WORDS_S; one speaker at a time. On a GPU the host
may be stuck (in NCCL) or ahead, and the CUDA events of the step marks say which boundary
the GPU's state is at; SIGTERM is heard on a thread of its own (`_watch_sigterm`).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from . import memory as mem
from .last_words import last_words_step
from .memory_dirs import hold_last_words, start_speaking, stop_speaking, take_writer
from .step_marks import StepMarks
from .tiers.api import Worker
from .tiers.memory import MEMORY_PLAN_REMAKES, MemoryTier

log = logging.getLogger("ftrain.runtime")

# What a worker whose group broke gives its memory tier's copy in flight before it exits.
SETTLE_S = 1.0
# What it gives, all in all, to that and to its last-words copy (`FailureFlush.last_words`): a
# state that cannot be copied within it leaves the tier's older copy.
LAST_WORDS_S = 2.0
# On a GPU: how long a survivor's last words wait for a stream caught in an optimizer step to
# reach the next boundary (or the collective it then waits in for good).
GPU_SETTLE_S = 0.25


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


class FailureFlush:
    """One worker's flush at a failure; see the module docstring."""

    def __init__(self, worker: Worker, tier: MemoryTier, marks: StepMarks, enabled: bool = True):
        self.worker = worker
        self.tier = tier
        self.marks = marks
        self.enabled = enabled  # FTRAIN_LAST_WORDS=0: no last words, no per-step marks
        self.objects: Mapping[str, Any] = {}  # the registered state (`start`)
        self.lock_fd: int | None = None  # fd of the tier's last-words lock (worker/memory_dirs.py)
        self.busy = False  # in `step_done` or the end: a SIGTERM's last words wait for its end
        self.finished = False  # the run ended: nothing more to say
        self._words_lock = threading.Lock()  # one speaker at a time
        self._speaker: int | None = None  # the thread saying the last words now
        self.term_pending = False  # a SIGTERM came while busy
        self.sigterm_before: Any = None  # the SIGTERM handler `_on_sigterm` replaced (put back at the end)
        self._sigterm_watch = False  # on a GPU, a thread hears SIGTERM through the wakeup fd

    @property
    def on_gpu(self) -> bool:
        return self.worker.device.type == "cuda"

    # -------------------------------------------------------------- set-up
    def claim_writer(self) -> None:
        """The node's writer (`init`, before its first collective, so before any sibling can
        complete a step): with last words, byte 0 of the tier's last-words lock, held until its
        writer is closed (the end) or it dies. A sibling writes the tier only once it has that
        byte (`_take_writer`): never beside a live writer."""
        if not self.enabled:
            return
        self.lock_fd = hold_last_words(self.tier.directory)
        if self.lock_fd is None:
            log.warning("memory tier: another process holds the writer's lock of %s; no last words "
                        "from this node", self.tier.directory)

    def start(self, objects: Mapping[str, Any]) -> None:
        """Every rank keeps its RNG states of every step, and notes every step boundary
        (worker/step_marks.py), counting optimizer steps with a pre-hook (the writer, and its
        siblings: any of them may have to speak for the node); SIGTERM says the last words."""
        self.objects = objects
        if not self.enabled or (not self.on_gpu and torch.cuda.is_initialized()):
            return
        self.marks.on = True
        optimizers = [o for o in objects.values() if isinstance(o, torch.optim.Optimizer)]
        if not optimizers:
            if self.tier.writer is not None:
                log.info("memory tier: no optimizer among the state: no last-words copy (nothing "
                         "tells when the parameters change)")
            return
        if self.tier.writer is None:
            # A sibling of the node's writer: it speaks when the writer is gone (`_take_writer`).
            # Its byte of the lock: torchrun's stop of a broken group waits for it (monitor.py).
            self.lock_fd = hold_last_words(self.tier.directory, self.worker.local_rank)
            if self.lock_fd is None:
                return
        elif self.lock_fd is None:
            return  # the writer could not claim the tier (`claim_writer`): no last words
        for opt in optimizers:
            opt.register_step_pre_hook(self.marks.count_optimizer_step)
        if threading.current_thread() is threading.main_thread():
            before = signal.signal(signal.SIGTERM, self._on_sigterm)
            self.sigterm_before = signal.SIG_DFL if before is None else before  # None: set in C
            if self.on_gpu and not callable(self.sigterm_before):
                self._watch_sigterm()

    def _watch_sigterm(self) -> None:
        """On a GPU: hear SIGTERM on a thread of its own. Python runs a signal's handler on the
        main thread between bytecodes, and a GPU survivor's main thread may be stuck in NCCL
        (or in a read of the GPU behind it) for good: its agent's SIGTERM then went unheard
        and the worker lingered until the agent's grace ran out and it was SIGKILLed (2.5 s
        of every recovery on two H100s). The signal's C handler writes its number to the
        wakeup fd at once; this thread says the last words and ends the process as the signal
        would have. Not where the script set its own handler (it may mean to go on) or where
        another wakeup fd is set (an event loop's)."""
        read, write = os.pipe()
        os.set_blocking(write, False)
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        except ValueError:
            previous = None
        if previous != -1:  # another owner (or none could be set): leave it
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read)
            os.close(write)
            return

        def watch() -> None:
            while True:
                try:
                    got = os.read(read, 64)
                except OSError:
                    return
                if not got:
                    return
                if signal.SIGTERM in got and not self.finished:
                    self.say()
                    flush_output()
                    os._exit(128 + signal.SIGTERM)

        self._sigterm_watch = True
        threading.Thread(target=watch, name="ftrain-sigterm", daemon=True).start()

    # -------------------------------------------------------------- SIGTERM
    def _on_sigterm(self, signum, frame) -> None:
        """SIGTERM (the node agent replacing the attempt after a lost node, torchrun stopping
        the group): the last words first (a survivor often hears of the fault this way before
        its next collective fails), then the signal's own end. In the middle of `step_done`
        (its state half made), or of this thread's own last words, they wait for its end."""
        if self.busy or self._speaker == threading.get_ident():
            self.term_pending = True
            return
        self.end_on_sigterm()

    def not_busy(self) -> None:
        """`step_done` (or the end) is over: a SIGTERM that came meanwhile has its end now."""
        self.busy = False
        if self.term_pending:
            self.end_on_sigterm()

    def end_on_sigterm(self) -> None:
        self.term_pending = False
        self.say()
        before = self.sigterm_before
        if callable(before):  # the script's own handler, which may go on training
            if self.tier.writer is not None:
                self.tier.writer.wait(stall=False)  # the last words whole before the optimizer may step
            before(signal.SIGTERM, None)
        elif before != signal.SIG_IGN:
            flush_output()
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def put_back_sigterm(self) -> None:
        """The end of the run: the script's SIGTERM handler as it was."""
        if self.sigterm_before is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.sigterm_before)
            if self._sigterm_watch:
                signal.set_wakeup_fd(-1)

    def release(self) -> None:
        """Nothing more to say: a stop need not wait (after the writer's last copy: a sibling
        takes the tier only once it is closed)."""
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    # -------------------------------------------------------------- the last words
    def say(self) -> None:
        """The copy in flight settled, then the last words, in LAST_WORDS_S at most (a worker on
        its way out: a broken group, a SIGTERM); a SIGTERM meanwhile waits for them. From any
        thread (on a GPU the peer watch's, when the training thread is stuck in NCCL); one at
        a time: a second caller waits for the first one's words and returns."""
        if self._speaker == threading.get_ident():
            return
        if not self._words_lock.acquire(blocking=False):
            if self._words_lock.acquire(timeout=SETTLE_S + LAST_WORDS_S + 1.0):
                self._words_lock.release()
            return
        self._speaker = threading.get_ident()
        began = time.monotonic()
        local_rank = self.worker.local_rank
        fd = self.lock_fd if self.speaks() else None
        speaking = fd is not None and start_speaking(fd, local_rank)  # a stop waits for it
        try:
            self.tier.settle(SETTLE_S)
            self.last_words(max(0.0, began + LAST_WORDS_S - time.monotonic()))
        finally:
            if speaking and self.lock_fd is not None:
                stop_speaking(self.lock_fd, local_rank)
            self._speaker = None
            self._words_lock.release()

    def speaks(self) -> bool:
        """Whether this rank may say last words: the node's writer (its tier on), or a sibling
        holding its byte of the tier's last-words lock (`start`)."""
        if self.tier.writer is not None:
            return not self.tier.writer.disabled
        return self.lock_fd is not None

    def last_words(self, timeout_s: float) -> bool:
        """A worker whose group broke (after the tier's `settle`): if its state is exactly that
        of its last step boundary and the node's tier holds an older step, copy it there,
        within `timeout_s` (a copy not whole by then is not committed: the older one stays).
        True if the copy was made. The node's writer, or a sibling once the writer is gone."""
        marks = self.marks
        mark = marks.boundary
        if not marks.on or self.finished or not self.speaks():
            return False
        began = time.perf_counter()
        w = self.tier.writer if self.tier.writer is not None else self._take_writer(timeout_s)
        if w is None or w.disabled:
            return False
        if self.on_gpu:
            return self._last_words_gpu(w, max(0.0, timeout_s - (time.perf_counter() - began)))
        rank = self.worker.rank
        try:
            plan = marks.plan
            versions = marks.versions(plan) if plan is not None and plan.check() else None
            held = w.held.step if w.held is not None else -1
            kept = marks.kept if plan is not None and marks.watched_plan is plan else None
            step, why = last_words_step(mark, marks.optimizer_steps, versions, held,
                                        buffers_kept=kept is not None)
            if plan is None and self.tier.plans >= MEMORY_PLAN_REMAKES:
                why = "its state is copied through state_dict() (no plan can follow it step by step)"
            if step is None or plan is None or mark is None or not self._may_copy(w, why, step):
                return False
            state, tensors = marks.words_parts(mark, plan, kept, self.worker.local_rank == 0)
            w.capture_split(state, tensors, step, plan.later, check=plan.check)
            w.settle(max(0.0, timeout_s - (time.perf_counter() - began)))
        except Exception as exc:  # noqa: BLE001 - the worker is on its way out; the older copy stays
            log.warning("rank %d: the last-words copy failed (%s); the memory tier keeps its older copy",
                        rank, exc)
            return False
        made = w.held is not None and w.held.step == step
        log.info("rank %d: last words: %s (step %d) in %.1f ms; %s", rank,
                 "copied the state into the node's memory tier" if made else "no copy within the time",
                 step, (time.perf_counter() - began) * 1e3, why)
        return made

    def _may_copy(self, w: mem.MemoryWriter, why: str, step: int | None) -> bool:
        """Whether the last words go on: a step to copy (else `why` is logged) and no copy in
        flight left unwhole."""
        if step is None:
            log.info("rank %d: no last-words copy: %s", self.worker.rank, why)
            return False
        if not w.settle(0.0):
            log.info("rank %d: no last-words copy: the copy in flight is not whole", self.worker.rank)
            return False
        return True

    def _last_words_gpu(self, w: mem.MemoryWriter, timeout_s: float) -> bool:
        """`last_words` on a GPU. The host may be stuck (in NCCL, in a read of the GPU) or
        ahead; the events say which boundary the GPU's state is at. A stream caught between
        a boundary and the next collective (an optimizer step running) is given
        GPU_SETTLE_S to reach the next boundary. The copy runs on a stream of its own; the
        events are read again once it is whole, and a state that moved meanwhile is not
        committed."""
        marks, rank = self.marks, self.worker.rank
        began = time.monotonic()
        deadline = began + timeout_s
        while True:
            found, why = marks.gpu_state()
            if found is not None or time.monotonic() >= min(deadline, began + GPU_SETTLE_S):
                break
            time.sleep(0.002)
        if found is None:
            log.info("rank %d: no last-words copy: %s", rank, why)
            return False
        mark, plan, host = found
        if host is None:
            log.info("rank %d: no last-words copy: the state's tensors in host memory are too large "
                     "to copy at every step boundary", rank)
            return False
        try:
            ok = marks.watched_plan is plan and marks.host_plan is plan and plan.check()
            versions = tuple(t._version for t in marks.watched) if ok else None
            held = w.held.step if w.held is not None else -1
            kept = marks.kept if ok else None
            step, why = last_words_step(mark, mark.optimizer_steps, versions, held,
                                        buffers_kept=kept is not None)
            if not self._may_copy(w, why, step):
                return False
            state, tensors = marks.words_parts(mark, plan, kept, self.worker.local_rank == 0, host)

            def still() -> bool:  # the same boundary, its state untouched while it was copied
                again = marks.gpu_state()[0]
                return again is not None and again[0] is mark

            made = w.capture_now(state, tensors, step, still, check=plan.check)
        except Exception as exc:  # noqa: BLE001 - the worker is on its way out; the older copy stays
            log.warning("rank %d: the last-words copy failed (%s); the memory tier keeps its older copy",
                        rank, exc)
            return False
        log.info("rank %d: last words: %s (step %d) in %.1f ms; %s", rank,
                 "copied the GPU's state into the node's memory tier" if made
                 else "no copy (the GPU's state moved while it was copied)",
                 step, (time.monotonic() - began) * 1e3, why)
        return made

    def _take_writer(self, timeout_s: float) -> mem.MemoryWriter | None:
        """A sibling whose group broke: take the writer's byte of the lock (the writer is gone:
        SIGKILLed, or it has said its own last words and exited), waiting up to `timeout_s`,
        then write the tier as its writer (a `MemoryWriter` of its own: the next slot after
        the one `latest.json` names, committed as every copy). None: the writer is alive, or
        nothing to say."""
        fd = self.lock_fd
        if fd is None or self.marks.boundary is None:
            return None
        began = time.perf_counter()
        if not take_writer(fd, timeout_s):
            log.info("rank %d: no last-words copy: the node's writer is alive (it speaks)", self.worker.rank)
            return None
        writer = self.tier.open_writer()
        for obj in self.objects.values():  # a script that goes on after SIGTERM: copies whole first
            if isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(writer.guard)
        log.info("rank %d: the node's writer is gone (waited %.1f ms): this rank writes its memory tier",
                 self.worker.rank, (time.perf_counter() - began) * 1e3)
        return writer
