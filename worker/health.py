"""A node's health checks: run by its agent when it registers and between jobs.

The built-in checks run in a child process (`python -m worker.health GPUS`), never in the
agent: the agent does not import torch, and a CUDA context in it would be inherited by
nothing good. They are the ones that catch a sick node before a job finds out the slow way:

- on a node with GPUs, that the devices it was given are visible, as many as it reports;
- a small matmul gives the known result (on each GPU, else on the CPU);
- memory can be allocated (64 MiB on each GPU, else on the CPU) and reads back;
- a collective self-test in a one-process group (NCCL on a GPU, gloo on the CPU).

Then the operator's own check (`ftrain node --health-check CMD`): a shell command, exit 0
is healthy; its output (the tail) is kept as the reason when it fails or times out.

A failed check quarantines the node at the control plane (docs/health.md).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from dataclasses import dataclass

from . import gpus
from .protocol import HEALTH_DETAIL_MAX_CHARS, HealthReport

log = logging.getLogger("ftrain.health")
BUILTIN_TIMEOUT_S = 120.0  # importing torch and a CUDA context on a loaded machine, with room
MEMORY_BYTES = 64 << 20


@dataclass(frozen=True)
class HealthChecks:
    """What a node checks (the built-in checks, the operator's command) and how often while idle."""

    builtin: bool = True
    command: str | None = None
    timeout_s: float = 60.0
    interval_s: float = 300.0  # an idle node checks again this often (after a job, at once)

    def run(self) -> HealthReport:
        """Run every check; the first that fails is the report's detail."""
        failed = (self.builtin and run_builtin(gpus.detect().count)) or (self.command and run_command(
            self.command, self.timeout_s))
        if failed:
            log.warning("health check failed: %s", failed)
            return HealthReport(ok=False, detail=_tail(failed))
        return HealthReport(ok=True)


def run_command(command: str, timeout_s: float) -> str | None:
    """The operator's check: None if `command` exits 0 within `timeout_s`, else why not."""
    try:
        done = subprocess.run(command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace").strip()
        return f"--health-check {command!r} did not finish within {timeout_s:g} s" + (f":\n{out}" if out else "")
    if done.returncode == 0:
        return None
    out = done.stdout.decode(errors="replace").strip()
    return f"--health-check {command!r} exited {done.returncode}" + (f":\n{out}" if out else "")


def run_builtin(gpus: int) -> str | None:
    """The built-in checks, in a child process: None if they pass, else why not."""
    try:
        done = subprocess.run([sys.executable, "-m", "worker.health", str(gpus)], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=BUILTIN_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"the built-in health checks did not finish within {BUILTIN_TIMEOUT_S:g} s"
    try:
        return json.loads(done.stdout.decode().strip().splitlines()[-1])["failed"]
    except (ValueError, IndexError, KeyError):
        err = done.stderr.decode(errors="replace").strip()
        return f"the built-in health checks exited {done.returncode}" + (f":\n{err}" if err else "")


def _tail(text: str) -> str:
    return text if len(text) <= HEALTH_DETAIL_MAX_CHARS else "…" + text[-(HEALTH_DETAIL_MAX_CHARS - 1):]


# ---------------------------------------------------------------- in the child process
def check_devices(torch, gpus: int) -> str | None:
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if seen < gpus:
        return f"devices: {gpus} GPU(s) given to this node, {seen} visible to CUDA"
    return None


def check_matmul(torch, device: str) -> str | None:
    """A 64x64 matmul of small integers: exact in float32, its sum known in closed form."""
    n = 64
    a = torch.arange(n * n, dtype=torch.float32, device=device).remainder(7).reshape(n, n)
    got = float((a @ torch.ones(n, n, device=device)).sum())
    want = float(sum(i % 7 for i in range(n * n)) * n)
    return None if got == want else f"matmul on {device}: sum {got:g}, expected {want:g}"


def check_memory(torch, device: str) -> str | None:
    try:
        block = torch.full((MEMORY_BYTES // 4,), 3, dtype=torch.int32, device=device)
    except RuntimeError as exc:
        return f"memory on {device}: could not allocate {MEMORY_BYTES >> 20} MiB: {exc}"
    total = int(block.sum())
    return None if total == 3 * (MEMORY_BYTES // 4) else f"memory on {device}: wrote 3s, read back a sum of {total}"


def check_collective(torch, device: str) -> str | None:
    """An all-reduce in a one-process group: the backend loads, and a collective completes."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    try:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30), device_id=None)
        t = torch.full((4,), 2.0, device=device)
        dist.all_reduce(t)
        ok = t.tolist() == [2.0] * 4
        dist.destroy_process_group()
    except Exception as exc:  # any failure of the backend is the finding
        return f"{backend} self-test on {device}: {type(exc).__name__}: {exc}"
    return None if ok else f"{backend} self-test on {device}: all_reduce gave {t.tolist()}"


def builtin(gpus: int) -> str | None:
    """Every built-in check on this process's devices; the first failure, or None."""
    import torch

    failed = check_devices(torch, gpus) if gpus else None
    devices = [f"cuda:{i}" for i in range(gpus)] if gpus else ["cpu"]
    for device in devices if failed is None else ():
        if device != "cpu":
            torch.cuda.set_device(device)
        failed = check_matmul(torch, device) or check_memory(torch, device) or (
            check_collective(torch, device) if device == devices[0] else None)
        if failed:
            break
    return failed


if __name__ == "__main__":  # python -m worker.health GPUS: one JSON line, {"failed": null | why}
    print(json.dumps({"failed": builtin(int(sys.argv[1]) if len(sys.argv) > 1 else 0)}), flush=True)
