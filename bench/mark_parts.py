"""Where a GPU step mark's time goes (worker/step_marks.py `StepMarks.mark`, for a survivor's last
words): the runtime's parts timed inside a real training loop (a 4-layer MLP of width W,
AdamW, batch 32, the local twin with a memory tier copying every 1000 steps), marks on and off
in alternating blocks of 300 steps; medians and means per part.

    python bench/mark_parts.py [--width 1600]

Inside the loop the host is busy launching the step's kernels, and a part costs more than in
isolation (an event recorded without its stream cost 40 us there, 3 us with it).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.snapshot import build  # noqa: E402
from worker import memory as mem  # noqa: E402
from worker import rng, runtime  # noqa: E402
from worker.step_marks import EventPool, StepMarks  # noqa: E402
from worker.tiers.memory import MemoryTier  # noqa: E402

PARTS = [(rng, "rng_state", "rng_state"), (MemoryTier, "keep_rng", "save_rng"),
         (mem, "freeze", "freeze"), (mem.StatePlan, "state", "plan.state"),
         (EventPool, "record", "event"), (StepMarks, "_host_copies", "host_copies"),
         (StepMarks, "versions", "versions"), (StepMarks, "mark", "MARK"),
         (runtime.Runtime, "_agree_on_control", "agree"),
         (StepMarks, "count_optimizer_step", "opt_prehook"),
         (runtime.Runtime, "step_done", "STEP_DONE")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1600, help="1600: 10M parameters")
    args = ap.parse_args()
    acc: dict[str, list[float]] = collections.defaultdict(list)
    for owner, name, label in PARTS:
        f = getattr(owner, name)

        def timed(*a, _f=f, _label=label, **k):
            began = time.perf_counter()
            out = _f(*a, **k)
            acc[_label].append(time.perf_counter() - began)
            return out
        setattr(owner, name, timed)
    shm = "/dev/shm" if Path("/dev/shm").is_dir() else None
    directory = tempfile.mkdtemp(prefix="ftrain-bench-marks-", dir=shm)
    try:
        run(args.width, directory, acc)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run(width: int, directory: str, acc: dict[str, list[float]]) -> None:
    rt = runtime.init(env={}, memory_dir=directory, memory_every=1000)
    model = rt.wrap(build(width, rt.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rt.restore(model=model, optimizer=opt)
    x = torch.randn(32, width, device=rt.device)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rt.step_done(loss=loss, samples=32)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(30):
        step()
    where = torch.cuda.get_device_name() if rt.device.type == "cuda" else "CPU"
    print(f"step mark parts on {where}, width {width}")
    for on in (True, False, True, False):
        rt.marks.on = on
        acc.clear()
        took = []
        for _ in range(300):
            began = time.perf_counter()
            step()
            took.append(time.perf_counter() - began)
        print(f"marks {on}: step median {statistics.median(took) * 1e3:.3f} ms "
              f"mean {statistics.mean(took) * 1e3:.3f}", flush=True)
        for k, v in sorted(acc.items()):
            print(f"   {k:14s} n={len(v):4d} median {statistics.median(v) * 1e6:8.1f} us  "
                  f"mean {statistics.mean(v) * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
