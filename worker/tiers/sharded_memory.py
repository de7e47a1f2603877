"""The memory tier of an FSDP2 model: every rank's own shards in its node's memory tier.

With DDP a node's first rank copies the whole state, which every rank holds. With FSDP2
each rank holds only its shards of the parameters and of the optimizer's state, so every
rank is a writer: its local state dict (the DTensors' local shards, the optimizer's state,
the scheduler, sampler and extras, its RNG states, the step, the world size and its rank)
goes into a writer of its own, `<node's memory dir>/shard-r<rank>/`, with the same slots,
checksums, budget and schedule as the DDP copy (worker/memory.py, worker/tiers/memory.py).
Every rank copies at the steps rank 0 picks, and never skips one (it waits for its own
previous copy instead), so the ranks' copies are of the same steps.

A restore from memory needs every rank's shard of one step, and the world size it was
saved at (a shard is a rank's slice of the model: it fits only the same world). Each rank
reads and verifies both of its slots (its last two copies: a rank killed mid-copy leaves its
other ranks' copies a step ahead of its own); the ranks gather which steps they hold, and
the newest step that every rank holds, saved at this world size, is the group's memory
copy: each node's first rank reports it to the control plane, which decides the restore
point as for DDP (service/decide/restore.py), and each rank then loads its own shard in
place (the DTensors rebuilt on the model's own mesh and placements). At another world size
the memory copies are no use and the group restores from disk, where DCP reshards.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .. import memory as mem
from .. import sharded
from ..links import LinkError, ServiceLink
from .api import SNAPSHOT_FORMAT, Found, Worker
from .memory import MemoryTier
from .peer import PeerTier, Wire
from .sharded import SHARDED_OBJECTS

log = logging.getLogger("ftrain.runtime")


def _dtensor_type() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def local_shards(state: Any, dtensor: type, found: list[torch.Tensor]) -> Any:
    """`state` with each DTensor replaced by its local shard (appended to `found`)."""
    if isinstance(state, dtensor):
        local = state.to_local()
        found.append(local)
        return local
    if isinstance(state, dict):
        return {k: local_shards(v, dtensor, found) for k, v in state.items()}
    if isinstance(state, list):
        return [local_shards(v, dtensor, found) for v in state]
    return state


def into_template(saved: Any, like: Any, dtensor: type) -> Any:
    """`saved` (local shards) put into `like` (the model's and optimizer's sharded state now,
    at the same world size): each DTensor's local shard copied in place, the rest as saved."""
    if isinstance(like, dtensor):
        local = like.to_local()
        if local.shape != saved.shape:
            raise ValueError(f"a memory shard of shape {tuple(saved.shape)} does not fit this rank's "
                             f"{tuple(local.shape)}")
        local.copy_(saved)
        return like
    if isinstance(saved, dict) and isinstance(like, dict):
        return {k: into_template(v, like.get(k), dtensor) for k, v in saved.items()}
    if isinstance(saved, list) and isinstance(like, list) and len(saved) == len(like):
        return [into_template(a, b, dtensor) for a, b in zip(saved, like)]
    return saved


class ShardedMemoryTier(MemoryTier):
    """Every rank's own shards in its node's memory tier; see the module docstring."""

    def __init__(self, worker: Worker, directory: Path, every: int | None):
        super().__init__(worker, directory, every)
        self.copies: dict[int, tuple] = {}  # step -> this rank's copy of it (`newest`)

    @property
    def shard_dir(self) -> Path:
        return self.directory / f"shard-r{self.worker.rank}"

    def open_writer(self) -> mem.MemoryWriter:
        """Every rank writes its own shards (its own directory in the node's tier)."""
        self.shard_dir.mkdir(mode=0o700, exist_ok=True)
        self.writer = mem.MemoryWriter(self.shard_dir, attempt=self.worker.attempt, rank=self.worker.rank)
        return self.writer

    def start_reports(self) -> None:
        """The node's first rank reports what its own shards' copy holds (one report a node)."""
        if self.worker.local_rank == 0:
            super().start_reports()

    def ready(self) -> bool:
        """Every rank copies each step rank 0 picks: its own previous copy is waited for, never
        skipped (a skipped shard would leave the group without a step that every rank holds)."""
        assert self.writer is not None
        self.writer.wait()
        return True

    def save(self, objects: Mapping[str, Any], step: int, rng: Any = None) -> bool:
        """Start the copy of this rank's local state at `step`: the shards (copied off in the
        writer's thread, before the optimizer's next step) and the small state (now)."""
        w = self.writer
        assert w is not None
        dtensor = _dtensor_type()
        shards: list[torch.Tensor] = []
        big = sharded.model_and_optimizer(objects["model"], objects.get("optimizer"))
        local = local_shards(big, dtensor, shards)
        state: dict[str, Any] = {"format": SNAPSHOT_FORMAT, "step": step, "world_size": self.worker.world_size,
                                 "rank": self.worker.rank, "rng": rng, "sharded": local}
        for name, obj in objects.items():
            if name not in SHARDED_OBJECTS and obj is not None:
                state[name] = obj.state_dict()
        # Only the optimizer's step changes the shards and its state: copied in the writer's
        # thread meanwhile (the optimizer's step pre-hook waits for it).
        later = {t.untyped_storage().data_ptr() for t in shards + _tensors(local.get("optimizer", {}))}
        w.capture(state, step, later)
        return not w.disabled

    # -------------------------------------------------------------- restoring
    def newest(self) -> Found | None:
        """This rank's copies (both slots, verified): Found(the newest step, {step: copy})."""
        self.copies = {}
        for slot in (0, 1):
            got = mem.read_slot(self.shard_dir, slot)
            if got is not None and got[0].get("rank") == self.worker.rank:
                self.copies[int(got[0]["step"])] = got
        held = mem.read_held(self.shard_dir)
        if held is not None and held.step not in self.copies:
            self._report_corrupt(held.step)
        return Found(max(self.copies), dict(self.copies)) if self.copies else None

    def _report_corrupt(self, step: int) -> None:
        worker, link = self.worker, self.worker.link
        reason = f"rank {worker.rank}'s shards fail their checksum"
        log.warning("rank %d: memory copy at step %d: %s; falling back to disk", worker.rank, step, reason)
        if link is not None:
            try:
                link.report_memory_corrupt(worker.node or "local", step, reason)
            except LinkError as exc:
                log.warning("rank %d: could not report the corrupt memory copy: %s", worker.rank, exc)

    def held_worlds(self) -> dict[int, int]:
        """{step: the world size it was saved at} of this rank's copies."""
        return {step: int(copy[0]["world_size"]) for step, copy in self.copies.items()}

    def load_shards(self, step: int, objects: Mapping[str, Any]) -> dict:
        """This rank's copy of `step`: its shards loaded into the model and optimizer in place;
        returns the rest of the state (step, rng, scheduler, sampler, extras)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict, set_model_state_dict

        state = mem.unpack(*self.copies[step])
        model, optimizer = objects["model"], objects.get("optimizer")
        like = sharded.model_and_optimizer(model, optimizer)
        with torch.no_grad():
            big = into_template(state.pop("sharded"), like, _dtensor_type())
        if optimizer is None:
            set_model_state_dict(model, big["model"])
        else:
            set_state_dict(model, optimizer, model_state_dict=big["model"], optim_state_dict=big["optimizer"])
        self.copies = {}
        return state

    def close(self) -> None:
        self.copies = {}
        super().close()


def _tensors(state: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    mem._split(state, found)
    return found


class ShardedPeerTier(PeerTier):
    """The group's view of its ranks' shards in memory: a step is restorable when every rank
    holds its own shard of it, saved at this world size (see the module docstring)."""

    def __init__(self, worker: Worker, local: ShardedMemoryTier, wire: Wire | None = None):
        super().__init__(worker, local, wire)
        self.local: ShardedMemoryTier = local
        self.objects: Mapping[str, Any] = {}
        self.complete: int | None = None  # the newest step every rank holds (`gather`)

    def gather(self, mine: Found | None, extra: Any = None) -> list:
        """Every rank's steps held (and `extra`); then each node's first rank reports the newest
        step that every rank holds, and a second all-gather is the barrier after which every
        report is in (rank 0 then asks for the restore point)."""
        worlds = self.local.held_worlds()
        if self.worker.distributed:
            got = self.wire.all_gather_object((worlds, extra))
        else:
            got = [(worlds, extra)]
        self.complete = complete_step([g[0] for g in got], self.worker.world_size)
        if self.complete is None and self.worker.is_chief:
            saved_at = sorted({w for g in got for w in g[0].values()} - {self.worker.world_size})
            if saved_at:
                log.info("the memory tier's shards were saved by %s ranks and the group has %d now: "
                         "restoring from disk, where DCP reshards them", "/".join(map(str, saved_at)),
                         self.worker.world_size)
        self.helds = [self.complete if self.complete is not None else -1] * self.worker.world_size
        self._report(self.complete)
        if self.worker.distributed:
            self.wire.all_gather_object(None)
        return [g[1] for g in got]

    def _report(self, step: int | None) -> None:
        worker, link = self.worker, self.worker.link
        if step is None or worker.local_rank != 0 or not worker.node or not isinstance(link, ServiceLink):
            return
        try:
            link.report_memory_held(worker.node, step)
        except LinkError as exc:
            log.warning("rank %d: could not report this node's shards in memory (step %d): %s; the "
                        "restore point will not count them", worker.rank, step, exc)

    def sent(self, step: int) -> bool:
        return False  # each rank's shard is on its own node

    def where_from(self, step: int, where: Any, mine: Found | None) -> str:
        return "every rank's own shards in its node's memory"

    def load(self, found: Found) -> dict:
        """This rank's own shard of `found.step`, loaded in place (the model and optimizer of
        `objects`, which the runtime sets before the restore)."""
        return self.local.load_shards(found.step, self.objects)


def complete_step(held: list[dict[int, int]], world_size: int) -> int | None:
    """The newest step that every rank holds (`held`: each rank's {step: world size saved at}),
    saved at `world_size` by as many ranks, or None."""
    if len(held) != world_size or not held:
        return None
    common = set.intersection(*({s for s, w in h.items() if w == world_size} for h in held))
    return max(common) if common else None
