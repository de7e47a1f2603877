"""The node agent (`ftrain node`): registers, heartbeats, runs torchrun for its job.

The agent is a reconcile loop. Each heartbeat returns what this node should be doing
(an `Assignment`: run job J attempt A, or stop); the agent compares that with the one
torchrun it may be running and starts, stops or leaves it. It reports every start and
every exit, ships worker output to the control plane, and never leaves a worker behind:
torchrun is started with a parent-death signal (SIGTERM: torchrun then stops its
workers), each worker with one too (SIGKILL when torchrun dies), and a stop kills what
is left of the tree.

A control plane that does not answer does not stop training: the agent keeps its
workers running and keeps trying. Only a 404 on heartbeat (the node's lease lapsed and
the job moved on) makes it stop its workers and register again.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from worker.env import (
    FTRAIN_ATTEMPT,
    FTRAIN_FORK_SERVER,
    FTRAIN_FORK_SERVER_SOCKET,
    FTRAIN_GLOBAL_BATCH_SIZE,
    FTRAIN_JOB_ID,
    FTRAIN_JOB_TOKEN,
    FTRAIN_LOG_LEVEL,
    FTRAIN_NODE,
    FTRAIN_NODE_TOKEN,
    FTRAIN_SERVER,
    FTRAIN_SNAPSHOT_DIR,
    FTRAIN_SNAPSHOT_EVERY,
    FTRAIN_SNAPSHOT_KEEP,
    FTRAIN_TOKEN,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
    TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE,
)
from worker.http import ApiError, ControlPlaneClient, HttpError
from worker.procs import (
    FORK_SERVER,
    descendants,
    is_alive,
    kill_all,
    pdeathsig_argv,
    state_of,
    worker_launch_prefix,
)
from worker.protocol import (
    MAX_LINE_CHARS,
    Assignment,
    HeartbeatReply,
    HeartbeatRequest,
    Known,
    LogLineIn,
    LogShipment,
    RegisterReply,
    RegisterRequest,
    ReportRequest,
)

log = logging.getLogger("ftrain.agent")

# Rendezvous tuning (DESIGN.md, "Known traps"): a lost node is noticed after
# keep_alive_interval x keep_alive_max_attempt = 3 s, and a round that has its minimum
# waits 1 s for latecomers instead of torch's 30 s.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=600"
# torch must never give up by itself: ftrain counts failures (not membership changes)
# against the job's max_restarts and stops the job when they are spent.
TORCHRUN_MAX_RESTARTS = 1_000_000
# A worker stopped (SIGSTOP, a debugger gone away) for this long is killed, so that torch
# restarts the group instead of the others waiting out the collective's timeout.
STOPPED_WORKER_GRACE_S = 3.0
# SIGTERM-to-SIGKILL grace when a group is replaced by a new attempt of the same job. Short
# on purpose: whatever the old attempt had to save is saved (a planned change snapshots
# first), and after a lost NCCL peer its workers are stuck in a collective and never exit
# on SIGTERM (measured on two H100s: the whole grace was spent waiting, every time).
REPLACE_GRACE_S = 0.3
# Each request's timeout; a heartbeat's is its long-poll wait plus this.
REQUEST_TIMEOUT_S = 5.0
# A reason longer than the control plane takes would have the whole report refused.
REPORT_REASON_MAX_CHARS = next(m.max_length for m in ReportRequest.model_fields["reason"].metadata
                               if hasattr(m, "max_length"))
_RANK_PREFIX = re.compile(r"^\[rank(\d+)\]:(.*)$")


@dataclass
class Outcome:
    state: str  # succeeded | failed | stopped
    exit_code: int | None
    reason: str | None


@dataclass
class WorkerGroup:
    """One torchrun process (and its workers) for one attempt of one job."""

    job_id: str
    attempt: int
    proc: subprocess.Popen
    stop_requested: bool = False
    stopped_since: dict = field(default_factory=dict)
    tails: dict = field(default_factory=lambda: collections.defaultdict(lambda: collections.deque(maxlen=20)))
    threads: list = field(default_factory=list)

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)


@dataclass
class ForkServer:
    """The job's `worker/fork_server.py` on this node; it outlives attempts, not the job."""

    job_id: str
    name: str  # its abstract unix socket
    proc: subprocess.Popen
    ready_fd: int  # it writes "ready" here once it has imported what it preloads
    ready: bool = False

    def is_ready(self) -> bool:
        """True once the server has imported torch & co. and serves (never blocks)."""
        if not self.ready and self.ready_fd >= 0:
            try:
                said = os.read(self.ready_fd, 64)
            except BlockingIOError:
                return False
            self.ready = said.startswith(b"ready")
            os.close(self.ready_fd)
            self.ready_fd = -1
        return self.ready

    def close(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1


class LogShipper:
    """Batches worker lines and ships them to the control plane in the background."""

    def __init__(self, client: ControlPlaneClient, node: str):
        self._client = client
        self._node = node
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], list[LogLineIn]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
        self._thread.start()

    def add(self, job_id: str, attempt: int, line: LogLineIn) -> None:
        with self._lock:
            batch = self._pending[(job_id, attempt)]
            if len(batch) < 50_000:  # a control plane away for long: drop rather than grow
                batch.append(line)

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, collections.defaultdict(list)
        for (job_id, attempt), lines in pending.items():
            for i in range(0, len(lines), 1000):
                shipment = LogShipment(node=self._node, attempt=attempt, lines=lines[i:i + 1000])
                try:
                    self._client.call("POST", f"/v1/jobs/{job_id}/logs", shipment)
                    lost = False
                except HttpError as exc:
                    # A 5xx (etcd away) is no answer: keep the lines, as for a refused
                    # connection; a 4xx is an answer: those lines are dropped.
                    lost = exc.status is None or exc.status >= 500
                if lost:
                    with self._lock:  # keep for the next try
                        self._pending[(job_id, attempt)][:0] = lines[i:]
                    break

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.flush()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.flush()


class NodeAgent:
    def __init__(self, server: str, token: str | None, name: str, nproc_per_node: int = 1,
                 data_dir: str | Path = ".ftrain", address: str | None = None):
        self.server = server.rstrip("/")
        self.token = token
        self.name = name
        self.nproc_per_node = nproc_per_node
        self.data_dir = Path(data_dir).resolve()
        self.address = address
        self.client = ControlPlaneClient(self.server, token, timeout=REQUEST_TIMEOUT_S)
        self.group: WorkerGroup | None = None
        self.fork_server: ForkServer | None = None
        self.finished: set[tuple[str, int]] = set()
        self.reports: list[ReportRequest] = []
        self.heartbeat_interval_s = 1.0
        self.lease_id: int | None = None
        self.known: Known | None = None  # the assignment last heard of, for the long poll
        self.registered = False
        self._shutdown = threading.Event()
        self.shipper = LogShipper(self.client, name)

    # ------------------------------------------------------------------ control plane
    def register(self) -> None:
        request = RegisterRequest(name=self.name, nproc_per_node=self.nproc_per_node, address=self.address)
        reply = RegisterReply.model_validate(self.client.call("POST", "/v1/nodes/register", request))
        self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.lease_id = reply.lease_id
        self.registered = True
        log.info("registered node %s with %s (lease %ss)", self.name, self.server, reply.lease_ttl_s)

    def heartbeat(self) -> Assignment | None | bool:
        """The assignment (or None); False when the node must register again."""
        # An idle node long-polls: the answer comes as soon as it is given a job.
        idle = self.group is None and not self.reports
        request = HeartbeatRequest(lease_id=self.lease_id, known=self.known,
                                   wait_s=self.heartbeat_interval_s if idle else 0)
        try:
            got = self.client.call("POST", f"/v1/nodes/{self.name}/heartbeat", request,
                                   timeout=self.heartbeat_interval_s + 5)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        a = HeartbeatReply.model_validate(got).assignment
        self.known = None if a is None else Known(job_id=a.job_id, attempt=a.attempt, action=a.action)
        return a

    def send_reports(self) -> None:
        while self.reports:
            try:
                self.client.call("POST", f"/v1/nodes/{self.name}/report", self.reports[0])
            except HttpError as exc:
                if exc.status is None:
                    raise  # no connection: the loop says so, and the report waits
                if exc.status >= 500:
                    return  # etcd or the control plane is away: keep it for the next beat
                # a 4xx is the control plane's answer to this report: it is done with
            self.reports.pop(0)

    def report(self, job_id: str, attempt: int, state: str, code: int | None = None,
               reason: str | None = None) -> None:
        self.reports.append(ReportRequest(job_id=job_id, attempt=attempt, state=state, exit_code=code,
                                          reason=_fit(reason, REPORT_REASON_MAX_CHARS)))

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        while not self._shutdown.is_set():
            beat_started, known_before = time.monotonic(), self.known
            try:
                if not self.registered:
                    self.register()
                self.send_reports()
                assignment = self.heartbeat()
                if assignment is False:
                    log.warning("the control plane no longer knows node %s; stopping its workers "
                                "and registering again", self.name)
                    self.stop_group("node lease lapsed")
                    self.registered = False
                    continue
                self.reconcile(assignment)
                self.send_reports()
            except (HttpError, ValidationError) as exc:
                log.warning("control plane at %s: %s; workers keep running", self.server, exc)
            self.check_exit()
            self.check_stopped_workers()
            # Running: check exits often. Idle: the heartbeat itself waited for a change (a
            # long poll), so go again at once after a change, else keep the beat's interval.
            if self.group:
                pause = 0.5
            elif self.known != known_before:
                pause = 0.05
            else:
                pause = max(0.05, self.heartbeat_interval_s - (time.monotonic() - beat_started))
            self._shutdown.wait(pause)
        self.stop_group("node agent shutting down")
        self.stop_fork_server()
        self.send_reports_best_effort()
        try:
            self.client.call("DELETE", f"/v1/nodes/{self.name}")
        except HttpError:
            pass
        self.shipper.close()
        self.client.close()

    def send_reports_best_effort(self) -> None:
        try:
            self.send_reports()
        except HttpError:
            pass

    def shutdown(self, *_args) -> None:
        self._shutdown.set()

    def reconcile(self, a: Assignment | None) -> None:
        g = self.group
        if a is None:
            if g is not None:
                self.stop_group("no longer assigned")
            self.stop_fork_server()
            return
        key = (a.job_id, a.attempt)
        if g is not None and (g.key != key or a.action == "stop"):
            if g.key == key:  # a cancel: give a plain script time to save on SIGTERM
                self.stop_group("stop requested", grace_s=a.cancel_grace_s)
            else:  # a new attempt replaces this one: nothing to wait for (workers may be
                # blocked in an NCCL collective with a dead peer and never see SIGTERM)
                self.stop_group("the job moved to a new attempt", grace_s=REPLACE_GRACE_S)
            g = None
        if g is None and key not in self.finished:
            if a.action == "run":
                self.start_group(a)
            else:  # told to stop before it started: say so, so the job can end
                self.finished.add(key)
                self.report(a.job_id, a.attempt, "stopped", None, "stopped before it started")

    # ------------------------------------------------------------------ torchrun
    def torchrun_argv(self, a: Assignment) -> list[str]:
        nproc = a.nproc_per_node
        if nproc == "auto":
            nproc = _gpu_count() or 1
        command = list(a.command)
        if command[0] in ("python", "python3"):
            command[0] = sys.executable  # the agent's interpreter: the venv with torch
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={a.nodes_min}:{a.nodes_max}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=ftrain", f"--rdzv-endpoint={self.server}", f"--rdzv-id={a.rdzv_id}",
            f"--rdzv-conf={RDZV_CONF}", f"--max-restarts={TORCHRUN_MAX_RESTARTS}",
            "--monitor-interval=0.2", "--tee=3",
        ]
        if self.address:
            argv.append(f"--local-addr={self.address}")
        argv += ["--no-python", *worker_launch_prefix(), *command]
        z = self.fork_server
        if z is not None and z.job_id == a.job_id and z.is_ready():
            # torchrun itself comes from the fork server too (torch imported: a new attempt
            # starts ~1 s sooner here, ~4 s on a GPU machine); the launcher stands in for it
            # and gets SIGTERM when this agent dies, which it forwards to torchrun.
            return worker_launch_prefix(signal.SIGTERM) + argv
        return pdeathsig_argv(argv, signal.SIGTERM)

    def job_env(self, a: Assignment) -> dict[str, str]:
        root = Path(a.snapshot_root) if a.snapshot_root else self.data_dir / "snapshots"
        snapshot_dir = root / a.job_id
        snapshot_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **a.env}
        env.update({
            FTRAIN_JOB_ID: a.job_id,
            FTRAIN_ATTEMPT: str(a.attempt),
            FTRAIN_SERVER: self.server,
            FTRAIN_JOB_TOKEN: a.job_token,
            FTRAIN_NODE: self.name,
            FTRAIN_SNAPSHOT_DIR: str(snapshot_dir),
            FTRAIN_SNAPSHOT_EVERY: str(a.snapshot_every),
            FTRAIN_SNAPSHOT_KEEP: str(a.snapshot_keep),
            # Restarts with torch's shared rendezvous TCPStore can hang (pytorch #135712).
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1",
            TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE: "[rank${rank}]:",
            "PYTHONUNBUFFERED": "1",
        })
        if a.global_batch_size:
            env[FTRAIN_GLOBAL_BATCH_SIZE] = str(a.global_batch_size)
        # Workers run the user's code: the node's and a user's tokens stay with the agent.
        env.pop(FTRAIN_NODE_TOKEN, None)
        env.pop(FTRAIN_TOKEN, None)
        return env

    def start_fork_server(self, a: Assignment, env: dict[str, str], cwd: str, log_dir: Path) -> str | None:
        """The job's fork server (started if need be), or None when the job opts out."""
        if env.get(FTRAIN_FORK_SERVER, "1") == "0":
            return None
        z = self.fork_server
        if z is not None and z.job_id == a.job_id and z.proc.poll() is None:
            return z.name
        self.stop_fork_server()
        env = dict(env)
        nproc = a.nproc_per_node
        if "OMP_NUM_THREADS" not in env and (nproc == "auto" or int(nproc) > 1):
            env["OMP_NUM_THREADS"] = "1"  # what torchrun sets for its workers: libgomp reads it once
        name = f"ftrain-{self.name}-{a.job_id}-{secrets.token_hex(8)}"
        ready_r, ready_w = os.pipe()
        os.set_blocking(ready_r, False)
        try:
            with open(log_dir / f"{self.name}-fork-server.log", "ab") as out:
                proc = subprocess.Popen(
                    pdeathsig_argv([sys.executable, str(FORK_SERVER), name, str(ready_w)], signal.SIGKILL),
                    cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                    pass_fds=(ready_w,), start_new_session=True)
        except OSError as exc:
            os.close(ready_r)
            log.warning("could not start the fork server for job %s (%s); workers start cold",
                        a.job_id, exc)
            return None
        finally:
            os.close(ready_w)
        self.fork_server = ForkServer(a.job_id, name, proc, ready_r)
        log.info("started the fork server (pid %d) for job %s", proc.pid, a.job_id)
        return name

    def stop_fork_server(self) -> None:
        z, self.fork_server = self.fork_server, None
        if z is None:
            return
        kill_all([z.proc.pid, *descendants(z.proc.pid)])
        z.proc.wait()
        z.close()

    def group_tree(self, g: WorkerGroup) -> list[int]:
        """Every process of the group below `g.proc`: torchrun's tree and what the job's
        fork server forked (workers, and torchrun itself when it came from there)."""
        z = self.fork_server
        return descendants(g.proc.pid, *([z.proc.pid] if z is not None else []))

    def start_group(self, a: Assignment) -> None:
        cwd = a.working_dir or os.getcwd()
        log_dir = self.data_dir / "logs" / a.job_id
        log_dir.mkdir(parents=True, exist_ok=True)
        env = self.job_env(a)
        if (fork_server := self.start_fork_server(a, env, cwd, log_dir)) is not None:
            env[FTRAIN_FORK_SERVER_SOCKET] = fork_server
        # torchrun writes to files, not pipes: an agent that dies must not leave torchrun
        # writing into a broken pipe (its log-tail threads then keep it from exiting).
        outputs = {s: log_dir / f"{self.name}-attempt{a.attempt}.{s}" for s in ("stdout", "stderr")}
        try:
            with open(outputs["stdout"], "wb") as out, open(outputs["stderr"], "wb") as err:
                proc = subprocess.Popen(
                    self.torchrun_argv(a), cwd=cwd,
                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True)
        except OSError as exc:
            self.finished.add((a.job_id, a.attempt))
            self.report(a.job_id, a.attempt, "failed", None,
                        f"could not start torchrun in {cwd}: {exc}")
            return
        g = WorkerGroup(a.job_id, a.attempt, proc)
        for stream, path in outputs.items():
            t = threading.Thread(target=self._pump, args=(g, stream, path), daemon=True,
                                 name=f"pump-{stream}")
            t.start()
            g.threads.append(t)
        self.group = g
        self.report(g.job_id, g.attempt, "running")
        log.info("started torchrun (pid %d) for job %s attempt %d", proc.pid, g.job_id, g.attempt)

    def _pump(self, g: WorkerGroup, stream: str, path: Path) -> None:
        """Follow torchrun's output file, line by line, until torchrun has exited."""
        with open(path, "rb") as f:
            partial = b""
            while True:
                raw = f.readline()
                if not raw:
                    if g.proc.poll() is not None:
                        raw = partial + f.read()
                        if not raw:
                            return
                    else:
                        time.sleep(0.05)
                        continue
                if not raw.endswith(b"\n") and g.proc.poll() is None:
                    partial += raw
                    continue
                raw, partial = partial + raw, b""
                text = raw.decode("utf-8", errors="replace").rstrip("\n")
                m = _RANK_PREFIX.match(text)
                rank, line = (int(m.group(1)), m.group(2)) if m else (None, text)
                g.tails[rank].append(line)
                self.shipper.add(g.job_id, g.attempt, LogLineIn(
                    rank=rank, stream=stream, line=line[:MAX_LINE_CHARS], time=time.time()))

    def check_exit(self) -> None:
        g = self.group
        if g is None or g.proc.poll() is None:
            return
        for t in g.threads:
            t.join(2)
        self.group = None
        self.finished.add(g.key)
        kill_all(self.group_tree(g))
        self.report(g.job_id, g.attempt, *self._outcome(g))
        self.shipper.flush()

    def check_stopped_workers(self) -> None:
        """Kill workers that have been stopped (state T) for longer than the grace period."""
        g = self.group
        if g is None:
            return
        now = time.monotonic()
        stopped = {p for p in self.group_tree(g) if state_of(p) in ("T", "t")}
        g.stopped_since = {p: g.stopped_since.get(p, now) for p in stopped}
        for pid, since in g.stopped_since.items():
            if now - since > STOPPED_WORKER_GRACE_S:
                log.warning("worker pid %d of job %s has been stopped for %.0f s; killing it so "
                            "the group restarts", pid, g.job_id, now - since)
                self.shipper.add(g.job_id, g.attempt, LogLineIn(
                    rank=None, stream="stderr", time=time.time(),
                    line=f"ftrain: worker pid {pid} was stopped for {now - since:.0f} s; killed"))
                kill_all([pid])

    def _outcome(self, g: WorkerGroup) -> tuple[str, int | None, str | None]:
        code = g.proc.returncode
        if g.stop_requested:
            return "stopped", code, "stopped by the control plane"
        if code == 0:
            return "succeeded", 0, None
        worker_ranks = sorted(r for r in g.tails if r is not None)
        lines = []
        for r in worker_ranks:
            lines += [f"[rank{r}] {x}" for x in list(g.tails[r])[-8:]]
        lines += list(g.tails[None])[-6:]
        return "failed", code, f"torchrun exited with code {code}; last lines:\n" + "\n".join(lines)

    def stop_group(self, why: str, grace_s: float = 5.0) -> None:
        """SIGTERM torchrun (it stops its workers), then SIGKILL whatever is left."""
        g = self.group
        if g is None:
            return
        g.stop_requested = True
        tree = self.group_tree(g)
        log.info("stopping job %s attempt %d (%s)", g.job_id, g.attempt, why)
        if g.proc.poll() is None:
            g.proc.send_signal(signal.SIGTERM)
            kill_all(tree, signal.SIGTERM)
            try:
                g.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        kill_all([g.proc.pid, *tree, *self.group_tree(g)])
        g.proc.wait()
        deadline = time.monotonic() + 5
        while any(is_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.check_exit()


def _fit(text: str | None, limit: int) -> str | None:
    """`text` cut to `limit` characters in the middle: its start and its last lines stay."""
    if text is None or len(text) <= limit:
        return text
    marker = "\n[...]\n"
    head = (limit - len(marker)) // 4
    return text[:head] + marker + text[len(text) - (limit - len(marker) - head):]


def _gpu_count() -> int:
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def main(server: str, token: str | None, name: str | None = None, nproc_per_node: int = 1,
         data_dir: str | Path = ".ftrain", address: str | None = None) -> None:
    logging.basicConfig(level=os.environ.get(FTRAIN_LOG_LEVEL, "INFO"),
                        format=f"%(asctime)s %(levelname)s node {name or socket.gethostname()}: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    agent = NodeAgent(server, token, name or socket.gethostname(), nproc_per_node, data_dir, address)
    signal.signal(signal.SIGTERM, agent.shutdown)
    signal.signal(signal.SIGINT, agent.shutdown)
    agent.run()


if __name__ == "__main__":  # python -m worker.agent SERVER TOKEN NAME
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None,
         sys.argv[3] if len(sys.argv) > 3 else None)
