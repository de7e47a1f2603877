"""An hour of a team's use with faults on a schedule: `python bench/soak.py --minutes 60 --faults`.

The layout of a production cluster on one machine, every part a real process started here (by
PID): 3 etcd members, 2 control planes (`ftrain serve`) on them, `--agents` real node agents
(`ftrain node`, given both URLs) running real torchrun CPU workers. Then, for `--minutes`:

* a long job (`examples/train.py`, the runtime, min == max == 2, a snapshot every 50 steps and
  the memory tier every step) that trains the whole time and is cancelled at the end;
* a steady stream of other jobs, at most `--in-flight` at a time and one every `--gap` s, in
  a fixed rotation: a short script (SUCCEEDED), min == max == 2 and min 1 < max 2 runs of
  train.py (SUCCEEDED), a script that exits 3 (FAILED), one cancelled while it runs (CANCELLED),
  one that prints `--big-log-mb` MB (SUCCEEDED, every line read back);
* with `--faults`, one fault every `--fault-every` s, in rotation: a worker of the long job
  SIGKILLed; an agent SIGKILLed (its whole tree) and started again; an agent SIGSTOPped for a
  blip (3 s) or past the node lease (12 s) and SIGCONTed; a control plane SIGKILLed and started
  again; an etcd member SIGKILLed and started again (it rejoins from its data directory).

Checked and printed: each job's terminal state against what its script and the faults dictate
(and none left PENDING/RUNNING past `--stuck-s`); that no job ran again after its last step (its
last line or step appears once in rank 0's log); the long job's steps lost at each restart (the
last step logged before it minus the step it resumed from), which fault preceded it, the tier
it resumed from (memory or disk) and whether the scheduler held its survivor for it first (its
"memory copy is on" event), and per fault kind; the same of the stream's train.py jobs, each
of which must list its last step as its latest committed snapshot; every
minute, etcd's key count and db size (in use and the file) from a member's /metrics, a census of
the keys by kind and by whose they are (the long job's, an open job's, a finished job's within
or past its retention, ...: bench/key_census.py), the RSS and open file descriptors of each
control plane and agent (from /proc), with a least-squares slope per hour over the run's second
half (of each census label too); 5xx answers (and whether inside a control-plane outage:
clients fail over to the other replica, so an outage shows as refused connections, not 5xx);
after the agents stop, processes of theirs still alive, /dev/shm entries and temp files left
(agents and workers run with TMPDIR in the soak's folder). Writes bench/results/soak-hour.json.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}

SHORT = ("import os, sys, time\n"
         "n = int(os.environ['SOAK_LINES'])\n"
         "for i in range(n):\n"
         "    print(f'soak-line {i:08d} ' + 'x' * 180)\n"
         "time.sleep(float(os.environ.get('SOAK_SLEEP', '1')))\n"
         "print('soak-done', flush=True)\n"
         "sys.exit(int(os.environ.get('SOAK_EXIT', '0')))\n")
SLEEPER = ("import time\n"
           "for i in range(100000):\n"
           "    print(f'tick {i}', flush=True)\n"
           "    time.sleep(0.5)\n")


@dataclass
class Tracked:
    id: str
    kind: str
    expect: str
    submitted: float
    steps: int = 0  # train.py's steps (0: a script with a 'soak-done' line)
    lines: int = 0
    cancel_at: float | None = None
    state: str = "PENDING"
    ended: float | None = None
    checked: dict = field(default_factory=dict)


class Api:
    """The user's client over both control planes: a refused connection fails over to the other
    replica; every 5xx is recorded with its time."""

    def __init__(self, urls: list[str], token: str):
        self.urls = urls
        self.clients = [httpx.Client(base_url=u, timeout=15, headers={"Authorization": f"Bearer {token}"})
                        for u in urls]
        self.i = 0
        self.lock = threading.Lock()
        self.requests = 0
        self.errors_5xx: list[tuple[float, str]] = []
        self.refused = 0

    def call(self, method: str, path: str, **kw) -> httpx.Response | None:
        for _ in range(2 * len(self.clients)):
            with self.lock:
                c = self.clients[self.i]
            try:
                r = c.request(method, path, **kw)
            except httpx.HTTPError:
                with self.lock:
                    self.refused += 1
                    self.i = (self.i + 1) % len(self.clients)
                time.sleep(0.2)
                continue
            with self.lock:
                self.requests += 1
                if r.status_code >= 500:
                    self.errors_5xx.append((time.time(), f"{method} {c.base_url}{path}: {r.status_code} "
                                                         f"{r.text[:160]}"))
            return r
        return None

    def close(self) -> None:
        for c in self.clients:
            c.close()


def proc_figures(pid: int) -> tuple[int, int, int] | None:
    """(RSS in kB, open fds, pid) of a live process."""
    try:
        rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if line.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd")), pid
    except (OSError, StopIteration):
        return None


def resumes(lines: list[dict]) -> list[dict]:
    """Rank 0's restarts from its lines (`bench.harness.rank0_lines`): for each run after
    the first, the step it started from, the last step logged before it, the steps lost, when
    it started (the agent's read time), and whether it resumed from the memory tier (the
    runtime's "resumed from memory (step S" line with that step) or from disk."""
    from bench.harness import FROM_MEMORY, RUN_START, STEP_LINE

    mem = {int(m.group(1)) for i in lines if (m := FROM_MEMORY.search(i["line"]))}
    out: list[dict] = []
    last: int | None = None
    for i in lines:
        if m := RUN_START.match(i["line"]):
            s = int(m.group(1))
            out.append({"resumed_from": s, "last_before": last, "start_t": i["time"],
                        "lost": None if last is None else last - s,
                        "tier": "memory" if s in mem else ("disk" if s else "none")})
        elif m := STEP_LINE.match(i["line"]):
            last = int(m.group(1))
    return out[1:]


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    den = sum((p[0] - mx) ** 2 for p in points)
    return None if den == 0 else 3600 * sum((p[0] - mx) * (p[1] - my) for p in points) / den


class HourSoak:
    def __init__(self, args, root: Path):
        self.args = args
        self.root = root
        self.rng = random.Random(args.seed)
        self.t0 = time.time()
        self.jobs: list[Tracked] = []
        self.faults: list[dict] = []
        self.outages: list[list[float]] = []  # [start, end] of a control plane down
        self.samples: list[dict] = []
        self.seen_pids: set[int] = set()  # every agent-tree process seen
        self.notes: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.long_id: str | None = None

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.t0:7.1f}s] {msg}", flush=True)

    # ---------------------------------------------------------------- the cluster

    def start_cluster(self) -> None:
        from service.embedded import EtcdProcess, cluster_endpoints, start_cluster
        from bench.harness import ControlPlane, NodeAgentProc

        r = self.root
        self.tmpdir = r / "tmp"
        self.tmpdir.mkdir()
        self.members = [EtcdProcess(r / f"etcd-{i}", name=f"m{i}", log_path=r / f"etcd-{i}.log")
                        for i in range(3)]
        spec = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = spec
        start_cluster(self.members)
        endpoints = cluster_endpoints(self.members)
        env = {"FTRAIN_RETENTION_S": str(self.args.retention),
               "FTRAIN_COMPACTION_INTERVAL_S": str(self.args.compaction),
               "FTRAIN_LOG_CAP_BYTES": str(16 * 2**20)}
        a = ControlPlane(endpoints, r / "cp-a", env=env).start()
        b = ControlPlane(endpoints, r / "cp-b", user_token=a.user_token, node_token=a.node_token, env=env)
        b.secret_dir, b.snapshot_root, b.log_root = a.secret_dir, a.snapshot_root, a.log_root
        b.start()
        self.cps = [a, b]
        self.server = f"{a.url},{b.url}"
        agent_env = {"TMPDIR": str(self.tmpdir)}
        self.agents = [NodeAgentProc(a, f"hour-{i}", r / f"agent-{i}", env=agent_env)
                       for i in range(self.args.agents)]
        for ag in self.agents:
            ag.start(server=self.server)
        self.api = Api([a.url, b.url], a.user_token)
        deadline = time.time() + 60
        while time.time() < deadline:
            r_ = self.api.call("GET", "/v1/nodes")
            if r_ is not None and r_.status_code == 200 and len(r_.json()["items"]) >= len(self.agents):
                break
            time.sleep(0.5)
        else:
            raise RuntimeError("the agents did not register within 60 s")

    def stop_cluster(self) -> dict:
        """Stop the agents, then look for what they left; then the control planes and etcd."""
        from bench.harness import stop_agents

        stop_agents(self.agents)
        time.sleep(1)
        alive = sorted(p for p in self.seen_pids if _alive(p))
        shm_left = sorted(n for n in set(_shm()) - self.shm_before if ".hour-" in n)  # this soak's nodes
        tmp_left = sorted(str(p.relative_to(self.tmpdir)) for p in self.tmpdir.rglob("*"))
        slash_tmp_left = sorted(set(os.listdir("/tmp")) - self.slash_tmp_before - {self.root.name})
        slash_tmp_left = [n for n in slash_tmp_left if _owned_by_us(Path("/tmp") / n)
                          and ("torch" in n or "ftrain" in n or n.startswith(("pymp-", "tmp")))]
        for cp in self.cps:
            cp.stop()
        for m in self.members:
            m.stop()
        self.api.close()
        return {"processes_alive": [(p, _argv(p)) for p in alive], "shm_left": shm_left,
                "tmpdir_left": tmp_left[:50], "tmpdir_left_n": len(tmp_left),
                "slash_tmp_new_maybe_ours": slash_tmp_left[:50]}

    # ---------------------------------------------------------------- jobs

    def submit(self, kind: str) -> None:
        a = self.args
        py = sys.executable
        steps = 0
        lines = 0
        env: dict[str, str] = {}
        nodes = {"min": 1, "max": 1}
        expect = "SUCCEEDED"
        max_restarts = 3
        if kind == "short":
            lines = 200
            command = [py, "-c", SHORT]
            env = {"SOAK_LINES": str(lines)}
        elif kind == "pair":
            steps = 40
            command = [py, str(TRAIN), "--steps", str(steps), "--step-delay", "0.1", "--batch", "8"]
            nodes = {"min": 2, "max": 2}
        elif kind == "elastic":
            steps = 40
            command = [py, str(TRAIN), "--steps", str(steps), "--step-delay", "0.1", "--batch", "8"]
            nodes = {"min": 1, "max": 2}
        elif kind == "fail":
            lines = 20
            command = [py, "-c", SHORT]
            env = {"SOAK_LINES": str(lines), "SOAK_EXIT": "3"}
            expect, max_restarts = "FAILED", 0
        elif kind == "cancel":
            command = [py, "-c", SLEEPER]
            expect = "CANCELLED"
        elif kind == "biglog":
            lines = int(a.big_log_mb * 1e6 / 200)
            command = [py, "-c", SHORT]
            env = {"SOAK_LINES": str(lines), "SOAK_SLEEP": "0"}
        else:
            raise ValueError(kind)
        n = len(self.jobs)
        spec = {"name": f"hour-{kind}-{n}", "command": command, "env": env, "nodes": nodes,
                "max_restarts": max_restarts}
        if steps:
            spec["snapshot"] = {"every_steps": 10}
        r = self.api.call("POST", "/v1/jobs", json=spec)
        if r is None or r.status_code != 201:
            self.notes.append(f"submit {kind}: {r and r.status_code} {r and r.text[:200]}")
            return
        t = Tracked(r.json()["id"], kind, expect, time.time(), steps=steps, lines=lines)
        if kind == "cancel":
            t.cancel_at = -1.0  # cancelled once it runs, 3 s later
        with self.lock:
            self.jobs.append(t)

    def submit_long(self) -> None:
        spec = {"name": "hour-long", "command": [sys.executable, str(TRAIN), "--steps", "100000000",
                                                 "--step-delay", str(self.args.long_step_delay),
                                                 "--batch", "8"],
                "nodes": {"min": 2, "max": 2}, "max_restarts": 1000,
                "snapshot": {"every_steps": 50, "keep": 3}}
        r = self.api.call("POST", "/v1/jobs", json=spec)
        assert r is not None and r.status_code == 201, r and r.text
        self.long_id = r.json()["id"]
        deadline = time.time() + 120
        while time.time() < deadline:
            body = self.api.call("GET", f"/v1/jobs/{self.long_id}").json()
            if (body.get("progress") or {}).get("step", 0) > 0:
                return
            time.sleep(1)
        raise RuntimeError(f"the long job did not train within 120 s: {body}")

    def poll_jobs(self) -> None:
        now = time.time()
        with self.lock:
            open_jobs = [j for j in self.jobs if j.ended is None]
        for j in open_jobs:
            r = self.api.call("GET", f"/v1/jobs/{j.id}")
            if r is None:
                continue
            if r.status_code == 404:
                j.state, j.ended = "GONE", now
                continue
            if r.status_code != 200:  # a 5xx, counted by `Api`: asked again next round
                continue
            j.state = r.json()["state"]
            if j.cancel_at == -1.0 and j.state == "RUNNING":
                j.cancel_at = now + 3
            if j.cancel_at and j.cancel_at > 0 and now >= j.cancel_at:
                self.api.call("POST", f"/v1/jobs/{j.id}/cancel")
                j.cancel_at = None
            if j.state in TERMINAL:
                j.ended = now
                self.check_job(j)

    def check_job(self, j: Tracked) -> None:
        """Its events and rank 0's log: ran once past its last step or line."""
        from bench.harness import rank0_lines

        c = self.api.clients[self.api.i]
        try:
            items = rank0_lines(c, j.id)
            lines = [i["line"] for i in items]
            events = c.get(f"/v1/jobs/{j.id}/events").json()["items"]
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            j.checked = {"error": repr(exc)[:200]}
            return
        j.checked = {"restarts": sum(1 for e in events if e["state"] == "RECOVERING"),
                     "reason": events[-1].get("reason") if events else None}
        if j.steps:
            j.checked["last_step_lines"] = sum(1 for ln in lines if ln.startswith(f"step={j.steps} "))
            j.checked["resumes"] = [(r["resumed_from"], r["lost"], r["tier"]) for r in resumes(items)]
            if j.state == "SUCCEEDED":  # its last step's snapshot committed (worker/handoff.py)
                try:
                    j.checked["latest"] = c.get(f"/v1/jobs/{j.id}/snapshots").json().get("latest")
                except (httpx.HTTPError, ValueError) as exc:
                    j.checked["latest"] = repr(exc)[:100]
        elif j.kind in ("short", "fail", "biglog"):
            j.checked["done_lines"] = sum(1 for ln in lines if ln == "soak-done")
            seen = {ln[10:18] for ln in lines if ln.startswith("soak-line ")}
            j.checked["data_lines"] = len(seen)
            if len(seen) != j.lines:  # which ones, and the log's own account, for a look
                j.checked["missing"] = [i for i in range(j.lines) if f"{i:08d}" not in seen][:10]
                try:
                    j.checked["log_head"] = {k: v for k, v in c.get(f"/v1/jobs/{j.id}/logs",
                                                                 params={"limit": 1}).json().items()
                                             if k != "items"}
                except (httpx.HTTPError, ValueError) as exc:
                    j.checked["log_head"] = repr(exc)[:100]

    def verdict(self, j: Tracked) -> str | None:
        """What is wrong with a job's end, or None."""
        if j.state == "GONE":
            return "deleted before it was seen terminal"
        if j.state not in TERMINAL:
            return f"not terminal: {j.state}"
        if j.state != j.expect:
            return f"{j.state}, expected {j.expect} ({j.checked.get('reason')})"
        c = j.checked
        if "error" in c:
            return f"check failed: {c['error']}"
        if j.state == "SUCCEEDED":
            if j.steps and c.get("last_step_lines") != 1:
                return f"its last step logged {c.get('last_step_lines')} times"
            if j.steps and c.get("latest") != j.steps:  # a multiple of its snapshot interval
                return f"its latest committed snapshot is {c.get('latest')}, not its last step {j.steps}"
            if "done_lines" in c and c["done_lines"] != 1:
                return f"'soak-done' logged {c['done_lines']} times"
            if "data_lines" in c and c["data_lines"] != j.lines:
                return f"{c['data_lines']} of {j.lines} lines in the log"
        return None

    def stream(self) -> None:
        kinds = ["short", "pair", "elastic", "fail", "cancel", "short", "biglog", "elastic"]
        k = 0
        last = 0.0
        while not self.stop.is_set():
            try:
                self.poll_jobs()
                with self.lock:
                    busy = sum(1 for j in self.jobs if j.ended is None)
                if busy < self.args.in_flight and time.time() - last >= self.args.gap:
                    self.submit(kinds[k % len(kinds)])
                    k += 1
                    last = time.time()
            except Exception as exc:  # noqa: BLE001 - the soak goes on; the note is reported
                self.notes.append(f"stream: {exc!r}"[:300])
            self.stop.wait(1.0)

    # ---------------------------------------------------------------- faults

    def agents_of_long(self) -> list:
        body = self.api.call("GET", f"/v1/jobs/{self.long_id}")
        names = set(body.json()["nodes"]) if body is not None and body.status_code == 200 else set()
        return [a for a in self.agents if a.name in names] or self.agents[:2]

    def fault(self, n: int) -> None:
        from bench.harness import workers_under

        kind = self.args.fault_kinds[n % len(self.args.fault_kinds)]
        rec = {"n": n, "kind": kind, "t": time.time() - self.t0}
        longs = self.agents_of_long()
        others = [a for a in self.agents if a not in longs]
        if kind == "worker-kill":
            ag = self.rng.choice(longs)
            pids = workers_under(ag.pid, TRAIN)
            for p in pids:
                _kill(p, signal.SIGKILL)
            rec.update(target=ag.name, pids=pids)
        elif kind == "agent-kill":
            # the long job's node and another in turn (the rotation's k-th agent kill)
            ag = self.rng.choice(longs if n // len(self.args.fault_kinds) % 2 == 0 or not others else others)
            self.remember(ag)
            killed = ag.kill_tree()
            rec.update(target=ag.name, pids=len(killed))
            time.sleep(3)
            ag.start(server=self.server)
        elif kind in ("agent-stop-short", "agent-stop-long"):
            ag = self.rng.choice(longs)
            pause = 3 if kind == "agent-stop-short" else 12
            _kill(ag.pid, signal.SIGSTOP)
            time.sleep(pause)
            _kill(ag.pid, signal.SIGCONT)
            rec.update(target=ag.name, pause_s=pause)
        elif kind == "cp-kill":
            cp = self.cps[n // len(self.args.fault_kinds) % 2]
            start = time.time()
            cp.proc.kill()
            cp.proc.wait()
            time.sleep(3)
            cp.start(timeout_s=60)
            self.outages.append([start, time.time() + 5])
            rec.update(target=cp.url, down_s=round(time.time() - start, 1))
        elif kind == "etcd-kill":
            m = self.members[n // len(self.args.fault_kinds) % 3]
            m.proc.kill()
            m.proc.wait()
            time.sleep(5)
            m.launch()
            m.wait_serving(60)
            rec.update(target=m.name)
        rec["took_s"] = round(time.time() - self.t0 - rec["t"], 1)
        self.faults.append(rec)
        self.log(f"fault {n}: {rec}")

    def remember(self, agent) -> None:
        self.seen_pids.update(agent.tree())

    # ---------------------------------------------------------------- samples

    def sample(self) -> dict:
        from bench.harness import etcd_metrics

        row: dict = {"t": round(time.time() - self.t0)}
        for m in self.members:
            try:
                row.update(etcd_metrics(m.endpoint))
                row["etcd_from"] = m.name
                row["census"] = self.key_census(m.endpoint)
                break
            except (httpx.HTTPError, OSError, ValueError):
                continue
        for cp in self.cps:
            f = proc_figures(cp.proc.pid) if cp.proc and cp.proc.poll() is None else None
            row[f"cp-{cp.port}"] = f
        for ag in self.agents:
            self.remember(ag)
            f = proc_figures(ag.pid) if ag.proc and ag.proc.poll() is None else None
            row[ag.name] = f
            row[f"{ag.name}-tree"] = len(ag.tree())
        with self.lock:
            row["jobs"] = len(self.jobs)
            row["open"] = sum(1 for j in self.jobs if j.ended is None)
        body = self.api.call("GET", f"/v1/jobs/{self.long_id}")
        if body is not None and body.status_code == 200:
            row["long_step"] = (body.json().get("progress") or {}).get("step")
            row["long_state"] = body.json()["state"]
        r = self.api.call("GET", "/v1/jobs", params={"limit": 500})
        row["listed"] = len(r.json()["items"]) if r is not None and r.status_code == 200 else None
        row["5xx"] = len(self.api.errors_5xx)
        self.samples.append(row)
        procs = " ".join(f"{k}={v[0] // 1024}M/{v[1]}fd" for k, v in row.items()
                         if isinstance(v, tuple))
        self.log(f"sample: keys={row.get('keys')} db_use={row.get('db_in_use', 0) / 1e6:.2f}MB "
                 f"db_file={row.get('db_total', 0) / 1e6:.2f}MB jobs={row['jobs']} open={row['open']} "
                 f"listed={row['listed']} long={row.get('long_step')} {row.get('long_state')} "
                 f"5xx={row['5xx']} {procs}")
        if "census" in row:
            self.log("  keys by kind: " + " ".join(f"{k}={n}" for k, n in row["census"].items()))
        return row

    def key_census(self, endpoint: str) -> dict[str, int]:
        """The keys under the control planes' prefix by kind and owner (bench/key_census.py);
        a job is 'expired' once the soak saw it finished more than the retention and one
        retention pass (plus 30 s) ago."""
        from bench.key_census import census, etcd_keys
        from service.decide.retention import RetentionPolicy, pass_interval_s

        keys = etcd_keys(endpoint)
        stale_s = self.args.retention + pass_interval_s(RetentionPolicy(self.args.retention)) + 30
        with self.lock:
            ended_at = {j.id: j.ended for j in self.jobs}
        return census(keys, "/ftrain", self.long_id, ended_at, time.time(), stale_s)

    # ---------------------------------------------------------------- the run

    def run(self) -> dict:
        a = self.args
        self.shm_before = set(_shm())
        self.slash_tmp_before = set(os.listdir("/tmp"))
        self.start_cluster()
        self.log(f"cluster up: 3 etcd members, 2 control planes {self.server}, {len(self.agents)} agents")
        self.submit_long()
        self.log(f"long job {self.long_id} training")
        stream = threading.Thread(target=self.stream, daemon=True)
        stream.start()
        end = self.t0 + 60 * a.minutes
        next_sample = time.time()
        next_fault = time.time() + a.fault_every / 2
        n = 0
        try:
            while time.time() < end:
                if time.time() >= next_sample:
                    self.sample()
                    next_sample += 60
                if a.faults and time.time() >= next_fault:
                    try:
                        self.fault(n)
                    except Exception as exc:  # noqa: BLE001 - reported, the soak goes on
                        self.notes.append(f"fault {n}: {exc!r}"[:300])
                        self.log(f"fault {n} failed: {exc!r}")
                    n += 1
                    next_fault += a.fault_every
                time.sleep(0.5)
            self.stop.set()
            stream.join(60)
            self.log("stream stopped; waiting for the open jobs to end")
            deadline = time.time() + a.stuck_s
            while time.time() < deadline:
                self.poll_jobs()
                with self.lock:
                    if all(j.ended is not None for j in self.jobs):
                        break
                time.sleep(1)
            self.sample()
            result = self.finish_long()
        finally:
            self.stop.set()
            left = self.stop_cluster()
        return {**result, "leftovers": left}

    def finish_long(self) -> dict:
        from bench.harness import runs

        self.api.call("POST", f"/v1/jobs/{self.long_id}/cancel")
        deadline = time.time() + 60
        state = None
        while time.time() < deadline:
            r = self.api.call("GET", f"/v1/jobs/{self.long_id}")
            state = r.json()["state"] if r is not None and r.status_code == 200 else None
            if state in TERMINAL:
                break
            time.sleep(1)
        c = self.api.clients[self.api.i]
        run_list = runs(c, self.long_id)
        from bench.harness import rank0_lines
        events = c.get(f"/v1/jobs/{self.long_id}/events").json()["items"]
        # the scheduler's hold of the survivors that keep its memory copy (service/decide/keep.py)
        holds = [e["time"] for e in events if "memory copy is on" in (e.get("reason") or "")]
        losses = []
        prev = self.t0
        for r in resumes(rank0_lines(c, self.long_id)):
            at = r["start_t"] - self.t0
            before = [f for f in self.faults if f["t"] <= at]
            losses.append({**r, "at_s": at, "fault_kind": before[-1]["kind"] if before else None,
                           "held": any(prev < t <= r["start_t"] for t in holds),
                           "after_fault": before[-1]["kind"] + f" #{before[-1]['n']} on "
                                          f"{before[-1].get('target')} at {before[-1]['t']:.0f} s"
                           if before else None})
            prev = r["start_t"]
        return {"long_job": {"id": self.long_id, "state": state, "runs": len(run_list),
                             # the last step logged (a run cancelled as it started logged none)
                             "last_step": next((st[-1] for _, st in reversed(run_list) if st), None),
                             "restarts": losses,
                             "events": [(e.get("time"), e["state"], e.get("reason")) for e in events][-80:]}}


def _alive(pid: int) -> bool:
    from worker.procs import is_alive
    return is_alive(pid)


def _argv(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _shm() -> list[str]:
    try:
        return os.listdir("/dev/shm")
    except OSError:
        return []


def _owned_by_us(path: Path) -> bool:
    try:
        return path.stat().st_uid == os.getuid()
    except OSError:
        return False


def summarize(result: dict, soak: HourSoak) -> list[str]:
    """The figures the report prints."""
    out = []
    by = {}
    bad = []
    for j in soak.jobs:
        key = (j.kind, j.expect)
        by.setdefault(key, {}).setdefault(j.state, 0)
        by[key][j.state] += 1
        if (why := soak.verdict(j)) is not None:
            bad.append(f"{j.id} {j.kind}: {why}; {j.checked}")
    out.append(f"jobs: {len(soak.jobs)} submitted besides the long one")
    for (kind, expect), states in sorted(by.items()):
        counts = ", ".join(f"{s} {n}" for s, n in sorted(states.items()))
        out.append(f"  {kind:8s} (expect {expect:9s}): {counts}")
    restarts = sum(j.checked.get("restarts", 0) for j in soak.jobs)
    out.append(f"  restarts (RECOVERING events) among them: {restarts}")
    out.append(f"jobs that ended wrong: {len(bad)}")
    out += [f"  {b}" for b in bad[:30]]
    kinds = {}
    for f in soak.faults:
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    out.append(f"faults injected: {len(soak.faults)} " + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    lj = result["long_job"]
    out.append(f"long job {lj['id']}: {lj['state']} after {lj['runs']} runs, last step {lj['last_step']}")
    for r in lj["restarts"]:
        out.append(f"  restart at {r['at_s'] or 0:.0f} s: last step {r['last_before']} -> resumed from "
                   f"{r['resumed_from']} ({r.get('tier')}{', held' if r.get('held') else ''}): "
                   f"{r['lost']} steps lost (after {r['after_fault']})"
                   + (" (below 0: rank 0's last lines were not shipped, they died with its agent)"
                      if (r["lost"] or 0) < 0 else ""))
    per_kind: dict = {}
    for r in lj["restarts"]:
        per_kind.setdefault(r.get("fault_kind"), []).append(r)
    out.append("  steps lost per fault kind (the latest fault before the restart):")
    for kind, rs in per_kind.items():
        out.append(f"    {kind}: {len(rs)} restarts, lost {[r['lost'] for r in rs]}, from memory "
                   f"{sum(r.get('tier') == 'memory' for r in rs)}, after a hold "
                   f"{sum(bool(r.get('held')) for r in rs)}")
    stream_resumes = [x for j in soak.jobs for x in j.checked.get("resumes", [])]
    if stream_resumes:
        out.append(f"stream train jobs' restarts: {len(stream_resumes)}, lost "
                   f"{sorted(x[1] for x in stream_resumes if x[1] is not None)}, from memory "
                   f"{sum(x[2] == 'memory' for x in stream_resumes)}")
    rows = soak.samples
    half = [r for r in rows if r["t"] >= rows[-1]["t"] / 2] if rows else []

    def series(key, idx=None):
        pts = []
        for r in rows:
            v = r.get(key)
            if v is None:
                continue
            pts.append((r["t"], v if idx is None else v[idx], None if idx is None else v[2]))
        return pts

    def line(label, pts, scale, unit):
        """First, last, max over the run; the slope over the second half, of the process that
        was alive at the end (a restarted process starts afresh)."""
        if not pts:
            return f"  {label}: no samples"
        vals = [p[1] for p in pts]
        pids = len({p[2] for p in pts})
        hp = [p[:2] for p in pts if p[0] >= (half[0]["t"] if half else 0) and p[2] == pts[-1][2]]
        s = slope_per_hour(hp)
        slope = "-" if s is None else f"{s / scale:+.2f}"
        return (f"  {label}: first {vals[0] / scale:.2f} last {vals[-1] / scale:.2f} "
                f"max {max(vals) / scale:.2f} {unit}; slope over the second half {slope} {unit}/h"
                + (f" ({pids} processes in turn)" if pids > 1 else ""))

    out.append(f"samples: {len(rows)} (one a minute)")
    out.append(line("etcd keys", series("keys"), 1, "keys"))
    out += census_lines(rows, half[0]["t"] if half else 0)
    out.append(line("etcd db in use", series("db_in_use"), 1e6, "MB"))
    out.append(line("etcd db file", series("db_total"), 1e6, "MB"))
    for cp in soak.cps:
        out.append(line(f"control plane :{cp.port} RSS", series(f"cp-{cp.port}", 0), 1024, "MiB"))
        out.append(line(f"control plane :{cp.port} fds", series(f"cp-{cp.port}", 1), 1, "fds"))
    for ag in soak.agents:
        out.append(line(f"agent {ag.name} RSS", series(ag.name, 0), 1024, "MiB"))
        out.append(line(f"agent {ag.name} fds", series(ag.name, 1), 1, "fds"))
    in_outage = [e for e in soak.api.errors_5xx if any(s <= e[0] <= t for s, t in soak.outages)]
    out.append(f"5xx: {len(soak.api.errors_5xx)} of {soak.api.requests} requests "
               f"({len(in_outage)} inside a control-plane outage); refused connections (failed over): "
               f"{soak.api.refused}")
    out += [f"  {time.strftime('%H:%M:%S', time.gmtime(t))} {e}" for t, e in soak.api.errors_5xx[:10]]
    left = result["leftovers"]
    out.append(f"after the agents stopped: {len(left['processes_alive'])} of their processes alive, "
               f"{len(left['shm_left'])} new /dev/shm entries, {left['tmpdir_left_n']} files in their "
               f"TMPDIR, "
               f"{len(left['slash_tmp_new_maybe_ours'])} new /tmp entries that may be theirs")
    for k in ("processes_alive", "shm_left", "tmpdir_left", "slash_tmp_new_maybe_ours"):
        if left[k]:
            out.append(f"  {k}: {left[k][:10]}")
    if soak.notes:
        out.append("notes:")
        out += [f"  {n}" for n in soak.notes[:20]]
    return out


def census_lines(rows: list[dict], half_t: float) -> list[str]:
    """The key census (bench/key_census.py): each label's first, last and max count and its
    slope per hour over the run's second half (samples from `half_t` on); the labels whose
    count is not 0 at the end or whose slope is not 0 first."""
    rows = [r for r in rows if "census" in r]
    if not rows:
        return ["  keys by kind: no census"]
    labels = sorted({k for r in rows for k in r["census"]})
    listed = []
    for k in labels:
        pts = [(r["t"], r["census"].get(k, 0)) for r in rows]
        s = slope_per_hour([p for p in pts if p[0] >= half_t]) or 0.0
        vals = [p[1] for p in pts]
        listed.append((-abs(s), k, vals[0], vals[-1], max(vals), s))
    listed.sort()
    total = [sum(r["census"].values()) for r in rows]
    out = [f"  keys by kind (a census, {len(rows)} samples): all first {total[0]} last {total[-1]} "
           f"max {max(total)}"]
    out += [f"    {k}: first {a} last {b} max {m}; slope over the second half {s:+.1f} keys/h"
            for _, k, a, b, m, s in listed]
    return out


FAULT_KINDS = ["worker-kill", "agent-kill", "agent-stop-short", "cp-kill", "etcd-kill", "agent-stop-long"]


def main_hour(args) -> int:
    def interrupted(*_):
        raise KeyboardInterrupt  # SIGTERM (or SIGINT, ignored in a background job) stops it cleanly

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    root = Path(tempfile.mkdtemp(prefix="ftrain-soak-hour-"))
    soak = HourSoak(args, root)
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    faults = f"every {args.fault_every:g} s" if args.faults else "off"
    print(f"soak-hour: {args.minutes:g} min, faults {faults} "
          f"({', '.join(args.fault_kinds)}), {args.agents} agents, at most {args.in_flight} jobs in flight, "
          f"one "
          f"every {args.gap:g} s, retention {args.retention:g} s, compaction every {args.compaction:g} s; "
          f"{os.cpu_count()} cores; {uptime}", flush=True)
    try:
        result = soak.run()
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    out = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "faults": soak.faults, "samples": soak.samples, "5xx": soak.api.errors_5xx,
           "jobs": [j.__dict__ for j in soak.jobs], **result}
    path = REPO / "bench" / "results" / "soak-hour.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    # written first: a summary that fails loses nothing
    path.write_text(json.dumps(out, indent=1, default=str) + "\n")
    lines = summarize(result, soak)
    print("\n".join(["", "summary:", *lines]), flush=True)
    path.write_text(json.dumps({**out, "summary": lines}, indent=1, default=str) + "\n")
    bad = sum(1 for j in soak.jobs if soak.verdict(j) is not None)
    return 1 if bad or soak.api.errors_5xx or result["leftovers"]["processes_alive"] else 0


def add_options(ap) -> None:
    g = ap.add_argument_group("the hour with faults (--minutes)")
    g.add_argument("--minutes", type=float, default=None,
                   help="run the timed soak with real jobs for this long")
    g.add_argument("--faults", action="store_true", help="inject faults on a schedule")
    g.add_argument("--fault-every", type=float, default=150.0, help="seconds between faults")
    g.add_argument("--fault-kinds", type=lambda s: s.split(","), default=FAULT_KINDS,
                   help="comma-separated, in rotation: " + ",".join(FAULT_KINDS))
    g.add_argument("--agents", type=int, default=4, help="real node agents (the long job holds two)")
    g.add_argument("--in-flight", type=int, default=2, help="stream jobs unfinished at a time")
    g.add_argument("--gap", type=float, default=8.0, help="seconds at least between submissions")
    g.add_argument("--big-log-mb", type=float, default=3.0)
    g.add_argument("--long-step-delay", type=float, default=0.2)
    g.add_argument("--stuck-s", type=float, default=240.0,
                   help="the open jobs' time to end after the stream stops")
    g.add_argument("--keep", action="store_true", help="keep the soak's folder (logs) for a look")
