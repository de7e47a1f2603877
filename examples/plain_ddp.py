"""A plain torchrun script, in the style of PyTorch's DDP fault-tolerance tutorial.

It uses no ftrain code at all: it reads the environment torchrun gives every worker
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ...), saves `snapshot.pt` on rank 0 every
`--save-every` epochs and loads it on start. Under ftrain the snapshot goes into
FTRAIN_SNAPSHOT_DIR (a directory every node sees), else into the working directory.

    torchrun --standalone --nproc-per-node=2 examples/plain_ddp.py --epochs 10
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def ddp_setup() -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # A timeout, so a lost peer fails the group in a minute, not gloo's default 30.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            timeout=timedelta(seconds=60))


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, step_delay):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.device = (torch.device("cuda", self.local_rank) if torch.cuda.is_available()
                       else torch.device("cpu"))
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.step_delay = step_delay
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot()
        self.model = DDP(self.model, device_ids=[self.local_rank] if torch.cuda.is_available() else None)

    def _load_snapshot(self) -> None:
        snapshot = torch.load(self.snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        if self.global_rank == 0:
            print(f"Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _save_snapshot(self, epoch: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(), "EPOCHS_RUN": epoch}
        # Write aside and rename: a worker killed mid-save must not leave a torn snapshot.pt.
        tmp = f"{self.snapshot_path}.tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}", flush=True)

    def _run_epoch(self, epoch: int) -> float:
        self.train_data.sampler.set_epoch(epoch)
        loss = torch.zeros(())
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()
        return loss.item()

    def train(self, max_epochs: int) -> None:
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            if self.global_rank == 0:
                print(f"epoch={epoch} loss={loss:.6f}", flush=True)
                if (epoch + 1) % self.save_every == 0:
                    self._save_snapshot(epoch + 1)
            if self.step_delay:
                time.sleep(self.step_delay)


def main() -> None:
    p = argparse.ArgumentParser(description="plain torchrun DDP training with snapshot.pt")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--save-every", type=int, default=1)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--step-delay", type=float, default=0.0, help="sleep per epoch (for demos and tests)")
    args = p.parse_args()

    ddp_setup()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 20, generator=g)
    y = x @ torch.randn(20, 1, generator=g)
    dataset = TensorDataset(x, y)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=False, sampler=DistributedSampler(dataset))
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    snapshot_dir = os.environ.get("FTRAIN_SNAPSHOT_DIR") or os.getcwd()
    trainer = Trainer(model, loader, optimizer, args.save_every,
                      os.path.join(snapshot_dir, "snapshot.pt"), args.step_delay)
    trainer.train(args.epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
