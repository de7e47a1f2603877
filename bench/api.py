"""Control-plane load: submissions and status reads per second, with 1,000 nodes heartbeating.

    python bench/api.py                      # 1,000 nodes, 10 s per phase, table + JSON
    python bench/api.py --quick              # 5 s per phase
    python bench/api.py --nodes 200 --duration 20 --concurrency 32

Starts a real etcd and a real control plane (uvicorn) on loopback, then, each in a
process of its own (asyncio + httpx):

* the heartbeat load (`--hb-procs` processes, each with a share of the nodes): registers
  `--nodes` nodes with the node token (`POST /v1/nodes/register`) and heartbeats each at
  the interval the control plane gives it (`POST /v1/nodes/{name}/heartbeat`),
  phase-shifted evenly, for the whole run; it records every beat, so the table says
  whether the control plane kept up (beats per second against those due, their latency,
  lease lapses seen as 404). A Python client is itself costly: when it falls behind,
  the CPU column says whose fault it is;
* the request load, one phase at a time, `--concurrency` requests in flight:
  `GET /v1/jobs/{id}` over a handful of jobs (status reads), then `POST /v1/jobs`
  (submissions; the jobs need one node each, so the scheduler hands them the fake
  nodes, as it would real ones, and the rest wait PENDING).

If `wrk` is on PATH the status reads are measured again with it (a C client that costs
the machine far less than Python does; DESIGN.md's figures came from it), and so is the
most heartbeats a second the control plane answers (round robin over the nodes). Also reports
the CPU each process used per phase, since on a 2-core machine the load generators
compete with the server. Writes bench/results/api.json (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx

TICKS = os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


# ------------------------------------------------------------------ role: heartbeat load

async def heartbeat_role(args) -> None:
    headers = {"Authorization": f"Bearer {args.token}"}
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    # This process beats for nodes first, first + step, ... (several processes share the load).
    names = [f"load-{i:05d}" for i in range(args.first, args.nodes, args.step)]
    in_flight = asyncio.Semaphore(args.connections)  # queue here, not inside httpx's pool
    beats: list[tuple[float, float, int, float]] = []  # (sent at, latency, status, lag)
    registered: dict[str, float] = {}
    leases: dict[str, int | None] = {}  # sent back with each beat, as the node agent does
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    async with httpx.AsyncClient(base_url=args.server, headers=headers, limits=limits, timeout=30) as client:
        sem = asyncio.Semaphore(32)

        async def register(name: str) -> None:
            async with sem:
                r = await client.post("/v1/nodes/register", json={"name": name, "nproc_per_node": 1})
                r.raise_for_status()
                registered[name] = float(r.json()["heartbeat_interval_s"])
                leases[name] = r.json().get("lease_id")

        t = time.monotonic()
        await asyncio.gather(*(register(n) for n in names))
        register_s = time.monotonic() - t
        interval = min(registered.values())
        Path(args.ready_file).write_text(json.dumps({"register_s": register_s, "interval_s": interval}))

        async def beat(i: int, name: str) -> None:
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
                    async with in_flight:
                        r = await client.post(f"/v1/nodes/{name}/heartbeat",
                                              json={"lease_id": leases.get(name)})
                    code = r.status_code
                    if code == 404:  # the lease lapsed: register again, as an agent would
                        again = await client.post("/v1/nodes/register",
                                                  json={"name": name, "nproc_per_node": 1})
                        leases[name] = again.json().get("lease_id")
                except httpx.HTTPError:
                    code = 0
                took = time.monotonic() - sent
                beats.append((time.time() - took, took, code, sent - due))
                k += 1
                if time.monotonic() - due > interval:  # fell behind by more than a beat: skip ahead
                    k = int((time.monotonic() - start) / interval) + 1

        await asyncio.gather(*(beat(i, n) for i, n in enumerate(names)))
    Path(args.stats_file).write_text(json.dumps({"register_s": register_s, "interval_s": interval,
                                                 "beats": beats}))


# ------------------------------------------------------------------ role: request load

async def load_role(args) -> None:
    headers = {"Authorization": f"Bearer {args.token}"}
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    ids = args.job_ids.split(",") if args.job_ids else []
    latencies: list[float] = []
    codes: dict[int, int] = {}
    counter = 0
    async with httpx.AsyncClient(base_url=args.server, headers=headers, limits=limits, timeout=30) as client:
        end = time.monotonic() + args.duration

        async def worker(w: int) -> None:
            nonlocal counter
            i = 0
            while time.monotonic() < end:
                i += 1
                t = time.perf_counter()
                try:
                    if args.kind == "read":
                        r = await client.get(f"/v1/jobs/{ids[(w + i) % len(ids)]}")
                    else:
                        counter += 1
                        r = await client.post("/v1/jobs", json={
                            "name": f"load-{w}-{i}", "command": ["python", "-c", "pass"],
                            "nodes": {"min": 1, "max": 1}, "max_restarts": 0})
                    code = r.status_code
                except httpx.HTTPError:
                    code = 0
                latencies.append(time.perf_counter() - t)
                codes[code] = codes.get(code, 0) + 1

        t0 = time.monotonic()
        await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
        elapsed = time.monotonic() - t0
    ok = sum(n for c, n in codes.items() if 200 <= c < 300)
    print(json.dumps({"requests": len(latencies), "ok": ok, "codes": codes, "elapsed_s": elapsed,
                      "per_s": ok / elapsed, "p50_ms": pct(latencies, 50) * 1e3,
                      "p99_ms": pct(latencies, 99) * 1e3, "max_ms": max(latencies) * 1e3}))


# ------------------------------------------------------------------ the orchestrator

def cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / TICKS
    except (OSError, IndexError, ValueError):
        return float("nan")


def heartbeat_script(root: Path, nodes: int) -> Path:
    """A wrk script that heartbeats the registered nodes round robin, as fast as it can."""
    path = root / "heartbeat.lua"
    path.write_text("n = 0\nrequest = function()\n  n = n + 1\n"
                    "  return wrk.format('POST', "
                    f"string.format('/v1/nodes/load-%05d/heartbeat', n % {nodes}))\n"
                    "end\n")
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
    p50 = re.search(r"50%\s+(\S+)", out)
    p99 = re.search(r"99%\s+(\S+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if not rate:
        return {"error": out[-500:]}
    return {"per_s": float(rate.group(1)), "p50_ms": ms(p50.group(1)), "p99_ms": ms(p99.group(1)),
            "non_2xx": int(non2xx.group(1)) if non2xx else 0}


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("main", "heartbeat", "load"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--server", help=argparse.SUPPRESS)
    ap.add_argument("--token", help=argparse.SUPPRESS)
    ap.add_argument("--ready-file", help=argparse.SUPPRESS)
    ap.add_argument("--stats-file", help=argparse.SUPPRESS)
    ap.add_argument("--kind", choices=("read", "submit"), help=argparse.SUPPRESS)
    ap.add_argument("--job-ids", help=argparse.SUPPRESS)
    ap.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--step", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--connections", type=int, default=32, help="heartbeat connections per process")
    ap.add_argument("--hb-procs", type=int, default=2, help="processes sharing the heartbeat load")
    ap.add_argument("--nodes", type=int, default=1000, help="registered nodes heartbeating")
    ap.add_argument("--node-ttl", type=int, default=None,
                    help="the control plane's node lease TTL (s); nodes beat every TTL/4 "
                         "(default: the control plane's own, 6 s)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    ap.add_argument("--quick", action="store_true", help="5 s per phase")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "api.json")
    args = ap.parse_args()
    if args.role == "heartbeat":
        asyncio.run(heartbeat_role(args))
        return 0
    if args.role == "load":
        asyncio.run(load_role(args))
        return 0
    if args.quick:
        args.duration = 5.0

    from tests.helpers.processes import ControlPlane, EtcdProcess, wait_for

    root = Path(tempfile.mkdtemp(prefix="ftrain-bench-api-"))
    etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log").start()
    cp_env = {"FTRAIN_NODE_TTL_S": str(args.node_ttl)} if args.node_ttl else {}
    cp = ControlPlane(etcd.endpoint, root / "cp", env=cp_env).start()
    me = [sys.executable, str(Path(__file__).resolve())]
    load_before = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"api benchmark: {args.nodes} nodes heartbeating, concurrency {args.concurrency}, "
          f"{args.duration:g} s per phase; control plane {cp.url}")
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; {load_before}")
    hbs: list[subprocess.Popen] = []
    result: dict = {"phases": {}}
    try:
        hbs = []
        for k in range(args.hb_procs):
            hbs.append(subprocess.Popen(
                [*me, "--role", "heartbeat", "--server", cp.url, f"--token={cp.node_token}",
                 "--nodes", str(args.nodes), "--first", str(k), "--step", str(args.hb_procs),
                 "--connections", str(args.connections), "--ready-file", str(root / f"ready-{k}.json"),
                 "--stats-file", str(root / f"beats-{k}.json")], cwd=REPO))
        wait_for(lambda: all((root / f"ready-{k}.json").exists() for k in range(args.hb_procs)), 300,
                 f"{args.nodes} nodes to register")
        info = [json.loads((root / f"ready-{k}.json").read_text()) for k in range(args.hb_procs)]
        print(f"registered {args.nodes} nodes in {max(i['register_s'] for i in info):.1f} s; heartbeat every "
              f"{info[0]['interval_s']:g} s each, from {args.hb_procs} process(es)")
        time.sleep(min(3.0, args.duration))  # let the beats settle into their phases

        with cp.client("user") as api:
            job_ids = [api.post("/v1/jobs", json={"name": f"read-{i}", "command": ["python", "-c", "pass"],
                                                  "nodes": {"min": 1, "max": 1}}).json()["id"]
                       for i in range(8)]

        pids = {"control plane": cp.proc.pid, "etcd": etcd.proc.pid}
        pids.update({f"heartbeat load {k}": h.pid for k, h in enumerate(hbs)})

        def phase(name: str, argv: list[str] | None, runner=None) -> None:
            before = {k: cpu_s(p) for k, p in pids.items()}
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            t0 = time.time()
            if argv is not None:
                # The load generator's CPU is read from the rusage of its wait (RUSAGE_CHILDREN).
                proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, text=True)
                out, _ = proc.communicate(timeout=args.duration + 120)
                got = json.loads(out.strip().splitlines()[-1])
            else:
                got = runner()
            t1 = time.time()
            cpu = {k: round((cpu_s(p) - before[k]) / (t1 - t0), 2) for k, p in pids.items()}
            cpu["heartbeat load"] = round(
                sum(v for k, v in cpu.items() if k.startswith("heartbeat load ")), 2)
            done = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu["load"] = round((done.ru_utime + done.ru_stime - children.ru_utime - children.ru_stime)
                                / (t1 - t0), 2)
            got["cpu_cores"] = cpu
            got["window"] = (t0, t1)
            result["phases"][name] = got
            print(f"  {name}: {got.get('per_s', 0):.0f}/s, p50 {got.get('p50_ms', 0):.1f} ms, "
                  f"p99 {got.get('p99_ms', 0):.1f} ms; cpu {cpu}", flush=True)

        common = ["--role", "load", "--server", cp.url, f"--token={cp.user_token}",
                  "--concurrency", str(args.concurrency), "--duration", str(args.duration)]
        phase("status reads (httpx)", [*me, *common, "--kind", "read", "--job-ids", ",".join(job_ids)])
        if shutil.which("wrk"):
            phase("status reads (wrk)", None, lambda: run_wrk(f"{cp.url}/v1/jobs/{job_ids[0]}", cp.user_token,
                                                              args.concurrency, args.duration))
        phase("submissions (httpx)", [*me, *common, "--kind", "submit"])
        if shutil.which("wrk"):
            phase("heartbeats, max (wrk)", None,
                  lambda: run_wrk(cp.url, cp.node_token, args.concurrency, args.duration,
                                  heartbeat_script(root, args.nodes)))
        phase("idle (heartbeats only)", None, lambda: time.sleep(args.duration) or {})
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
    load_after = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()

    print()
    print(f"load before: {load_before}")
    print(f"load after:  {load_after}")
    print()
    head = (f"{'phase':<24}{'req/s':>8}{'p50 ms':>9}{'p99 ms':>9}{'non-2xx':>9}   "
            f"{'beats/s (due)':>15}{'beat p99 ms':>12}{'lapsed':>8}   cpu: cp / etcd / hb / load")
    print(head)
    print("-" * len(head))
    for name, g in result["phases"].items():
        h = g["heartbeats"]
        non2xx = g.get("non_2xx", g.get("requests", 0) - g.get("ok", 0)) if "per_s" in g else 0
        req = f"{g['per_s']:>8.0f}{g['p50_ms']:>9.1f}{g['p99_ms']:>9.1f}{non2xx:>9}" if "per_s" in g \
            else f"{'-':>8}{'-':>9}{'-':>9}{'-':>9}"
        cpu = g["cpu_cores"]
        beats = f"{h['beats_per_s']:.0f} ({h['due_per_s']:.0f})"
        beat_p99 = "-" if h["p99_ms"] is None else f"{h['p99_ms']:.0f}"
        print(f"{name:<24}{req}   {beats:>15}{beat_p99:>12}{h['lapsed_404']:>8}   "
              f"{cpu['control plane']:.2f} / {cpu['etcd']:.2f} / "
              f"{cpu['heartbeat load']:.2f} / {cpu['load']:.2f}")
    result.update({"machine": {"host": platform.node(), "cores": os.cpu_count(), "load_before": load_before,
                               "load_after": load_after, "wrk": bool(shutil.which("wrk"))},
                   "config": {"nodes": args.nodes, "concurrency": args.concurrency,
                              "duration_s": args.duration, "heartbeat_interval_s": beats_data["interval_s"],
                              "register_s": beats_data.get("register_s"), "command": " ".join(sys.argv)}})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print()
    print(f"JSON written to {args.out}:")
    print(json.dumps(result, indent=1))
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
