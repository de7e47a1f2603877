"""The sharded disk tier: every rank's shards of an FSDP2 model and its optimizer, written
with torch.distributed.checkpoint into one directory of the job's snapshot folder and
committed by rank 0 once every rank's shards are whole (worker/sharded.py has the layout).

It stands where `DiskTier` stands, with the same commits, retention, corrupt fallback and
hand-over (rank 0's `AsyncWriter` completes and commits each snapshot), and differs in who
saves: every rank, at the same step. A restore reads the small state (step, RNG states,
scheduler, sampler, extras) from rank 0's file and the model and optimizer by DCP's load,
resharded for however many ranks the group has now.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .. import sharded
from .. import snapshot as snap
from .api import SNAPSHOT_FORMAT, Found
from .disk import DiskTier

log = logging.getLogger("ftrain.runtime")

# What DCP saves and loads; the rest of the registered objects go into rank 0's small file.
SHARDED_OBJECTS = ("model", "optimizer")


class ShardedDiskTier(DiskTier):
    """Every rank's shards, committed by rank 0; see the module docstring."""

    every_rank_saves = True

    def __init__(self, disk: DiskTier):
        super().__init__(disk.worker, disk.directory, disk.writer)
        self.objects: Mapping[str, Any] = {}
        self.group: Any = None
        self.token = ""
        self._own: threading.Thread | None = None  # a rank other than 0: its sums being written
        self.host = sharded.HostShards()  # the host buffers every snapshot's copy goes into

    def prepare(self, objects: Mapping[str, Any]) -> None:
        """Every rank, at the restore: the objects it saves, the gloo group DCP writes over
        from its thread, and one temporary-directory token every rank writes into."""
        self.objects = objects
        worker = self.worker
        token = f"{worker.attempt}-{secrets.token_hex(4)}"
        if worker.distributed:
            self.group = sharded.checkpoint_group()
            box = [token]
            dist.broadcast_object_list(box, src=0)
            token = box[0]
        self.token = token
        if worker.distributed and self.directory is not None:
            self._check_shared()

    def _check_shared(self) -> None:
        """Every rank sees rank 0's snapshot folder (each writes its shards into the same
        directory), or the job stops at once with what to do, not at its first snapshot."""
        assert self.directory is not None
        probe = self.directory / f".ftrain-shared-{self.token}"
        if self.worker.is_chief:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe.touch()
        dist.barrier(group=self.group)
        seen: list = [None] * self.worker.world_size
        dist.all_gather_object(seen, probe.exists(), group=self.group)
        if self.worker.is_chief:
            probe.unlink(missing_ok=True)
        blind = [rank for rank, saw in enumerate(seen) if not saw]
        if blind:
            raise RuntimeError(
                f"rank(s) {blind} do not see rank 0's snapshot folder {self.directory}: an FSDP2 model's "
                "snapshots are every rank's shards in one directory, so FTRAIN_SNAPSHOT_DIR must be on "
                "storage every node mounts (start the control plane with --snapshot-root on it)")

    # -------------------------------------------------------------- saving
    def save(self, objects: Mapping[str, Any], step: int, rng: Any, *, control_id: int | None = None,
             blocking: bool = False, began: float | None = None) -> bool:
        """Every rank: copy its shards off (the stall) and start writing them; rank 0 hands its
        part to the writer, which commits once every rank's shards are whole. `rng`: every
        rank's RNG states (rank 0's list). Rank 0's answer for a blocking save: False if the
        storage refused the write."""
        start = time.perf_counter() if began is None else began
        assert self.directory is not None and self.writer is not None
        self._wait_own()  # one save in flight: waiting for it is part of the stall
        if self.worker.is_chief:
            self.writer.wait_written()
        waited_s = time.perf_counter() - start
        tmp = self.directory / f".{sharded.snapshot_name(step)}{sharded.TMP_MARK}{self.token}"
        tmp.mkdir(mode=0o700, parents=True, exist_ok=True)  # the job's user alone reads its shards
        big = {name: objects[name] for name in SHARDED_OBJECTS}
        future = sharded.start_save(sharded.model_and_optimizer(big["model"], big["optimizer"]), tmp, self.group,
                                    self.host)
        stall_s = time.perf_counter() - start
        self.stalls_s.append(stall_s)
        self.waits_s.append(waited_s)
        if not self.worker.is_chief:
            self._own = threading.Thread(target=self._finish_own, args=(future, tmp, step),
                                         name=f"snapshot-shards-{step}", daemon=True)
            self._own.start()
            return True
        log.info("snapshot step=%d stall_ms=%.1f (waiting for the previous save %.1f, copy-off %.1f), "
                 "sharded over %d ranks", step, stall_s * 1e3, waited_s * 1e3, (stall_s - waited_s) * 1e3,
                 self.worker.world_size)
        small = {"format": SNAPSHOT_FORMAT, "step": step, "world_size": self.worker.world_size,
                 "time": time.time(), "rng": rng}
        small.update({name: None if obj is None else snap.to_host(obj.state_dict())
                      for name, obj in objects.items() if name not in SHARDED_OBJECTS})
        pending = sharded.ShardedSave(future, tmp, self.worker.world_size, small)
        self.writer.submit(pending, step, stall_s, control_id, blocking=blocking)
        return not (blocking and self.writer.failed_step == step)

    def _finish_own(self, future: Any, tmp: Path, step: int) -> None:
        """A rank other than 0: its write awaited, its sums written for rank 0's manifest."""
        try:
            future.result()
            sharded.write_own_sums(tmp, self.worker.rank)
        except Exception as exc:  # noqa: BLE001 - rank 0's write fails with it and says so
            log.warning("rank %d: its shards of step %d not saved: %s", self.worker.rank, step, exc)

    def _wait_own(self) -> None:
        if self._own is not None:
            self._own.join()
            self._own = None

    def wait(self) -> None:
        self._wait_own()
        super().wait()

    def close(self) -> None:
        """This rank's write finished (rank 0 waits for its sums), then as `DiskTier.close`."""
        self._wait_own()
        super().close()
        self.host.close()

    # -------------------------------------------------------------- restoring
    def takes(self, path: str) -> bool:
        return sharded.is_snapshot_dir(path)

    def verify(self, path: Path, checksum: str, size: int | None) -> None:
        sharded.verify(path, checksum, size)

    def load(self, found: Found) -> dict:
        """Every rank: the small state (its "rng" is every saving rank's, by rank), and the model's
        and optimizer's shards loaded in place, resharded for this world."""
        path = self.resolve(found.where)
        state = snap.load(path / sharded.STATE_FILE)
        began = time.perf_counter()
        sharded.load(self.objects["model"], self.objects.get("optimizer"), path)
        saved_by = state.get("world_size")
        log.info("rank %d: loaded the shards of step %d (saved by %s ranks, loaded into %d) in %.3f s",
                 self.worker.rank, found.step, saved_by, self.worker.world_size, time.perf_counter() - began)
        return state
