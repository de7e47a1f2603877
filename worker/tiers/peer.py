"""The peer tier: a memory copy another node holds, sent over the process group.

With DDP every rank holds the whole state, so after a node is replaced the newest memory
copy is often on another node. At a restore every rank says which step its node's copy
holds (`gather`, one all-gather that also carries what the runtime adds: the peer watch's
addresses); where some rank lacks the chosen step, the rank that holds it sends its packed
copy to all (one broadcast of the skeleton, one of the bytes). Saving is the memory tier's:
what a peer sends is its node's copy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .. import memory as mem
from .api import Found, SnapshotTier, Worker
from .memory import MemoryTier

log = logging.getLogger("ftrain.runtime")


class Wire(Protocol):
    """The collectives the peer tier sends over (the process group's, or a test's)."""

    def all_gather_object(self, obj: Any) -> list: ...
    def broadcast_object(self, obj: Any, src: int) -> Any: ...
    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


class GroupWire:
    """The default process group's collectives."""

    def __init__(self, world_size: int):
        self.world_size = world_size

    def all_gather_object(self, obj: Any) -> list:
        got: list = [None] * self.world_size
        dist.all_gather_object(got, obj)
        return got

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        dist.broadcast(tensor, src=src)


class PeerTier(SnapshotTier):
    """The group's memory copies; see the module docstring."""

    name = "peer"

    def __init__(self, worker: Worker, local: MemoryTier | None, wire: Wire | None = None):
        self.worker = worker
        self.local = local
        self.wire: Wire = wire if wire is not None else GroupWire(worker.world_size)
        self.helds: list[int] = [-1] * worker.world_size  # each rank's node's step (-1: none)
        self._copy: Found | None = None  # this node's copy, as its tier found it

    def gather(self, mine: Found | None, extra: Any = None) -> list:
        """Every rank's step (and `extra`): the barrier after which every rank's tier has
        reported what it holds. Returns every rank's `extra`."""
        self._copy = mine
        held = mine.step if mine is not None else -1
        if not self.worker.distributed:
            self.helds = [held]
            return [extra]
        got = self.wire.all_gather_object((held, extra))
        self.helds = [g[0] for g in got]
        return [g[1] for g in got]

    def save(self, objects: Mapping[str, Any], step: int, rng: Any) -> bool:
        """What a peer sends is its node's copy: the memory tier saves it."""
        return self.local.save(objects, step, rng) if self.local is not None else False

    def wait(self) -> None:
        if self.local is not None:
            self.local.wait()

    def newest(self) -> Found | None:
        """The newest step some rank's node holds, and the first rank that holds it."""
        newest = max(self.helds)
        return Found(newest, self.helds.index(newest)) if newest >= 0 else None

    def holds(self, step: int) -> Found | None:
        """`step`, where some rank's node holds it: Found(step, that rank)."""
        return Found(step, self.helds.index(step)) if step in self.helds else None

    def sent(self, step: int) -> bool:
        """Whether a restore of `step` is sent: some rank's node lacks it."""
        return any(h != step for h in self.helds)

    def where_from(self, step: int, where: Any, mine: Found | None) -> str:
        """Where this rank's copy of `step` came from, for the log."""
        sent = self.sent(step) and (mine is None or mine.step != step)
        return f"sent by rank {where}" if sent else "this node's copy"

    def load(self, found: Found) -> dict:
        """The copy of `found.step`, every rank at once: this node's where it holds it, the
        copy rank `found.where` sends where some rank lacks it."""
        step, src = found.step, found.where
        worker = self.worker
        copy = self._copy.where if self._copy is not None and self._copy.step == step else None
        if self.sent(step):
            mine = self._copy.where if self._copy is not None else None
            packed = (mine[0], mine[2], mine[1].numel()) if worker.rank == src and mine is not None else None
            skeleton, packing, size = self.wire.broadcast_object(packed, src)
            flat = mine[1] if worker.rank == src else torch.empty(size, dtype=torch.uint8)
            wire = flat.to(worker.device) if worker.device.type == "cuda" else flat
            self.wire.broadcast(wire, src)
            if self.helds[worker.rank] != step:
                copy = (skeleton, wire.cpu() if wire is not flat else flat, packing)
        assert copy is not None and copy[0]["step"] == step
        return mem.unpack(*copy)

    def close(self) -> None:
        self._copy = None
