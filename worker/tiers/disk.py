"""The disk tier: rank 0's snapshot files in the job's snapshot folder (worker/snapshot.py),
each committed to the control plane (or the local twin's index), pruned to `keep`.

A save copies the state off the training path into host memory (the only stall, measured
and logged) and hands it to `worker.snapshot.AsyncWriter`, which writes it atomically with
a checksum and commits it in the background. A restore takes the newest committed snapshot
that passes its checksum, reporting a corrupt one and falling back to the one before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import handoff, sharded
from .. import snapshot as snap
from ..links import ServiceLink
from .api import SNAPSHOT_FORMAT, Found, SnapshotTier, Worker

log = logging.getLogger("ftrain.runtime")


class DiskTier(SnapshotTier):
    """Snapshot files, committed; see the module docstring."""

    name = "disk"
    every_rank_saves = False  # rank 0 saves the whole state (a sharded tier: every rank its shards)

    def __init__(self, worker: Worker, directory: Path | None, writer: snap.AsyncWriter | None):
        self.worker = worker
        self.directory = directory
        self.writer = writer
        self.stalls_s: list[float] = []  # per snapshot: the training loop's stall
        self.waits_s: list[float] = []  # of which: waiting for the previous save
        self._staging = snap.HostStaging()

    def save(self, objects: Mapping[str, Any], step: int, rng: Any, *, control_id: int | None = None,
             blocking: bool = False, began: float | None = None) -> bool:
        """Rank 0: copy the state off the device and hand it to the writer; `rng` is every
        rank's RNG states, `began` when the stall began (the RNG states' gather). For a
        blocking save, False if the storage refused the write."""
        start = time.perf_counter() if began is None else began
        assert self.writer is not None
        self.writer.wait_written()  # one write in flight: waiting for it is part of the stall
        waited_s = time.perf_counter() - start
        state = {"format": SNAPSHOT_FORMAT, "step": step, "world_size": self.worker.world_size,
                 "time": time.time(), "rng": rng}
        live = {name: None if obj is None else obj.state_dict() for name, obj in objects.items()}
        state.update(self._staging.copy(live))
        device = self.worker.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the non-blocking copies into pinned memory
        stall_s = time.perf_counter() - start
        self.stalls_s.append(stall_s)
        self.waits_s.append(waited_s)
        log.info("snapshot step=%d stall_ms=%.1f (waiting for the previous save %.1f, copy-off %.1f)",
                 step, stall_s * 1e3, waited_s * 1e3, (stall_s - waited_s) * 1e3)
        self.writer.submit(state, step, stall_s, control_id, blocking=blocking)
        return not (blocking and self.writer.failed_step == step)

    def wait(self) -> None:
        if self.writer is not None:
            self.writer.wait()

    def newest(self) -> Found | None:
        """Rank 0: the newest committed snapshot that passes its checksum (reporting others)."""
        link = self.worker.link
        if link is None:
            return None
        if self.directory is not None:
            snap.cleanup_temporaries(self.directory)
        items, latest = link.snapshots()
        if latest is None:
            return None
        for item in sorted(items, key=lambda i: i.step, reverse=True):
            if item.bad or item.step > latest:
                continue
            if not self.takes(item.path):
                log.warning("snapshot at step %d (%s) is not of this model's layout (%s); skipped", item.step,
                            item.path, "sharded" if self.every_rank_saves else "one file")
                continue
            path = self.resolve(item.path)
            try:
                self.verify(path, item.checksum, item.size)
                return Found(item.step, str(path))
            except snap.SnapshotCorrupt as exc:
                log.warning("snapshot at step %d is corrupt, trying the one before: %s", item.step, exc)
                link.report_corrupt(item.step, str(exc))
        return None

    def takes(self, path: str) -> bool:
        """Whether a committed snapshot is of this tier's layout: one file (a directory is a
        sharded snapshot, worker/tiers/sharded.py)."""
        return not sharded.is_snapshot_dir(path)

    def verify(self, path: Path, checksum: str, size: int | None) -> None:
        snap.verify(path, checksum, size)

    def load(self, found: Found) -> dict:
        """The snapshot's state (the file in this rank's view of the snapshot directory,
        loaded weights-only: worker/snapshot.py `load`); its "rng" is every rank's, by rank."""
        return snap.load(self.resolve(found.where))

    def close(self) -> None:
        """What the control plane did not take goes to the node agent (worker/handoff.py)."""
        if self.writer is not None:
            self.writer.finish()

    def resolve(self, path: str) -> Path:
        """A committed file in this node's view of the job's snapshot directory: the committed
        path where it is in that directory, else the same file name there (the directory of
        another node, or a forged commit's `/tmp/evil.pt`: every rank loads the file, so a file
        elsewhere is never opened). Without a directory (the local twin): its own commits."""
        p = Path(path)
        if self.directory is None or snap.in_directory(p, self.directory):
            return p
        return self.directory / p.name

    def await_handed_over(self) -> None:
        """Rank 0, before it chooses: the commits that an earlier group of this attempt
        (torchrun restarted it) left its node agent are made first (worker/handoff.py
        `wait_pending`), or the restore could pick an older snapshot."""
        link = self.worker.link
        if self.directory is None or not isinstance(link, ServiceLink):
            return
        if not handoff.pending(self.directory, link.attempt):
            return
        log.info("rank %d: waiting for the snapshot commits an earlier group of attempt %d left "
                 "its node agent before choosing where to resume", self.worker.rank, link.attempt)
        if not handoff.wait_pending(self.directory, link.attempt):
            log.warning("rank %d: the snapshot commits an earlier group left its node agent were not "
                        "made within %.0f s; resuming from the latest the control plane lists",
                        self.worker.rank, handoff.PENDING_WAIT_S)
