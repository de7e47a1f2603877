"""A plain DDP script for several GPUs under torchrun, as PyTorch's DDP tutorial runs one.

Nothing in it knows ftrain: it needs CUDA and NCCL, takes its GPU from LOCAL_RANK (so two
workers on one host need two GPUs they can see), saves `snapshot.pt` in the working
directory every `save_every` epochs from global rank 0, and resumes from it when present.

    torchrun --standalone --nproc-per-node=gpu examples/multigpu_torchrun.py 50 10
    ftrain up --nodes 2; ftrain submit examples/multigpu_job.json   # one GPU per local node
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

SNAPSHOT = "snapshot.pt"


class RandomPairs(Dataset):
    """`size` fixed random (input, target) pairs: 20 features in, one number out."""

    def __init__(self, size: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(size, 20, generator=g)
        self.y = torch.rand(size, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class Trainer:
    def __init__(self, model: torch.nn.Module, data: DataLoader, optimizer: torch.optim.Optimizer,
                 save_every: int):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.rank = int(os.environ["RANK"])
        self.data = data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        model = model.to(self.local_rank)
        if os.path.exists(SNAPSHOT):
            state = torch.load(SNAPSHOT, map_location=f"cuda:{self.local_rank}")
            model.load_state_dict(state["model"])
            self.epochs_run = state["epochs_run"]
            print(f"[GPU{self.rank}] resuming from {SNAPSHOT} at epoch {self.epochs_run}", flush=True)
        self.model = DDP(model, device_ids=[self.local_rank])

    def epoch(self, n: int) -> float:
        self.data.sampler.set_epoch(n)
        total = 0.0
        for x, y in self.data:
            x, y = x.to(self.local_rank), y.to(self.local_rank)
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(x), y)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
        print(f"[GPU{self.rank}] epoch {n} | batches {len(self.data)} | loss {total / len(self.data):.4f}",
              flush=True)
        return total

    def save(self, n: int) -> None:
        torch.save({"model": self.model.module.state_dict(), "epochs_run": n + 1}, SNAPSHOT + ".tmp")
        os.replace(SNAPSHOT + ".tmp", SNAPSHOT)
        print(f"epoch {n}: snapshot saved to {SNAPSHOT}", flush=True)

    def train(self, total_epochs: int) -> None:
        for n in range(self.epochs_run, total_epochs):
            self.epoch(n)
            if self.rank == 0 and (n + 1) % self.save_every == 0:
                self.save(n)


def main() -> None:
    parser = argparse.ArgumentParser(description="Plain DDP training on several GPUs.")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch_size", type=int, default=32)
    args = parser.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    print(f"[GPU{dist.get_rank()}] of {dist.get_world_size()}: cuda:{local_rank} = "
          f"{torch.cuda.get_device_name(local_rank)}, CUDA_VISIBLE_DEVICES="
          f"{os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    data = RandomPairs(2048)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False, pin_memory=True,
                        sampler=DistributedSampler(data))
    model = torch.nn.Linear(20, 1)
    trainer = Trainer(model, loader, torch.optim.SGD(model.parameters(), lr=1e-3), args.save_every)
    trainer.train(args.total_epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
