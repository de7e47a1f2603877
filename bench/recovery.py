"""Recovery benchmark: ftrain against plain torchrun, side by side, on one machine.

    python bench/recovery.py              # 5 trials of every variant and fault (~30 min on 2 cores)
    python bench/recovery.py --quick      # 1 trial; tuned torchrun, ftrain (and ftrain-runtime's join)
    python bench/recovery.py --trials 3 --variants torchrun-tuned,ftrain --scenarios join

The same DDP script (bench/workload.py: gloo, a small MLP, a tutorial-style snapshot
every 10 steps) runs under:

* `torchrun-default`: two `torchrun --nnodes=1:N --rdzv-backend=c10d` agents on this
  machine acting as two nodes, torch's defaults (30 s last call, keep-alive 5 s x 3,
  shared rendezvous store);
* `torchrun-tuned`: the same at its best: `last_call_timeout=1`,
  keep-alive 1 s x 3, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`;
* `ftrain`: a real etcd, a real control plane and two real node agents, the job
  submitted over REST;
* `ftrain-runtime`: ftrain with the script's `--mode runtime` (ftrain's runtime library,
  which snapshots at a step boundary when the control plane asks before a join, and keeps
  the memory tier: a copy of the state in each node's memory as often as fits 5% of the
  step, every step here, so a SIGKILL loses at most a step or so). For it the table also
  gives the memory tier's cost per step as the training thread sees it (bench/snapshot.py
  measures the whole overhead, contention for cores and memory included);
* `ftrain-runtime-nolw`: the same without a survivor's last-words copy (`FTRAIN_LAST_WORDS=0`,
  worker/last_words.py), to compare steps lost where the tier copies every K > 1 steps
  (`--memory-every K` sets the jobs' FTRAIN_MEMORY_EVERY).

Each trial runs each fault once per variant, variants alternating (their order rotates
per trial). A session is a fresh set of agents (and a fresh job): the worker SIGKILL and
then, once it trains again at world size 2, the agent SIGKILL share one session (if the
first is not recovered, the second gets a session of its own); the join has its own:

* cold start: launch of the torchruns / the job's submit (agents already registered)
  -> first step; measured in the kill sessions (`--nnodes=1:2`, job max 2);
* worker SIGKILL: one worker of the second node -> first step of the restarted group;
* agent SIGKILL: the second node's torchrun or node agent with its whole process tree
  -> first step of the group that goes on (and its world size);
* join: a third torchrun / node agent started mid-run (`--nnodes=1:3`, job max 3)
  -> first step at world size 3.

Times are read from the workload's JSON log lines (wall-clock `t` of each step, of each
worker's boot, of the process group), against the wall-clock time of the kill or launch.
Steps lost = the furthest step logged before the new group resumed - the step it resumed
from. A fault not recovered within --deadline seconds counts as a hang. The kill lands
after a random delay (the same for every variant of a trial), so where it falls between
two snapshots is spread evenly. The second node is the one killed; in torchrun it is not
the host of the c10d store (`is_host=0`; killing the host leaves nothing to re-rendezvous
with, so that fault is never recovered there).

Prints min/median/max per figure and the ratios of the medians ftrain / torchrun, and
writes everything (raw trials, ftrain's job events, the machine's load) to
bench/results/recovery.json (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx

from bench.harness import ControlPlane, EtcdProcess, NodeAgentProc, wait_for, workers_under
from service.embedded import free_port
from worker import memory
from worker.env import FTRAIN_PHASE_LOG
from worker.procs import descendants
from worker.procs import is_alive as pid_alive

WORKLOAD = REPO / "bench" / "workload.py"
SNAPSHOT_EVERY = 10
STEP_TIME_S = 0.05
WARM_STEPS = 10  # steps trained before a fault, so the fault hits a steady job
TORCHRUN_MAX_RESTARTS = 100
TUNED_CONF = ["last_call_timeout=1", "keep_alive_interval=1", "keep_alive_max_attempt=3"]

VARIANTS = {
    "torchrun-default": {"kind": "torchrun", "tuned": False, "mode": "tutorial"},
    "torchrun-tuned": {"kind": "torchrun", "tuned": True, "mode": "tutorial"},
    "ftrain": {"kind": "ftrain", "mode": "tutorial"},
    "ftrain-runtime": {"kind": "ftrain", "mode": "runtime"},
    # The runtime without a survivor's last-words copy (worker/last_words.py): the baseline
    # for what they save when the tier copies every K > 1 steps (--memory-every).
    "ftrain-runtime-nolw": {"kind": "ftrain", "mode": "runtime", "env": {"FTRAIN_LAST_WORDS": "0"}},
}
SCENARIOS = ("worker_kill", "agent_kill", "join")


class Unrecovered(Exception):
    """The job did not get back to training within the deadline."""


# ------------------------------------------------------------------ the workload's log

class EventFile:
    """The workload's JSON lines, read incrementally (appended to by every worker)."""

    def __init__(self, path: Path):
        self.path = path
        self.items: list[dict] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return self.items
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for raw in lines:
            try:
                self.items.append(json.loads(raw))
            except ValueError:
                continue
        return self.items

    def steps(self) -> list[dict]:
        return [e for e in self.poll() if e["ev"] == "step"]

    def wait_steps(self, n: int, world: int, timeout_s: float, since: float = 0.0) -> dict:
        """Wait for `n` steps at `world` logged after `since`."""
        def reached():
            at = [e for e in self.steps() if e["world"] == world and e["t"] > since]
            return bool(at) and at[-1]["step"] >= at[0]["step"] + n and at[-1]
        return wait_for(reached, timeout_s, f"{n} steps at world size {world}", interval_s=0.05)

    def recovery(self, since: float, world: int | None, deadline_s: float) -> dict:
        """The first group that resumed after `since` (at `world`, if given) and its first step.

        Returns times relative to `since`: the first worker boot after it, rank 0's process
        group, its resume and its first step; the step it resumed from and the steps lost.
        """
        end = since + deadline_s

        def found():
            items = self.poll()
            for i, e in enumerate(items):
                if e["ev"] != "resume" or e["t"] <= since or (world is not None and e["world"] != world):
                    continue
                for f in items[i + 1:]:
                    if f["ev"] == "step" and f["pid"] == e["pid"]:
                        return i, e, f
            return None

        while time.time() < end:
            hit = found()
            if hit:
                break
            time.sleep(0.05)
        else:
            raise Unrecovered(f"no step{'' if world is None else f' at world size {world}'} "
                              f"within {deadline_s:g} s")
        i, resume, first = hit
        items = self.items
        before = [e["step"] for e in items[:i] if e["ev"] == "step"]
        boots = [e["t"] for e in items if e["ev"] == "boot" and e["t"] > since]
        pg = next((e["t"] for e in items[:i] if e["ev"] == "pg" and e["pid"] == resume["pid"]), None)
        last = max(before) if before else 0
        return {
            "time_s": round(first["t"] - since, 3),
            "steps_lost": max(0, last - resume["step"]),
            "last_step_before": last,
            "resumed_from": resume["step"],
            "world_after": first["world"],
            "phases_s": {
                "first_worker_boot": round(min(boots) - since, 3) if boots else None,
                "rank0_process_group": round(pg - since, 3) if pg else None,
                "rank0_resumed": round(resume["t"] - since, 3),
                "first_step": round(first["t"] - since, 3),
            },
            # rank 0's own account (runtime mode): CUDA device, store wait, process group,
            # DDP (NCCL's communicator), memory read, gather, choice, load; the first step's
            # one-time memory-tier work (slot mapped and registered, staging made)
            "runtime_phases_s": resume.get("phases"),
            "first_step_mem_setup_ms": first.get("mem_setup_ms"),
            "first_step_ms": first.get("first_ms"),
        }

    def first_step_time(self) -> float:
        return self.steps()[0]["t"]

    def memory_tier_cost(self) -> dict | None:
        """The memory tier's cost per step so far, from rank 0's step lines (runtime mode)."""
        steps = [e for e in self.steps() if "mem_ms" in e]
        if len(steps) < 3:
            return None
        periods = [(b["t"] - a["t"]) * 1e3 for a, b in zip(steps, steps[1:]) if b["step"] == a["step"] + 1]
        marks = [e["mark_ms"] for e in steps if "mark_ms" in e]
        return {"mem_ms_median": statistics.median(e["mem_ms"] for e in steps),
                "mark_ms_median": statistics.median(marks) if marks else None,
                "step_period_ms_median": statistics.median(periods) if periods else None,
                "mem_every_median": statistics.median(e["mem_every"] for e in steps), "steps": len(steps)}


# Set by --device/--width: extra workload arguments, and how many GPUs the nodes share.
WORKLOAD_ARGS: list[str] = []
JOB_ENV: dict[str, str] = {}  # set by --memory-every: the ftrain job's environment
GPUS = 0


def node_env(i: int) -> dict[str, str]:
    """Node i's own GPU (round robin) when running on GPUs: each node acts as one machine."""
    return {"CUDA_VISIBLE_DEVICES": str(i % GPUS)} if GPUS else {}


def _kill(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _workers_under(pid: int) -> list[int]:
    """The workload processes under `pid` (not torchrun, not the agent's exec shim)."""
    return workers_under(pid, WORKLOAD)


# ------------------------------------------------------------------ the two systems

class TorchrunCluster:
    """Plain torchrun: one `torchrun` process per node, c10d rendezvous on node 0."""

    def __init__(self, root: Path, tuned: bool, mode: str, max_nodes: int):
        self.root = root
        self.tuned = tuned
        self.mode = mode
        self.max_nodes = max_nodes
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        self.log = EventFile(root / "events.jsonl")
        root.mkdir(parents=True, exist_ok=True)

    def launch_node(self) -> float:
        i = len(self.procs)
        # Node 0 hosts the c10d store; pinning it (is_host) keeps the fault on a non-host node.
        conf = [f"is_host={1 if i == 0 else 0}"] + (TUNED_CONF if self.tuned else [])
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes=1:{self.max_nodes}",
                "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}",
                "--rdzv-id=bench", f"--rdzv-conf={','.join(conf)}",
                f"--max-restarts={TORCHRUN_MAX_RESTARTS}",
                str(WORKLOAD), "--mode", self.mode, "--log-file", str(self.log.path),
                "--snapshot-dir", str(self.root / "snapshots"), "--snapshot-every", str(SNAPSHOT_EVERY),
                "--step-time", str(STEP_TIME_S), *WORKLOAD_ARGS]
        env = {**os.environ, **node_env(i)}
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        if self.tuned:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        (self.root / "snapshots").mkdir(exist_ok=True)
        out = open(self.root / f"torchrun-{i}.log", "ab")  # noqa: SIM115
        t = time.time()
        self.procs.append(subprocess.Popen(argv, cwd=self.root, env=env, stdout=out,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True))
        out.close()
        return t

    def start(self, nodes: int = 2) -> float:
        t0 = self.launch_node()
        for _ in range(nodes - 1):
            self.launch_node()
        return t0

    def tree(self, i: int) -> list[int]:
        p = self.procs[i]
        return [p.pid, *descendants(p.pid)] if p.poll() is None else []

    def workers(self, i: int) -> list[int]:
        return _workers_under(self.procs[i].pid)

    def kill_node(self, i: int) -> list[int]:
        pids = self.tree(i)
        _kill(pids)
        self.procs[i].wait()
        return pids

    def stop(self) -> None:
        for i in range(len(self.procs)):
            self.kill_node(i)

    def diagnostics(self, since: float) -> dict:
        return {}


class FtrainStack:
    """One etcd and one control plane, shared by every ftrain trial of a run."""

    def __init__(self, root: Path):
        self.root = root
        self.etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log")
        self.cp: ControlPlane | None = None

    def start(self) -> FtrainStack:
        self.etcd.start()
        self.cp = ControlPlane(self.etcd.endpoint, self.root / "cp").start()
        self.api = self.cp.client("user")
        self.node_api = self.cp.client("node")
        return self

    def stop(self) -> None:
        if self.cp:
            self.api.close()
            self.node_api.close()
            self.cp.stop()
        self.etcd.kill()

    def live_nodes(self) -> set[str]:
        return {n["name"] for n in self.api.get("/v1/nodes").json()["items"]}


class FtrainCluster:
    """Node agents of one trial; the job goes in over REST."""

    def __init__(self, stack: FtrainStack, root: Path, mode: str, max_nodes: int, tag: str,
                 env: dict[str, str] | None = None):
        self.stack = stack
        self.root = root
        self.mode = mode
        self.env = {**JOB_ENV, **(env or {})}
        self.max_nodes = max_nodes
        self.tag = tag
        self.agents: list[NodeAgentProc] = []
        self.job_id: str | None = None
        self.log = EventFile(root / "events.jsonl")
        root.mkdir(parents=True, exist_ok=True)

    def launch_node(self) -> float:
        # Every node's torchrun notes its re-rendezvous phases in one file (worker/rendezvous/marks.py).
        env = {**node_env(len(self.agents)), FTRAIN_PHASE_LOG: str(self.root / "phases.jsonl")}
        agent = NodeAgentProc(self.stack.cp, f"{self.tag}-n{len(self.agents)}", self.root / "nodes",
                              env=env)
        t = time.time()
        agent.start()
        self.agents.append(agent)
        return t

    def start(self, nodes: int = 2) -> float:
        for _ in range(nodes):
            self.launch_node()
        names = {a.name for a in self.agents}
        # Only this trial's nodes may be live, or the job could land on a stale one.
        wait_for(lambda: self.stack.live_nodes() == names, 30, f"exactly nodes {sorted(names)}")
        command = ["python", str(WORKLOAD), "--mode", self.mode, "--log-file", str(self.log.path),
                   "--step-time", str(STEP_TIME_S), *WORKLOAD_ARGS]
        if self.mode == "tutorial":
            command += ["--snapshot-every", str(SNAPSHOT_EVERY)]
        spec = {"name": f"bench-{self.tag}", "command": command, "working_dir": str(REPO),
                "nodes": {"min": 1, "max": self.max_nodes}, "max_restarts": 100,
                "snapshot": {"every_steps": SNAPSHOT_EVERY, "keep": 3}, "env": self.env}
        t0 = time.time()
        resp = self.stack.api.post("/v1/jobs", json=spec)
        resp.raise_for_status()
        self.job_id = resp.json()["id"]
        return t0

    def tree(self, i: int) -> list[int]:
        return self.agents[i].tree()

    def workers(self, i: int) -> list[int]:
        return _workers_under(self.agents[i].pid)

    def kill_node(self, i: int) -> list[int]:
        return self.agents[i].kill_tree()

    def stop(self) -> None:
        api = self.stack.api
        if self.job_id:
            try:
                api.post(f"/v1/jobs/{self.job_id}/cancel")
            except httpx.HTTPError:
                pass
        for agent in self.agents:
            agent.kill_tree()
            memory.remove_leftovers(agent.workdir, agent.name)  # the killed agent's memory tier
        for agent in self.agents:  # what a graceful agent does on exit: give its lease back
            try:
                self.stack.node_api.delete(f"/v1/nodes/{agent.name}")
            except httpx.HTTPError:
                pass
        if self.job_id:
            try:
                wait_for(lambda: api.get(f"/v1/jobs/{self.job_id}").json()["state"]
                         in ("CANCELLED", "FAILED", "SUCCEEDED"), 20, f"job {self.job_id} to end")
            except AssertionError as exc:
                print(f"  warning: {exc}", file=sys.stderr)

    def diagnostics(self, since: float) -> dict:
        """The job's events, with times relative to the fault (for where the time goes)."""
        if not self.job_id:
            return {}
        try:
            items = self.stack.api.get(f"/v1/jobs/{self.job_id}/events").json()["items"]
        except (httpx.HTTPError, ValueError):
            return {}
        return {"job_id": self.job_id, "events": [
            {"t": round(_event_time(e) - since, 3), "state": e.get("state"), "reason": e.get("reason")}
            for e in items if _event_time(e) is not None], "agent": self.agent_marks(since),
            "marks": self.phase_marks(since)}

    def phase_marks(self, since: float) -> dict:
        """Each node's torchrun phases after `since` (the fault), seconds, first of each:
        `killed:*` the second node's (the one the fault hit), `other:*` the first's
        (worker/rendezvous/marks.py); `group_formed`: the new round complete and its workers
        started on every node that was in it."""
        roles = {a.name: role for a, role in zip(self.agents, ("other", "killed", "joined"))}
        out: dict = {}
        started: dict = {}
        try:
            lines = (self.root / "phases.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return out
        for raw in lines:
            try:
                m = json.loads(raw)
            except ValueError:
                continue
            if m["t"] <= since or m.get("node") not in roles:
                continue
            role = roles[m["node"]]
            out.setdefault(f"{role}:{m['phase']}", round(m["t"] - since, 3))
            if m["phase"] == "rdzv_done":
                started.setdefault(role, (m.get("round"), m.get("world")))
            elif m["phase"] == "workers_started" and role in started:
                out.setdefault(f"{role}:started_after_round", round(m["t"] - since, 3))
        rounds = {r for r, _ in started.values()}
        worlds = {w for _, w in started.values()}
        starts = [out.get(f"{role}:started_after_round") for role in started]
        if len(rounds) == 1 and len(worlds) == 1 and len(started) == next(iter(worlds)) \
                and all(t is not None for t in starts):
            out["group_formed"] = max(starts)
        return out

    def agent_marks(self, since: float) -> dict:
        """The first survivor's agent, from its log: when it began stopping the old group and
        when it started the new attempt's torchrun, seconds after `since` (the fault)."""
        if not self.agents:
            return {}
        marks: dict = {}
        for line in _log_lines(self.agents[0].workdir / f"agent-{self.agents[0].name}.log", since):
            t, text = line
            if "stopping job" in text:
                marks.setdefault("stop_old", round(t - since, 3))
            elif "started torchrun" in text and "stop_old" in marks:
                marks.setdefault("torchrun_started", round(t - since, 3))
        return marks


def _log_lines(path: Path, since: float) -> list[tuple[float, str]]:
    """(wall-clock time, line) of a Python log's lines (`%(asctime)s`: local time, ms) after `since`."""
    out = []
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            stamp = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S")) + int(line[20:23]) / 1e3
        except ValueError:
            continue
        if stamp > since:
            out.append((stamp, line[24:]))
    return out


def _event_time(e: dict) -> float | None:
    t = e.get("time")
    return float(t) if isinstance(t, (int, float)) else None


# ------------------------------------------------------------------ one trial of one fault

def run_session(variant: str, faults: list[str], trial: int, root: Path, stack: FtrainStack | None,
                deadline_s: float, delay_s: float) -> list[dict]:
    """One cluster, one cold start, then `faults` one after the other; a record per fault.

    A fault that is not recovered ends the session (the records of the faults after it
    are left out, for the caller to run again in a fresh session).
    """
    spec = VARIANTS[variant]
    max_nodes = 3 if "join" in faults else 2
    where = root / f"t{trial}-{'+'.join(faults)}-{variant}"
    tag = f"t{trial}{faults[0][0]}{secrets.token_hex(2)}"
    cluster = (TorchrunCluster(where, spec["tuned"], spec["mode"], max_nodes) if spec["kind"] == "torchrun"
               else FtrainCluster(stack, where, spec["mode"], max_nodes, tag, spec.get("env")))
    records: list[dict] = []
    fault_t = None
    try:
        t0 = cluster.start(2)
        first = {"variant": variant, "scenario": faults[0], "trial": trial, "dir": str(where)}
        records.append(first)
        try:
            wait_for(lambda: cluster.log.steps(), 30 + deadline_s, "the first step")
        except AssertionError:
            first["cold_start"] = {"recovered": False}
            first["fault"] = {"recovered": False, "error": "never started"}
            return records
        first["cold_start"] = {"recovered": True, "max_nodes": max_nodes,
                               "time_s": round(cluster.log.first_step_time() - t0, 3)}
        for n, fault in enumerate(faults):
            rec = first if n == 0 else {"variant": variant, "scenario": fault, "trial": trial,
                                        "dir": str(where), "after": faults[:n]}
            if n:
                records.append(rec)
            try:
                cluster.log.wait_steps(WARM_STEPS, 2, 60, since=fault_t or 0.0)
            except AssertionError as exc:
                rec["fault"] = {"recovered": False,
                                "error": f"not training at world size 2 before the fault: {exc}"}
                return records
            if n == 0:
                first["memory_tier"] = cluster.log.memory_tier_cost()
            time.sleep(delay_s)
            if fault == "worker_kill":
                victims = wait_for(lambda: cluster.workers(1), 10, "the second node's worker")
                fault_t = time.time()
                _kill(victims)
                world = None
            elif fault == "agent_kill":
                fault_t = time.time()
                killed = cluster.kill_node(1)
                wait_for(lambda pids=killed: not any(pid_alive(p) for p in pids), 10,
                         "the node's tree to die")
                world = None
            else:
                fault_t = cluster.launch_node()
                world = 3
            rec["fault_t"] = fault_t  # wall clock, to line up the nodes' logs (--timeline)
            try:
                rec["fault"] = {"recovered": True, **cluster.log.recovery(fault_t, world, deadline_s)}
            except Unrecovered as exc:
                rec["fault"] = {"recovered": False, "error": str(exc)}
            rec["diagnostics"] = cluster.diagnostics(fault_t)
            formed = rec["diagnostics"].get("marks", {}).get("group_formed")
            if rec["fault"]["recovered"] and formed is not None:
                rec["fault"]["group_formed_s"] = formed
            if not rec["fault"]["recovered"]:
                return records
        return records
    except AssertionError as exc:
        if records and "fault" not in records[-1]:
            records[-1]["fault"] = {"recovered": False, "error": f"harness: {exc}"}
        return records
    finally:
        cluster.stop()


def sessions_for(scenarios: list[str]) -> list[list[str]]:
    """Worker kill then agent kill share a session (one cold start); a join has its own."""
    kills = [s for s in ("worker_kill", "agent_kill") if s in scenarios]
    return ([kills] if kills else []) + ([["join"]] if "join" in scenarios else [])


# ------------------------------------------------------------------ summary

FIGURES = [
    ("cold start (s)", "cold_start", None, "time_s"),
    ("worker SIGKILL -> next step (s)", "fault", "worker_kill", "time_s"),
    ("  -> new group formed (s)", "fault", "worker_kill", "group_formed_s"),
    ("  steps lost", "fault", "worker_kill", "steps_lost"),
    ("agent SIGKILL -> training again (s)", "fault", "agent_kill", "time_s"),
    ("  -> new group formed (s)", "fault", "agent_kill", "group_formed_s"),
    ("  steps lost", "fault", "agent_kill", "steps_lost"),
    ("  world size after", "fault", "agent_kill", "world_after"),
    ("node joins -> step at world 3 (s)", "fault", "join", "time_s"),
    ("  steps lost", "fault", "join", "steps_lost"),
]


def _values(trials: list[dict], variant: str, part: str, scenario: str | None, key: str) -> tuple[list, int]:
    """Values of one figure for one variant, and the number of attempts."""
    rows = [t for t in trials if t["variant"] == variant and t.get(part)
            and (scenario is None or t["scenario"] == scenario)
            and (part != "cold_start" or t["scenario"] != "join")]
    vals = [t[part][key] for t in rows if t[part].get("recovered") and t[part].get(key) is not None]
    return vals, len(rows)


def summarize(trials: list[dict], variants: list[str]) -> dict:
    out: dict = {}
    for _label, part, scenario, key in FIGURES:
        fig = f"{scenario or part}.{key}"
        out[fig] = {}
        for v in variants:
            vals, n = _values(trials, v, part, scenario, key)
            if n == 0:
                continue
            out[fig][v] = {"n": n, "recovered": len(vals), "hangs": n - len(vals),
                           "min": min(vals) if vals else None,
                           "median": round(statistics.median(vals), 3) if vals else None,
                           "max": max(vals) if vals else None}
    return out


def ratios(summary: dict, variants: list[str]) -> dict:
    out: dict = {}
    for fig, per in summary.items():
        if not fig.endswith("time_s"):
            continue
        for f in (v for v in variants if v.startswith("ftrain")):
            for t in (v for v in variants if v.startswith("torchrun")):
                a, b = per.get(f, {}).get("median"), per.get(t, {}).get("median")
                if a is not None and b:
                    out.setdefault(fig, {})[f"{f}/{t}"] = round(a / b, 2)
    return out


def print_table(summary: dict, rat: dict, variants: list[str]) -> None:
    w = 36
    head = f"{'figure':<{w}}" + "".join(f"{v:>26}" for v in variants)
    print(head)
    print(f"{'':<{w}}" + "".join(f"{'min / median / max (ok/n)':>26}" for _ in variants))
    print("-" * len(head))
    for label, part, scenario, key in FIGURES:
        fig = f"{scenario or part}.{key}"
        cells = []
        for v in variants:
            s = summary[fig].get(v)
            if s is None:
                cells.append(f"{'-':>26}")
            elif s["median"] is None:
                text = f"none (0/{s['n']})"
                cells.append(f"{text:>26}")
            else:
                fmt = (lambda x: f"{x:.2f}") if key.endswith("_s") else (lambda x: f"{x:g}")
                text = f"{fmt(s['min'])} / {fmt(s['median'])} / {fmt(s['max'])} ({s['recovered']}/{s['n']})"
                cells.append(f"{text:>26}")
        print(f"{label:<{w}}" + "".join(cells))
    if rat:
        print()
        print("ratio of medians, ftrain / torchrun (below 1: ftrain faster)")
        for fig, per in rat.items():
            print(f"  {fig:<26}" + "  ".join(f"{k} = {v:.2f}" for k, v in per.items()))


def phase_table(trials: list[dict], variants: list[str]) -> dict:
    """Median time from the fault to each milestone, per fault and variant (where the time goes).

    For ftrain also the control plane's view from the job's events: when a surviving node
    began re-forming the group (RECOVERING), when the group was formed (rank 0's report),
    when it trained again (the new group's first step, as the control plane recorded it),
    and for a join when the scheduler gave the job the new node.
    """
    out: dict = {}
    marks = {"recovering": lambda r: r["state"] == "RECOVERING",
             "group_formed": lambda r: r["reason"].startswith(("group formed", "rendezvous complete")),
             "training_again": lambda r: r["reason"].startswith("training again"),
             "node_given": lambda r: "joined; scaling up" in r["reason"],
             "lease_lapsed": lambda r: "lease lapsed" in r["reason"]}
    for scenario in SCENARIOS:
        for v in variants:
            rows = [t for t in trials if t["variant"] == v and t["scenario"] == scenario
                    and t.get("fault", {}).get("recovered")]
            if not rows:
                continue
            got: dict = {}
            for name in ("first_worker_boot", "rank0_process_group", "rank0_resumed", "first_step"):
                vals = [r["fault"]["phases_s"][name] for r in rows
                        if r["fault"]["phases_s"].get(name) is not None]
                if vals:
                    got[name] = round(statistics.median(vals), 2)
            for name in ("stop_old", "torchrun_started"):  # the survivor's agent (ftrain)
                vals = [r["diagnostics"]["agent"][name] for r in rows
                        if r.get("diagnostics", {}).get("agent", {}).get(name) is not None]
                if vals:
                    got[f"agent:{name}"] = round(statistics.median(vals), 2)
            names = dict.fromkeys(k for r in rows for k in r.get("diagnostics", {}).get("marks", {}))
            for name in names:  # each node's torchrun (worker/rendezvous/marks.py)
                vals = [r["diagnostics"]["marks"][name] for r in rows
                        if name in r.get("diagnostics", {}).get("marks", {})]
                got[f"marks:{name}"] = round(statistics.median(vals), 3)
            for name, match in marks.items():
                vals = []
                for r in rows:
                    ts = [e["t"] for e in r.get("diagnostics", {}).get("events", [])
                          if e["t"] > 0 and match(e)]
                    if ts:
                        vals.append(min(ts))
                if vals:
                    got[f"cp:{name}"] = round(statistics.median(vals), 2)
            out.setdefault(scenario, {})[v] = got
    return out


def print_phases(phases: dict) -> None:
    print("where the time goes: median seconds from the fault to each milestone")
    print("  (cp:* from ftrain's job events, cp:lease_lapsed its lost node's lease revoked or lapsed;")
    print("   agent:* from the surviving agent's log; the rest from the workload's log lines;")
    print("   per node: its torchrun's phase marks, killed = the node the fault hit)")
    order = ["cp:node_given", "cp:recovering", "cp:lease_lapsed", "agent:stop_old", "agent:torchrun_started",
             "cp:group_formed", "first_worker_boot",
             "rank0_process_group", "rank0_resumed", "first_step"]
    for scenario, per in phases.items():
        print(f"  {scenario}")
        for v, got in per.items():
            print(f"    {v:<17} " + "  ".join(f"{k}={got[k]}" for k in order if k in got))
            for role in ("killed", "other", "joined"):
                seen = sorted((t, k.split(":", 2)[2]) for k, t in got.items()
                              if k.startswith(f"marks:{role}:"))
                if seen:
                    print(f"      {role + ' node':<15} " + "  ".join(f"{k}={t}" for t, k in seen))
            if "marks:group_formed" in got:
                print(f"      {'group formed':<15} {got['marks:group_formed']} (round complete, "
                      "workers started on every node)")


def print_runtime_phases(trials: list[dict]) -> None:
    """Medians of rank 0's start-up and restore phases (runtime mode), per fault."""
    for scenario in SCENARIOS:
        rows = [t["fault"] for t in trials if t["scenario"] == scenario
                and t.get("fault", {}).get("recovered") and t["fault"].get("runtime_phases_s")]
        if not rows:
            continue
        names = list(dict.fromkeys(k for r in rows for k in r["runtime_phases_s"]))
        parts = []
        for k in names:
            vals = [r["runtime_phases_s"][k] for r in rows if k in r["runtime_phases_s"]]
            parts.append(f"{k[:-2]}={statistics.median(vals):.3f}")
        setups = [r["first_step_mem_setup_ms"] for r in rows if r.get("first_step_mem_setup_ms")]
        if setups:
            parts.append(f"first-step memory setup={statistics.median(setups):.1f} ms")
        firsts = [r["first_step_ms"] for r in rows if r.get("first_step_ms")]
        if firsts:
            parts.append("first step (ms): " + " ".join(
                f"{k}={statistics.median(f[k] for f in firsts):.1f}" for k in firsts[0]))
        print(f"  {scenario:<12} rank 0 (s, median of {len(rows)}): " + "  ".join(parts))


def print_memory_tier(trials: list[dict]) -> None:
    """The memory tier's cost per step, as the training thread of rank 0 saw it before the faults."""
    for variant in dict.fromkeys(t["variant"] for t in trials if t.get("memory_tier")):
        costs = [t["memory_tier"] for t in trials if t.get("memory_tier") and t["variant"] == variant]
        mem = statistics.median(c["mem_ms_median"] for c in costs)
        periods = [c["step_period_ms_median"] for c in costs if c["step_period_ms_median"]]
        period = statistics.median(periods) if periods else None
        every = statistics.median(c["mem_every_median"] for c in costs)
        share = f" = {100 * mem / period:.1f}% of a {period:.1f} ms step period" if period else ""
        print()
        print(f"memory tier ({variant}, {len(costs)} session(s)): the training thread's time in it "
              f"{mem:.2f} ms per step (median){share}; a copy every {every:g} step(s)")
        marks = [c["mark_ms_median"] for c in costs if c.get("mark_ms_median") is not None]
        if marks:  # the step boundary's mark: RNG states kept every step, the state's skeleton (CPU)
            mark = statistics.median(marks)
            share = f" = {100 * mark / period:.2f}% of the step period" if period else ""
            print(f"  of which every step's mark (RNG states kept, the boundary noted): {mark:.3f} ms{share}")


def _uptime() -> str:
    try:
        done = subprocess.run(["uptime"], capture_output=True, text=True, timeout=5, check=False)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 trial of torchrun-tuned and ftrain (< 5 min)")
    ap.add_argument("--trials", type=int, help="trials per variant and fault (default 5; --quick 1)")
    ap.add_argument("--variants", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--scenarios", help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--deadline", type=float, default=60.0,
                    help="a fault not recovered by then is a hang (s)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "recovery.json")
    ap.add_argument("--workdir", type=Path, help="keep the trials' logs here (default: a temporary dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--from-json", type=Path, help="print the tables of an earlier run's JSON and exit")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: NCCL, each node on its own GPU (join needs 3 GPUs)")
    ap.add_argument("--width", type=int, help="the workload MLP's width (default: the workload's)")
    ap.add_argument("--memory-every", type=int,
                    help="ftrain jobs: a memory-tier copy every K steps (FTRAIN_MEMORY_EVERY; default: "
                         "the runtime picks K to fit its budget)")
    args = ap.parse_args()
    global GPUS
    if args.device == "cuda":
        import torch

        GPUS = torch.cuda.device_count()
        if GPUS < 2:
            ap.error(f"--device cuda needs at least 2 GPUs; this machine has {GPUS}")
        WORKLOAD_ARGS.extend(["--device", "cuda"])
    if args.width:
        WORKLOAD_ARGS.extend(["--width", str(args.width)])
    if args.memory_every is not None:
        JOB_ENV["FTRAIN_MEMORY_EVERY"] = str(args.memory_every)
    if args.from_json:
        old = json.loads(args.from_json.read_text())
        vs = old["config"]["variants"]
        print(f"{old['config']['command']}; load before: {old['machine']['load_before']}")
        print_table(summarize(old["trials"], vs), ratios(summarize(old["trials"], vs), vs), vs)
        print()
        print_phases(phase_table(old["trials"], vs))
        return 0

    trials_n = args.trials or (1 if args.quick else 5)
    variants = (args.variants.split(",") if args.variants
                else ["torchrun-tuned", "ftrain", "ftrain-runtime"] if args.quick else list(VARIANTS))
    scenarios = args.scenarios.split(",") if args.scenarios else list(SCENARIOS)
    scenarios_of = {v: scenarios for v in variants}
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="ftrain-bench-recovery-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    load_before = _uptime()
    started = time.time()
    print(f"recovery benchmark: {trials_n} trial(s) x {variants} x {scenarios}; logs in {root}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; {load_before}")

    uses_ftrain = any(VARIANTS[v]["kind"] == "ftrain" for v in variants)
    stack = FtrainStack(root / "ftrain").start() if uses_ftrain else None
    trials: list[dict] = []
    try:
        for trial in range(trials_n):
            for faults in sessions_for(scenarios):
                delay_s = rng.uniform(0, SNAPSHOT_EVERY * STEP_TIME_S)
                order = variants[trial % len(variants):] + variants[:trial % len(variants)]
                for variant in order:
                    todo = [f for f in faults if f in scenarios_of[variant]]
                    while todo:
                        records = run_session(variant, todo, trial, root, stack, args.deadline, delay_s)
                        done = {r["scenario"] for r in records}
                        todo = [f for f in todo if f not in done]  # after a hang: a fresh session
                        for r in records:
                            r["load"] = os.getloadavg()[0]
                            trials.append(r)
                            f = r.get("fault", {})
                            cold = r.get("cold_start", {}).get("time_s", "-")
                            recovery, lost = f.get("time_s", "HANG"), f.get("steps_lost", "-")
                            phases = f.get("phases_s", f.get("error"))
                            print(f"  trial {trial} {r['scenario']:<11} {variant:<17} cold {cold!s:>6} s"
                                  f"  recovery {recovery!s:>6} s  lost {lost!s:>3}"
                                  f"  world {f.get('world_after', '-')}  phases {phases}", flush=True)
                        if not records:
                            break
    finally:
        if stack:
            stack.stop()

    summary = summarize(trials, variants)
    rat = ratios(summary, variants)
    load_after = _uptime()
    print()
    print(f"load before: {load_before}")
    print(f"load after:  {load_after}")
    print(f"wall time: {time.time() - started:.0f} s")
    print()
    print_table(summary, rat, variants)
    phases = phase_table(trials, variants)
    print()
    print_phases(phases)
    print_runtime_phases(trials)
    print_memory_tier(trials)
    import torch
    gpus = [torch.cuda.get_device_name(i) for i in range(GPUS)]
    result = {"machine": {"host": platform.node(), "cores": os.cpu_count(), "torch": torch.__version__,
                          "python": platform.python_version(), "load_before": load_before,
                          "load_after": load_after, "gpus": gpus},
              "config": {"trials": trials_n, "variants": variants, "scenarios": scenarios,
                         "deadline_s": args.deadline, "snapshot_every": SNAPSHOT_EVERY,
                         "step_time_s": STEP_TIME_S, "warm_steps": WARM_STEPS,
                         "tuned_conf": TUNED_CONF, "command": " ".join(sys.argv),
                         "workload_args": WORKLOAD_ARGS, "job_env": JOB_ENV},
              "summary": summary, "ratios": rat, "phases": phases, "trials": trials}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print()
    print(f"JSON written to {args.out}:")
    print(json.dumps({"machine": result["machine"], "config": result["config"], "summary": summary,
                      "ratios": rat, "phases": phases}, indent=1))
    if not args.workdir:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
