"""Straggler detection at its default settings: how soon a slow rank is flagged, and whether a
healthy job's ranks ever are, side by side on one cluster in one run.

    .venv/bin/python bench/stragglers.py [--minutes 10] [--slow-by 1.5] [--step-delay 0.25]
                                         [--out FILE]

One etcd, one control plane and four node agents (real processes). Two jobs of
examples/train.py (the ftrain runtime, gloo DDP on CPU), each on two nodes, with the job
spec's defaults for `straggler_window_s` and `straggler_factor`:
- the slow job: its rank 1 sleeps `--slow-by` times as long as the others per step;
- the healthy job: every rank at the same pace, the baseline: what the detector says of
  ranks that are not slow, under the same load.

Both run for `--minutes`. Figures: the slow job's time to its first flag (from its ranks'
first timing, and from its submission), the rank and factor flagged, and each job's ranks'
compute per step as the control plane last saw them; for the healthy job, the flags raised
over the whole run (0 is right).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    ControlPlane,
    EtcdProcess,
    NodeAgentProc,
    publish,
    stop_agents,
    wait_for,
)

POLL_S = 1.0


def spec(name: str, step_delay_s: float, *extra: str) -> dict:
    return {"name": name, "working_dir": str(REPO),
            "command": ["python", "examples/train.py", "--steps", "1000000", "--step-delay", str(step_delay_s),
                        "--width", "32", *extra],
            "nodes": {"min": 2, "max": 2}, "snapshot": {"every_steps": 25, "keep": 2},
            "env": {"OMP_NUM_THREADS": "1"}}


def flags(api: httpx.Client, job_id: str) -> list[dict]:
    """The job's straggler events, oldest first."""
    items = api.get(f"/v1/jobs/{job_id}/events").json()["items"]
    return [e for e in items if e["reason"].startswith("straggler")]


def per_step(job: dict) -> dict[int, float]:
    """Each rank's compute per step (ms), as the job's last stored report gives it."""
    ranks = (job.get("progress") or {}).get("ranks") or []
    return {r["rank"]: round(1000 * r["compute_s"] / r["steps"], 1) for r in ranks
            if r.get("steps") and r.get("compute_s") is not None}


def run(args, root: Path) -> dict:
    etcd = EtcdProcess(root / "etcd", log_path=root / "etcd.log")
    etcd.start()
    cp = ControlPlane(etcd.endpoint, root / "cp")
    agents: list[NodeAgentProc] = []
    try:
        cp.start()
        agents = [NodeAgentProc(cp, f"n{i}", root / f"n{i}", env={"CUDA_VISIBLE_DEVICES": ""}).start()
                  for i in range(4)]
        with cp.client("user") as api:
            wait_for(lambda: len(api.get("/v1/nodes").json()["items"]) == 4, 120, "4 nodes to register")
            slow = api.post("/v1/jobs", json=spec("slow", args.step_delay, "--slow-rank", "1",
                                                  "--slow-by", str(args.slow_by))).json()
            healthy = api.post("/v1/jobs", json=spec("healthy", args.step_delay)).json()
            return watch(api, slow, healthy, args.minutes * 60)
    finally:
        stop_agents(agents)
        cp.stop()
        etcd.stop()


def watch(api: httpx.Client, slow: dict, healthy: dict, seconds: float) -> dict:
    started = time.time()
    first_flag: dict | None = None
    while time.time() - started < seconds:
        s = api.get(f"/v1/jobs/{slow['id']}").json()
        if first_flag is None and s["stragglers"]:
            first_flag = {"job": s, "flag": s["stragglers"][0]}
        time.sleep(POLL_S)
    s, h = (api.get(f"/v1/jobs/{j['id']}").json() for j in (slow, healthy))
    out = {"seconds": round(time.time() - started), "slow_state": s["state"], "healthy_state": h["state"],
           "slow_ms_per_step": per_step(s), "healthy_ms_per_step": per_step(h),
           "healthy_flags": len(flags(api, h["id"])), "healthy_flagged_now": h["stragglers"],
           "healthy_timed_s": timed_s(h), "slow_timed_s": timed_s(s)}
    if first_flag is not None:
        flag, job = first_flag["flag"], first_flag["job"]
        out |= {"flag_rank": flag["rank"], "flag_factor": flag["factor"],
                "to_flag_from_timing_s": round(flag["since"] - job["progress"]["ranks_since"], 1),
                "to_flag_from_submit_s": round(flag["since"] - job["created_at"], 1)}
    for j in (slow, healthy):
        api.post(f"/v1/jobs/{j['id']}/cancel")
    return out


def timed_s(job: dict) -> float | None:
    p = job.get("progress") or {}
    return round(p["time"] - p["ranks_since"]) if p.get("ranks_since") and p.get("time") else None


def ranks(ms: dict[int, float]) -> str:
    return " / ".join(f"{ms[r]:.0f}" for r in sorted(ms)) or "-"


def report(f: dict, args) -> str:
    lines = [f"stragglers at the default window and factor: 2 jobs x 2 nodes, {args.minutes:g} min, "
             f"rank 1 of the slow job sleeps {args.slow_by:g}x per step ({args.step_delay:g} s a step)", "",
             f"{'figure':46} {'slow job':>14} {'healthy job':>14}",
             f"{'compute per step, rank 0 / rank 1 (ms)':46} {ranks(f['slow_ms_per_step']):>14} "
             f"{ranks(f['healthy_ms_per_step']):>14}",
             f"{'ranks timed for (s)':46} {str(f['slow_timed_s']):>14} {str(f['healthy_timed_s']):>14}",
             f"{'straggler flags raised':46} {'rank ' + str(f.get('flag_rank', '-')):>14} "
             f"{f['healthy_flags']:>14}",
             f"{'time to flag, from first timing (s)':46} {str(f.get('to_flag_from_timing_s', '-')):>14} {'-':>14}",
             f"{'time to flag, from submission (s)':46} {str(f.get('to_flag_from_submit_s', '-')):>14} {'-':>14}",
             f"{'factor flagged':46} {str(f.get('flag_factor', '-')):>14} {'-':>14}",
             f"states at the end: slow {f['slow_state']}, healthy {f['healthy_state']}"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--slow-by", type=float, default=1.5)
    p.add_argument("--step-delay", type=float, default=0.25)
    p.add_argument("--out", help="also write the table and the figures (JSON) here")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftrain-stragglers-") as tmp:
        figures = run(args, Path(tmp))
    publish(report(figures, args), figures, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
