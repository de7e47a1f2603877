"""A data order that resumes mid-epoch exactly.

`ResumableSampler` is `DistributedSampler` with a position: the order of epoch `e` is a
pure function of `(seed, e)` (a `torch.randperm` seeded with `seed + e`, as
DistributedSampler does), and the sampler knows how far into that order the job is
(`epoch`, `index` = samples of the epoch the whole group has consumed). Its state goes into
every snapshot, so a restarted job continues with the very next batch, not the start of
the epoch.

Each step takes the next *global* batch of the epoch's order and splits it over the
ranks in contiguous chunks. Because the position counts global samples, a job that comes
back with a different world size continues at the same place in the same order; and with
a fixed `global_batch_size` the samples of each step are the same whatever the world size.
If the global batch does not divide by the world size, ranks get chunks that differ by
one sample; `loss_weight` scales a rank's mean loss so that DDP's gradient average is
still the mean over the global batch.

The position advances when a batch is *yielded*, so iterate the sampler in the training
loop (or through a `DataLoader(batch_sampler=..., num_workers=0)`); a loader that
prefetches would move the position ahead of the training.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class ResumableSampler:
    """Batches of dataset indices for one rank, endlessly, epoch after epoch."""

    def __init__(self, num_samples: int, batch_size: int | None = None, *, rank: int = 0,
                 world_size: int = 1, seed: int = 0, shuffle: bool = True,
                 global_batch_size: int | None = None):
        if (batch_size is None) == (global_batch_size is None):
            raise ValueError("give exactly one of batch_size (per rank) and global_batch_size")
        self.global_batch_size = global_batch_size or batch_size * world_size  # type: ignore[operator]
        if self.global_batch_size < world_size:
            raise ValueError(f"global batch {self.global_batch_size} is smaller than the world "
                             f"size {world_size}: some ranks would get no samples")
        if num_samples < self.global_batch_size:
            raise ValueError(f"{num_samples} samples cannot fill one global batch of "
                             f"{self.global_batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0
        base, extra = divmod(self.global_batch_size, world_size)
        self._start = rank * base + min(rank, extra)
        self.local_batch_size = base + (1 if rank < extra else 0)

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size  # the last partial batch is dropped

    @property
    def loss_weight(self) -> float:
        """Multiply this rank's mean loss by this so DDP's average is the global mean."""
        return self.local_batch_size * self.world_size / self.global_batch_size

    def order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator()
        g.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=g)

    def __iter__(self) -> Iterator[list[int]]:
        g = self.global_batch_size
        while True:
            order = self.order(self.epoch)
            while self.index + g <= self.num_samples:
                start = self.index + self._start
                batch = order[start:start + self.local_batch_size].tolist()
                self.index += g
                yield batch
            self.epoch += 1
            self.index = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "num_samples": self.num_samples, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples", self.num_samples) != self.num_samples:
            raise ValueError(f"the snapshot's dataset had {state['num_samples']} samples, this "
                             f"one has {self.num_samples}; the data position cannot be restored")
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self.seed = int(state.get("seed", self.seed))
