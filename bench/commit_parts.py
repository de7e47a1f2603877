"""Where a memory-tier copy's time on the training thread goes: the calls of the capture and of
the commit (`MemoryWriter._finish`) each wrapped with a timer, over the bench MLP's loop
(bench/snapshot.py; 10M parameters, a copy every 16 steps, no step marks).

    python3 bench/commit_parts.py        # on a GPU: the staged path the runtime takes there
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.snapshot import SIZES, memory_overhead, shm_dir  # noqa: E402
from worker import memory as mem  # noqa: E402
from worker import rng  # noqa: E402
from worker.memory_gpu import GpuStaging  # noqa: E402
from worker.tiers.memory import MemoryTier  # noqa: E402

took: dict[str, list[float]] = {}


def timed(label: str, f: Callable) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            took.setdefault(label, []).append(time.perf_counter() - start)
    return call


class _TimedOs:
    """`os` as worker/memory.py sees it, with `replace` timed (the real module left alone)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(os, name)

    replace = staticmethod(timed("os.replace", os.replace))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="10M")
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--every", type=int, default=16)
    args = p.parse_args()
    for name in ("_dump", "_write_json", "_sum64_small"):
        setattr(mem, name, timed(name, getattr(mem, name)))
    mem.os = _TimedOs()
    mem.open = timed("open", open)  # the slot's metadata file (a module global shadows the builtin)
    for cls, name in ((mem.StatePlan, "check"), (mem.MemoryWriter, "_finish"),
                      (mem.MemoryWriter, "capture_split"), (GpuStaging, "capture"),
                      (MemoryTier, "keep_rng")):
        setattr(cls, name, timed(name, getattr(cls, name)))
    rng.rng_state = timed("rng_state", rng.rng_state)
    with shm_dir("ftrain-bench-commit-") as shm:
        backend = None if torch.cuda.is_available() else "gloo"
        a = memory_overhead(SIZES[args.size], args.steps, 32, shm, backend, block=40, every=args.every,
                            last_words=False)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.size}, {device}, torch {torch.__version__}: {a['copies']} copies, a copy every "
          f"{args.every} steps; the parts on the training thread (microseconds)")
    for name, times in sorted(took.items(), key=lambda kv: -statistics.median(kv[1]) * len(kv[1])):
        print(f"{name:>18} n={len(times):5d} median {statistics.median(times) * 1e6:8.1f}  "
              f"mean {statistics.mean(times) * 1e6:8.1f}")


if __name__ == "__main__":
    main()
