"""The DDP job that bench/recovery.py runs under plain torchrun and under ftrain.

Gloo on CPU (or NCCL with `--device cuda`), an MLP (about 80k parameters at the default
width) on random batches. Two ways to keep
its place, picked by `--mode`:

* `tutorial` (the default): PyTorch's DDP fault-tolerance tutorial. Rank 0 saves
  `snapshot.pt` (model, optimizer, step) every `--snapshot-every` steps into the snapshot
  directory (`--snapshot-dir`, else FTRAIN_SNAPSHOT_DIR); every rank loads it on start.
  It runs the same under torchrun and under ftrain, so the two are compared on one script.
* `runtime`: the same loop through ftrain's runtime (`ftrain.runtime`), which snapshots
  every FTRAIN_SNAPSHOT_EVERY steps and snapshots at a step boundary when the control
  plane asks before a planned change (a join), so such a change loses no step; under an
  ftrain agent it also copies the state into the node's memory tier (worker/memory.py),
  so a worker or node SIGKILL loses at most a step or so. Its `step` lines carry the
  training thread's time in the memory tier (`mem_ms`) and the copy interval (`mem_every`), and on
  CPU the step boundary's mark (`mark_ms`: RNG states kept every step, for a last-words copy).

Every process appends JSON lines to `--log-file` (one write each, O_APPEND, so lines from
several processes do not interleave): `boot` when the interpreter starts (before `import
torch`), `pg` once the process group is formed, `resume` with the step it starts from,
and, from rank 0, `step` after every optimizer step. Each has a wall-clock time `t`, so
the benchmark reads recovery times off the log instead of timing with sleeps.
"""

import time

BOOT_T = time.time()

import argparse
import datetime
import json
import os
import sys


class EventLog:
    """Appends one JSON object per line to a file shared by every worker of a run."""

    def __init__(self, path: str | None):
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if path else None
        self.base = {"pid": os.getpid(), "rank": int(os.environ.get("RANK", "0")),
                     "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                     "attempt": int(os.environ.get("FTRAIN_ATTEMPT", "0"))}

    def write(self, ev: str, t: float | None = None, **fields) -> None:
        if self.fd is None:
            return
        record = {"ev": ev, "t": round(time.time() if t is None else t, 4), **self.base, **fields}
        os.write(self.fd, (json.dumps(record) + "\n").encode())


def build_model(torch, width: int):
    return torch.nn.Sequential(
        torch.nn.Linear(64, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1))


def run_tutorial(args, events: EventLog) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)  # before init_process_group, so NCCL binds this GPU
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    events.write("pg", world=world)
    torch.manual_seed(0)
    model = DDP(build_model(torch, args.width).to(device),
                device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    directory = args.snapshot_dir or os.environ.get("FTRAIN_SNAPSHOT_DIR") or "."
    path = os.path.join(directory, "snapshot.pt")
    step = 0
    if os.path.exists(path):
        snap = torch.load(path, weights_only=True, map_location=device)
        model.module.load_state_dict(snap["model"])
        opt.load_state_dict(snap["optimizer"])
        step = snap["step"]
    if rank == 0:
        events.write("resume", step=step, world=world)
    g = torch.Generator().manual_seed(rank * 100_003 + step)
    while step < args.steps:
        x = torch.randn(args.batch, 64, generator=g).to(device)
        loss = model(x).pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if rank == 0:
            events.write("step", step=step, world=world)
            if step % args.snapshot_every == 0:
                tmp = f"{path}.tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "step": step}, tmp)
                os.replace(tmp, path)
        time.sleep(args.step_time)
    dist.destroy_process_group()
    return 0


def run_runtime(args, events: EventLog) -> int:
    import torch

    from ftrain import runtime

    rt = runtime.init(timeout_s=args.pg_timeout, snapshot_dir=args.snapshot_dir,
                      snapshot_every=args.snapshot_every if args.snapshot_dir else None)
    events.write("pg", world=rt.world_size)
    torch.manual_seed(0)
    model = rt.wrap(build_model(torch, args.width))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = rt.restore(model=model, optimizer=opt)
    if rt.is_chief:  # with the runtime's start-up and restore phases (s), to see where the time goes
        events.write("resume", step=start, world=rt.world_size,
                     phases={k: round(v, 4) for k, v in rt.phases_s.items()})
    g = torch.Generator().manual_seed(rt.rank * 100_003 + start)
    memory = rt.memory.writer if rt.memory is not None else None  # the node's memory tier (worker/memory.py), on its first rank
    while rt.step < args.steps:
        waited = sum(memory.stalls_s) if memory else 0.0
        setup = sum(memory.setups_s) if memory else 0.0
        t0 = time.perf_counter()
        x = torch.randn(args.batch, 64, generator=g).to(rt.device)
        loss = model(x).pow(2).mean()
        t1 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        rt.step_done(loss=loss, samples=args.batch * rt.world_size)
        t4 = time.perf_counter()
        if rt.is_chief and rt.step == start + 1:  # the first step of a start: where its time goes
            parts = {"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2, "step_done": t4 - t3}
            extra_first = {"first_ms": {k: round(v * 1e3, 1) for k, v in parts.items()}}
        else:
            extra_first = {}
        if rt.is_chief:
            # The training thread's time in the memory tier this step (copy start, and the
            # optimizer's wait for the previous copy), and the copy interval in use.
            extra = {} if memory is None else {"mem_ms": round((sum(memory.stalls_s) - waited) * 1e3, 3),
                                               "mem_every": rt.memory_interval}
            if memory is not None and rt.boundary_s:  # CPU: this step's mark (RNG states, boundary)
                extra["mark_ms"] = round(rt.boundary_s[-1] * 1e3, 4)
            if memory is not None and sum(memory.setups_s) > setup:  # a slot mapped, registered...
                extra["mem_setup_ms"] = round((sum(memory.setups_s) - setup) * 1e3, 3)
            events.write("step", step=rt.step, world=rt.world_size, **extra, **extra_first)
        time.sleep(args.step_time)
    rt.finish()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("tutorial", "runtime"), default="tutorial")
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--step-time", type=float, default=0.05, help="sleep after each step (s)")
    ap.add_argument("--snapshot-every", type=int, default=10)
    ap.add_argument("--snapshot-dir", help="default: FTRAIN_SNAPSHOT_DIR, else the working directory")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--pg-timeout", type=float, default=30.0,
                    help="init_process_group timeout (s): gloo's 30 min default turns a lost peer "
                         "into a hang")
    ap.add_argument("--log-file", help="append JSON event lines here")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: NCCL, one GPU per process (tutorial mode; the runtime picks by itself)")
    args = ap.parse_args()
    events = EventLog(args.log_file)
    events.write("boot", t=BOOT_T)
    run = run_runtime if args.mode == "runtime" else run_tutorial
    return run(args, events)


if __name__ == "__main__":
    sys.exit(main())
