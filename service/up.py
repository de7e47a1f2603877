"""`ftrain up`: the one-machine cluster in the foreground (private etcd, control plane, node agents).

`up` is a supervisor and nothing else. Every part runs as a child process that `up`
started and stops by PID, each in its own session, so that a Ctrl-C typed in the terminal
reaches `up` alone and `up` can stop the parts in order: node agents first (they stop
their workers and leave), then the control plane, then etcd. Stopping etcd before the
control plane would turn the control plane's last writes into errors; stopping the
control plane before the agents would leave them retrying against nothing.

The control plane is a child (`ftrain serve`) rather than uvicorn inside this process:
uvicorn installs its own SIGINT/SIGTERM handlers and would shut the API down before the
agents had left, and a child runs exactly the code path of the multi-machine set-up.

Children get PR_SET_PDEATHSIG, so a SIGKILLed `up` does not leave them running. etcd is
started by `EtcdProcess`, which cannot take that hook; its PID is recorded in
`<data-dir>/etcd.pid` and a leftover from a killed `up` is stopped on the next start.

The data directory holds everything that must survive a restart: the tokens (mode 0600),
the control-plane secret (`secrets/`, 0700: job tokens are derived from it),
the etcd data and its ports, and the snapshots.

Nothing there is for other local users. The directory is made mode 0700 on every start,
and `up` and its children create files 0600 and directories 0700 (umask 077). etcd is
closed too: `up` turns on etcd's own authentication with a `root` user whose random
password is kept in `<data-dir>/etcd-password` (0600), and the control plane connects with
it; another local user who finds etcd's port is refused every read and write. Everything
here runs as the user who ran `up`, the workers too: they can read the tokens and the
password (same user, same trust). `ftrain node --run-as USER` is the way to run workers as
someone else.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import importlib.util
import json
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from service.embedded import ROOT_USER, EtcdProcess, free_port
from worker.env import FTRAIN_NODE_TOKEN, FTRAIN_TOKEN, FTRAIN_USER_TOKEN

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_JOB = REPO / "examples" / "job.json"
READY_TIMEOUT_S = 30.0
NODES_TIMEOUT_S = 20.0
AGENT_STOP_GRACE_S = 15.0
CONTROL_PLANE_STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.2
PR_SET_PDEATHSIG = 1


class UpError(RuntimeError):
    """`up` cannot start or keep running; the message says why and what to do."""


@dataclass
class UpOptions:
    data_dir: Path = Path(".ftrain")
    host: str = "127.0.0.1"
    port: int = 8000
    nodes: int = 2
    retention_s: float | None = None  # None: the control plane's default (or its env)
    retention_jobs: int | None = None


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: Path
    reported_exit: bool = False


@dataclass
class Paths:
    """Every file `up` keeps under the data directory."""

    root: Path
    token: Path = field(init=False)
    node_token: Path = field(init=False)
    etcd_password: Path = field(init=False)
    server: Path = field(init=False)
    etcd_ports: Path = field(init=False)
    etcd_pid: Path = field(init=False)
    etcd_data: Path = field(init=False)
    snapshots: Path = field(init=False)
    logs: Path = field(init=False)
    job_logs: Path = field(init=False)
    secret_dir: Path = field(init=False)
    lock: Path = field(init=False)

    def __post_init__(self) -> None:
        r = self.root
        self.token, self.node_token, self.server = r / "token", r / "node-token", r / "server"
        self.etcd_password = r / "etcd-password"
        self.etcd_ports, self.etcd_pid, self.etcd_data = r / "etcd-ports", r / "etcd.pid", r / "etcd"
        self.snapshots, self.logs, self.lock = r / "snapshots", r / "logs", r / "up.lock"
        # The workers' output as the control plane keeps it (GET /logs); `logs` holds the
        # processes' own logs, and each agent's copy of torchrun's output under logs/<job>.
        self.job_logs = r / "job-logs"
        # The control plane's secret (job tokens are derived from it) and the jobs' secret env.
        self.secret_dir = r / "secrets"


# Pieces that decide, without starting anything (tested on their own).

def ensure_token(path: Path) -> str:
    """The token kept in `path` (mode 0600), created on first use and reused after."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        token = path.read_text().strip()
        if not token:
            raise UpError(f"{path} is empty; delete it and `ftrain up` makes a new token") from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def is_port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def choose_etcd_ports(path: Path, host: str = "127.0.0.1") -> tuple[int, int]:
    """The ports of the last run if both are free, else new free ones; remembered in `path`."""
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        saved = json.loads(path.read_text())
        client, peer = int(saved["client"]), int(saved["peer"])
        if client != peer and is_port_free(client, host) and is_port_free(peer, host):
            return client, peer
    client = free_port(host)
    peer = free_port(host)
    while peer == client:
        peer = free_port(host)
    path.write_text(json.dumps({"client": client, "peer": peer}) + "\n")
    return client, peer


def local_url(host: str, port: int) -> str:
    """The URL a local client uses: a wildcard listen address is reached on loopback."""
    if host in ("0.0.0.0", "", "::"):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}"


def example_job_path(cwd: Path | None = None) -> str:
    """The example job's path as typed in a shell here: relative when under `cwd`, else absolute."""
    cwd = (cwd or Path.cwd()).resolve()
    try:
        return str(EXAMPLE_JOB.relative_to(cwd))
    except ValueError:
        return str(EXAMPLE_JOB)


def curl_lines(url: str, token: str, job_file: str) -> list[str]:
    """The commands to try against a running control plane, ready to paste."""
    auth = shlex.quote(f"Authorization: Bearer {token}")
    return [
        "# submit the example job",
        f"curl -sS -X POST {url}/v1/jobs -H {auth} -H 'Content-Type: application/json' "
        f"--data @{shlex.quote(job_file)}",
        "# then set JOB to the \"id\" it printed (JOB=...) for its status, events, logs and cancel:",
        f"curl -sS {url}/v1/jobs/$JOB -H {auth}",
        f"curl -sS {url}/v1/jobs/$JOB/events -H {auth}",
        f"curl -sSN \"{url}/v1/jobs/$JOB/logs?follow=true\" -H {auth}",
        f"curl -sS -X POST {url}/v1/jobs/$JOB/cancel -H {auth}",
    ]


def agent_available() -> bool:
    try:
        return importlib.util.find_spec("worker.agent") is not None
    except ModuleNotFoundError:
        return False


# Processes

def _die_with_parent() -> None:
    """Runs in the child before exec: get SIGTERM when `up` dies, however it dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def _spawn(name: str, argv: list[str], env: dict, log_path: Path) -> Child:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=os.getcwd(),
                                start_new_session=True, preexec_fn=_die_with_parent)
    return Child(name, proc, log_path)


def _has_exited(proc: subprocess.Popen) -> bool:
    """Exited, without reaping it: its PID (and so its process group id) stays ours until wait()."""
    if proc.returncode is not None:
        return True
    try:
        info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


def _stop_children(children: list[Child], grace_s: float) -> None:
    """SIGTERM each child, wait up to `grace_s`, then SIGKILL what is left of each one's
    process group (a worker its agent left behind) before reaping the child."""
    for child in children:
        if not _has_exited(child.proc):
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children:
        while not _has_exited(child.proc) and time.monotonic() < deadline:
            time.sleep(0.05)
        if child.proc.returncode is None:
            # The child is alive or a zombie, so its PID still names its own group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)
        child.proc.wait()


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _stop_leftover_etcd(paths: Paths) -> None:
    """Stop an etcd that a SIGKILLed `up` on this data directory left running."""
    try:
        pid = int(paths.etcd_pid.read_text().strip())
    except (FileNotFoundError, ValueError):
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        argv = []
    # Only a process that is an etcd on this very data directory is ours to stop.
    ours = {str(paths.etcd_data).encode(), str(paths.etcd_data.resolve()).encode()}
    if argv and os.path.basename(argv[0]) == b"etcd" and ours & set(argv):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
            time.sleep(0.05)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    paths.etcd_pid.unlink(missing_ok=True)


class LocalCluster:
    """etcd, one control plane and N node agents on this machine, started and stopped in order."""

    def __init__(self, options: UpOptions, out=None):
        self.options = options
        self.paths = Paths(Path(options.data_dir).absolute())
        self.url = local_url(options.host, options.port)
        self.out = out or sys.stdout
        self.stop_requested = threading.Event()
        self.etcd: EtcdProcess | None = None
        self.control_plane: Child | None = None
        self.agents: list[Child] = []
        self.user_token = ""
        self.node_token = ""
        self._lock_fd: int | None = None

    def say(self, message: str = "") -> None:
        print(message, file=self.out, flush=True)

    # start

    def start(self) -> None:
        self._prepare_data_dir()
        self._check_stop()
        self._start_etcd()
        self._check_stop()
        self._start_control_plane()
        self._check_stop()
        self._start_agents()

    def _check_stop(self) -> None:
        if self.stop_requested.is_set():
            raise _Interrupted

    def _prepare_data_dir(self) -> None:
        p = self.paths
        os.umask(0o077)  # everything `up` and its children create is the user's alone
        p.root.mkdir(parents=True, exist_ok=True)
        os.chmod(p.root, 0o700)  # also a directory an older `up` made 0755
        self._lock_fd = os.open(p.lock, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise UpError(f"another `ftrain up` is running with the data directory {p.root}; "
                          "stop it first (Ctrl-C in its terminal) or pass another --data-dir") from None
        self.user_token = ensure_token(p.token)
        self.node_token = ensure_token(p.node_token)
        ensure_token(p.etcd_password)
        for d in (p.snapshots, p.logs, p.job_logs):
            d.mkdir(mode=0o700, exist_ok=True)
        if not is_port_free(self.options.port, self.options.host):
            raise UpError(f"port {self.options.port} on {self.options.host} is in use (another "
                          "`ftrain up` or another server?); pass another --port")
        p.server.write_text(self.url + "\n")

    def _start_etcd(self) -> None:
        _stop_leftover_etcd(self.paths)
        client, peer = choose_etcd_ports(self.paths.etcd_ports)
        self.etcd = EtcdProcess(self.paths.etcd_data, client_port=client, peer_port=peer,
                                log_path=self.paths.logs / "etcd.log",
                                root_password=ensure_token(self.paths.etcd_password))
        try:
            self.etcd.start()
        except FileNotFoundError as exc:
            raise UpError(f"cannot start etcd: {exc}") from exc
        except RuntimeError as exc:
            raise UpError(f"{exc}\n{_tail(self.paths.logs / 'etcd.log')}") from exc
        assert self.etcd.proc is not None
        self.paths.etcd_pid.write_text(f"{self.etcd.proc.pid}\n")

    def _start_control_plane(self) -> None:
        assert self.etcd is not None
        o = self.options
        env = {**os.environ, FTRAIN_USER_TOKEN: self.user_token, FTRAIN_NODE_TOKEN: self.node_token}
        argv = [sys.executable, "-m", "service.cli", "serve", "--etcd", self.etcd.endpoint,
                "--host", o.host, "--port", str(o.port), "--snapshot-root", str(self.paths.snapshots),
                "--log-root", str(self.paths.job_logs), "--secret-dir", str(self.paths.secret_dir),
                "--etcd-user", ROOT_USER, "--etcd-password-file", str(self.paths.etcd_password)]
        if o.retention_s is not None:
            argv += ["--retention", str(o.retention_s)]
        if o.retention_jobs is not None:
            argv += ["--retention-jobs", str(o.retention_jobs)]
        self.control_plane = _spawn("control plane", argv, env, self.paths.logs / "control-plane.log")
        self._wait_ready()

    def _wait_ready(self) -> None:
        assert self.control_plane is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = "no answer yet"
        while time.monotonic() < deadline:
            self._check_stop()
            if self.control_plane.proc.poll() is not None:
                raise UpError(f"the control plane exited with code {self.control_plane.proc.returncode}; "
                              f"its log ({self.control_plane.log_path}) ends with:\n"
                              f"{_tail(self.control_plane.log_path)}")
            try:
                resp = httpx.get(f"{self.url}/readyz", timeout=1)
                if resp.status_code == 200:
                    return
                last = resp.text
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(POLL_INTERVAL_S)
        raise UpError(f"the control plane at {self.url} was not ready within {READY_TIMEOUT_S:g} s "
                      f"(last answer: {last}); see {self.control_plane.log_path}")

    def _start_agents(self) -> None:
        if self.options.nodes <= 0:
            return
        if not agent_available():
            self.say(f"warning: the node agent (worker/agent.py) is not in this build; starting without "
                     f"the {self.options.nodes} local node(s)")
            return
        # Workers run the user's code: no token reaches them through the agent's environment.
        # The agent reads the node token from its file (0600), not from argv (`ps` shows that
        # to every local user) or its environment (/proc/<pid>/environ shows that to its user).
        env = {k: v for k, v in os.environ.items()
               if k not in (FTRAIN_TOKEN, FTRAIN_USER_TOKEN, FTRAIN_NODE_TOKEN)}
        shares = self._gpu_shares()
        for i in range(self.options.nodes):
            name = f"local-{i}"
            argv = [sys.executable, "-m", "service.cli", "node", "--server", self.url,
                    "--name", name, "--data-dir", str(self.paths.root),
                    "--token-file", str(self.paths.node_token)]
            if shares is not None:
                argv += ["--gpus", ",".join(shares[i]) or "none"]
            self.agents.append(_spawn(f"node {name}", argv, env, self.paths.logs / f"node-{name}.log"))

    def _gpu_shares(self) -> list[list[str]] | None:
        """This host's GPUs dealt out among the local agents, each its own (`ftrain node --gpus`),
        so that no two agents' workers use one GPU; None without GPUs."""
        from worker import gpus

        ids = gpus.host_ids()
        if not ids:
            return None
        shares = gpus.split(ids, self.options.nodes)
        self.say(f"GPUs: {len(ids)}, " + ", ".join(f"local-{i}: {len(s)}" for i, s in enumerate(shares)))
        if len(ids) < self.options.nodes:
            self.say(f"warning: fewer GPUs ({len(ids)}) than local nodes ({self.options.nodes}); "
                     "the nodes without one run their workers without a GPU")
        return shares

    def wait_for_nodes(self) -> list[str]:
        """Names of the local nodes registered within NODES_TIMEOUT_S (best effort)."""
        wanted = {f"local-{i}" for i in range(len(self.agents))}
        if not wanted:
            return []
        seen: set[str] = set()
        deadline = time.monotonic() + NODES_TIMEOUT_S
        headers = {"Authorization": f"Bearer {self.user_token}"}
        while time.monotonic() < deadline and not self.stop_requested.is_set():
            try:
                resp = httpx.get(f"{self.url}/v1/nodes", headers=headers, timeout=2)
                if resp.status_code == 404:
                    return []
                if resp.status_code == 200:
                    seen = {n["name"] for n in resp.json().get("items", [])} & wanted
                    if seen == wanted:
                        break
            except (httpx.HTTPError, ValueError):
                pass
            if all(_has_exited(a.proc) for a in self.agents):
                break
            self.stop_requested.wait(POLL_INTERVAL_S)
        return sorted(seen)

    # run

    def watch(self) -> int:
        """Wait for a stop signal; report children that die. Returns the exit code."""
        while not self.stop_requested.wait(POLL_INTERVAL_S):
            for part in (self.control_plane,):
                if part is not None and part.proc.poll() is not None:
                    self.say(f"error: the {part.name} exited with code {part.proc.returncode}; "
                             f"stopping. Its log ({part.log_path}) ends with:\n{_tail(part.log_path)}")
                    return 1
            if self.etcd is not None and self.etcd.proc is not None and self.etcd.proc.poll() is not None:
                self.say(f"error: etcd exited with code {self.etcd.proc.returncode}; stopping. "
                         f"See {self.paths.logs / 'etcd.log'}")
                return 1
            for agent in self.agents:
                if not agent.reported_exit and agent.proc.poll() is not None:
                    agent.reported_exit = True
                    self.say(f"warning: {agent.name} exited with code {agent.proc.returncode}; "
                             f"see {agent.log_path}")
        return 0

    # stop

    def stop(self) -> None:
        """Agents, then the control plane, then etcd; each by PID, each waited for."""
        if self.agents:
            _stop_children(self.agents, AGENT_STOP_GRACE_S)
        if self.control_plane is not None:
            _stop_children([self.control_plane], CONTROL_PLANE_STOP_GRACE_S)
        if self.etcd is not None:
            self.etcd.stop()
            self.paths.etcd_pid.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def print_banner(self, nodes: list[str]) -> None:
        assert self.etcd is not None
        rel = self.paths.root
        with contextlib.suppress(ValueError):
            rel = self.paths.root.relative_to(Path.cwd())
        self.say(f"ftrain is up: control plane {self.url} (API docs {self.url}/docs), "
                 f"etcd {self.etcd.endpoint}")
        self.say(f"dashboard: {self.url}/ui/ (sign in with the user token)")
        self.say(f"data directory {rel}: user (admin) token in {rel}/token, node token in "
                 f"{rel}/node-token, etcd's root password in {rel}/etcd-password, the control-plane "
                 f"secret in {rel}/secrets, logs in {rel}/logs, the workers' output in {rel}/job-logs")
        if self.agents:
            self.say(f"local nodes registered: {', '.join(nodes) or 'none yet'} "
                     f"(of {len(self.agents)} started)")
        elif self.options.nodes == 0:
            self.say("no local nodes (--nodes 0): jobs stay PENDING until a node joins")
        self.say()
        self.say("Try it:")
        for line in curl_lines(self.url, self.user_token, example_job_path()):
            self.say(f"  {line}")
        self.say()
        self.say("Or with the CLI (it reads the token and URL from the data directory):")
        data_flag = "" if str(rel) == ".ftrain" else f" --data-dir {shlex.quote(str(rel))}"
        self.say(f"  ftrain submit {shlex.quote(example_job_path())}{data_flag}")
        self.say(f"  ftrain list{data_flag}")
        self.say()
        self.say("Ctrl-C stops everything.")


class _Interrupted(Exception):
    pass


def run(options: UpOptions) -> int:
    """Run the local cluster in the foreground until SIGINT, SIGTERM or SIGHUP."""
    cluster = LocalCluster(options)
    signals_seen = 0

    def on_signal(signum, frame):
        nonlocal signals_seen
        signals_seen += 1
        cluster.stop_requested.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    code = 0
    try:
        try:
            cluster.start()
            nodes = cluster.wait_for_nodes()
            cluster._check_stop()
            cluster.print_banner(nodes)
            code = cluster.watch()
        except _Interrupted:
            code = 0
        except UpError as exc:
            cluster.say(f"error: {exc}")
            code = 1
        if signals_seen:
            cluster.say("stopping: node agents, control plane, etcd ...")
    finally:
        cluster.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    if signals_seen:
        cluster.say("stopped.")
    return code
