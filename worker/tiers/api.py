"""The snapshot tiers' contract: what `worker/runtime.py` asks of each place it keeps the
training state, and what it tells them of the worker.

A tier saves the state of the registered objects (model, optimizer, scheduler, sampler,
extras: anything with `state_dict()`) at a step, says which step it can give back (the
newest whole copy it holds, verified: a damaged one is reported and skipped for the one
before, or for none), and gives that state back. Three tiers:

- `DiskTier` (`disk.py`): rank 0's files in the job's snapshot folder, committed to the
  control plane, pruned to `keep`; every `snapshot_every` steps and for planned changes.
- `MemoryTier` (`memory.py`): the node's copy in /dev/shm (`worker/memory.py`), two slots,
  every step or as often as its budget allows; outlives the worker.
- `PeerTier` (`peer.py`): another node's memory copy, sent over the process group to the
  ranks whose node lacks it.

An FSDP2 model's tiers are every rank's: `ShardedDiskTier` (`sharded.py`, DCP) and
`ShardedMemoryTier` with `ShardedPeerTier` (`sharded_memory.py`: each rank's shards and a
replica of them on another node).

The tiers differ in who saves (rank 0, each node's first rank, nobody) and how often; the
runtime decides that (`Runtime.step_done`), the tier only keeps and gives back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..links import Link

# The version of a snapshot's layout (disk file or memory copy), kept in each.
SNAPSHOT_FORMAT = 1


@dataclass
class Worker:
    """What the parts of the runtime know of this worker (made once by `runtime.init`); `link`
    may be replaced (a test's recording link)."""

    rank: int
    local_rank: int
    world_size: int
    distributed: bool
    device: torch.device
    link: Link | None = None
    node: str | None = None  # FTRAIN_NODE: the name its memory tier is reported under
    attempt: int = 0

    @property
    def is_chief(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class Found:
    """A copy a tier can restore: its step, and where it is (a path, a source rank)."""

    step: int
    where: Any = None


class SnapshotTier(ABC):
    """One place the training state is kept (see the module docstring)."""

    name: ClassVar[str]  # what `Runtime.resumed_tier` says: "disk", "memory" or "peer"

    @abstractmethod
    def save(self, objects: Mapping[str, Any], step: int, rng: Any) -> bool:
        """Start saving `objects`' state at `step`, with `rng` (the RNG states to restore);
        False if the tier refused it (its storage full): the previous copy stays."""

    @abstractmethod
    def wait(self) -> None:
        """Until the save in flight is whole and committed, or has failed (and said so)."""

    @abstractmethod
    def newest(self) -> Found | None:
        """The newest whole copy this tier can restore, verified; a damaged one is reported
        and skipped for the one before, or None."""

    @abstractmethod
    def load(self, found: Found) -> dict:
        """The state of `found`: {"step", "rng", and each object's name: its state_dict}."""

    @abstractmethod
    def close(self) -> None:
        """The save in flight finished and the tier's resources let go (the end of a run)."""


def load_into(objects: Mapping[str, Any], state: Mapping[str, Any]) -> None:
    """Give each registered object its part of a restored state."""
    for name, obj in objects.items():
        if obj is not None and state.get(name) is not None:
            obj.load_state_dict(state[name])
