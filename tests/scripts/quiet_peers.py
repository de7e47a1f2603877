"""A plain script (no ftrain runtime) whose ranks talk once, an all_reduce when the group
forms, then only step: a dead peer goes unnoticed by the survivors, as one does by ranks
blocked in an NCCL collective. Rank 0 prints `step=N world=W` every step."""

import datetime
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
world = dist.get_world_size()
for step in range(int(sys.argv[1])):
    time.sleep(0.05)
    if dist.get_rank() == 0:
        print(f"step={step} world={world}", flush=True)
dist.destroy_process_group()
