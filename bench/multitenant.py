"""Many teams on one small cluster: ftrain's scheduler (priority, fair share, preemption)
against first come, first served, on one trace in one run.

    .venv/bin/python bench/multitenant.py [--nodes 4] [--jobs 30] [--minutes 10] [--seed 1]
                                          [--parallel] [--only ARM] [--out FILE]
                                          [--records FILE]

Each arm starts its own etcd, control plane and `--nodes` node agents (real processes; the
workers do gloo DDP steps), makes three users in two teams, and submits the same trace as
those users, each job at its arrival time: a seeded mix of priorities (0, 5, 10), sizes
(1 to 4 nodes, fixed and elastic), runtime jobs (examples/train.py) and plain scripts
(examples/plain_ddp.py, which save every epoch). The FIFO arm is the same control plane
with `FTRAIN_QUEUE_POLICY=fifo`: one queue in submission order, no priority, fair share or
preemption. `--parallel` runs both arms at once (a host with cores to spare); by default
they run one after the other.

Figures, per arm and as ftrain / FIFO:
- utilization: node-seconds held by a job over node-seconds available, from the first
  submission to the last job's end (the agents' nodes sampled twice a second);
- the wait for nodes of the priority-10 jobs (submission to leaving PENDING), p50 and p95;
- steps lost by runtime jobs (a run that starts before the step the last one reached) and
  epochs lost by plain scripts, over every restart, preemption and resize;
- Jain's fairness index of the node-seconds each user's priority-0 jobs held, counted only
  while every user had a priority-0 job unfinished (1.0: equal shares), and the same of the
  two teams' (where users get alike, the team of two holds twice the other: about 0.9);
- the trace's makespan.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import (  # noqa: E402
    ControlPlane,
    EtcdProcess,
    NodeAgentProc,
    publish,
    rank0_lines,
    stop_agents,
    wait_for,
)

USERS = {"ana": "vision", "ben": "vision", "chloe": "language"}
SHAPES = ((1, 1), (1, 2), (2, 2), (1, 4), (2, 4))  # (min, max) nodes
STEP_DELAY_S = 0.2
EPOCH_DELAY_S = 2.0
SAMPLE_EVERY_S = 0.5
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}

RUN_START = re.compile(r"^start step=(\d+)")
STEP = re.compile(r"^step=(\d+)\b")
RESUMED_EPOCH = re.compile(r"Resuming training from snapshot at Epoch (\d+)")
EPOCH = re.compile(r"^epoch=(\d+)\b")


@dataclass
class Arrival:
    at_s: float  # after the trace's start
    user: str
    priority: int
    spec: dict


def trace(jobs: int, minutes: float, seed: int) -> list[Arrival]:
    """The jobs, their users and arrival times: every user gets the same number of
    priority-0 jobs (so that an equal share is the fair one), arrivals spread over the first
    60% of the window, each job 20 to 90 s of work in a 10-minute trace (scaled with it)."""
    rng = random.Random(seed)
    users = list(USERS)
    out = []
    turns: dict[int, int] = {}  # priority -> jobs of it so far: users take turns within each
    # 10% of priority 10 (at least one), 20% of priority 5, the rest 0, in a seeded order
    high, mid = max(1, round(jobs / 10)), round(jobs / 5)
    priorities = [10] * high + [5] * mid + [0] * (jobs - high - mid)
    rng.shuffle(priorities)
    for i, priority in enumerate(priorities):
        turns[priority] = turns.get(priority, 0) + 1
        user = users[turns[priority] % len(users)]
        lo, hi = rng.choice(SHAPES)
        seconds = rng.uniform(20, 90) * minutes / 10  # ~ the capacity of 4 nodes over the window
        plain = rng.random() < 0.3
        name = f"{'plain' if plain else 'rt'}-{i:02d}-p{priority}"
        if plain:
            epochs = max(3, round(seconds / EPOCH_DELAY_S))
            command = ["python", "examples/plain_ddp.py", "--epochs", str(epochs), "--save-every", "1",
                       "--step-delay", str(EPOCH_DELAY_S)]
        else:
            steps = max(20, round(seconds / STEP_DELAY_S))
            command = ["python", "examples/train.py", "--steps", str(steps), "--step-delay", str(STEP_DELAY_S)]
        spec = {"name": name, "command": command, "working_dir": str(REPO),
                "nodes": {"min": lo, "max": hi}, "max_restarts": 3, "priority": priority,
                "snapshot": {"every_steps": 10, "keep": 2}, "env": {"OMP_NUM_THREADS": "1"}}
        out.append(Arrival(rng.uniform(0, 0.6 * minutes * 60), user, priority, spec))
    out.sort(key=lambda a: a.at_s)
    for a in out[1:]:  # the first job comes at once
        a.at_s -= out[0].at_s
    out[0].at_s = 0.0
    return out


@dataclass
class Arm:
    """One cluster running the whole trace under one queue policy."""
    name: str
    policy: str
    nodes: int
    root: Path
    submitted: dict[str, Arrival] = field(default_factory=dict)  # job id -> its arrival
    samples: list[tuple[float, dict[str, str | None]]] = field(default_factory=list)  # node -> job
    owners: dict[str, str] = field(default_factory=dict)
    unfinished: list[tuple[float, set[str]]] = field(default_factory=list)  # users with a p0 job open
    jobs: dict[str, dict] = field(default_factory=dict)
    started_at: float = 0.0
    ended_at: float = 0.0

    def run(self, arrivals: list[Arrival]) -> None:
        etcd = EtcdProcess(self.root / "etcd", log_path=self.root / "etcd.log")
        etcd.start()
        cp = ControlPlane(etcd.endpoint, self.root / "cp", env={"FTRAIN_QUEUE_POLICY": self.policy})
        agents: list[NodeAgentProc] = []
        try:
            cp.start()
            # The trace's workers train on CPU (gloo): on a GPU host the ranks of the 4 nodes
            # (8, arms side by side) would share its GPUs, which NCCL refuses.
            agents = [NodeAgentProc(cp, f"n{i}", self.root / f"n{i}", env={"CUDA_VISIBLE_DEVICES": ""}).start()
                      for i in range(self.nodes)]
            with cp.client("user") as admin:
                wait_for(lambda: len(admin.get("/v1/nodes").json()["items"]) == self.nodes, 120,
                         f"{self.nodes} nodes to register")
                tokens = {u: self._add_user(admin, u, team) for u, team in USERS.items()}
                self._drive(cp, admin, tokens, arrivals)
        finally:
            stop_agents(agents)
            cp.stop()
            etcd.stop()

    @staticmethod
    def _add_user(admin: httpx.Client, name: str, team: str) -> str:
        resp = admin.post("/v1/users", json={"name": name, "team": team})
        resp.raise_for_status()
        return resp.json()["token"]

    def _drive(self, cp: ControlPlane, admin: httpx.Client, tokens: dict[str, str],
               arrivals: list[Arrival]) -> None:
        clients = {u: httpx.Client(base_url=cp.url, timeout=30, headers={"Authorization": f"Bearer {t}"})
                   for u, t in tokens.items()}
        self.started_at = time.time()
        pending = list(arrivals)
        try:
            while True:
                now = time.time() - self.started_at
                while pending and pending[0].at_s <= now:
                    a = pending.pop(0)
                    resp = clients[a.user].post("/v1/jobs", json=a.spec)
                    resp.raise_for_status()
                    self.submitted[resp.json()["id"]] = a
                    self.owners[resp.json()["id"]] = a.user
                if not self._sample(admin) and not pending:
                    break
                time.sleep(SAMPLE_EVERY_S)
            self.ended_at = time.time()
            for job_id in self.submitted:
                self.jobs[job_id] = admin.get(f"/v1/jobs/{job_id}").json()
                self.jobs[job_id]["events"] = admin.get(f"/v1/jobs/{job_id}/events").json()["items"]
                self.jobs[job_id]["rank0"] = [i["line"] for i in rank0_lines(admin, job_id)]
        finally:
            for c in clients.values():
                c.close()

    def _sample(self, admin: httpx.Client) -> int:
        """Note which job holds each node and which users have a priority-0 job unfinished;
        returns how many submitted jobs are unfinished."""
        t = time.time()
        nodes = {n["name"]: n.get("job") for n in admin.get("/v1/nodes").json()["items"]}
        states = {j["id"]: j["state"] for j in admin.get("/v1/jobs", params={"limit": 1000}).json()["items"]}
        open_jobs = [j for j in self.submitted if states.get(j) not in TERMINAL]
        self.samples.append((t, nodes))
        self.unfinished.append((t, {self.owners[j] for j in open_jobs if self.submitted[j].priority == 0}))
        return len(open_jobs)

    def records(self) -> dict:
        return {"started_at": self.started_at, "ended_at": self.ended_at, "samples": self.samples,
                "unfinished": [(t, sorted(users)) for t, users in self.unfinished],
                "jobs": {job_id: {**j, "user": self.owners[job_id], "at_s": self.submitted[job_id].at_s}
                         for job_id, j in self.jobs.items()}}

    # --- figures ---

    def figures(self) -> dict:
        return {"utilization": self.utilization(), **self.high_priority_wait(), **self.lost(),
                **self.restarts(),
                "jain_p0": self.jain(), "jain_p0_teams": self.jain(USERS.get), "p0_node_s": self.p0_node_s(),
                "makespan_s": round(self.ended_at - self.started_at, 1),
                "failed": sorted(f"{j['spec']['name']}: {j['state']} ({j['reason']})"
                                 for j in self.jobs.values() if j["state"] != "SUCCEEDED")}

    def _intervals(self):
        for (t, nodes), (t_next, _) in zip(self.samples, self.samples[1:]):
            yield t_next - t, nodes

    def utilization(self) -> float:
        busy = sum(dt * sum(1 for j in nodes.values() if j) for dt, nodes in self._intervals())
        available = sum(dt * self.nodes for dt, _ in self._intervals())
        return round(busy / available, 4) if available else 0.0

    def high_priority_wait(self) -> dict:
        waits = []
        for job_id, j in self.jobs.items():
            if self.submitted[job_id].priority < 10:
                continue
            left = next((e["time"] for e in j["events"] if e["state"] != "PENDING"), None)
            if left is not None:
                waits.append(left - j["created_at"])
        if not waits:
            return {"p10_wait_p50_s": None, "p10_wait_p95_s": None, "p10_jobs": 0}
        waits.sort()
        p95 = waits[min(len(waits) - 1, round(0.95 * (len(waits) - 1)))]
        return {"p10_wait_p50_s": round(statistics.median(waits), 2), "p10_wait_p95_s": round(p95, 2),
                "p10_jobs": len(waits)}

    def restarts(self) -> dict:
        """The trace's restarts by cause, added up over its jobs (what each arm paid in
        stopped and restarted groups)."""
        total: dict[str, int] = {}
        for j in self.jobs.values():
            for cause, n in (j.get("restarts_by_cause") or {}).items():
                total[cause] = total.get(cause, 0) + n
        return {f"restarts_{cause}": n for cause, n in sorted(total.items())}

    def lost(self) -> dict:
        steps = epochs = 0
        for j in self.jobs.values():
            if j["spec"]["command"][1].endswith("plain_ddp.py"):
                epochs += replayed(j["rank0"], RESUMED_EPOCH, EPOCH, first=0)
            else:
                steps += replayed(j["rank0"], RUN_START, STEP)
        return {"runtime_steps_lost": steps, "plain_epochs_lost": epochs}

    def p0_node_s(self, by=lambda user: user) -> dict[str, float]:
        """The node-seconds each user's priority-0 jobs held while every user had one
        unfinished; `by`: whose share a user's node-seconds add to (its team's, say)."""
        share = dict.fromkeys(map(by, USERS), 0.0)
        opened = dict(self.unfinished)
        for (t, nodes), (t_next, _) in zip(self.samples, self.samples[1:]):
            if opened.get(t) != set(USERS):
                continue
            for job_id in nodes.values():
                if job_id and job_id in self.submitted and self.submitted[job_id].priority == 0:
                    share[by(self.owners[job_id])] += t_next - t
        return {who: round(x, 1) for who, x in share.items()}

    def jain(self, by=lambda user: user) -> float | None:
        """Jain's index of `p0_node_s` (1.0: equal shares)."""
        xs = list(self.p0_node_s(by).values())
        if not any(xs):
            return None
        return round(sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)), 4)


def replayed(lines: list[str], start: re.Pattern, progress: re.Pattern, first: int = 1) -> int:
    """Units of work done twice: a run that starts from S (its start marker; without one,
    the unit before its first) after an earlier run reached L > S redoes L - S. `first`:
    the number of the first unit (the runtime's steps count from 1, the script's epochs
    from 0); a marker S says S units are done."""
    lost, reached, last, marker = 0, 0, 0, None
    for line in lines:
        if m := start.search(line):
            marker = int(m.group(1))
            continue
        if not (m := progress.match(line)):
            continue
        n = int(m.group(1)) + 1 - first  # units done once this one is
        if marker is not None or n != last + 1:  # a new run
            begin = marker if marker is not None else n - 1
            lost += max(0, reached - begin)
            marker = None
        last, reached = n, max(reached, n)
    return lost


def ratio(a, b) -> str:
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def report(figures: dict[str, dict], args) -> str:
    rows = [("utilization (busy / available node-s)", "utilization"),
            ("priority-10 wait for nodes p50 (s)", "p10_wait_p50_s"),
            ("priority-10 wait for nodes p95 (s)", "p10_wait_p95_s"),
            ("runtime steps lost", "runtime_steps_lost"),
            ("plain-script epochs lost", "plain_epochs_lost"),
            ("Jain's index, priority-0 node-s per user", "jain_p0"),
            ("  the same per team (2 users / 1 user)", "jain_p0_teams"),
            ("makespan (s)", "makespan_s")]
    f, o = figures["fifo"], figures["ftrain"]
    lines = [f"multitenant trace: {args.jobs} jobs, {len(USERS)} users in {len(set(USERS.values()))} teams, "
             f"{args.nodes} nodes, ~{args.minutes:g} min, seed {args.seed}, "
             f"{'arms side by side' if args.parallel else 'arms one after the other'}", "",
             f"{'figure':44} {'FIFO':>10} {'ftrain':>10} {'ftrain/FIFO':>12}"]
    for label, key in rows:
        lines.append(f"{label:44} {str(f[key]):>10} {str(o[key]):>10} {ratio(o[key], f[key]):>12}")
    for key in sorted(k for k in {**f, **o} if k.startswith("restarts_")):
        label = "restarts: " + key.removeprefix("restarts_").replace("_", " ")
        lines.append(f"{label:44} {f.get(key, 0):>10} {o.get(key, 0):>10}")
    lines.append(f"{'priority-10 jobs':44} {f['p10_jobs']:>10} {o['p10_jobs']:>10}")
    for user in USERS:
        lines.append(f"{'priority-0 node-s of ' + user:44} {f['p0_node_s'][user]:>10} {o['p0_node_s'][user]:>10}")
    lines.append(f"jobs not SUCCEEDED: FIFO {f['failed'] or 'none'}, ftrain {o['failed'] or 'none'}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--jobs", type=int, default=30)
    p.add_argument("--minutes", type=float, default=10.0, help="the trace's length (job sizes scale with it)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--parallel", action="store_true", help="run both arms at once")
    p.add_argument("--only", choices=["fifo", "ftrain"], help="run one arm and print its figures (no table)")
    p.add_argument("--out", help="also write the table and the figures (JSON) here")
    p.add_argument("--records", help="write each arm's raw records here (JSON: the node samples, every "
                   "job with its events and rank 0's lines), to see where its node-seconds went")
    args = p.parse_args()
    arrivals = trace(args.jobs, args.minutes, args.seed)
    with tempfile.TemporaryDirectory(prefix="ftrain-multitenant-") as tmp:
        arms = [Arm("fifo", "fifo", args.nodes, Path(tmp) / "fifo"),
                Arm("ftrain", "priority", args.nodes, Path(tmp) / "ftrain")]
        arms = [a for a in arms if args.only in (None, a.name)]
        if args.parallel:
            threads = [threading.Thread(target=a.run, args=(arrivals,)) for a in arms]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            for a in arms:
                a.run(arrivals)
        figures = {a.name: a.figures() for a in arms}
    if args.records:
        Path(args.records).write_text(json.dumps({a.name: a.records() for a in arms}))
    publish(report(figures, args) if not args.only else json.dumps(figures, indent=1), figures, args.out)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
