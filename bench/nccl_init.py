"""What a restarted GPU worker pays before its first collective: CUDA's context, the process
group, NCCL's communicator (made at the first collective), and DDP's set-up, one process per
GPU, for world sizes 1 and 2, with the environment as it is and with NCCL knobs that are said
to change its start-up (each run a fresh group of fresh processes, as after a fault).

    python bench/nccl_init.py [--repeats 2] [--variants default,NCCL_CUMEM_ENABLE=0]

Prints the median seconds of each phase on rank 0. GPUs only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
t1 = time.perf_counter()
dist.init_process_group("nccl")
t2 = time.perf_counter()
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
t3 = time.perf_counter()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2048, 2048).cuda(), device_ids=[rank])
torch.cuda.synchronize()
t4 = time.perf_counter()
if rank == 0:
    print(json.dumps({"cuda_s": t1 - t0, "process_group_s": t2 - t1, "first_collective_s": t3 - t2,
                      "ddp_s": t4 - t3}), flush=True)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, extra: dict[str, str]) -> dict:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, **extra, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for line in outs[0].splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(outs[0][-2000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--variants", default="default,NCCL_CUMEM_ENABLE=0,NCCL_RUNTIME_CONNECT=0")
    args = p.parse_args()
    for variant in args.variants.split(","):
        extra = {} if variant == "default" else dict([variant.split("=", 1)])
        for world in (int(w) for w in args.worlds.split(",")):
            got = [run(world, extra) for _ in range(args.repeats)]
            med = {k: statistics.median(g[k] for g in got) for k in got[0]}
            print(f"{variant:<28} world {world}: " + "  ".join(f"{k[:-2]}={v:.3f}" for k, v in med.items())
                  + f"  (s, median of {len(got)}; {time.strftime('%H:%M:%S')})", flush=True)


if __name__ == "__main__":
    main()
