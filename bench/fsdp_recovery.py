"""An FSDP2 job that loses a node, on ftrain: how long until it trains again, and how many
steps it lost.

    python bench/fsdp_recovery.py                                     # CPU (gloo), small
    python bench/fsdp_recovery.py --dim 2048 --depth 16 --heads 16 --length 512 \\
        --global-batch 16 --trials 2                                  # two GPUs, ~0.8B parameters

Per trial: a real etcd and control plane (shared by the trials), two fresh node agents (one
GPU each on a GPU host; on a host of one GPU they share it, NCCL told they are two hosts),
and examples/train_fsdp.py submitted as a job of 1 to 2 nodes with
the runtime: every rank's shards in its node's memory tier (on the tier's own schedule, or
every `--memory-every` steps) with a replica on the other node, and on disk every
`--every` steps. Once rank 0 has logged `--kill-at` steps at world size 2, the second
node's agent is SIGKILLed with its whole process tree (torchrun and the worker too); the
job goes on alone, its group of one restoring the two ranks' shards resharded.

Figures per trial, from rank 0's lines of the job's log (their read times on the agent):
- step time at world size 2 before the fault (median of the gaps between step lines);
- fault -> first step of the group that goes on (s): what the lost node cost in time;
- steps lost: the furthest step logged before the fault - the step the new group started
  from (0: nothing retrained);
- where the restore came from (memory or disk), and the runtime's own restore line.

Plain torchrun has no figure to stand beside these: with NCCL a survivor of an agent SIGKILL
waits in its collective and never trains again (docs/benchmarks.md, recovery on GPUs). The
restore's cost against the same script loading its own DCP checkpoint is
bench/fsdp_restore.py's.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    FROM_MEMORY,
    ControlPlane,
    EtcdProcess,
    NodeAgentProc,
    STEP_LINE,
    publish,
    rank0_lines,
    runs,
    stop_agents,
    wait_for,
)

TRAIN_FSDP = REPO / "examples" / "train_fsdp.py"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}


def _params(args: argparse.Namespace) -> int:
    """The model's parameters (built on the meta device: nothing allocated)."""
    import torch

    sys.path.insert(0, str(REPO / "examples"))
    from train_fsdp import TinyTransformer

    with torch.device("meta"):
        net = TinyTransformer(args.vocab, args.length, args.dim, args.heads, args.depth)
    return sum(p.numel() for p in net.parameters())


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _gpu_env(name: str, k: int, gpus: int) -> dict | None:
    """The k-th node's GPU. On a host of one GPU both nodes share it, and NCCL is told they are
    two hosts (`NCCL_HOSTID`: it refuses two ranks of one host on one GPU), so their traffic
    goes through its socket transport on loopback, as between two machines."""
    if not gpus:
        return None
    env = {"CUDA_VISIBLE_DEVICES": str(k % gpus)}
    if gpus < 2:
        env.update(NCCL_HOSTID=name, NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1")
    return env


def _spec(args: argparse.Namespace, trial: int) -> dict:
    command = ["python", str(TRAIN_FSDP), "--steps", str(args.steps), "--dim", str(args.dim),
               "--depth", str(args.depth), "--heads", str(args.heads), "--vocab", str(args.vocab),
               "--length", str(args.length), "--global-batch", str(args.global_batch),
               "--samples", str(max(args.samples, args.global_batch))]
    env = {"FTRAIN_MEMORY_EVERY": str(args.memory_every)} if args.memory_every else {}
    if os.environ.get("PYTHONPATH"):  # where this benchmark found its packages, the job finds them too
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return {"name": f"fsdp-recovery-{trial}", "command": command, "working_dir": str(REPO),
            "nodes": {"min": 1, "max": 2}, "nproc_per_node": 1, "max_restarts": 10,
            "snapshot": {"every_steps": args.every, "keep": 2}, "env": env}


def _step_times(lines: list[dict], until: float) -> list[float]:
    """Gaps between rank 0's consecutive step lines written before `until`."""
    marks = [(int(m.group(1)), item["time"]) for item in lines
             if item["time"] <= until and (m := STEP_LINE.match(item["line"]))]
    return [t1 - t0 for (s0, t0), (s1, t1) in zip(marks, marks[1:]) if s1 == s0 + 1]


def trial(stack: tuple, args: argparse.Namespace, i: int, root: Path, gpus: int) -> dict:
    cp, api = stack
    agents = [NodeAgentProc(cp, f"t{i}-n{k}", root / f"t{i}-n{k}", env=_gpu_env(f"t{i}-n{k}", k, gpus)).start()
              for k in range(2)]
    try:
        names = {a.name for a in agents}
        wait_for(lambda: names <= {n["name"] for n in api.get("/v1/nodes").json()["items"]}, 60,
                 "both agents registered")
        job_id = api.post("/v1/jobs", json=_spec(args, i)).raise_for_status().json()["id"]
        submitted_at = time.time()

        def at_kill_step() -> bool:
            got = runs(api, job_id)
            world = api.get(f"/v1/jobs/{job_id}").json()["world_size"]
            return world == 2 and bool(got) and bool(got[-1][1]) and got[-1][1][-1] >= args.kill_at

        try:
            wait_for(at_kill_step, args.start_deadline, f"step {args.kill_at} at world size 2")
        except AssertionError:
            _say_where_it_is(api, job_id, submitted_at)
            raise
        killed_at = time.time()
        agents[1].kill_tree()
        before = len(runs(api, job_id))
        try:
            wait_for(lambda: len(got := runs(api, job_id)) > before and got[-1][1], args.deadline,
                     "the group that goes on to log a step")
        except AssertionError:
            _say_where_it_is(api, job_id, killed_at)
            raise
        figures = _figures(api, job_id, killed_at, before)
        api.post(f"/v1/jobs/{job_id}/cancel")  # measured: the rest of its steps are not needed
        return figures
    finally:
        stop_agents(agents)


def _say_where_it_is(api, job_id: str, since: float) -> None:
    """The job's events and its log's lines since `since` (the fault: what the group that goes
    on did; the submission: how far the job got)."""
    for e in api.get(f"/v1/jobs/{job_id}/events").json()["items"]:
        if e["time"] >= since - 1:
            print(f"event +{e['time'] - since:.1f} s {e['state']}: {e.get('reason', '')}", file=sys.stderr)
    for item in rank0_lines(api, job_id):
        if item["time"] >= since:
            print(f"log +{item['time'] - since:.1f} s {item['line'][:300]}", file=sys.stderr)


def _figures(api, job_id: str, killed_at: float, runs_before: int) -> dict:
    lines = rank0_lines(api, job_id)
    got = runs(api, job_id)
    furthest = max(step for _, steps in got[:runs_before] for step in steps)
    start = got[runs_before][0]
    first_after = next(item["time"] for item in lines if item["time"] > killed_at
                       and (m := STEP_LINE.match(item["line"])) and int(m.group(1)) == got[runs_before][1][0])
    restored = [item["line"] for item in lines if item["time"] > killed_at
                and any(word in item["line"] for word in ("restored", "resumed", "joins them"))]
    return {"step_s": statistics.median(_step_times(lines, killed_at) or [0.0]),
            "time_s": round(first_after - killed_at, 3), "steps_lost": furthest - start,
            "resumed_from": start, "furthest": furthest,
            "tier": "memory" if any(FROM_MEMORY.search(item["line"]) for item in lines
                                    if item["time"] > killed_at) else "disk",
            "restore_lines": restored[-3:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--steps", type=int, default=200, help="the job's steps (it is cancelled once measured)")
    p.add_argument("--kill-at", type=int, default=20, help="rank 0's step at which the node is killed")
    p.add_argument("--every", type=int, default=50, help="steps between disk snapshots")
    p.add_argument("--memory-every", type=int, help="steps between memory copies (default: the tier's schedule)")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--samples", type=int, default=256, help="the synthetic dataset's sequences (made at "
                   "every start, so a restart pays for them: keep it small)")
    p.add_argument("--deadline", type=float, default=120, help="seconds the group that goes on may take")
    p.add_argument("--start-deadline", type=float, default=720,
                   help="seconds the job may take from its submission to the step it is killed at")
    p.add_argument("--out", help="also write the table and figures here")
    args = p.parse_args()

    # A SIGTERM (a `timeout`, a Ctrl-C's cousin) unwinds like an error: the agents, which run in
    # sessions of their own, are stopped by the `finally` blocks instead of training on.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    gpus = _gpus()
    root = Path(tempfile.mkdtemp(prefix="ftrain-bench-fsdp-recovery-"))
    etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log")
    etcd.start()
    cp = ControlPlane(etcd.endpoint, root / "cp").start()
    api = cp.client("user")
    try:
        rows = [trial((cp, api), args, i, root, gpus) for i in range(args.trials)]
    finally:
        api.close()
        cp.stop()
        etcd.kill()
    params = _params(args)
    publish(_table(args, rows, gpus, params), {"args": vars(args), "gpus": gpus, "params": params, "trials": rows},
            args.out)


def _table(args: argparse.Namespace, rows: list[dict], gpus: int, params: int) -> str:
    where = ("2 nodes sharing 1 GPU, NCCL over loopback sockets" if gpus == 1 else f"{gpus} GPU(s), NCCL"
             if gpus else "CPU, gloo")
    head = (f"FSDP2 job of 1 to 2 nodes ({where}; {params / 1e6:.1f}M parameters, "
            f"{args.global_batch}x{args.length} tokens a step), the second node's agent SIGKILLed "
            f"at step {args.kill_at}\n")
    cols = f"{'trial':>5} {'step (s)':>9} {'fault -> step (s)':>18} {'steps lost':>11} {'from':>7}\n"
    body = "".join(f"{i:>5} {r['step_s']:>9.3f} {r['time_s']:>18.3f} {r['steps_lost']:>11} {r['tier']:>7}\n"
                   for i, r in enumerate(rows))
    lines = "".join(f"  trial {i}: {line}\n" for i, r in enumerate(rows) for line in r["restore_lines"])
    return head + cols + body + lines


if __name__ == "__main__":
    main()
