"""What snapshots cost the training loop, and what the memory tier costs and saves.

For an MLP of about 10M and about 100M parameters (AdamW, so the state is ~3x the
weights), runs the runtime's loop with snapshots never, every 10 steps and every step,
and reports the mean step time of each, plus the stall each snapshot causes (median of
>= 5: the copy-off to host memory, done on the training thread) against a synchronous
`torch.save` of the same state to the same directory (what the tutorial's scripts do).

The memory tier (worker/memory.py): the same loop with a copy into /dev/shm every step
and no disk snapshots; its step time against "never" is the overhead per step; its
stall is what the training thread waits (the copy of the small state, and the optimizer
pre-hook's wait for the copy thread); its copy time is from `step_done` to the copy being
whole. Restore: from memory (read the node's copy, load it into a fresh model and
optimizer) against from disk (verify the checksum, `torch.load`, load; the file in the
page cache, which favours the disk). Replication: sending a copy to a rank that lacks it
(a rejoining node), one gloo broadcast of the packed bytes between two processes here.

    python bench/snapshot.py                  # both sizes, table + bench/snapshot.json
    python bench/snapshot.py --sizes 10M --dir /mnt/shared/tmp

It runs the runtime's local twin (one process, snapshots committed to a local index):
the control plane's commit is one small HTTP call in the background and is not on the
training path either way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from worker import memory as mem  # noqa: E402
from ftrain import runtime  # noqa: E402
from worker import snapshot as snap  # noqa: E402

SIZES = {"10M": 1536, "100M": 5000}  # width of a 4-layer square MLP: params ~ 4 * width^2


def sync(device: torch.device) -> None:
    """The end of a step as a training loop sees it (a `loss.item()`): the training stream's
    work done. Not `torch.cuda.synchronize()`, which also waits for the memory tier's copy on
    its side stream, a wait no loop has (that made the first GPU figures 511% / 1,628%)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def build(width: int, device: torch.device) -> torch.nn.Module:
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1]).to(device)


def run_mode(width: int, every: int | None, steps: int, batch: int, directory: Path,
             backend: str | None, memory_dir: Path | None = None) -> dict:
    """Train `steps` steps with snapshots every `every` steps (None: never), and a copy into
    the memory tier every step if `memory_dir` is given."""
    rt = runtime.init(env={}, backend=backend, snapshot_dir=directory if every else None,
                      snapshot_every=every, snapshot_keep=2, memory_dir=memory_dir,
                      memory_every=1 if memory_dir else 0)
    torch.manual_seed(0)
    model = rt.wrap(build(width, rt.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=rt.device)
    rt.restore(model=model, optimizer=opt)

    def step() -> None:
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rt.step_done(loss=loss, samples=batch)

    for _ in range(3):  # warm-up: optimizer state, allocator, first snapshot file
        step()
    rt.stalls_s.clear()
    rt.waits_s.clear()
    writer = rt.memory.writer if rt.memory is not None else None
    if writer is not None:
        writer.stalls_s.clear()
        writer.copies_s.clear()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync(rt.device)
        times.append(time.perf_counter() - start)
    drain_start = time.perf_counter()
    rt.finish()  # the last save in flight
    return {"every": every, "steps": steps, "step_s_mean": statistics.mean(times),
            "step_s_median": statistics.median(times), "drain_s": time.perf_counter() - drain_start,
            "stalls_s": rt.stalls_s, "waits_s": rt.waits_s,
            "copy_s": [s - w for s, w in zip(rt.stalls_s, rt.waits_s)],
            "params": sum(p.numel() for p in model.parameters()),
            "memory_stalls_s": writer.stalls_s if writer else [],
            "memory_copies_s": writer.copies_s if writer else [],
            "state": (model, opt)}


def memory_overhead(width: int, steps: int, batch: int, memory_dir: Path, backend: str | None,
                    block: int = 3, every: int | None = 1, path: str = "staged",
                    register: bool = True, graphs: bool = True, commit_inline: bool = True,
                    last_words: bool = True) -> dict:
    """One model and loop, the memory tier on and off in alternating blocks of `block` steps
    (so that a load that drifts over the run weighs on both alike); step times of each.
    `every`: the copy interval (None: the runtime picks it to fit its 5% budget). `path`,
    `register`: the writer's GPU path (MemoryWriter.device_path, .register_host)."""
    mem.MemoryWriter.device_path, mem.MemoryWriter.register_host = path, register
    mem.MemoryWriter.graphs = graphs
    mem.MemoryWriter.commit_inline = commit_inline
    rt = runtime.init(env={} if last_words else {"FTRAIN_LAST_WORDS": "0"}, backend=backend,
                      memory_dir=memory_dir, memory_every=every)
    torch.manual_seed(0)
    model = rt.wrap(build(width, rt.device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(batch, width, device=rt.device)
    rt.restore(model=model, optimizer=opt)
    writer = rt.memory.writer
    assert writer is not None

    copied: list[bool] = []  # per on step: a copy started at its end

    def step() -> float:
        start = time.perf_counter()
        before = len(writer.stalls_s)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        rt.step_done(loss=loss, samples=batch)
        sync(rt.device)
        took = time.perf_counter() - start
        if rt.memory is not None:
            copied.append(len(writer.stalls_s) > before)
        return took

    for _ in range(4):  # warm-up, a whole copy each: both slots mapped (and registered), staging made
        step()
        writer.wait(stall=False)
    copied.clear()  # (the warm-up's flags were once kept: every on step's flag was 4 steps off)
    writer.stalls_s.clear()
    writer.copies_s.clear()
    writer.commits_s.clear()
    writer.checksums_s.clear()
    writer.skipped = 0
    on: list[float] = []
    off: list[float] = []
    tier = rt.memory
    marks = rt.marks.on  # the step boundaries' marks, for last words: part of the tier's cost
    left = 0  # steps to the picked schedule's next copy when an on block ended
    for b in range(max(2, 2 * (steps // (2 * block)))):
        rt.memory = tier if b % 2 == 0 else None  # off: no RNG ring either (its cost counts)
        # (once rank 0 stopped the marks they stay off: turned on again, each on block's first
        # step paid a mark before the step's broadcast turned them off again)
        rt.marks.on = marks and b % 2 == 0 and not rt.marks.off
        # The runtime times its steps while the tier is on: an off block in between is not a
        # step (counted as one, it made the picked interval 4 where it is 14 on an H100).
        rt.schedule.last_step_t = None
        if b % 2 == 0 and b:  # the picked schedule resumes where it paused: the steps of the
            rt.schedule.next = rt.step + 1 + left  # off block must not make a copy due at once
        (on if b % 2 == 0 else off).extend(step() for _ in range(block))
        if b % 2 == 0:
            left = max(0, rt.schedule.next - rt.step - 1)
        writer.wait(stall=False)  # untimed: a copy in flight must not slow the next block's steps
    rt.memory, rt.marks.on = tier, marks
    # What the runtime believed a copy cost when it picked the interval (`CopySchedule.plan_next`).
    believed = {"copy_cost_s": rt.schedule.copy_cost_s, "last_cost_s": writer.last_cost_s(),
                "quiet_s": rt.schedule.quiet_s, "step_s": rt.schedule.step_s}
    rt.finish()
    mem.MemoryWriter.device_path, mem.MemoryWriter.register_host = "staged", True
    mem.MemoryWriter.graphs = True
    mem.MemoryWriter.commit_inline = True
    # The on steps that ended with no copy started, and the steps right after a copy (its
    # commit, its GPU work beside training): is the cost paid every step, or per copy?
    quiet = [t for t, c, p in zip(on, copied, [False] + copied) if not c and not p]
    mean = statistics.mean  # a copy every K steps (or skipped while one is in flight): the mean
    return {"on_s": on, "off_s": off, "memory_stalls_s": writer.stalls_s, "memory_copies_s": writer.copies_s,
            "interval": rt.memory_interval, "block": block, "overhead": mean(on) / mean(off) - 1,
            "copies": len(writer.copies_s), "skipped": writer.skipped, "host_copy": writer.host_copy,
            "memory_commits_s": writer.commits_s, "memory_checksums_s": writer.checksums_s,
            "memory_commits_cpu_s": writer.commits_cpu_s, "copied": copied,
            "quiet_overhead": statistics.median(quiet) / statistics.median(off) - 1 if quiet else None,
            "median_overhead": statistics.median(on) / statistics.median(off) - 1,
            "commit_inline": commit_inline,
            "plan": rt.memory.plan is not None, "graphed": writer.graphed,
            "marks": marks, "mark_s": statistics.median(rt.boundary_s) if rt.boundary_s else None,
            "path": path if rt.device.type == "cuda" else "cpu",
            "steps_per_copy": len(on) / max(1, len(writer.copies_s)), "believed": believed}


@contextlib.contextmanager
def shm_dir(prefix: str = "ftrain-bench-memory-") -> Iterator[Path]:
    """A fresh directory where the memory tier lives (/dev/shm where there is one), removed
    at the end."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=mem.SHM_ROOT if mem.SHM_ROOT.is_dir() else None))
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def restore_times(width: int, memory_dir: Path, disk_file: Path, repeats: int) -> dict:
    """Load the memory tier's copy, and the disk snapshot, into a fresh model and optimizer."""
    model = build(width, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    checksum = snap.file_checksum(disk_file)
    out: dict = {"memory_s": [], "disk_s": []}
    for _ in range(repeats):
        start = time.perf_counter()
        state = mem.load(memory_dir)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        out["memory_s"].append(time.perf_counter() - start)
        del state
        start = time.perf_counter()
        snap.verify(disk_file, checksum)
        state = snap.load(disk_file)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        out["disk_s"].append(time.perf_counter() - start)
        del state
    return out


def _replicate(rank: int, memory_dir: str, store_path: str, repeats: int, result: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    size = 0
    if rank == 0:
        skeleton, flat, packing = mem.read_copy(memory_dir)
        size = flat.numel()
    box = [size]
    dist.broadcast_object_list(box, src=0)
    if rank == 1:
        flat = torch.empty(box[0], dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.broadcast(flat, src=0)
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(result).write_text(json.dumps(times))
    dist.destroy_process_group()


def replication_times(memory_dir: Path, root: Path, repeats: int) -> list[float]:
    """Send the memory tier's packed bytes from one gloo process to another (loopback)."""
    import torch.multiprocessing as mp

    store, result = root / "replicate.store", root / "replicate.json"
    mp.spawn(_replicate, args=(str(memory_dir), str(store), repeats, str(result)), nprocs=2)
    return json.loads(result.read_text())


def sync_save(model: torch.nn.Module, opt: torch.optim.Optimizer, directory: Path,
              repeats: int) -> list[float]:
    """Time a plain synchronous torch.save of the same state (model + optimizer)."""
    out = []
    path = directory / "sync.pt"
    for _ in range(repeats):
        start = time.perf_counter()
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        out.append(time.perf_counter() - start)
    path.unlink(missing_ok=True)
    return out


def picked_only(args) -> None:
    """`--picked-only`: the memory tier's whole cost as a job gets it by default (the runtime
    picks the copy interval for its budget; the step boundaries' marks for last words on, or
    off with FTRAIN_LAST_WORDS=0), runs alternating, each its own on/off baseline."""
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    device = torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu"
    backend = "gloo" if args.device == "cpu" else None
    print(f"memory tier, interval picked by the runtime, torch {torch.__version__}, {device}, "
          f"{os.cpu_count()} cores, batch {args.batch}, AdamW; load {os.getloadavg()[0]:.2f}")
    print(f"{'model':>6} {'last words':>10} | {'step off ms':>11} {'overhead mean':>13} {'median':>7} | "
          f"{'interval':>8} {'copies':>6} {'mark ms':>7}")
    out = []
    for size in args.sizes:
        # Steps of 1.5-5 ms on an H100 wobble by more than the 5% measured: thousands of them
        # (240 for 10M gave 3.5-14.1% by means in three runs on one host).
        width, steps = SIZES[size], args.steps or (400 if size == "10M" else 100)
        for run in range(args.picked_only):
            for last_words in (True, False):
                with shm_dir() as shm:
                    a = memory_overhead(width, 8 * steps, args.batch, shm, backend,
                                        block=max(10, min(40, steps // 2)), every=None,
                                        last_words=last_words)
                mark = "-" if a["mark_s"] is None or not a["marks"] else f"{a['mark_s'] * 1e3:.3f}"
                print(f"{size:>6} {'on' if last_words else 'off':>10} | "
                      f"{statistics.median(a['off_s']) * 1e3:>11.2f} {a['overhead'] * 100:>12.1f}% "
                      f"{a['median_overhead'] * 100:>6.1f}% | {a['interval']:>8} {a['copies']:>6} {mark:>7}",
                      flush=True)
                out.append({"size": size, "run": run, "last_words": last_words,
                            **{k: a[k] for k in ("overhead", "median_overhead", "interval", "copies",
                                                 "mark_s", "on_s", "off_s")}})
    Path(args.json).write_text(json.dumps(out))
    print("overhead = mean (median) step time with the tier on / off - 1, alternating blocks in one "
          "loop; a step ends when the GPU's work is done; mark = the step boundary's mark (median)")
    print("pooled over the runs (every on step against every off step of them):")
    for size in args.sizes:
        for last_words in (True, False, None):
            rs = [r for r in out if r["size"] == size and last_words in (None, r["last_words"])]
            on = [t for r in rs for t in r["on_s"]]
            off = [t for r in rs for t in r["off_s"]]
            runs = [r["overhead"] * 100 for r in rs]
            name = "all" if last_words is None else "on" if last_words else "off"
            print(f"{size:>6} {name:>10} | {len(rs)} runs, {len(on)} steps on, {len(off)} off: "
                  f"mean {_pct(on, off, statistics.mean)}, median {_pct(on, off, statistics.median)}; "
                  f"runs' means {min(runs):.1f}% to {max(runs):.1f}%")


def _pct(on: list[float], off: list[float], how) -> str:
    return f"{(how(on) / how(off) - 1) * 100:.1f}%"


def main() -> None:
    p = argparse.ArgumentParser(description="snapshot stall and step time")
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=None, help="steps per mode (default by size)")
    p.add_argument("--dir", default=None, help="where snapshots go (default: a temp dir)")
    p.add_argument("--json", default=str(Path(__file__).with_suffix(".json")))
    p.add_argument("--device", choices=["auto", "cpu"], default="auto",
                   help="cpu: stay on the CPU even where CUDA is available")
    p.add_argument("--picked-only", type=int, metavar="RUNS", default=0,
                   help="only the memory tier with the interval the runtime picks, with the step "
                        "boundaries' marks (last words) and without, alternating, RUNS times each")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    if args.picked_only:
        picked_only(args)
        return

    results = []
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        for size in args.sizes:
            width = SIZES[size]
            steps = args.steps or (30 if size == "10M" else 12)
            row: dict = {"size": size, "width": width}
            for label, every in (("never", None), ("every_10", 10), ("every_1", 1)):
                d = root / f"{size}-{label}"
                got = run_mode(width, every, steps if every != 1 else max(6, steps // 2), args.batch, d,
                               "gloo" if args.device == "cpu" else None)
                model, opt = got.pop("state")
                row["params"] = got.pop("params")
                row[label] = got
                if label == "every_1":
                    row["sync_save_s"] = sync_save(model, opt, root, 5)
                    row["state_bytes"] = max(os.path.getsize(f) for f in d.glob("step-*.pt"))
                del model, opt
            shm = Path(tempfile.mkdtemp(prefix="ftrain-bench-memory-", dir=mem.SHM_ROOT
                                        if mem.SHM_ROOT.is_dir() else root))
            try:
                backend = "gloo" if args.device == "cpu" else None
                for name in ("every_1", "pinned", "pageable", "auto", "eager", "thread", "auto_thread"):
                    (shm / name).mkdir()
                n = 2 * steps
                if on_gpu:  # through a pinned buffer, and the first version's path
                    row["memory_pinned"] = memory_overhead(width, n, args.batch, shm / "pinned", backend,
                                                           register=False)
                    row["memory_pageable"] = memory_overhead(width, n, args.batch, shm / "pageable",
                                                             backend, path="pageable")
                    row["memory_eager"] = memory_overhead(width, n, args.batch, shm / "eager", backend,
                                                          graphs=False)
                    row["memory_thread_commit"] = memory_overhead(width, n, args.batch, shm / "thread",
                                                                  backend, commit_inline=False)
                    row["memory_auto_thread_commit"] = memory_overhead(
                        width, 8 * steps, args.batch, shm / "auto_thread", backend, block=max(10, steps // 2),
                        every=None, commit_inline=False)
                row["memory_every_1"] = memory_overhead(width, n, args.batch, shm / "every_1", backend)
                row["memory_auto"] = memory_overhead(width, 8 * steps, args.batch, shm / "auto", backend,
                                                     block=max(10, steps // 2), every=None)
                disk_file = max((root / f"{size}-every_10").glob("step-*.pt"))
                row["restore"] = restore_times(width, shm / "every_1", disk_file, 3)
                row["replicate_s"] = replication_times(shm / "every_1", root, 3)
            finally:
                shutil.rmtree(shm, ignore_errors=True)
            m = row["memory_every_1"]
            row["memory_overhead"] = m["overhead"]
            row["memory_stall_s_median"] = statistics.median(m["memory_stalls_s"])
            row["memory_copy_s_median"] = statistics.median(m["memory_copies_s"])
            row["restore_memory_s_median"] = statistics.median(row["restore"]["memory_s"])
            row["restore_disk_s_median"] = statistics.median(row["restore"]["disk_s"])
            row["replicate_s_median"] = statistics.median(row["replicate_s"])
            copies = row["every_1"]["copy_s"] + row["every_10"]["copy_s"]
            row["stall_s_median"] = statistics.median(copies)  # the copy-off: the stall proper
            row["stall_count"] = len(copies)
            row["stall_every_1_s_median"] = statistics.median(row["every_1"]["stalls_s"])
            row["sync_save_s_median"] = statistics.median(row["sync_save_s"])
            results.append(row)
            print(f"{size}: done", file=sys.stderr, flush=True)

    device = torch.cuda.get_device_name() if on_gpu else platform.processor() or "cpu"
    print(f"\nsnapshot cost, torch {torch.__version__}, {device}, {os.cpu_count()} cores, "
          f"batch {args.batch}, AdamW\n")
    head = (f"{'model':>6} {'params':>8} {'state MB':>8} | {'step ms: never':>14} {'every 10':>9} "
            f"{'every 1':>8} | {'stall ms (median, n)':>20} {'sync torch.save ms':>19} "
            f"{'stall every 1 ms':>17}")
    print(head)
    print("-" * len(head))
    for r in results:
        n = f"{r['stall_s_median'] * 1e3:.1f} (n={r['stall_count']})"
        print(f"{r['size']:>6} {r['params'] / 1e6:>7.1f}M {r['state_bytes'] / 1e6:>8.0f} | "
              f"{r['never']['step_s_mean'] * 1e3:>14.1f} {r['every_10']['step_s_mean'] * 1e3:>9.1f} "
              f"{r['every_1']['step_s_mean'] * 1e3:>8.1f} | {n:>20} {r['sync_save_s_median'] * 1e3:>19.1f} "
              f"{r['stall_every_1_s_median'] * 1e3:>17.1f}")
    print("\nstall = copy-off to host memory on the training thread (median over the snapshots of "
          "both modes);\nstall every 1 = the same plus waiting for the previous save, which is "
          "still being written\nwhen snapshots are taken every step (one save in flight).")
    print(f"\nmemory tier (a copy asked for every step, /dev/shm), {device}, batch {args.batch}\n")
    head = (f"{'model':>6} {'path':>28} | {'step ms: off':>12} {'memory on':>9} {'overhead':>8} | "
            f"{'stall ms':>8} {'copy ms':>8} {'sum ms':>7} {'commit ms':>9} {'steps/copy':>10}")
    print(head)
    print("-" * len(head))
    for r in results:
        for key in ("memory_every_1", "memory_thread_commit", "memory_eager", "memory_pinned",
                    "memory_pageable"):
            m = r.get(key)
            if m is None:
                continue
            name = m["path"] + (f" ({m['host_copy']}{', graphs' if m.get('graphed') else ''}"
                                f"{'' if m.get('commit_inline', True) else ', thread commits'})"
                                if m["path"] == "staged" else "")
            print(f"{r['size']:>6} {name:>28} | {statistics.mean(m['off_s']) * 1e3:>12.2f} "
                  f"{statistics.mean(m['on_s']) * 1e3:>9.2f} {m['overhead'] * 100:>7.1f}% | "
                  f"{statistics.median(m['memory_stalls_s']) * 1e3:>8.2f} "
                  f"{statistics.median(m['memory_copies_s']) * 1e3:>8.1f} "
                  f"{statistics.median(m['memory_checksums_s'] or [0]) * 1e3:>7.2f} "
                  f"{statistics.median(m['memory_commits_s'] or [0]) * 1e3:>9.2f} "
                  f"{m['steps_per_copy']:>10.1f}")
    print(f"\n{'model':>6} | {'restore ms: memory':>18} {'disk':>7} {'x':>5} | {'replicate ms':>12}")
    for r in results:
        print(f"{r['size']:>6} | {r['restore_memory_s_median'] * 1e3:>18.1f} "
              f"{r['restore_disk_s_median'] * 1e3:>7.1f} "
              f"{r['restore_disk_s_median'] / r['restore_memory_s_median']:>5.1f} | "
              f"{r['replicate_s_median'] * 1e3:>12.1f}")
    for r in results:
        for key in ("memory_auto", "memory_auto_thread_commit"):
            a = r.get(key)
            if a is None:
                continue
            quiet = a.get("quiet_overhead")
            how = "" if a["commit_inline"] else " (thread commits)"
            away = "-" if quiet is None else f"{quiet * 100:.1f}%"
            wall = statistics.median(a["memory_commits_s"] or [0]) * 1e3
            cpu = statistics.median(a["memory_commits_cpu_s"] or [0]) * 1e3
            print(f"{r['size']:>6} | interval picked for the 5% budget{how}: a copy every {a['interval']} "
                  f"step(s) at the end ({a['copies']} copies in {len(a['on_s'])} steps), overhead "
                  f"{a['overhead'] * 100:.1f}% (means), {a['median_overhead'] * 100:.1f}% (medians), "
                  f"steps away from copies {away} (medians); commit {wall:.2f} ms wall, {cpu:.2f} ms CPU; "
                  f"blocks of {a['block']} steps")
    print("\noverhead = mean step time with the memory tier (a copy asked for every step, each rank's RNG\n"
          "states kept at each copy step) / without either - 1\n"
          "(one loop, the tier on and off in alternating blocks of 3 steps; a step ends when the training\n"
          "stream's work is done); path: staged = GPU staging copy + one non-blocking copy into the\n"
          "slot (registered with CUDA, or through a pinned buffer), a copy still in flight skips the\n"
          "next (graphs: the side stream's work replayed from CUDA graphs);\n"
          "pageable = the first version (per-tensor copies into pageable memory, the optimizer\n"
          "waits for them); steps/copy = steps of the on blocks per whole copy; stall = the training "
          "thread's wait\n(median per copy); copy = step_done to the copy being whole; sum = the "
          "checksum's time on the\ncopy thread (on the GPU path: summed on the GPU); commit = the copy "
          "thread's work after the copy\nis in (GPU path: checksum, plan check, metadata; it holds "
          "the GIL at times); restore "
          "= into a fresh model and\noptimizer (disk: checksum + torch.load, from the page "
          "cache); replicate = one gloo broadcast\nof the copy's packed bytes to a second process "
          "(loopback).")
    meta = {"torch": torch.__version__, "device": device, "cpus": os.cpu_count(), "batch": args.batch}
    Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
