"""The built-in health checks, run in a process of their own (`python -m worker.health_probe`):
worker/health.py starts it with a timeout, so a driver that hangs fails the check instead of
the agent, and the agent itself never imports torch. Prints one JSON line per check.

On a node with GPUs (the ones its agent was given: CUDA_VISIBLE_DEVICES, or every one
nvidia-smi lists) each check runs on the first; without, on the CPU:

- devices: torch sees as many GPUs as the node was given;
- matmul: a product whose result is known exactly (ones @ ones is the inner size everywhere);
- memory: a buffer of MEMORY_MIB can be allocated, written and read back;
- collective: a one-process group (NCCL on GPUs, gloo on CPU) all-reduces a tensor.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

from . import gpus

MATMUL_N = 256
MEMORY_MIB = 64


def _devices(torch, given: int) -> str | None:
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < given:
        return f"the node was given {given} GPU(s) but torch sees {seen}"
    return None


def _matmul(torch, device) -> str | None:
    ones = torch.ones(MATMUL_N, MATMUL_N, device=device)
    product = ones @ ones
    wrong = int((product != MATMUL_N).sum())
    return f"{wrong} of {MATMUL_N * MATMUL_N} elements of ones @ ones are not {MATMUL_N}" if wrong else None


def _memory(torch, device) -> str | None:
    n = MEMORY_MIB * (1 << 20) // 4
    buf = torch.empty(n, dtype=torch.int32, device=device)
    buf.copy_(torch.arange(n, dtype=torch.int32, device=device))
    if int(buf[-1]) != n - 1 or int(buf[n // 2]) != n // 2:
        return f"a {MEMORY_MIB} MiB buffer did not read back what was written"
    return None


def _collective(torch, device) -> str | None:
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        t = torch.arange(4, dtype=torch.float32, device=device)
        dist.all_reduce(t)
        if t.tolist() != [0.0, 1.0, 2.0, 3.0]:
            return f"a one-process {backend} all-reduce gave {t.tolist()}"
        return None
    finally:
        dist.destroy_process_group()


def main() -> int:
    given = gpus.detect().count
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - any failure to load torch is the finding
        print(json.dumps({"name": "devices", "ok": False, "detail": f"torch does not load: {exc}"}))
        return 1
    device = torch.device("cuda", 0) if given and torch.cuda.is_available() else torch.device("cpu")
    checks = [("devices", lambda: _devices(torch, given)), ("matmul", lambda: _matmul(torch, device)),
              ("memory", lambda: _memory(torch, device)), ("collective", lambda: _collective(torch, device))]
    failed = False
    for name, check in checks:
        try:
            problem = check()
        except Exception as exc:  # noqa: BLE001 - a check that raises has failed; say how
            problem = f"{type(exc).__name__}: {exc}"
        failed = failed or problem is not None
        print(json.dumps({"name": name, "ok": problem is None, "detail": problem or "ok"}), flush=True)
        if name == "devices" and problem is not None:
            break  # the rest would run on the wrong device
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
