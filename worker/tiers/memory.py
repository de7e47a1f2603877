"""The memory tier, the runtime's side: this node's copy of the state in /dev/shm
(worker/memory.py), written by the node's first rank, and each rank's RNG states beside it.

A save goes through the state's `StatePlan` (made at the first copy, again when the copy
thread finds it stale, at most MEMORY_PLAN_REMAKES times), else through the full
`state_dict()`s. A restarted worker reads its node's copy while CUDA and the process group
start (`Prefetch`); a copy that fails its checksum counts as none (reported), so the
restore falls back to a peer's copy or the disk. The writer reports what it holds to the
control plane about once a second, so the snapshot list shows both tiers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import memory as mem
from .. import rng as rngs
from ..links import LinkError, ServiceLink
from .api import SNAPSHOT_FORMAT, Found, SnapshotTier, Worker

log = logging.getLogger("ftrain.runtime")

# How often the memory tier makes its StatePlan (worker/memory.py) before it keeps to the full
# state_dict() path: a plan found stale each time (a state_dict hook that makes new tensors)
# would otherwise never commit a copy.
MEMORY_PLAN_REMAKES = 4
# The longest copy interval the runtime picks (worker/step_timing.py); the RNG ring outlasts two.
MEMORY_EVERY_MAX = 50


class Prefetch:
    """`mem.read_copy(directory)` in a thread of its own, started before CUDA and the process
    group (a restarted worker's copy read and verified meanwhile, not after them)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._got: tuple | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._read, name="ftrain-memory-read", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            self._got = mem.read_copy(self.directory)
        except BaseException as exc:  # noqa: BLE001 - raised where the restore reads it
            self._error = exc

    def result(self) -> tuple | None:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._got


class MemoryTier(SnapshotTier):
    """This node's memory copy; see the module docstring. `writer` is the node's first rank's
    (None on its siblings, which keep only their RNG states here)."""

    name = "memory"

    def __init__(self, worker: Worker, directory: Path, every: int | None,
                 prefetch: Prefetch | None = None):
        self.worker = worker
        self.directory = directory
        self.every = every  # steps between copies; None: picked to fit the budget
        self.writer: mem.MemoryWriter | None = None
        self.plan: mem.StatePlan | None = None  # the state split once (worker/memory.StatePlan)
        self.plans = 0  # plans made so far (at most MEMORY_PLAN_REMAKES)
        self.rng_keeper: mem.RngKeeper | None = None  # each rank's RNG states beside the tier
        self.rng_s = 0.0  # the last copy step's RNG capture (taken on copy steps only, on a GPU)
        self.report_every_s = 1.0
        self._prefetch = prefetch  # this node's copy, read while the worker starts
        self._reporter: threading.Thread | None = None
        self._stop_report = threading.Event()

    @property
    def rng_ring(self) -> int:
        """How many steps of RNG states each rank keeps: enough to outlast two copies."""
        return 2 * max(self.every or 0, MEMORY_EVERY_MAX) + 2

    def open_writer(self) -> mem.MemoryWriter:
        """This rank writes the node's tier (its first rank, or a sibling once the writer is gone)."""
        self.writer = mem.MemoryWriter(self.directory, attempt=self.worker.attempt, rank=self.worker.rank)
        return self.writer

    # -------------------------------------------------------------- saving
    def ready(self) -> bool:
        """Whether this rank's writer takes a copy now: not while its previous GPU copy is in
        flight (skipped: the copies come as often as the link allows)."""
        assert self.writer is not None
        return not self.writer.busy()

    def save(self, objects: Mapping[str, Any], step: int, rng: Any = None) -> bool:
        """Start the copy of this step into the node's tier: through the `StatePlan`, else the
        full `state_dict()`s. `rng`: this rank's states of the step (None: taken now)."""
        w = self.writer
        assert w is not None
        if rng is None:
            rng = rngs.rng_state()
        elif self.rng_keeper is not None:  # as the ring pickled them (the same objects once loaded)
            rng = self.rng_keeper.pickled(rng) or rng
        header = {"format": SNAPSHOT_FORMAT, "step": step, "world_size": self.worker.world_size, "rng": rng}
        plan = self.plan_of(objects)
        if plan is not None:
            w.capture_split({**header, **plan.state()}, plan.tensors, step, plan.later, check=plan.check)
            return not w.disabled
        live = {name: obj for name, obj in objects.items() if obj is not None}
        state: dict[str, Any] = {**header, **{name: obj.state_dict() for name, obj in live.items()}}
        w.capture(state, step, mem.changed_by_step(live.values()))
        return not w.disabled

    def plan_of(self, objects: Mapping[str, Any]) -> mem.StatePlan | None:
        """The writer's `StatePlan`: made at the first copy (or step boundary), again when the
        copy thread found it stale, at most MEMORY_PLAN_REMAKES times."""
        w = self.writer
        if w is not None and w.stale:  # a copy's check found a tensor replaced: not committed
            w.stale = False
            self.plan = None
            log.info("memory tier: the state's tensors changed (a tensor replaced, optimizer state "
                     "added); taking them again")
        if self.plan is None and self.plans < MEMORY_PLAN_REMAKES:
            self.plans += 1
            self.plan = mem.StatePlan.make(dict(objects))
            if self.plan is None:
                self.plans = MEMORY_PLAN_REMAKES  # not a state a plan can follow
        return self.plan

    def last_cost_s(self) -> float:
        """What the last copy cost the training loop (`MemoryWriter.last_cost_s`), with the
        ranks' RNG capture, which comes with every copy."""
        assert self.writer is not None
        return self.writer.last_cost_s() + self.rng_s

    def link_busy_s(self) -> float:
        """How long the last copy kept a link busy after it was whole (a sharded model's
        exchange of replicas); the next copy would wait for it. None here."""
        return 0.0

    def keep_rng(self, step: int, rng: dict) -> None:
        """Write this step's RNG states into the rank's ring (worker/memory.RngKeeper)."""
        if self.rng_keeper is None:
            self.rng_keeper = mem.RngKeeper(self.directory, self.worker.rank, self.rng_ring)
        self.rng_keeper.keep(step, rng)

    def take_rng(self, step: int) -> dict:
        """This rank's RNG states now, kept in its ring as those of `step` (timed: `rng_s`)."""
        start = time.perf_counter()
        rng = rngs.rng_state()
        self.keep_rng(step, rng)
        self.rng_s = time.perf_counter() - start
        return rng

    def wait(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    def settle(self, timeout_s: float) -> None:
        """The copy in flight made whole, and this rank's RNG states written, in at most
        `timeout_s` (a worker about to exit at once: a copy of the step before the fault is
        consistent, since the optimizer waits for the copy before it changes the state, and it
        is the newest step this node holds)."""
        deadline = time.monotonic() + timeout_s
        if self.writer is not None:
            self.writer.settle(timeout_s)
        if self.rng_keeper is not None:
            self.rng_keeper.flush(max(0.0, deadline - time.monotonic()))

    def flush(self, objects: Mapping[str, Any], step: int, missed: bool) -> None:
        """At the end: the copy in flight whole; the last step's copy if it was due and skipped
        (`missed`: a copy was in flight), so the tier holds the state the job ended with; the
        writer's buffers freed."""
        w = self.writer
        assert w is not None
        try:
            w.wait()
            if missed and not w.disabled and objects:
                self.save(objects, step)
                w.wait()
        except Exception as exc:  # noqa: BLE001 - the end of the job must not fail for it
            log.warning("memory tier: the last copy failed (%s); the disk tier still holds", exc)
        finally:
            w.close()

    def close(self) -> None:
        self._stop_report.set()
        self._prefetch = None  # a copy read ahead and never restored from: its memory freed
        if self.writer is not None:
            self.writer.close()
        if self.rng_keeper is not None:
            self.rng_keeper.flush()

    # -------------------------------------------------------------- restoring
    def newest(self) -> Found | None:
        """This node's copy (verified): Found(step, the copy). A corrupt one counts as none, so
        the restore falls back to a peer's copy or disk, and the job's events say so."""
        worker, link = self.worker, self.worker.link
        try:
            copy = self._read_copy()
        except mem.CopyCorrupt as exc:
            log.warning("rank %d: %s; falling back to the next source (a peer's copy, then disk)",
                        worker.rank, exc)
            if worker.local_rank == 0 and link is not None:
                try:
                    link.report_memory_corrupt(worker.node or "local", exc.step, exc.reason)
                except LinkError as err:
                    log.warning("rank %d: could not report the corrupt memory copy: %s", worker.rank, err)
            return None
        if copy is None:
            return None
        held = int(copy[0]["step"])
        if worker.local_rank == 0 and worker.node and isinstance(link, ServiceLink):
            try:
                link.report_memory_held(worker.node, held)
            except LinkError as exc:
                log.warning("rank %d: could not report this node's memory copy (step %d): %s; the "
                            "restore point will not count it", worker.rank, held, exc)
        return Found(held, copy)

    def load(self, found: Found) -> dict:
        """The state of a copy `newest` found (its "rng": the writer's states, see `rng_of`)."""
        return mem.unpack(*found.where)

    def rng_of(self, step: int) -> dict | None:
        """This rank's own RNG states of `step`, kept on its node (`keep_rng`)."""
        return mem.load_rng(self.directory, self.worker.rank, step, self.rng_ring)

    def _read_copy(self) -> tuple | None:
        """`mem.read_copy` of this node's tier: the one `init` started reading, if it did."""
        prefetch, self._prefetch = self._prefetch, None
        if prefetch is not None and prefetch.directory == self.directory:
            return prefetch.result()
        return mem.read_copy(self.directory)

    # -------------------------------------------------------------- reporting
    def start_reports(self) -> None:
        """The node's first rank tells the control plane what its memory tier holds, about
        once a second, so that the snapshot list shows both tiers."""
        worker = self.worker
        if self.writer is None or not isinstance(worker.link, ServiceLink) or not worker.node \
                or self._reporter is not None:
            return
        self._reporter = threading.Thread(target=self._report, name="ftrain-memory-report", daemon=True)
        self._reporter.start()

    def _report(self) -> None:
        link, node = self.worker.link, self.worker.node
        assert self.writer is not None and link is not None and node is not None
        reported = None
        while not self._stop_report.wait(self.report_every_s):
            held = self.writer.held
            if held is None or held.step == reported:
                continue
            try:
                link.report_memory(node, held.step)
                reported = held.step
            except LinkError as exc:
                if exc.status == 409:  # a stale attempt, or the job ended: nothing more to say
                    log.info("memory tier reports stop: %s", exc)
                    return
                log.debug("memory tier report failed: %s", exc)

    def stop_reports(self) -> None:
        self._stop_report.set()
