"""What a restarted GPU worker pays before its first collective: CUDA's context, the process
group, NCCL's communicator (made at the first collective), and DDP's set-up, one process per
GPU, for world sizes 1 and 2, with the environment as it is and with NCCL knobs that are said
to change its start-up (each run a fresh group of fresh processes, as after a fault).
Two variants are not NCCL knobs: `eager` makes the communicator inside `init_process_group`
(`device_id`), and `prewarm` first makes (and ends) a communicator of one rank alone in the
process, the way a worker started ahead of its group could (`prewarm_s` is that cost, paid
before the group forms; the other phases are what is left after it).

    python bench/nccl_init.py [--repeats 2] [--variants default,NCCL_CUMEM_ENABLE=0,eager,prewarm]

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
torch.zeros(1, device="cuda")
t1 = time.perf_counter()
pre = 0.0
if os.environ.get("BENCH_PREWARM") == "1":
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", rank))
    dist.all_reduce(torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    dist.destroy_process_group()
    pre = time.perf_counter() - t1
    t1 = time.perf_counter()
eager = {"device_id": torch.device("cuda", rank)} if os.environ.get("BENCH_EAGER") == "1" else {}
dist.init_process_group("nccl", **eager)
t2 = time.perf_counter()
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
t3 = time.perf_counter()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2048, 2048).cuda(), device_ids=[rank])
torch.cuda.synchronize()
t4 = time.perf_counter()
got = {"cuda_s": t1 - t0 - pre, "prewarm_s": pre, "process_group_s": t2 - t1,
       "first_collective_s": t3 - t2, "ddp_s": t4 - t3}
if os.environ.get("BENCH_ALLREDUCE") == "1":  # what the knob costs the training: all-reduce times
    for mb in (1, 16, 256):
        x = torch.ones(mb * 2**18, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        got[f"allreduce_{mb}MB_ms"] = (time.perf_counter() - began) / 20 * 1e3
if rank == 0:
    print(json.dumps(got), flush=True)
dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, extra: dict[str, str], show: str = "") -> dict:
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = {**os.environ, **extra, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(subprocess.Popen([sys.executable, "-c", CHILD], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for line in outs[0].splitlines():
        if show and any(word in line for word in show.split("|")):
            print(f"    rank 0: {line}", flush=True)
    for line in outs[0].splitlines():
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(outs[0][-2000:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--variants", default="default,NCCL_CUMEM_ENABLE=0,NCCL_RUNTIME_CONNECT=0,eager,prewarm")
    p.add_argument("--allreduce", action="store_true",
                   help="also time all-reduces of 1, 16 and 256 MB (ms; the knobs' cost to training)")
    p.add_argument("--show", default="", help="print rank 0's output lines holding any of these "
                   "|-separated words (with NCCL_DEBUG=INFO: 'Init timings|version')")
    args = p.parse_args()
    for variant in args.variants.split(","):
        special = {"eager": {"BENCH_EAGER": "1"}, "prewarm": {"BENCH_PREWARM": "1"}}
        extra = special.get(variant) or ({} if variant == "default" else dict([variant.split("=", 1)]))
        extra = {**extra, **({"BENCH_ALLREDUCE": "1"} if args.allreduce else {})}
        for world in (int(w) for w in args.worlds.split(",")):
            got = [run(world, extra, args.show) for _ in range(args.repeats)]
            med = {k: statistics.median(g[k] for g in got) for k in got[0]}
            print(f"{variant:<28} world {world}: " + "  ".join(f"{k[:-2]}={v:.3f}" for k, v in med.items())
                  + f"  (s, median of {len(got)}; {time.strftime('%H:%M:%S')})", flush=True)


if __name__ == "__main__":
    main()
