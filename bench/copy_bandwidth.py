"""What a GPU-to-host copy of the memory tier's size costs (GPU only): bandwidth of one
copy into pageable memory, pinned memory, a /dev/shm file mapping as it is and once
registered with CUDA (the memory tier's slot), and device to device; plus how long importing
torch and a first CUDA operation take (a restarted worker pays both).

    python bench/copy_bandwidth.py
"""

import os
import time

t0 = time.perf_counter()
import torch  # noqa: E402

t1 = time.perf_counter()
torch.cuda.init()
torch.ones(1, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
print(f"import torch {t1 - t0:.3f} s, CUDA init + first op {t2 - t1:.3f} s", flush=True)


def bandwidth(src: torch.Tensor, dst: torch.Tensor, reps: int = 5) -> tuple[float, float]:
    """(GB/s, ms) of the median of `reps` non-blocking copies, after one warm-up."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    median = sorted(times)[reps // 2]
    return src.numel() / median / 1e9, median * 1e3


for mb in (113, 1200):
    n = mb << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    out = {"pageable": bandwidth(src, torch.empty(n, dtype=torch.uint8)),
           "pinned": bandwidth(src, torch.empty(n, dtype=torch.uint8, pin_memory=True))}
    path = f"/dev/shm/ftrain-copy-bandwidth-{os.getpid()}"
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, n)
    shm = torch.from_file(path, shared=True, size=n, dtype=torch.uint8)
    out["/dev/shm mapping"] = bandwidth(src, shm)
    start = time.perf_counter()
    rc = int(torch.cuda.cudart().cudaHostRegister(shm.data_ptr(), n, 1))
    took = time.perf_counter() - start
    out[f"/dev/shm mapping registered (rc {rc}, {took * 1e3:.0f} ms to register)"] = bandwidth(src, shm)
    torch.cuda.cudart().cudaHostUnregister(shm.data_ptr())
    del shm
    os.unlink(path)
    out["device to device"] = bandwidth(src, torch.empty_like(src))
    for name, (gbs, ms) in out.items():
        print(f"{mb:>5} MB  {name:<56} {gbs:7.1f} GB/s {ms:8.2f} ms", flush=True)
