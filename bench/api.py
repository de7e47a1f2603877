"""Control-plane load: status reads, submissions and heartbeats, against the machine's ceiling.

    python bench/api.py                        # 1,000 nodes, 10 s per phase, table + JSON
    python bench/api.py --quick                # 5 s per phase
    python bench/api.py --nodes 5000 --heartbeats-only --duration 60   # do leases lapse?
    python bench/api.py --quick --profile cp.prof   # where the control plane's time goes

Starts a real etcd and a real control plane (`ftrain serve`, uvicorn) on loopback, and:

* `--ceiling` (on by default): the same app stack (FastAPI, the body-size middleware,
  uvicorn as `ftrain serve` runs it) answering a constant from memory, loaded by the same
  clients: what this machine serves at most, before the nodes register ("quiet") and again
  while they heartbeat, so the figures read as a share of the machine's own ceiling;
* the heartbeat load (`--hb-procs` processes, each with a share of the nodes): registers
  `--nodes` nodes with the node token, then heartbeats each with its own credential at the
  interval the control plane gives it (TTL/4), phase-shifted evenly, for the whole run; it
  records every beat (beats a second against those due, latency, leases lapsed: a 404,
  after which the node registers again, as an agent does);
* one job training: a job of one node is handed to a fake node, which reports it running
  and reports progress every second with the job's token, as rank 0 does;
* the request load, one phase at a time, `--concurrency` requests in flight: `GET
  /v1/jobs/{id}` (status reads) and `POST /v1/jobs` (submissions; each job wants one node,
  so the scheduler hands them the fake nodes and the rest wait PENDING), each with wrk where
  installed (a C client) and with a lean Python client (bench/wire.py), in processes of
  their own.

Each request phase is also given as a share of the ceiling the same client measured in the
same run ("x ceil": quiet; under the heartbeats in the lines below the table), and with the
user requests the control plane shed with 429 (service/admission.py: node traffic first).
Every phase reports the CPU each process used (cores): the load generators run on the same
machine as the server, and their share is printed. Writes bench/results/api.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx

TICKS = os.sysconf("SC_CLK_TCK")
SUBMISSION = {"name": "load", "command": ["python", "-c", "pass"], "nodes": {"min": 1, "max": 1},
              "max_restarts": 0}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


# ------------------------------------------------------------------ role: heartbeat load

async def heartbeat_role(args) -> None:
    from bench.wire import Client

    # This process beats for nodes first, first + step, ... (several processes share the load).
    names = [f"load-{i:05d}" for i in range(args.first, args.nodes, args.step)]
    client = Client(args.server, conns=args.connections, token=args.token)
    beats: list[tuple[float, float, int, float]] = []  # (sent at, latency, status, lag)
    interval_of: dict[str, float] = {}
    credential: dict[str, str] = {}  # each node's own, from its registration
    lease: dict[str, int | None] = {}
    training: dict[str, asyncio.Task] = {}  # the job that trains, on the node it was given
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    sem = asyncio.Semaphore(32)

    async def register(name: str) -> None:
        async with sem:
            # As an agent does: a 503 (etcd slow to answer on a loaded machine) is tried again;
            # a 409 after one (the first try registered the name, its answer was lost) once the
            # lease that try took has lapsed.
            deadline = time.monotonic() + 120
            while True:
                r = await client.request("POST", "/v1/nodes/register", {"name": name, "nproc_per_node": 1})
                if r.status == 200:
                    break
                if r.status not in (409, 502, 503, 504) or time.monotonic() > deadline:
                    raise RuntimeError(f"register {name}: {r.status} {r.body[:200]!r}")
                await asyncio.sleep(0.5)
            body = r.json()
            interval_of[name] = float(body["timeouts"]["heartbeat_interval_s"])
            credential[name], lease[name] = body["credential"], body.get("lease_id")

    async def train(name: str, a: dict) -> None:
        """Hold the job RUNNING as an agent would, and report progress as rank 0 does."""
        report = {"job_id": a["job_id"], "attempt": a["attempt"]}
        await client.request("POST", f"/v1/nodes/{name}/report", {**report, "state": "running"},
                             token=credential[name])
        step = 0
        while not stop.is_set():
            step += 10
            await client.request("POST", f"/v1/jobs/{a['job_id']}/progress",
                                 {"step": step, "loss": 1.0 / step, "attempt": a["attempt"]},
                                 token=a["job_token"])
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)

    t = time.monotonic()
    register_s = 0.0

    async def node(i: int, name: str) -> None:
        """Register, then beat at once, as an agent does (registering 5,000 nodes takes longer
        than a lease: the first ones would lapse if they waited for the last)."""
        nonlocal register_s
        await register(name)
        if len(interval_of) == len(names):
            register_s = time.monotonic() - t
            Path(args.ready_file).write_text(json.dumps({"register_s": register_s,
                                                         "interval_s": interval_of[name]}))
        await beat(i, name)

    async def beat(i: int, name: str) -> None:
        interval = interval_of[name]
        start = time.monotonic() + interval * i / len(names)  # spread evenly over one interval
        k = 0
        while not stop.is_set():
            due = start + k * interval
            delay = due - time.monotonic()
            if delay > 0:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                    return
                except TimeoutError:
                    pass
            sent = time.monotonic()
            try:
                r = await client.request("POST", f"/v1/nodes/{name}/heartbeat",
                                         {"lease_id": lease.get(name)}, token=credential[name])
                code = r.status
                if code == 404:  # the lease lapsed: register again, as an agent would
                    await register(name)
                elif code == 200 and name not in training:
                    a = r.json()["assignment"]
                    if a is not None and a["job_id"].startswith("train-") and a["action"] == "run":
                        training[name] = asyncio.create_task(train(name, a))
            except (OSError, asyncio.IncompleteReadError, RuntimeError):
                code = 0
            took = time.monotonic() - sent
            beats.append((time.time() - took, took, code, sent - due))
            k += 1
            if time.monotonic() - due > interval:  # fell behind by more than a beat: skip ahead
                k = int((time.monotonic() - start) / interval) + 1

    await asyncio.gather(*(node(i, n) for i, n in enumerate(names)))
    interval = min(interval_of.values())
    for task in training.values():
        task.cancel()
    Path(args.stats_file).write_text(json.dumps({"register_s": register_s, "interval_s": interval,
                                                 "beats": beats, "training": sorted(training)}))


# ------------------------------------------------------------------ role: request load

async def load_role(args) -> None:
    from bench.wire import Client

    ids = args.job_ids.split(",") if args.job_ids else []
    client = Client(args.server, conns=args.concurrency, token=args.token)
    latencies: list[float] = []
    started: list[float] = []  # when each request was sent (for the p99 of each second)
    codes: dict[int, int] = {}
    end = time.monotonic() + args.duration

    async def worker(w: int) -> None:
        i = 0
        while time.monotonic() < end:
            i += 1
            t = time.perf_counter()
            try:
                if args.kind == "read":
                    r = await client.request("GET", f"/v1/jobs/{ids[(w + i) % len(ids)]}")
                elif args.kind == "ceiling":
                    r = await client.request("GET", "/ceiling")
                else:
                    r = await client.request("POST", "/v1/jobs", SUBMISSION)
                code = r.status
            except (OSError, asyncio.IncompleteReadError):
                code = 0
            latencies.append(time.perf_counter() - t)
            started.append(t)
            codes[code] = codes.get(code, 0) + 1
            if code == 429 and r.retry_after_s:  # as the CLI and the runtime do (service/client.py)
                await asyncio.sleep(min(r.retry_after_s, max(0.0, end - time.monotonic())))

    t0 = time.monotonic()
    p0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    elapsed = time.monotonic() - t0
    ok = sum(n for c, n in codes.items() if 200 <= c < 300)
    by_second: dict[int, list[float]] = {}
    for t, took in zip(started, latencies, strict=True):
        by_second.setdefault(int(t - p0), []).append(took)
    print(json.dumps({"requests": len(latencies), "ok": ok, "codes": codes, "elapsed_s": elapsed,
                      "per_s": ok / elapsed, "p50_ms": pct(latencies, 50) * 1e3,
                      "p99_ms": pct(latencies, 99) * 1e3, "max_ms": max(latencies) * 1e3,
                      "p99_ms_by_second": [round(pct(v, 99) * 1e3, 1)
                                           for _, v in sorted(by_second.items())]}))


# ------------------------------------------------------------------ role: the ceiling

def ceiling_role(args) -> None:
    """The control plane's app stack (FastAPI, its body-size middleware, uvicorn as `ftrain
    serve` runs it, each answer in one write) answering one constant from memory: what this
    machine serves at most."""
    import uvicorn
    from fastapi import FastAPI

    from service.app import BodySizeLimit

    app = FastAPI(title="ceiling")
    app.add_middleware(BodySizeLimit, max_bytes=64 * 1024)
    constant = {"id": "ceiling-000000", "state": "RUNNING", "attempt": 1}

    @app.get("/ceiling")
    async def ceiling() -> dict:
        return constant

    from service.one_write import OneWriteHttp

    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", http=OneWriteHttp)


# ------------------------------------------------------------------ the orchestrator

def cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (OSError, IndexError, ValueError):
        return float("nan")


def submission_script(root: Path) -> Path:
    """A wrk script that submits jobs (each wants one node), as fast as it can."""
    path = root / "submit.lua"
    path.write_text('wrk.method = "POST"\n'
                    f"wrk.body = '{json.dumps(SUBMISSION)}'\n"
                    'wrk.headers["Content-Type"] = "application/json"\n')
    return path


def run_wrk(url: str, token: str, concurrency: int, duration: float,
            script: Path | None = None) -> dict | None:
    wrk = shutil.which("wrk")
    if not wrk:
        return None
    out = subprocess.run([wrk, "-t2", f"-c{concurrency}", f"-d{int(duration)}s", "--latency",
                          *(["-s", str(script)] if script else []),
                          "-H", f"Authorization: Bearer {token}", url],
                         capture_output=True, text=True, timeout=duration + 30, check=False).stdout
    def ms(text: str) -> float:
        m = re.match(r"([\d.]+)(us|ms|s)", text)
        v = float(m.group(1))
        return v / 1000 if m.group(2) == "us" else v * 1000 if m.group(2) == "s" else v
    rate = re.search(r"Requests/sec:\s+([\d.]+)", out)
    total = re.search(r"(\d+) requests in", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)  # the latency distribution, not a Stdev share
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if not rate:
        return {"error": out[-500:]}
    bad = int(non2xx.group(1)) if non2xx else 0
    share_ok = 1 - bad / max(1, int(total.group(1))) if total else 1.0
    return {"per_s": float(rate.group(1)) * share_ok, "p50_ms": ms(p50.group(1)),
            "p99_ms": ms(p99.group(1)), "non_2xx": bad}


ETCD_DISK = {"wal fsync": "etcd_disk_wal_fsync_duration_seconds",
             "backend commit": "etcd_disk_backend_commit_duration_seconds"}


def etcd_disk(url: str) -> dict[str, dict[float, float]]:
    """etcd's own histograms of its disk waits (cumulative buckets, from its /metrics)."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out: dict[str, dict[float, float]] = {}
    for label, name in ETCD_DISK.items():
        for m in re.finditer(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M):
            out.setdefault(label, {})[float(m.group(1))] = float(m.group(2))
    return out


def etcd_disk_delta(before: dict, after: dict) -> dict:
    """Per histogram: how many waits in the window, and the bucket bound (ms) under which
    99% and all of them fell (what a submission waits on when etcd's disk is shared)."""
    out = {}
    for label, hist in after.items():
        prior = before.get(label, {})
        n = hist.get(float("inf"), 0) - prior.get(float("inf"), 0)
        if n <= 0:
            continue
        def bound(q: float, hist=hist, prior=prior, n=n) -> float:
            return next(le for le in sorted(hist) if hist[le] - prior.get(le, 0) >= q * n)
        out[label] = {"n": int(n), "p99_le_ms": bound(0.99) * 1e3, "max_le_ms": bound(1.0) * 1e3}
    return out


def beat_stats(beats: list, t0: float, t1: float, nodes: int, interval: float) -> dict:
    window = [b for b in beats if t0 <= b[0] < t1]
    lat = [b[1] for b in window]
    lag = [b[3] for b in window]
    return {"beats_per_s": round(len(window) / (t1 - t0), 1), "due_per_s": round(nodes / interval, 1),
            "p50_ms": round(pct(lat, 50) * 1e3, 1) if lat else None,
            "p99_ms": round(pct(lat, 99) * 1e3, 1) if lat else None,
            "late_p99_ms": round(pct(lag, 99) * 1e3, 1) if lag else None,
            "lapsed_404": sum(1 for b in window if b[2] == 404),
            "errors": sum(1 for b in window if b[2] not in (200, 404))}


CEILINGS = ("quiet", "under the heartbeats")


def ceiling_ratios(phases: dict) -> None:
    """Each request phase's rate as a share of the ceiling the same client measured in the
    same run, quiet and under the heartbeats: `vs_ceiling`, in place."""
    for name, got in phases.items():
        if name.startswith("ceiling") or "per_s" not in got or "(" not in name:
            continue
        client = name[name.rindex("("):]
        got["vs_ceiling"] = {label: round(got["per_s"] / c["per_s"], 2) for label in CEILINGS
                             if (c := phases.get(f"ceiling, {label} {client}")) and c.get("per_s")}


def profiled_control_plane(base, profile: Path | None):
    """`base` (tests.helpers.processes.ControlPlane), its process run under cProfile if asked."""
    if profile is None:
        return base

    class Profiled(base):
        def start(self, timeout_s: float = 30.0):
            real = sys.executable
            wrapper = self.workdir / "python-cprofile"
            self.workdir.mkdir(parents=True, exist_ok=True)
            # uvicorn re-raises SIGTERM after its graceful shutdown, with the handler it found
            # in place: this one, which writes the stats (python -m cProfile never would).
            runner = self.workdir / "cprofile_run.py"
            runner.write_text(
                "import cProfile, runpy, signal, sys\n"
                "p = cProfile.Profile()\n"
                "def dump(*_):\n"
                f"    p.disable(); p.dump_stats({str(profile.resolve())!r}); sys.exit(0)\n"
                "signal.signal(signal.SIGTERM, dump)\n"
                "module, sys.argv = sys.argv[2], [sys.argv[2], *sys.argv[3:]]  # -m MODULE ARGS\n"
                "p.enable()\n"
                "runpy.run_module(module, run_name='__main__', alter_sys=True)\n")
            wrapper.write_text(f"#!/bin/sh\nexec {real} {runner} \"$@\"\n")
            wrapper.chmod(0o755)
            sys.executable = str(wrapper)
            try:
                return super().start(timeout_s)
            finally:
                sys.executable = real

    return Profiled


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("main", "heartbeat", "load", "ceiling"), default="main",
                    help=argparse.SUPPRESS)
    ap.add_argument("--server", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--token", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--stats-file", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=("read", "submit", "ceiling"), help=argparse.SUPPRESS)
    ap.add_argument("--job-ids", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--connections", type=int, default=64, help="heartbeat connections per process")
    ap.add_argument("--hb-procs", type=int, default=2, help="processes sharing the heartbeat load")
    ap.add_argument("--nodes", type=int, default=1000, help="registered nodes heartbeating")
    ap.add_argument("--node-ttl", type=int, default=None,
                    help="the control plane's node lease TTL (s); nodes beat every TTL/4 "
                         "(default: the control plane's own, 6 s)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--quick", action="store_true", help="5 s per phase")
    ap.add_argument("--ceiling", action=argparse.BooleanOptionalAction, default=True,
                    help="measure the machine's ceiling too: the same app stack serving a constant "
                         "from memory, before the nodes register and again under their heartbeats")
    ap.add_argument("--phases", default="reads,submissions",
                    help="the request phases to run, of reads,submissions (e.g. --phases submissions)")
    ap.add_argument("--heartbeats-only", action="store_true",
                    help="no request phases: the nodes heartbeat for --duration (e.g. --nodes 5000)")
    ap.add_argument("--profile", type=Path, default=None,
                    help="run the control plane under cProfile and write its stats here (it runs slower)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the run's folder (etcd's data, the control plane's log) and say where")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "api.json")
    args = ap.parse_args()
    if args.role == "heartbeat":
        asyncio.run(heartbeat_role(args))
        return 0
    if args.role == "load":
        asyncio.run(load_role(args))
        return 0
    if args.role == "ceiling":
        ceiling_role(args)
        return 0
    if args.quick:
        args.duration = 5.0

    from bench.harness import ControlPlane, EtcdProcess, wait_for

    root = Path(tempfile.mkdtemp(prefix="ftrain-bench-api-"))
    etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log").start()
    cp_env = {"FTRAIN_NODE_TTL_S": str(args.node_ttl)} if args.node_ttl else {}
    cp = profiled_control_plane(ControlPlane, args.profile)(etcd.endpoint, root / "cp", env=cp_env).start()
    me = [sys.executable, str(Path(__file__).resolve())]
    load_before = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"api benchmark: {args.nodes} nodes heartbeating, concurrency {args.concurrency}, "
          f"{args.duration:g} s per phase; control plane {cp.url}; wrk: {bool(shutil.which('wrk'))}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; {load_before}")
    hbs: list[subprocess.Popen] = []
    result: dict = {"phases": {}}
    pids = {"control plane": cp.proc.pid, "etcd": etcd.proc.pid}
    finished = False

    def phase(name: str, argv: list[str] | None, runner=None) -> None:
        before = {k: cpu_s(p) for k, p in pids.items()}
        disk_before = etcd_disk(etcd.endpoint)
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.time()
        if argv is not None:
            # The load generator's CPU is read from the rusage of its wait (RUSAGE_CHILDREN).
            proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
            out, _ = proc.communicate(timeout=args.duration + 120)
            got = json.loads(out.strip().splitlines()[-1])
        else:
            got = runner() or {}
        t1 = time.time()
        cpu = {k: round((cpu_s(p) - before[k]) / (t1 - t0), 2) for k, p in pids.items()}
        cpu["heartbeat load"] = round(
            sum(v for k, v in cpu.items() if k.startswith("heartbeat load ")), 2)
        done = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu["load"] = round((done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime)
                            / (t1 - t0), 2)
        got["cpu_cores"] = cpu
        got["etcd_disk"] = etcd_disk_delta(disk_before, etcd_disk(etcd.endpoint))
        got["window"] = (t0, t1)
        result["phases"][name] = got
        print(f"  {name}: {got.get('per_s', 0):.0f}/s, p50 {got.get('p50_ms', 0):.1f} ms, "
              f"p99 {got.get('p99_ms', 0):.1f} ms; cpu {cpu}", flush=True)
        if "p99_ms_by_second" in got:
            print(f"    p99 ms of each second: {got['p99_ms_by_second']}", flush=True)
        if got["etcd_disk"]:
            print("    etcd's disk: " + "; ".join(
                f"{label} {d['n']}, p99 <= {d['p99_le_ms']:g} ms, max <= {d['max_le_ms']:g} ms"
                for label, d in got["etcd_disk"].items()), flush=True)

    def ceiling_phases(label: str) -> None:
        port = free_port()
        server = subprocess.Popen([*me, "--role", "ceiling", "--port", str(port)], cwd=REPO)
        pids["ceiling server"] = server.pid
        url = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: httpx.get(f"{url}/ceiling", timeout=1).status_code == 200, 30,
                     "the ceiling server")
            if shutil.which("wrk"):
                phase(f"ceiling, {label} (wrk)", None,
                      lambda: run_wrk(f"{url}/ceiling", "x", args.concurrency, args.duration))
            phase(f"ceiling, {label} (python)",
                  [*me, "--role", "load", "--server", url, "--token=x", "--kind", "ceiling",
                   "--concurrency", str(args.concurrency), "--duration", str(args.duration)])
        finally:
            server.terminate()
            server.wait(30)
            del pids["ceiling server"]

    try:
        if args.ceiling:
            ceiling_phases("quiet")
        for k in range(args.hb_procs):
            hbs.append(subprocess.Popen(
                [*me, "--role", "heartbeat", "--server", cp.url, f"--token={cp.node_token}",
                 "--nodes", str(args.nodes), "--first", str(k), "--step", str(args.hb_procs),
                 "--connections", str(args.connections), "--ready-file", str(root / f"ready-{k}.json"),
                 "--stats-file", str(root / f"beats-{k}.json")], cwd=REPO))
            pids[f"heartbeat load {k}"] = hbs[-1].pid
        wait_for(lambda: all((root / f"ready-{k}.json").exists() for k in range(args.hb_procs)), 600,
                 f"{args.nodes} nodes to register")
        info = [json.loads((root / f"ready-{k}.json").read_text()) for k in range(args.hb_procs)]
        print(f"registered {args.nodes} nodes in {max(i['register_s'] for i in info):.1f} s; heartbeat every "
              f"{info[0]['interval_s']:g} s each, from {args.hb_procs} process(es)")

        # The CLI's client: a 503 (etcd slow on a loaded machine) or a 429 is tried again.
        from service.client import FtrainClient

        with FtrainClient(cp.url, cp.user_token) as api:
            spec = {"command": ["python", "-c", "pass"], "nodes": {"min": 1, "max": 1}}
            train = api.submit({**spec, "name": "train"})["id"]
            wait_for(lambda: api.get_job(train)["state"] == "RUNNING", 60,
                     "the training job to run on a fake node")
            wait_for(lambda: (api.get_job(train).get("progress") or {}).get("step"),
                     60, "the training job's first progress report")
            job_ids = [train] + [api.submit({**spec, "name": f"read-{i}"})["id"] for i in range(7)]
        print(f"one job training ({train}: RUNNING on a fake node, progress every second)")
        time.sleep(min(3.0, args.duration))  # let the beats settle into their phases

        common = ["--role", "load", "--server", cp.url, f"--token={cp.user_token}",
                  "--concurrency", str(args.concurrency), "--duration", str(args.duration)]
        wanted = set() if args.heartbeats_only else set(args.phases.split(","))
        if "reads" in wanted:
            if shutil.which("wrk"):
                phase("status reads (wrk)", None, lambda: run_wrk(
                    f"{cp.url}/v1/jobs/{train}", cp.user_token, args.concurrency, args.duration))
            phase("status reads (python)", [*me, *common, "--kind", "read", "--job-ids", ",".join(job_ids)])
        if "submissions" in wanted:
            if shutil.which("wrk"):
                phase("submissions (wrk)", None, lambda: run_wrk(
                    f"{cp.url}/v1/jobs", cp.user_token, args.concurrency, args.duration,
                    submission_script(root)))
            phase("submissions (python)", [*me, *common, "--kind", "submit"])
        if wanted:
            if args.ceiling:
                ceiling_phases("under the heartbeats")
        phase("idle (heartbeats only)", None, lambda: time.sleep(args.duration))
        with cp.client("user") as api:  # (a 503 on a starved machine: said, not a crash)
            final = api.get(f"/v1/jobs/{train}").json()
            final.setdefault("state", f"not read: {final.get('detail', final)}")
        result["training_job"] = {"id": train, "state": final["state"],
                                  "step": (final.get("progress") or {}).get("step")}
        finished = True
    finally:
        for h in hbs:
            if h.poll() is None:
                h.send_signal(signal.SIGTERM)
        for h in hbs:
            try:
                h.wait(60)
            except subprocess.TimeoutExpired:
                h.kill()
        cp.stop()
        etcd.kill()
        if not finished:  # a failed run leaves nothing behind (etcd's data, the beats' files)
            shutil.rmtree(root, ignore_errors=True)

    beats_data = {"beats": [], "interval_s": 1.0, "register_s": None}
    for k in range(len(hbs)):
        f = root / f"beats-{k}.json"
        if f.exists():
            got = json.loads(f.read_text())
            beats_data["beats"] += got["beats"]
            beats_data["interval_s"] = got["interval_s"]
            beats_data["register_s"] = max(beats_data["register_s"] or 0, got["register_s"])
    for got in result["phases"].values():
        t0, t1 = got.pop("window")
        got["heartbeats"] = beat_stats(beats_data["beats"], t0, t1, args.nodes, beats_data["interval_s"])
    whole = [b for b in beats_data["beats"]]
    result["heartbeats_whole_run"] = {"beats": len(whole),
                                      "lapsed_404": sum(1 for b in whole if b[2] == 404),
                                      "errors": sum(1 for b in whole if b[2] not in (200, 404))}
    ceiling_ratios(result["phases"])
    load_after = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()

    print()
    print(f"load before: {load_before}")
    print(f"load after:  {load_after}")
    print()
    head = (f"{'phase':<34}{'req/s':>8}{'x ceil':>8}{'p50 ms':>9}{'p99 ms':>9}{'non-2xx':>9}{'429':>7}   "
            f"{'beats/s (due)':>15}{'beat p99 ms':>12}{'lapsed':>8}   cpu: cp / etcd / hb / load")
    print(head)
    print("-" * len(head))
    for name, g in result["phases"].items():
        h = g["heartbeats"]
        non2xx = g.get("non_2xx", g.get("requests", 0) - g.get("ok", 0)) if "per_s" in g else 0
        ratio = g.get("vs_ceiling", {}).get("quiet")
        ratio = "-" if ratio is None else f"{ratio:.2f}x"
        refused = g.get("codes", {}).get("429", "-" if "codes" not in g else 0)
        req = f"{g['per_s']:>8.0f}{ratio:>8}{g['p50_ms']:>9.1f}{g['p99_ms']:>9.1f}{non2xx:>9}{refused:>7}" \
            if "per_s" in g else f"{'-':>8}{'-':>8}{'-':>9}{'-':>9}{'-':>9}{'-':>7}"
        cpu = g["cpu_cores"]
        beats = f"{h['beats_per_s']:.0f} ({h['due_per_s']:.0f})"
        beat_p99 = "-" if h["p99_ms"] is None else f"{h['p99_ms']:.0f}"
        server = cpu.get("ceiling server", cpu["control plane"])
        print(f"{name:<34}{req}   {beats:>15}{beat_p99:>12}{h['lapsed_404']:>8}   "
              f"{server:.2f} / {cpu['etcd']:.2f} / "
              f"{cpu['heartbeat load']:.2f} / {cpu['load']:.2f}")
    for name, g in result["phases"].items():
        if g.get("vs_ceiling"):
            print(f"{name}: " + ", ".join(f"{r:.2f}x the ceiling {label}"
                                          for label, r in g["vs_ceiling"].items()))
    whole = result["heartbeats_whole_run"]
    print(f"heartbeats over the whole run: {whole['beats']}, leases lapsed (404): {whole['lapsed_404']}, "
          f"errors: {whole['errors']}; training job: {result.get('training_job')}")
    print("(x ceil: req/s as a share of the quiet ceiling of the same client in this run; 429: "
          "user requests the control plane shed, node traffic first)")
    print("(cpu: cores used; 'cp' is the ceiling server in the ceiling phases. The load "
          "generators share the machine's 2 cores with the server: their share is 'hb' + 'load'.)")
    result.update({"machine": {"host": platform.node(), "cores": os.cpu_count(), "load_before": load_before,
                               "load_after": load_after, "wrk": bool(shutil.which("wrk"))},
                   "config": {"nodes": args.nodes, "concurrency": args.concurrency,
                              "duration_s": args.duration, "heartbeat_interval_s": beats_data["interval_s"],
                              "register_s": beats_data.get("register_s"), "command": " ".join(sys.argv)}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"JSON written to {args.out}")
    if args.keep:
        print(f"kept {root} (the control plane's log: {root / 'cp'})")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
