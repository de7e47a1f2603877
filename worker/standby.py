"""What a standby worker does before it is needed: the per-process start-up costs of a GPU
worker, paid while the job trains instead of after a fault (worker/fork_server.py forks it).

A restarted GPU worker waits, after its group formed, for CUDA's context on its device and
for NCCL to load its kernels into the process when the first communicator is made: on two
H100s 0.2-0.3 s and 0.3-0.4 s (NCCL 2.28's "Init timings": kernels 0.32 of a 0.49 s
communicator at world 2; 0.06 s in all once a communicator of one rank was made first in the
process, bench/nccl_init.py). Neither depends on the group: a
process forked ahead of time makes both (and a communicator of itself alone, then ends it),
warms cuBLAS and the autograd engine up as the runtime's own warm-up does, and waits. The
next worker of its local rank is that process (the fork server hands it the request); the
script then finds its device ready (the environment it warmed up with must match the
request's where CUDA and NCCL read it: `worker/fork_server.py` `fingerprint`), and its first
communicator costs what only the group itself needs (the bootstrap with its peers, the
topology, the connections).

The price: a standby holds a CUDA context (about 0.5 GB) on its GPU beside the worker that
trains there. FTRAIN_WORKER_STANDBY=0 (a job knob) turns standbys off; "1" makes them even
where the node has no NVIDIA device (then they warm nothing up: the hand-over alone).
"""

from __future__ import annotations

import os
import time


def warm(local_rank: int) -> str:
    """Make CUDA's context on this local rank's GPU, load NCCL's kernels (a communicator of
    one rank, made and ended), and warm cuBLAS and autograd up; what was done, in words.
    Draws no random numbers; leaves no process group; the current device is left unset."""
    began = time.perf_counter()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or local_rank >= torch.cuda.device_count():
        return "no GPU for this local rank: nothing to warm up"
    device = torch.device("cuda", local_rank)
    with torch.cuda.device(device):  # the device is left as a fresh process has it (unset)
        torch.zeros(1, device=device)
        context_s = time.perf_counter() - began
        if dist.is_available() and dist.is_nccl_available():
            dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                    device_id=device)
            dist.all_reduce(torch.ones(1, device=device))
            torch.cuda.synchronize(device)
            dist.destroy_process_group()
        nccl_s = time.perf_counter() - began - context_s
        from . import runtime

        runtime._warm_cuda(device)
        torch.cuda.synchronize(device)
    return (f"CUDA's context on cuda:{local_rank} {context_s:.2f} s, NCCL's kernels {nccl_s:.2f} s, "
            f"in all {time.perf_counter() - began:.2f} s (pid {os.getpid()})")
