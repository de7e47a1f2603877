"""What sharded snapshots of an FSDP2 model cost the training loop and its restore, against
the same script saving torch.distributed.checkpoint (DCP) itself under plain torchrun.

For a transformer of examples/train_fsdp.py's kind, sharded with `fully_shard` over
`--nproc` ranks (gloo on CPU, NCCL on GPUs), three runs of `--steps` steps each:

- `none`: no snapshots: the step time every other run is compared with;
- `ftrain`: the runtime (its local twin: a snapshot folder and its index), a sharded
  snapshot every `--every` steps (worker/tiers/sharded.py: each rank's shards by
  `dcp.async_save`, checksums, rank 0's commit once every rank's shards are whole);
- `memory`: the runtime with its memory tier alone, no disk snapshot (worker/tiers/sharded_memory.py:
  every rank's own shards in node-local shared memory), a copy at the interval the tier picks to
  stay within its budget, and `memory/N` a copy every N steps for each `--memory-every N`
  (1: every step, what an agent SIGKILL loses at most one step to); each rank as if on a
  node of its own (its own memory folder and `FTRAIN_NODE`), so that each keeps a replica of
  another's shards, as on a cluster; it also reports the copy's stall on the training thread
  and the exchange of replicas (medians);
- `dcp`: the script's own `dcp.async_save` every `--every` steps over a gloo group, waited
  for before the next (what a tuned script does under torchrun, with no checksum or commit);

each reporting its mean step time (the snapshot's cost as % of the step time against
`none`) and the training thread's stall per snapshot (median). Then a restart of each
(`ftrain`, `memory`, `dcp`) at the same world size, timed from a fresh model and optimizer
to the state loaded: ftrain's `rt.restore` from disk (the newest committed snapshot verified,
then DCP's load) and from memory (every rank's shards read and verified, then loaded in
place), against the script's own `get_state_dict` + `dcp.load` + `set_state_dict`.

    python bench/fsdp_restore.py                                  # CPU, small: a smoke figure
    python bench/fsdp_restore.py --nproc 2 --dim 2048 --depth 16 --heads 16 --every 10 \\
        --steps 60 --dir /mnt/shared/bench                         # two GPUs, ~0.8B parameters

Rank 0 of each run writes its figures as JSON; this script prints the table and writes
bench/fsdp_restore.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WARM_STEPS = 10  # steps not timed: warm-up, and the memory tier's first copy (`first_copy_stall_s`)


# ---------------------------------------------------------------------------- one rank's run

def _rank(args: argparse.Namespace) -> None:
    """One rank of a run under torchrun (`--role rank`)."""
    sys.path.insert(0, str(REPO))
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "examples"))
    from train_fsdp import TinyTransformer, shard, synthetic_tokens  # noqa: E402

    from ftrain import runtime  # noqa: E402

    began = time.perf_counter()
    torch.manual_seed(0)
    rt = None
    if args.mode in ("ftrain", "memory"):
        memory = _as_a_node(args.memory_dir) if args.mode == "memory" else None
        rt = runtime.init(snapshot_dir=args.dir, snapshot_keep=2,
                          # (the memory runs: the tier alone, its cost and its restore, no disk snapshot)
                          snapshot_every=args.every if args.mode == "ftrain" else args.steps + 1,
                          memory_dir=memory, memory_every=sum(args.memory_every) or None)
        device = rt.device
    else:
        use_cuda = torch.cuda.is_available()
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    with torch.device(device):  # (as examples/train_fsdp.py: built where it trains)
        net = TinyTransformer(args.vocab, args.length, args.dim, args.heads, args.depth)
    model = shard(net, device)
    params = sum(p.numel() for p in net.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = synthetic_tokens(max(args.batch, 64), args.length, args.vocab, 0)

    if args.profile and args.restore_only:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        restore_s = profile.runcall(_restore, args, rt, model, optimizer, began)
        with open(Path(args.profile, f"restore-{args.mode}-rank{rank}.txt"), "w") as f:
            for order in ("cumulative", "tottime"):
                pstats.Stats(profile, stream=f).sort_stats(order).print_stats(30)
    else:
        restore_s = _restore(args, rt, model, optimizer, began)
    if args.restore_only:
        _report(args, rank, {"restore_s": restore_s, "tier": rt.resumed_tier if rt is not None else "disk"})
        if rt is not None:
            rt.finish()
        return
    group = dist.new_group(backend="gloo") if args.mode == "dcp" else None
    pending = None
    times, stalls = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        batch = data[: args.batch].to(device)
        loss = torch.nn.functional.cross_entropy(model(batch[:, :-1]).reshape(-1, args.vocab),
                                                 batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss.item()  # the end of a step as a loop sees it
        s0 = time.perf_counter()
        if rt is not None:
            rt.step_done(loss=loss)
            if args.mode == "ftrain" and step % args.every == 0:
                stalls.append(rt.stalls_s[-1])
        elif args.mode == "dcp" and step % args.every == 0:
            pending = _own_dcp_save(args, model, optimizer, step, pending, group)
            stalls.append(time.perf_counter() - s0)
        times.append(time.perf_counter() - t0)
    if rt is not None:
        rt.finish()
    elif pending is not None:
        pending.result()
    # Past the first steps (warm-up; the memory tier's first copy, which sets up its buffers)
    warm_from = min(WARM_STEPS, len(times) - 1)
    warm = times[warm_from:]
    figures = {"params": params, "step_s": statistics.mean(warm),
               "stall_s": statistics.median(stalls) if stalls else 0.0, "snapshots": len(stalls)}
    if rt is not None and rt.memory is not None:
        figures.update(_memory_figures(rt.memory, warm_from=1))
    _report(args, rank, figures)


def _as_a_node(memory_dir: str) -> str:
    """Each rank as if on a node of its own (its own memory folder and node name), so that the
    memory tier keeps a replica of each rank's shards on another rank's node, as on a cluster."""
    rank = os.environ["RANK"]
    os.environ["FTRAIN_NODE"] = f"bench-node-{rank}"
    mine = Path(memory_dir, f"node-{rank}")
    mine.mkdir(exist_ok=True)
    return str(mine)


def _memory_figures(tier, warm_from: int) -> dict:
    """The memory tier's copies past the first few: the training thread's stall per copy, and
    the exchange of replicas (on the thread that does it, where the tier has one)."""
    def median(values: list) -> float:
        values = values[warm_from:]
        return statistics.median(values) if values else 0.0

    stalls = tier.writer.stalls_s if tier.writer is not None else []
    return {"copy_stall_s": median(stalls), "copies": len(stalls), "first_copy_stall_s": stalls[0] if stalls else 0.0,
            "replicate_s": median(getattr(tier, "replicate_s", []))}


def _own_dcp_save(args, model, optimizer, step: int, pending, group):
    """The script's own snapshot: wait for the previous one, then DCP's async save."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    if pending is not None:
        pending.result()
        if dist.get_rank() == 0:  # the newest whole checkpoint is kept, older ones removed (keep 2, as ftrain's)
            for old in sorted(Path(args.dir).glob("own-*"), key=lambda p: int(p.name.split("-")[1]))[:-1]:
                shutil.rmtree(old, ignore_errors=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return dcp.async_save({"model": model_sd, "optimizer": optim_sd},
                          checkpoint_id=os.path.join(args.dir, f"own-{step}"), process_group=group)


def _restore(args, rt, model, optimizer, began: float) -> float | None:
    """A restart's restore, timed: ftrain's `rt.restore`, or the script's own DCP load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    if not args.restore_only:
        if rt is not None:
            rt.restore(model=model, optimizer=optimizer)
        return None
    t0 = time.perf_counter()
    if rt is not None:
        rt.restore(model=model, optimizer=optimizer)
    else:
        newest = max(Path(args.dir).glob("own-*"), key=lambda p: int(p.name.split("-")[1]))
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.load({"model": model_sd, "optimizer": optim_sd}, checkpoint_id=str(newest))
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    return time.perf_counter() - t0


def _report(args, rank: int, figures: dict) -> None:
    if rank == 0:
        Path(args.result).write_text(json.dumps(figures))


# ---------------------------------------------------------------------------- the driver

def _run(args: argparse.Namespace, mode: str, directory: Path, restore_only: bool = False) -> dict:
    """One run under torchrun; `mode` `memory/N` is the memory tier with a copy every N steps."""
    mode, _, every = mode.partition("/")
    result = directory / f"result-{mode}{every}-{int(restore_only)}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}",
           "--master-port", str(args.port), __file__, "--role", "rank", "--mode", mode,
           "--dir", str(directory / mode), "--result", str(result), "--steps", str(args.steps),
           "--every", str(args.every), "--dim", str(args.dim), "--depth", str(args.depth),
           "--heads", str(args.heads), "--vocab", str(args.vocab), "--length", str(args.length),
           "--batch", str(args.batch), "--memory-dir", str(args.memory_dir),
           "--memory-every", *([every] if every else [])] + \
        (["--restore-only"] if restore_only else []) + (["--profile", args.profile] if args.profile else [])
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    began = time.monotonic()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode != 0:
        raise SystemExit(f"{mode} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    got = json.loads(result.read_text())
    print(f"  {mode}{'/' + every if every else ''} {'restore' if restore_only else 'run'} done in "
          f"{time.monotonic() - began:.0f} s: {got}", file=sys.stderr, flush=True)
    for line in done.stderr.splitlines() if restore_only else ():  # (the runtime's: where its restore went)
        if "restored in phases" in line:
            print(f"    {line.strip()}", file=sys.stderr, flush=True)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", default="driver", choices=["driver", "rank"])
    p.add_argument("--mode", default="none", choices=["none", "ftrain", "memory", "dcp"])
    p.add_argument("--nproc", type=int, default=2, help="ranks (GPUs on a GPU host)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--every", type=int, default=5, help="steps between snapshots")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--dir", help="snapshot folder (shared by the ranks); default: a temporary one")
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--memory-dir", help=argparse.SUPPRESS)
    p.add_argument("--memory-every", type=int, nargs="*", default=[], metavar="N",
                   help="also run the memory tier with a copy every N steps (beside the interval it picks)")
    p.add_argument("--restore-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--memory-only", action="store_true",
                   help="only the memory tier's run (beside one without snapshots) and its restore")
    p.add_argument("--disk-only", action="store_true",
                   help="only ftrain's sharded disk snapshots and their restore")
    p.add_argument("--profile", metavar="DIR",
                   help="profile each restore (cProfile, rank by rank) into DIR/restore-<run>-rank<r>.txt")
    p.add_argument("--port", type=int, default=29655)
    p.add_argument("--timeout-s", type=float, default=1800)
    p.add_argument("--out", default=str(REPO / "bench" / "fsdp_restore.json"))
    args = p.parse_args()
    if args.role == "rank":
        _rank(args)
        return

    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ftrain-fsdp-bench-"))
    directory.mkdir(parents=True, exist_ok=True)
    # The memory tier where a node agent puts it: a folder of this run's own in /dev/shm.
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    args.memory_dir = tempfile.mkdtemp(prefix="ftrain-fsdp-bench-memory-", dir=shm)
    try:
        if args.memory_only:
            none = _run(args, "none", directory)
            ran = _run(args, "memory", directory)
            got = _run(args, "memory", directory, restore_only=True)
            cost = 100 * (ran["step_s"] - none["step_s"]) / none["step_s"]
            print(f"memory tier alone: step {ran['step_s'] * 1e3:.1f} ms against {none['step_s'] * 1e3:.1f} ms "
                  f"without ({cost:+.1f}%), {ran['copies']} copies in {args.steps} steps; restore from memory "
                  f"{got['restore_s']:.3f} s ({got['tier']})")
            return
        if args.disk_only:
            ran = _run(args, "ftrain", directory)
            got = _run(args, "ftrain", directory, restore_only=True)
            print(f"ftrain's sharded disk snapshots: {ran['snapshots']} in {args.steps} steps, a stall of "
                  f"{ran['stall_s']:.1f} s each; restore from disk {got['restore_s']:.3f} s ({got['tier']})")
            return
        none = _run(args, "none", directory)
        modes = ["ftrain", *(f"memory/{n}" for n in args.memory_every if n > 0), "memory", "dcp"]
        runs = {mode: _run(args, mode, directory) for mode in modes}
        # (the memory tier holds the copies of the last memory run: the interval the tier picks)
        restored = {mode: _run(args, mode, directory, restore_only=True) for mode in ("ftrain", "memory", "dcp")}
    finally:
        shutil.rmtree(args.memory_dir, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(directory, ignore_errors=True)
    restores = {mode: got["restore_s"] for mode, got in restored.items()}
    if restored["memory"]["tier"] != "memory":
        raise SystemExit(f"the memory run restored from {restored['memory']['tier']}, not from memory")
    base = none["step_s"]
    rows = {mode: {**got, "cost_pct": 100 * (got["step_s"] - base) / base, "restore_s": restores.get(mode)}
            for mode, got in runs.items()}
    out = {"when": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
           "device": _device(), "nproc": args.nproc, "params": none["params"], "every": args.every,
           "steps": args.steps, "step_s_none": base, "runs": rows,
           "restore_from_memory_s": restores["memory"]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{none['params'] / 1e6:.1f}M parameters, {args.nproc} ranks on {out['device']}, a snapshot every "
          f"{args.every} steps; step without snapshots {base * 1e3:.1f} ms")
    print(f"{'run':<10} {'step ms':>9} {'cost %':>7} {'stall ms':>9} {'restore s':>10}")
    for mode, row in rows.items():
        restore = f"{row['restore_s']:>10.3f}" if row["restore_s"] is not None else f"{'-':>10}"
        print(f"{mode:<10} {row['step_s'] * 1e3:>9.1f} {row['cost_pct']:>7.1f} {row['stall_s'] * 1e3:>9.1f} {restore}")
    for mode, row in rows.items():
        if mode.startswith("memory"):
            print(f"{mode}: {row['copies']} copies in {args.steps} steps; the training thread's stall per copy "
                  f"{row['copy_stall_s'] * 1e3:.1f} ms, an exchange of replicas {row['replicate_s'] * 1e3:.1f} ms "
                  f"(medians)")
    print(f"restore from memory {restores['memory']:.3f} s, from disk {restores['ftrain']:.3f} s: "
          f"{restores['ftrain'] / restores['memory']:.1f}x faster")


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"CPU ({platform.processor() or platform.machine()})"


if __name__ == "__main__":
    main()
