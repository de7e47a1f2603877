"""Where the memory tier's copies cost the step time, and what the runtime believed they cost.

For the bench's MLP (bench/snapshot.py), the tier on and off in alternating blocks in one
loop, with the interval the runtime picks and with fixed intervals. For each it prints the
overhead by means and medians, the cost of one copy as the step times show it (the on
blocks' mean step over the off blocks', times the steps per copy) against the runtime's own
estimate when it picked the interval, and the on steps' excess over the off blocks' median
by their offset from the copy that started last (0: the step whose end starts the copy).

    python bench/copy_profile.py --size 10M --steps 1200 --every picked 8 16 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.snapshot import SIZES, memory_overhead, shm_dir  # noqa: E402


def profile(on: list[float], copied: list[bool], base: float, depth: int) -> list[float]:
    """Mean excess over `base` of the on steps by their offset after the last copy's start
    (the copy starts at the end of the step flagged in `copied`: offset 1 is the next step)."""
    by: dict[int, list[float]] = {}
    since = None
    for t, c in zip(on, copied):
        if c:  # (a copy's own step counts at offset 0 only, not also at the previous copy's offset)
            since = 0
        if since is not None:
            if since <= depth:
                by.setdefault(since, []).append(t - base)
            since += 1
    return [statistics.mean(by[k]) if k in by else float("nan") for k in range(depth + 1)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=list(SIZES), default="10M")
    p.add_argument("--steps", type=int, default=1200, help="steps with the tier on (as many off)")
    p.add_argument("--block", type=int, default=40)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--every", nargs="+", default=["picked"], help="'picked' or a fixed interval")
    p.add_argument("--last-words", choices=["on", "off"], default="on")
    p.add_argument("--depth", type=int, default=6, help="offsets shown after a copy's start")
    p.add_argument("--json", default=None, help="also write every step's time here")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    backend = None if torch.cuda.is_available() else "gloo"
    print(f"copy profile, {args.size}, {device}, torch {torch.__version__}, batch {args.batch}, "
          f"last words {args.last_words}; load {os.getloadavg()[0]:.2f}")
    print(f"{'every':>6} {'K':>3} | {'off ms':>6} {'mean':>6} {'median':>6} | {'copy ms seen':>12} "
          f"{'believed':>8} {'last':>6} | excess ms by offset 0..{args.depth}")
    runs = []
    for every in args.every:
        with shm_dir() as shm:
            a = memory_overhead(SIZES[args.size], 2 * args.steps, args.batch, shm, backend,
                                block=args.block, every=None if every == "picked" else int(every),
                                last_words=args.last_words == "on")
        off_mean, off_median = statistics.mean(a["off_s"]), statistics.median(a["off_s"])
        seen = (statistics.mean(a["on_s"]) - off_mean) * a["steps_per_copy"]
        b = a["believed"]
        believed = "-" if b["copy_cost_s"] is None else f"{b['copy_cost_s'] * 1e3:.2f}"
        prof = " ".join(f"{x * 1e3:6.2f}" for x in profile(a["on_s"], a["copied"], off_median, args.depth))
        print(f"{every:>6} {a['interval']:>3} | {off_median * 1e3:6.2f} {a['overhead'] * 100:5.1f}% "
              f"{a['median_overhead'] * 100:5.1f}% | {seen * 1e3:12.2f} {believed:>8} "
              f"{b['last_cost_s'] * 1e3:6.2f} | {prof}", flush=True)
        runs.append({"every": every, **{k: a[k] for k in (
            "on_s", "off_s", "copied", "interval", "block", "memory_stalls_s",
            "memory_commits_s", "memory_commits_cpu_s", "memory_copies_s", "believed", "mark_s", "marks")}})
    if args.json:
        Path(args.json).write_text(json.dumps(runs))
    print("copy ms seen = (mean on step - mean off step) x steps per copy; believed = the runtime's "
          "mean of what its last copies cost the steps beside them; last = the training thread's time "
          "in the last copy and its commit")


if __name__ == "__main__":
    main()
