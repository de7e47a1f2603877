"""One rendezvous round of N participants: ftrain's backend against torch's c10d (TCPStore).

    python bench/rendezvous.py                          # N = 8 16 32 64 128 256 512 1024
    python bench/rendezvous.py --sizes 8,64,256 --procs 16 --timeout 300

Each participant is torch's own `DynamicRendezvousHandler` (`min == max == N`) calling
`next_rendezvous()` once, as torchrun's agent does. Participants are threads spread over
`--procs` processes forked from this one after it imported torch, so they are not held to
one interpreter (and no process pays torch's import). They start together at a moment agreed
in advance; a round's time is from that moment to the last participant's return (its rank
and the world size checked: ranks 0..N-1 once each).

- ftrain: a real etcd and a real control plane (uvicorn) on loopback, a job submitted for
  each round (a fresh rendezvous id), participants made by `worker.rendezvous.dynamic_handler`
  (the handler torchrun gets, without round reports);
- c10d: a TCPStore server in a process of its own, participants made by torch's
  `C10dRendezvousBackend` over a TCPStore client each, as `--rdzv-backend=c10d` does.

The participant processes stand in for other machines: they run niced (`--nice`, 19 by default;
0 to leave them be), so that on a small machine the servers (etcd and the control plane; the
TCPStore) are not starved by the very participants that stand in for other hosts (the kernel
weighs each thread: 1,024 participant threads at nice 10 outweighed the control plane's one
about 28 to 1 while they ran, and it got 11% of a core; at nice 19, about 4 to 1), and their
objects from before the fork (torch's) are frozen out of the garbage collector (`gc.freeze`): on
a machine of its own an agent's collector scans one handler's state, here it would scan the
states of all the participants of its process. The header line says both, and the load average
at the start and the end of the run (`os.getloadavg`).

Both use TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the setting ftrain's agent uses). Both run in
the same invocation, one after the other at each N, so they meet the same machine. A size a
backend does not finish within `--timeout` is reported as such and that backend is not tried
at larger sizes. Prints a table and writes JSON (--out). For ftrain it also prints the control
plane's and etcd's CPU apart and, from the control plane's /metrics, its etcd calls, the state
writes and the batches that wrote them, and the waits of state long polls in the round.

On a larger machine (e.g. 32 cores): `--procs 32 --nice 0 --setup 0.005`; the bench raises its
open-file limit to what N participants need at a server (the usual 1,024 is too few).

After the round (`--hold S`, ftrain only): what a formed job costs while it trains. Every
participant keeps its handler, and torch's keep-alive timer (a keep-alive every
`--keep-alive` s), for a keep-alive interval and then S seconds more, over which the bench
reports: the rendezvous state writes and the etcd writes (puts) a second, the bytes etcd
received and sent a second (etcd's own /metrics: gRPC bytes), the control plane's and etcd's
CPU (% of a core), and the keep-alives as torch's timer thread saw them (each a read and a
write of the state; count, p50/p99/max latency, failures). At the end it reads the state and
checks that every participant is still in the round with a live heartbeat. `--monitor S`:
each participant also runs torchrun's monitor (`num_nodes_waiting()` every S s; the node agent's
is 0.1) with ftrain's follower of the state, as a torchrun agent does while its group trains.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"

import torch.distributed as dist  # noqa: E402  (imported before the forks, on purpose)
from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend  # noqa: E402
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler  # noqa: E402

import worker.rendezvous as ftrain_rdzv  # noqa: E402
from worker import torch_internals  # noqa: E402

SIZES = [8, 16, 32, 64, 128, 256, 512, 1024]


KEEP_ALIVE_S = 5  # torch's default keep-alive interval (x 3 attempts: a node is dead after 15 s)


def params(backend: str, endpoint: str, run_id: str, n: int, timeout_s: float) -> RendezvousParameters:
    return RendezvousParameters(backend=backend, endpoint=endpoint, run_id=run_id, min_nodes=n, max_nodes=n,
                                join_timeout=str(int(timeout_s)), local_addr="127.0.0.1",
                                keep_alive_interval=str(KEEP_ALIVE_S))


NICE = 19  # of the participant processes (--nice)
SETUP_S = 0.03  # a participant's time to make its handler before the common start (--setup), s
MARGIN_S = 90.0  # after the join timeout, how long a round's participants are waited for (--margin)


class KeepAlives:
    """The keep-alives of one process's participants as torch's timer thread runs them (each a
    read and a write of the state), timed: `--hold`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds: list[float] = []
        self.writes: list[float] = []  # of those, the state write's request alone (PUT /state)
        self.failed = 0
        self.local = threading.local()

    def time(self, handler) -> None:
        """Time `handler`'s keep-alive operations (its executor's runs of a keep-alive op)."""
        keep_alive_op = torch_internals.get(torch_internals.KEEP_ALIVE_OP)
        executor = torch_internals.op_executor(handler)
        run = executor.run

        def timed(op, deadline, *args, **kwargs):
            if not isinstance(op, keep_alive_op):
                return run(op, deadline, *args, **kwargs)
            began, ok = time.monotonic(), False
            self.local.keeping = True
            try:
                result, ok = run(op, deadline, *args, **kwargs), True
                return result
            finally:
                self.local.keeping = False
                with self.lock:
                    self.seconds.append(time.monotonic() - began)
                    self.failed += not ok

        executor.run = timed
        transport = getattr(torch_internals.backend_of(handler), "_transport", None)  # ftrain's only
        if transport is None:
            return
        call = transport.call

        def timed_call(method, path, body=None, **kwargs):
            if method != "PUT" or not getattr(self.local, "keeping", False):
                return call(method, path, body, **kwargs)
            began = time.monotonic()
            try:
                return call(method, path, body, **kwargs)
            finally:
                with self.lock:
                    self.writes.append(time.monotonic() - began)

        transport.call = timed_call


HANDLERS: list = []  # the participants' handlers, kept (their keep-alive timers hold weak references)
KEEP_ALIVES = KeepAlives()
MONITOR_S = 0.0  # --monitor: torchrun's monitor asking num_nodes_waiting() this often (0: not)
RELEASED = threading.Event()  # the hold is over


def monitor(handler) -> None:
    """torchrun's agent while its group trains: `num_nodes_waiting()` every MONITOR_S."""
    while not RELEASED.is_set():
        try:
            handler.num_nodes_waiting()
        except Exception:  # noqa: BLE001 - as torch's agent would: the next look tries again
            pass
        RELEASED.wait(MONITOR_S)


def participant(kind: str, endpoint: str, run_id: str, n: int, timeout_s: float, start_at: float,
                out: list, index: int) -> None:
    """One node: make the handler, wait for the start, join the round; record (rank, world, t,
    whether it was ready only after the start)."""
    try:
        if kind == "ftrain":
            handler = ftrain_rdzv.dynamic_handler(params("ftrain", endpoint, run_id, n, timeout_s),
                                                  follow=MONITOR_S > 0)
        else:
            host, port = endpoint.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
            handler = create_handler(store, C10dRendezvousBackend(store, run_id),
                                     params("c10d", endpoint, run_id, n, timeout_s))
        late = time.time() > start_at
        time.sleep(max(0.0, start_at - time.time()))
        KEEP_ALIVES.time(handler)
        HANDLERS.append(handler)
        info = handler.next_rendezvous()
        out[index] = (info.rank, info.world_size, time.time(), late)
        if MONITOR_S > 0:
            threading.Thread(target=monitor, args=(handler,), daemon=True).start()
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out[index] = (None, None, f"{type(exc).__name__}: {exc}")


def child(kind: str, endpoint: str, run_id: str, n: int, timeout_s: float, start_at: float,
          first: int, step: int, write_fd: int, release_fd: int) -> None:
    """A forked process running the participants first, first+step, ... as threads. It writes a
    line of their results once they all returned; then, holding the handlers (their keep-alive
    timers run on) until the parent closes `release_fd`, a line of their keep-alives."""
    os.nice(NICE)
    mine = list(range(first, n, step))
    out: list = [None] * len(mine)
    threading.stack_size(512 * 1024)
    common = (kind, endpoint, run_id, n, timeout_s, start_at, out)
    threads = [threading.Thread(target=participant, args=(*common, i), daemon=True) for i in range(len(mine))]
    for t in threads:
        t.start()
    deadline = start_at + timeout_s + MARGIN_S  # torch's join timeout, then a margin for reads in flight
    for t in threads:
        t.join(max(0.0, deadline - time.time()))
    with os.fdopen(write_fd, "w") as pipe:
        pipe.write(json.dumps([o if o is not None else (None, None, "no answer") for o in out]) + "\n")
        pipe.flush()
        with os.fdopen(release_fd) as release:
            release.read()  # until the parent closes it: the hold is over (or there is none)
        RELEASED.set()
        with KEEP_ALIVES.lock:
            pipe.write(json.dumps({"seconds": KEEP_ALIVES.seconds, "writes": KEEP_ALIVES.writes,
                                   "failed": KEEP_ALIVES.failed}) + "\n")


def one_round(kind: str, endpoint: str, run_id: str, n: int, procs: int, timeout_s: float,
              hold: Callable[[dict], dict] | None = None) -> dict:
    """Fork the participants, return the round's time or why it failed. `hold`: called once the
    round completed while the participants still hold their handlers (their keep-alives go on);
    what it returns is added, with the keep-alives the participants made meanwhile."""
    procs = max(1, min(procs, n))
    gc.collect()
    gc.freeze()  # the forks' objects from before the fork are left out of their collections
    # Time to make N handlers (and connections) before the common start.
    start_at = time.time() + 3.0 + n * SETUP_S
    children = []
    usage_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    releases = []
    for k in range(procs):
        read_fd, write_fd = os.pipe()
        release_read, release_write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            os.close(release_write)
            for other in releases:
                os.close(other)
            code = 0
            try:
                child(kind, endpoint, run_id, n, timeout_s, start_at, k, procs, write_fd, release_read)
            except BaseException:  # noqa: BLE001
                code = 1
            os._exit(code)
        os.close(write_fd)
        os.close(release_read)
        releases.append(release_write)
        children.append((pid, os.fdopen(read_fd)))
    results = []
    for _, pipe in children:
        text = pipe.readline()
        results.extend(json.loads(text) if text else [(None, None, "process died")])
    held: dict = {}
    if hold is not None and all(r[0] is not None for r in results):
        held = hold({"end": max(r[2] for r in results)})
    for release in releases:
        os.close(release)
    keep_alives: list[float] = []
    writes: list[float] = []
    failed = 0
    for pid, pipe in children:
        with pipe:
            text = pipe.readline()
        os.waitpid(pid, 0)
        if text:
            got = json.loads(text)
            keep_alives += got["seconds"]
            writes += got.get("writes", [])
            failed += got["failed"]
    if held:
        held.update(keep_alive_stats(keep_alives, failed, writes))
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (usage.ru_utime - usage_before.ru_utime) + (usage.ru_stime - usage_before.ru_stime)
    errors = [r[2] for r in results if r[0] is None]
    if errors:
        kinds: dict[str, int] = {}
        for e in errors:
            kinds[e.split(":")[0]] = kinds.get(e.split(":")[0], 0) + 1
        return {"ok": False, "error": f"{len(errors)} of {n} failed ({kinds}), e.g. {errors[0][:200]}",
                "participants_cpu_s": round(cpu_s, 1)}
    late = sum(1 for r in results if len(r) > 3 and r[3])
    ranks = sorted(r[0] for r in results)
    if ranks != list(range(n)) or any(r[1] != n for r in results):
        sizes = sorted({r[1] for r in results})
        return {"ok": False, "error": f"ranks 0..{n - 1} not each once, or world sizes {sizes} not {n} "
                                      "(nodes whose keep-alive expired were dropped)",
                "participants_cpu_s": round(cpu_s, 1)}
    got = {"ok": True, "round_s": round(max(r[2] for r in results) - start_at, 3),
           "participants_cpu_s": round(cpu_s, 1)}
    if held:
        got["hold"] = held
    if late:
        got["late"] = late  # ready after the common start: the round's time includes their set-up
    return got


def open_files(n: int) -> int:
    """Raise this process's open-file limit (inherited by the servers it starts: the control
    plane, etcd, the TCPStore) to what N participants need (a few sockets each at a server),
    as far as the hard limit allows; the limit now. The usual soft limit, 1,024, is below
    what a server of 1,024 participants holds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, 4 * n + 1024)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


COUNTS = {"ftrain_etcd_request_seconds_count": "etcd_calls",  # watches not counted
          "ftrain_rdzv_state_writes_total": "state_writes",
          "ftrain_rdzv_state_batches_total": "state_batches",
          "ftrain_rdzv_poll_waits_total": "poll_waits"}


def counts(api) -> dict[str, int]:
    """The control plane's counts so far (its /metrics): etcd calls, rendezvous state writes,
    the batches that wrote them, waits of state long polls."""
    got = dict.fromkeys(COUNTS.values(), 0)
    for line in api.get("/metrics").text.splitlines():
        name, _, value = line.partition(" ")
        if name in COUNTS:
            got[COUNTS[name]] = int(float(value))
    return got


ETCD_COUNTS = {"etcd_mvcc_put_total": "etcd_puts",
               "etcd_network_client_grpc_received_bytes_total": "etcd_received_bytes",
               "etcd_network_client_grpc_sent_bytes_total": "etcd_sent_bytes"}


def etcd_counts(endpoint: str) -> dict[str, float]:
    """etcd's own counts so far (its /metrics): puts, and the bytes its clients sent it (the
    writes, mostly) and it sent them (the reads)."""
    import httpx

    got = dict.fromkeys(ETCD_COUNTS.values(), 0.0)
    for line in httpx.get(f"{endpoint}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in ETCD_COUNTS:
            got[ETCD_COUNTS[name]] += float(value)
    return got


def keep_alive_stats(seconds: list[float], failed: int, writes: list[float]) -> dict:
    """The keep-alives of a hold as torch's timer threads saw them: how many, their latency, and
    their state writes' (the PUT request alone, answer included, before the node decodes it)."""
    if not seconds:
        return {"keep_alives": 0, "keep_alive_failed": failed}

    def at(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

    got = {"keep_alives": len(seconds), "keep_alive_failed": failed, "keep_alive_p50_ms": at(seconds, 0.5),
           "keep_alive_p99_ms": at(seconds, 0.99), "keep_alive_max_ms": round(max(seconds) * 1000, 1)}
    if writes:
        got.update(write_p50_ms=at(writes, 0.5), write_p99_ms=at(writes, 0.99))
    return got


def holding(api, etcd, servers: list[int], rdzv_id: str, token: str, n: int, hold_s: float,
            ) -> Callable[[dict], dict]:
    """The `--hold` of one ftrain round (module docstring): from a keep-alive interval after the
    round to `hold_s` later, the writes, bytes and CPU a second; then the state's check."""

    def sample() -> tuple[list[float], dict, dict, float]:
        return [cpu_s(p) for p in servers], counts(api), etcd_counts(etcd.endpoint), time.monotonic()

    def hold(_: dict) -> dict:
        # The round's own figures end here (main), not with the hold.
        at_end = {"cpu": [cpu_s(p) for p in servers], "counts": counts(api)}
        time.sleep(KEEP_ALIVE_S)  # every node's timer has fired once
        (cpu0, cp0, etcd0, t0) = sample()
        time.sleep(hold_s)
        (cpu1, cp1, etcd1, t1) = sample()
        span = t1 - t0

        def rate(after: dict, before: dict, name: str, scale: float = 1.0) -> float:
            return round((after[name] - before[name]) / span / scale, 1)

        got = {"hold_s": round(span, 1),
               "state_writes_per_s": rate(cp1, cp0, "state_writes"),
               "state_batches_per_s": rate(cp1, cp0, "state_batches"),
               "etcd_calls_per_s": rate(cp1, cp0, "etcd_calls"),
               "etcd_puts_per_s": rate(etcd1, etcd0, "etcd_puts"),
               "etcd_in_kb_per_s": rate(etcd1, etcd0, "etcd_received_bytes", 1000),
               "etcd_out_kb_per_s": rate(etcd1, etcd0, "etcd_sent_bytes", 1000),
               "control_plane_cpu_pct": round(100 * (cpu1[0] - cpu0[0]) / span, 1),
               "etcd_cpu_pct": round(100 * (cpu1[1] - cpu0[1]) / span, 1)}
        got.update(state_check(api, rdzv_id, token, n))
        got["round_end"] = at_end
        return got

    return hold


def state_check(api, rdzv_id: str, token: str, n: int) -> dict:
    """After a hold: the round's participants and the age of the stalest heartbeat (torch drops a
    node whose heartbeat is 3 keep-alive intervals old)."""
    import base64

    from worker.protocol import open_state
    from worker.rdzv_state import RdzvDoc

    reply = api.get(f"/v1/rdzv/{rdzv_id}/state", headers={"Authorization": f"Bearer {token}"}).json()
    doc = RdzvDoc.from_json(open_state(base64.b64decode(reply["state"])))
    stalest = min(doc.last_heartbeats.values()) if doc.last_heartbeats else 0
    return {"participants_after": len(doc.participants), "complete_after": doc.complete,
            "state_kb": round(len(base64.b64decode(reply["state"])) / 1000, 1),
            "stalest_heartbeat_s": round(time.time() - stalest / 1e6, 1)}


def _held(got: dict) -> str:
    """' hold: ...' for an ftrain round held (`--hold`)."""
    h = got.get("hold")
    if not h:
        return ""
    ms = "/".join(str(h.get(f"keep_alive_{q}_ms", "-")) for q in ("p50", "p99", "max"))
    return (f" | hold {h['hold_s']} s: {h['state_writes_per_s']} state writes/s in "
            f"{h['state_batches_per_s']} batches/s, etcd {h['etcd_puts_per_s']} puts/s, "
            f"{h['etcd_calls_per_s']} calls/s, in {h['etcd_in_kb_per_s']} KB/s, "
            f"out {h['etcd_out_kb_per_s']} KB/s; "
            f"cpu control plane {h['control_plane_cpu_pct']}%, etcd {h['etcd_cpu_pct']}% of a core; "
            f"keep-alives {h['keep_alives']} (failed {h['keep_alive_failed']}), p50/p99/max {ms} ms "
            f"(their writes p50/p99 {h.get('write_p50_ms', '-')}/{h.get('write_p99_ms', '-')} ms); "
            f"after: {h['participants_after']} participants, complete {h['complete_after']}, "
            f"state {h['state_kb']} KB, "
            f"stalest heartbeat {h['stalest_heartbeat_s']} s")


def _apart(got: dict) -> str:
    """' (control plane C s, etcd E s; K etcd calls, ...)' for an ftrain round."""
    if "control_plane_cpu_s" not in got:
        return ""
    return (f" (control plane {got['control_plane_cpu_s']} s, etcd {got['etcd_cpu_s']} s; "
            f"{got['etcd_calls']} etcd calls, {got['state_writes']} state writes in "
            f"{got['state_batches']} batches, {got['poll_waits']} poll waits)")


def start_tcpstore() -> tuple[subprocess.Popen, int]:
    """torch's TCPStore server (the c10d backend's) in a process of its own."""
    proc = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, signal, datetime, torch.distributed as d\n"
         "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
         "timeout=datetime.timedelta(seconds=600))\n"
         "print(s.port, flush=True)\n"
         "signal.sigwait([signal.SIGTERM])\n"],
        stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, port


def main() -> int:
    global KEEP_ALIVE_S, NICE, SETUP_S, MARGIN_S, MONITOR_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="participants per round, comma-separated")
    ap.add_argument("--procs", type=int, default=16, help="processes the participants are spread over")
    ap.add_argument("--timeout", type=float, default=300.0, help="join timeout of a round, s")
    ap.add_argument("--backends", default="ftrain,c10d")
    ap.add_argument("--keep-alive", type=int, default=KEEP_ALIVE_S,
                    help="torch's keep_alive_interval, s, for both backends (a node is dead after 3 of them)")
    ap.add_argument("--nice", type=int, default=NICE,
                    help="niceness of the participant processes (they stand in for other machines)")
    ap.add_argument("--setup", type=float, default=SETUP_S,
                    help="s per participant given to make the handlers before the common start "
                         "(3 s + N x this; the default suits 2 cores)")
    ap.add_argument("--margin", type=float, default=MARGIN_S,
                    help="s after the join timeout a failing round's participants are waited for")
    ap.add_argument("--hold", type=float, default=0.0,
                    help="ftrain: after each round, hold the participants (their keep-alives on) for a "
                         "keep-alive interval and this many s more, measured (module docstring)")
    ap.add_argument("--monitor", type=float, default=0.0,
                    help="ftrain, with --hold: each participant also runs torchrun's monitor, "
                         "num_nodes_waiting() every this many s (the node agent's: 0.1), with ftrain's "
                         "follower of the state (worker/rendezvous/follow.py), as torchrun's agent does")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "rendezvous.json"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    KEEP_ALIVE_S = args.keep_alive
    NICE = args.nice
    SETUP_S, MARGIN_S = args.setup, args.margin
    MONITOR_S = args.monitor if args.hold > 0 else 0.0
    files = open_files(max(sizes))
    backends = args.backends.split(",")

    from bench.harness import ControlPlane, EtcdProcess

    root = Path(tempfile.mkdtemp(prefix="ftrain-bench-rdzv-"))
    etcd = cp = tcp = None
    load = os.getloadavg()
    print(f"rendezvous benchmark: one round, min == max == N, participants as threads over {args.procs} "
          f"forked processes (nice {NICE}, gc frozen at the fork), keep-alive {KEEP_ALIVE_S} s, "
          f"join timeout {args.timeout:g} s{f', held {args.hold:g} s after' if args.hold else ''}"
          f"{f', monitor every {MONITOR_S:g} s' if MONITOR_S else ''}; "
          f"{platform.node()}, {os.cpu_count()} cores, "
          f"load {load[0]:.1f} at start, open files {files}", flush=True)
    rows: list[dict] = []
    failed: set[str] = set()
    try:
        if "ftrain" in backends:
            etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log").start()
            cp = ControlPlane(etcd.endpoint, root / "cp").start()
            api = cp.client("user")
        if "c10d" in backends:
            tcp, tcp_port = start_tcpstore()
        print(f"{'N':>6} {'ftrain s':>10} {'c10d s':>10} {'ftrain/c10d':>12}   notes")
        for n in sizes:
            row: dict = {"n": n}
            for kind in backends:
                if kind in failed:
                    row[kind] = {"ok": False, "error": "skipped: a smaller size did not complete"}
                    continue
                servers = {"ftrain": [cp.proc.pid, etcd.proc.pid] if cp else [],
                           "c10d": [tcp.pid] if tcp else []}
                before = [cpu_s(p) for p in servers[kind]]
                counts_before = counts(api) if kind == "ftrain" else {}
                if kind == "ftrain":
                    job = api.post("/v1/jobs", json={"name": f"rdzv-{n}", "command": ["python", "-c", "pass"],
                                                     "nodes": {"min": 1, "max": 1}}).json()
                    token = os.environ["FTRAIN_JOB_TOKEN"] = cp.job_token_of(job["id"])
                    rdzv_id = f"{job['id']}-a{job['attempt']}"
                    hold = holding(api, etcd, servers["ftrain"], rdzv_id, token, n, args.hold) \
                        if args.hold > 0 else None
                    got = one_round("ftrain", cp.url, rdzv_id, n, args.procs, args.timeout, hold)
                    api.post(f"/v1/jobs/{job['id']}/cancel")
                else:
                    got = one_round("c10d", f"127.0.0.1:{tcp_port}", f"rdzv-{n}-{time.time_ns()}", n,
                                    args.procs, args.timeout)
                at_end = got.get("hold", {}).pop("round_end", None)  # a held round's figures end with it
                spent = [(cpu_s(p) if at_end is None else at_end["cpu"][i]) - b
                         for i, (p, b) in enumerate(zip(servers[kind], before))]
                got["server_cpu_s"] = round(sum(spent), 1)
                if kind == "ftrain":  # the control plane and etcd apart, and its etcd calls
                    got["control_plane_cpu_s"], got["etcd_cpu_s"] = round(spent[0], 1), round(spent[1], 1)
                    after = counts(api) if at_end is None else at_end["counts"]
                    got.update({k: v - counts_before[k] for k, v in after.items()})
                row[kind] = got
                if not got["ok"]:
                    failed.add(kind)
            rows.append(row)
            f, c = row.get("ftrain", {}), row.get("c10d", {})
            ratio = f"{f['round_s'] / c['round_s']:.2f}" if f.get("ok") and c.get("ok") else "-"
            notes = "; ".join([f"{k}: {row[k]['error']}" for k in backends if not row[k]["ok"]]
                              + [f"{k}: {row[k]['late']} ready after the start" for k in backends
                                 if row[k].get("late")])
            cpu = " ".join(f"{k} cpu: participants {row[k].get('participants_cpu_s', '-')} s, "
                           f"server {row[k].get('server_cpu_s', '-')} s{_apart(row[k])};" for k in backends)
            times = f"{f.get('round_s', '-')!s:>10} {c.get('round_s', '-')!s:>10}"
            print(f"{n:>6} {times} {ratio:>12}   {cpu} {notes}{_held(f)}", flush=True)
    finally:
        if tcp is not None:
            tcp.send_signal(signal.SIGTERM)
            tcp.wait(10)
        if cp is not None:
            cp.stop()
        if etcd is not None:
            etcd.stop()
        subprocess.run(["rm", "-rf", str(root)], check=False)
    print(f"load {os.getloadavg()[0]:.1f} at the end", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": platform.node(), "cores": os.cpu_count(),
                                          "procs": args.procs, "nice": NICE, "load_at_start": load[0],
                                          "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
