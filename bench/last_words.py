"""What a survivor's last words cost (worker/last_words.py, worker/runtime.py), on CPU, or on
the GPU where there is one (there the marks also record CUDA events, and a step is timed to
the end of its GPU work):

* every step, on every rank: the step boundary's mark (`StepMarks.mark`, worker/step_marks.py: this rank's
  RNG states captured and kept in its ring in the node's tier; on the node's writer, the
  boundary noted with the state's skeleton pickled), measured per step, and the step time
  with the marks on against off, alternating blocks of steps in one process (a baseline in
  the same run);
* at a failure: the last-words copy itself (the state of the last step into the tier, whole
  and committed), which must fit in `runtime.LAST_WORDS_S`.

    python bench/last_words.py [--widths 512,1600,5000] [--steps 40] [--blocks 4]

The model: 4 linear layers of width W (4 W^2 parameters: 1M at 512, 10M at 1600, 100M at
5000), AdamW, a batch of 32, the local twin (one process) with a memory tier in /dev/shm
copying every 1000 steps (so that only the marks and the last words are measured).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from worker import memory as mem  # noqa: E402
from ftrain import runtime  # noqa: E402


def run(width: int, steps: int, blocks: int, directory: Path) -> dict:
    rt = runtime.init(env={}, memory_dir=directory, memory_every=1000)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = rt.wrap(torch.nn.Sequential(*layers[:-1]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
    sampler = rt.sampler(1 << 20, batch_size=32)
    rt.restore(model=model, optimizer=opt, scheduler=sched, sampler=sampler)
    params = sum(p.numel() for p in model.parameters())
    x = torch.randn(32, width, device=rt.device)
    batches = iter(sampler)
    gpu = rt.device.type == "cuda"

    def step() -> float:
        began = time.perf_counter()
        next(batches)
        opt.zero_grad(set_to_none=True)
        model(x + torch.randn(()) * 0).pow(2).mean().backward()
        opt.step()
        sched.step()
        rt.step_done()
        if gpu:  # a step ends when the GPU's work is done (in a job, step_done's broadcast waits)
            torch.cuda.synchronize()
        return time.perf_counter() - began

    for _ in range(3):
        step()
    on_steps: list[float] = []
    off_steps: list[float] = []
    marks: list[float] = []
    for block in range(2 * blocks):
        on = block % 2 == 0
        rt.marks.on = on
        rt.boundary_s.clear()
        took = [step() for _ in range(steps)]
        (on_steps if on else off_steps).extend(took)
        if on:
            marks.extend(rt.boundary_s)
    rt.marks.on = True
    w = rt.memory.writer
    assert w is not None
    for _ in range(2):  # both slots mapped, as a job's periodic copies leave them (untimed)
        step()
        rt.memory.save(rt._state, rt.step)
        w.wait(stall=False)
    # The last words, a few times: each after a step of its own (the tier then holds an older one).
    words: list[float] = []
    missed = 0
    for _ in range(3):
        step()
        w.wait(stall=False)
        began = time.perf_counter()
        made = rt.at_failure.last_words(runtime.LAST_WORDS_S)
        took = time.perf_counter() - began
        held = mem.read_held(directory)
        assert made == (held is not None and held.step == rt.step), (made, held)  # never a wrong step
        if made:
            words.append(took)
        else:
            missed += 1
            w.wait(stall=False)  # the copy the bound cut short (in a worker: ended by its exit)
    rt.finish()
    on_ms, off_ms = statistics.median(on_steps) * 1e3, statistics.median(off_steps) * 1e3
    return {"width": width, "params": params, "step_on_ms": on_ms, "step_off_ms": off_ms,
            "mark_ms": statistics.median(marks) * 1e3,
            "mark_p90_ms": sorted(marks)[int(0.9 * len(marks))] * 1e3,
            "last_words_ms": statistics.median(words) * 1e3 if words else None, "missed": missed}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="512,1600,5000")
    ap.add_argument("--steps", type=int, default=40, help="steps per block")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of each (marks on, off), alternating")
    args = ap.parse_args()
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"last words on {where} ({os.cpu_count()} cores, torch {torch.__version__}, 1 thread); load "
          f"{os.getloadavg()[0]:.2f}; {args.blocks} x {args.steps} steps with the marks on, alternating "
          f"with as many off")
    print(f"{'params':>8} {'step off ms':>12} {'step on ms':>11} {'mark ms':>8} {'mark p90':>9} "
          f"{'mark/step':>10} {'last words ms':>14}")
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    for width in (int(w) for w in args.widths.split(",")):
        directory = Path(tempfile.mkdtemp(prefix="ftrain-bench-lastwords-", dir=shm))
        try:
            r = run(width, args.steps, args.blocks, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        print(f"{r['params'] / 1e6:>7.1f}M {r['step_off_ms']:>12.2f} {r['step_on_ms']:>11.2f} "
              f"{r['mark_ms']:>8.3f} {r['mark_p90_ms']:>9.3f} {100 * r['mark_ms'] / r['step_off_ms']:>9.2f}% "
              + (f"{r['last_words_ms']:>14.1f}" if r["last_words_ms"] is not None else f"{'none':>14}")
              + (f"  ({r['missed']} of 3 not whole in time: the older copy kept)" if r["missed"] else ""),
              flush=True)
    print(f"load after {os.getloadavg()[0]:.2f}; a last-words copy must be whole within "
          f"runtime.LAST_WORDS_S = {runtime.LAST_WORDS_S:g} s (less the settling of a copy in flight)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
