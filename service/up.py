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
it. etcd listens on its TCP client port only once that is done: each start first runs it
on a unix socket in `<data-dir>/etcd-sockets` (0700), turns authentication on there (or
checks it), refuses an etcd holding users, roles or keys that `up` did not put there, and
only then restarts it on TCP (service/embedded.py). Its members' peer traffic stays on unix
sockets there. Another local user who finds etcd's port is refused every read and write. Everything
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
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from pathlib import Path

import httpx

from service.client import remember_local_cluster
from service.embedded import ROOT_USER, EtcdProcess, EtcdTampered, cluster_endpoints, free_port, start_cluster
from worker.env import FTRAIN_NODE_TOKEN, FTRAIN_TOKEN, FTRAIN_USER_TOKEN

REPO = Path(__file__).resolve().parent.parent
EXAMPLE_JOB = REPO / "examples" / "job.json"
READY_TIMEOUT_S = 30.0
NODES_TIMEOUT_S = 20.0
# An agent told to stop drains first (its jobs stop at a step boundary and save, up to
# worker/agent.py LEAVE_GRACE_S), then stops what is left of its workers (5 s more at most).
AGENT_STOP_GRACE_S = 25.0
CONTROL_PLANE_STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.2
# A part that dies is started again after a delay that doubles from the first to the last
# value, and starts afresh once the part has run STEADY_S: a part that cannot start (a port
# taken, a broken data directory) is retried twice a minute, not in a tight loop.
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STEADY_S = 60.0
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
    replicas: int = 1  # control planes, on ports port, port+1, ...
    etcd_members: int = 1  # etcd members of one cluster, each with its own data directory


@dataclass
class Child:
    """A part `up` supervises: its process now, and how to start it again when it dies."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    relaunch: Callable[[], subprocess.Popen] | None = None
    started_at: float = field(default_factory=time.monotonic)
    delay_s: float | None = None  # the last restart's delay (None: never restarted)
    restart_at: float | None = None  # when it starts again (None: it runs)
    restarts: int = 0


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
    etcd_sockets: Path = field(init=False)
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
        self.etcd_sockets = r / "etcd-sockets"  # etcd's peers, and its clients while it is closed
        self.snapshots, self.logs, self.lock = r / "snapshots", r / "logs", r / "up.lock"
        # The workers' output as the control plane keeps it (GET /logs); `logs` holds the
        # processes' own logs, and each agent's copy of torchrun's output under logs/<job>.
        self.job_logs = r / "job-logs"
        # The control plane's secret (job tokens are derived from it) and the jobs' secret env.
        self.secret_dir = r / "secrets"

    def etcd_member_data(self, i: int, members: int) -> Path:
        """Member i's data directory: `etcd` for a lone member, else `etcd-<i>`."""
        return self.etcd_data if members == 1 else self.root / f"etcd-{i}"


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


def choose_etcd_port(path: Path, host: str = "127.0.0.1") -> int:
    """The client port of the last run if it is free, else a new free one; remembered in `path`.

    etcd's peers talk over unix sockets (service/embedded.py): a member has no peer port."""
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        client = int(json.loads(path.read_text())["client"])
        if is_port_free(client, host):
            return client
    client = free_port(host)
    path.write_text(json.dumps({"client": client}) + "\n")
    return client


def choose_cluster_ports(path: Path, members: int, host: str = "127.0.0.1") -> list[int]:
    """The client port of each member of a cluster of `members` (more than one).

    The ports of the first start are kept for good (a restart whose port is taken says so).
    """
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        saved = json.loads(path.read_text())
        if "members" not in saved:
            raise UpError(f"this data directory holds a one-member etcd ({path}); run `ftrain up` "
                          "on it with --etcd-members 1, or pass another --data-dir for a cluster")
        if any("peer" in m for m in saved["members"]):
            raise UpError(f"this data directory's etcd members talk over TCP peer ports ({path}), which "
                          "any local user can reach and write through; `ftrain up` keeps peer traffic "
                          "on unix sockets only for a cluster it makes: pass another --data-dir "
                          "(this one's jobs are not carried over)")
        ports = [int(m["client"]) for m in saved["members"]]
        if len(ports) != members:
            raise UpError(f"this data directory holds an etcd of {len(ports)} members ({path}); run "
                          f"`ftrain up` on it with --etcd-members {len(ports)}, or pass another --data-dir")
        taken = [p for p in ports if not is_port_free(p, host)]
        if taken:
            raise UpError(f"the etcd members' ports {', '.join(map(str, taken))} on {host} are in "
                          "use (a leftover etcd?); stop what holds them and start again")
        return ports
    chosen: set[int] = set()
    while len(chosen) < members:
        chosen.add(free_port(host))
    ports = sorted(chosen)
    path.write_text(json.dumps({"members": [{"client": c} for c in ports]}) + "\n")
    return ports


def restart_delay(previous_s: float | None, ran_s: float) -> float:
    """How long to wait before starting again a part that died after running `ran_s`, whose
    last restart waited `previous_s` (None: its first death)."""
    if previous_s is None or ran_s >= STEADY_S:
        return BACKOFF_FIRST_S
    return min(previous_s * 2, BACKOFF_MAX_S)


def exit_text(code: int) -> str:
    """A process's exit as people say it: `code 1`, or the signal's name (`SIGKILL`)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return signal.Signals(-code).name
    return f"code {code}"


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


def curl_lines(url: str, token_file: str, job_file: str) -> list[str]:
    """The commands to try against a running control plane, ready to paste: the token is read
    from its file into $TOKEN once, never printed (a terminal's scrollback is not for secrets)."""
    auth = '"Authorization: Bearer $TOKEN"'
    return [
        f"TOKEN=$(cat {shlex.quote(token_file)})",
        "# submit the example job",
        f"curl -sS -X POST {url}/v1/jobs -H {auth} -H 'Content-Type: application/json' "
        f"--data @{shlex.quote(job_file)}",
        "# then set JOB to the \"id\" it printed (JOB=...) for its status, events, logs and cancel:",
        f"curl -sS {url}/v1/jobs/$JOB -H {auth}",
        f"curl -sS {url}/v1/jobs/$JOB/events -H {auth}",
        f"curl -sSN \"{url}/v1/jobs/$JOB/logs?follow=true&wait_s=30\" -H {auth}",
        f"curl -sS -X POST {url}/v1/jobs/$JOB/cancel -H {auth}",
    ]


def cli_command(argv0: str | None = None, cwd: Path | None = None) -> str:
    """How to type the `ftrain` command here: `ftrain` when that on PATH is this one, else the
    path of this environment's script (`.venv/bin/ftrain` under `make up`)."""
    argv0 = argv0 if argv0 is not None else sys.argv[0]
    mine = Path(argv0) if Path(argv0).name == "ftrain" else Path(sys.executable).parent / "ftrain"
    on_path = shutil.which("ftrain")
    if on_path is not None and Path(on_path).resolve() == mine.resolve():
        return "ftrain"
    cwd = (cwd or Path.cwd()).resolve()
    try:
        return shlex.quote(str(mine.absolute().relative_to(cwd)))
    except ValueError:
        return shlex.quote(str(mine.absolute()))


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
    cwd = os.getcwd()

    def launch() -> subprocess.Popen:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=cwd,
                                    start_new_session=True, preexec_fn=_die_with_parent)

    return Child(name, launch(), log_path, launch)


def _etcd_child(member: EtcdProcess, name: str) -> Child:
    """An etcd member as a supervised part: started again on its own data directory and ports."""
    def launch() -> subprocess.Popen:
        member.launch()
        assert member.proc is not None
        return member.proc

    assert member.proc is not None
    return Child(name, member.proc, member.log_path, launch)


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


def hand_started_agents(root: Path, ours: set[int]) -> list[int]:
    """PIDs of the node agents that run on data directory `root` and that `up` did not start
    (`ftrain node` started by hand against the local cluster): each holds its name's lock
    there (`worker.node_link.lock_name`), with its PID written in it."""
    pids = []
    for path in sorted(root.glob("node-credential.*.lock")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                continue  # nobody holds it: no agent of that name runs
            except BlockingIOError:
                pid = int(os.read(fd, 32).split()[0])
        except (ValueError, IndexError, OSError):
            continue
        finally:
            os.close(fd)
        if pid not in ours and pid != os.getpid() and _is_agent(pid):
            pids.append(pid)
    return pids


def _is_agent(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"node" in argv or any(a.endswith(b"worker.agent") for a in argv)


def _wait_gone(pids: list[int], deadline: float) -> None:
    """Wait until each process (not our child: its parent reaps it) is gone or a zombie, up to
    `deadline`; then SIGKILL what is left."""
    def alive(pid: int) -> bool:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        return stat.rsplit(")", 1)[-1].split()[0] != "Z"

    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _stop_leftover_etcd(paths: Paths) -> None:
    """Stop an etcd that a SIGKILLed `up` on this data directory left running."""
    try:
        pids = [int(line) for line in paths.etcd_pid.read_text().split()]
    except (FileNotFoundError, ValueError):
        return
    for pid in pids:  # one line per member
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            argv = []
        # Only a process that is an etcd on one of this data directory's members is ours to stop.
        if argv and os.path.basename(argv[0]) == b"etcd" and _our_etcd_dir(paths, argv):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.05)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    paths.etcd_pid.unlink(missing_ok=True)


def _our_etcd_dir(paths: Paths, argv: list[bytes]) -> bool:
    """Whether an etcd's argv names a member data directory under this data directory."""
    try:
        data_dir = Path(argv[argv.index(b"--data-dir") + 1].decode())
    except (ValueError, IndexError, UnicodeDecodeError):
        return False
    roots = {paths.root, paths.root.resolve()}
    return data_dir.parent in roots and (data_dir.name == "etcd" or data_dir.name.startswith("etcd-"))


class LocalCluster:
    """etcd (M members), control planes (N replicas) and node agents on this machine,
    started and stopped in order."""

    def __init__(self, options: UpOptions, out=None):
        self.options = options
        self.paths = Paths(Path(options.data_dir).absolute())
        self.urls = [local_url(options.host, options.port + i) for i in range(options.replicas)]
        self.url = self.urls[0]
        self.server = ",".join(self.urls)  # what clients are given: every replica, to fail over
        self.out = out or sys.stdout
        self.stop_requested = threading.Event()
        self.etcds: list[EtcdProcess] = []
        self.control_planes: list[Child] = []
        self.etcd_parts: list[Child] = []  # the members, as supervised parts
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
        for port in range(self.options.port, self.options.port + self.options.replicas):
            if not is_port_free(port, self.options.host):
                raise UpError(f"port {port} on {self.options.host} is in use (another "
                              "`ftrain up` or another server?); pass another --port")
        p.server.write_text(self.server + "\n")
        remember_local_cluster(p.root)  # the user's CLI finds this cluster from any directory

    def _start_etcd(self) -> None:
        _stop_leftover_etcd(self.paths)
        m = self.options.etcd_members
        password = ensure_token(self.paths.etcd_password)
        if m == 1:
            ports = [choose_etcd_port(self.paths.etcd_ports)]
        else:
            if self.paths.etcd_data.exists():
                raise UpError(f"this data directory holds a one-member etcd ({self.paths.etcd_data}); "
                              "run `ftrain up` on it with --etcd-members 1, or pass another --data-dir")
            ports = choose_cluster_ports(self.paths.etcd_ports, m)
        names = ["ftrain"] if m == 1 else [f"ftrain-{i}" for i in range(m)]
        self.etcds = [
            EtcdProcess(self.paths.etcd_member_data(i, m), client_port=client, peer_socket=True,
                        socket_dir=self.paths.etcd_sockets,
                        log_path=self.paths.logs / ("etcd.log" if m == 1 else f"etcd-{i}.log"),
                        root_password=password, name=names[i])
            for i, client in enumerate(ports)]
        if m > 1:
            peers = ",".join(f"{e.name}={e.peer_url}" for e in self.etcds)
            for member in self.etcds:
                member.initial_cluster = peers
        try:
            start_cluster(self.etcds)
        except FileNotFoundError as exc:
            raise UpError(f"cannot start etcd: {exc}") from exc
        except EtcdTampered as exc:
            raise UpError(str(exc)) from exc  # says all: etcd's log has nothing to add
        except RuntimeError as exc:
            raise UpError(f"{exc}\n{_tail(self.etcds[0].log_path)}") from exc
        finally:
            self._record_etcd_pids()
        self.etcd_parts = [_etcd_child(e, "etcd" if m == 1 else f"etcd member {e.name}") for e in self.etcds]

    @property
    def etcd_endpoints(self) -> str:
        return cluster_endpoints(self.etcds)

    def control_plane_argv(self, i: int) -> list[str]:
        """Replica i's `ftrain serve`: every etcd member, its own port, the shared folders."""
        o = self.options
        argv = [sys.executable, "-m", "service.cli", "serve", "--etcd", self.etcd_endpoints,
                "--host", o.host, "--port", str(o.port + i), "--snapshot-root", str(self.paths.snapshots),
                "--log-root", str(self.paths.job_logs), "--secret-dir", str(self.paths.secret_dir),
                "--etcd-user", ROOT_USER, "--etcd-password-file", str(self.paths.etcd_password)]
        if o.retention_s is not None:
            argv += ["--retention", str(o.retention_s)]
        if o.retention_jobs is not None:
            argv += ["--retention-jobs", str(o.retention_jobs)]
        return argv

    def _start_control_plane(self) -> None:
        env = {**os.environ, FTRAIN_USER_TOKEN: self.user_token, FTRAIN_NODE_TOKEN: self.node_token}
        for i in range(self.options.replicas):
            name, log = ("control plane", "control-plane.log") if self.options.replicas == 1 else \
                (f"control plane {i}", f"control-plane-{i}.log")
            self.control_planes.append(_spawn(name, self.control_plane_argv(i), env, self.paths.logs / log))
        for child, url in zip(self.control_planes, self.urls, strict=True):
            self._wait_ready(child, url)

    def _wait_ready(self, child: Child, url: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        last = "no answer yet"
        while time.monotonic() < deadline:
            self._check_stop()
            if child.proc.poll() is not None:
                raise UpError(f"the {child.name} exited with code {child.proc.returncode}; "
                              f"its log ({child.log_path}) ends with:\n"
                              f"{_tail(child.log_path)}")
            try:
                resp = httpx.get(f"{url}/readyz", timeout=1)
                if resp.status_code == 200:
                    return
                last = resp.text
            except httpx.HTTPError as exc:
                last = repr(exc)
            time.sleep(POLL_INTERVAL_S)
        raise UpError(f"the {child.name} at {url} was not ready within {READY_TIMEOUT_S:g} s "
                      f"(last answer: {last}); see {child.log_path}")

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
            argv = [sys.executable, "-m", "service.cli", "node", "--server", self.server,
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
        """Supervise until a stop signal: a part that dies (an etcd member, a control plane, a
        node agent) is started again after a backoff (`restart_delay`), with one line that
        says so. Only a signal stops the cluster. Returns the exit code."""
        while not self.stop_requested.wait(POLL_INTERVAL_S):
            now = time.monotonic()
            for part in [*self.etcd_parts, *self.control_planes, *self.agents]:
                self._supervise(part, now)
        return 0

    def _supervise(self, part: Child, now: float) -> None:
        if part.restart_at is None:
            if part.relaunch is None or part.proc.poll() is None:
                return
            part.delay_s = restart_delay(part.delay_s, now - part.started_at)
            part.restart_at = now + part.delay_s
            part.restarts += 1
            self.say(f"{part.name} exited ({exit_text(part.proc.returncode)}); restarting it in "
                     f"{part.delay_s:g} s (restart {part.restarts}; its log: {part.log_path})")
        elif now >= part.restart_at:
            part.restart_at = None
            part.started_at = now
            try:
                part.proc = part.relaunch()
            except OSError as exc:  # the next pass sees it dead and backs off further
                self.say(f"warning: could not start the {part.name} again: {exc}")
            if part in self.etcd_parts:
                self._record_etcd_pids()

    def _record_etcd_pids(self) -> None:
        """The members' PIDs, for the next `up` to stop any a SIGKILLed `up` left behind."""
        pids = [e.proc.pid for e in self.etcds if e.proc is not None]
        self.paths.etcd_pid.write_text("".join(f"{pid}\n" for pid in pids))

    # stop

    def stop(self) -> None:
        """Agents (those started by hand on this data directory too), then the control plane,
        then etcd; each by PID, each waited for."""
        others = hand_started_agents(self.paths.root, {a.proc.pid for a in self.agents})
        for pid in others:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + AGENT_STOP_GRACE_S
        if self.agents:
            _stop_children(self.agents, AGENT_STOP_GRACE_S)
        _wait_gone(others, deadline)
        if self.control_planes:
            _stop_children(self.control_planes, CONTROL_PLANE_STOP_GRACE_S)
        if self.etcds:
            for member in self.etcds:
                member.stop()
            self.paths.etcd_pid.unlink(missing_ok=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def print_banner(self, nodes: list[str]) -> None:
        rel = self.paths.root
        with contextlib.suppress(ValueError):
            rel = self.paths.root.relative_to(Path.cwd())
        if len(self.urls) == 1 and len(self.etcds) == 1:
            self.say(f"ftrain is up: control plane {self.url} (API docs {self.url}/docs), "
                     f"etcd {self.etcd_endpoints}")
        else:
            self.say(f"ftrain is up: {len(self.urls)} control plane(s) {', '.join(self.urls)} (API docs "
                     f"{self.url}/docs), etcd of {len(self.etcds)} member(s) {self.etcd_endpoints}")
            self.say(f"clients take every replica and fail over: --server {self.server} "
                     f"(or FTRAIN_SERVER={self.server}; the CLI reads {rel}/server)")
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
        for line in curl_lines(self.url, str(rel / "token"), example_job_path()):
            self.say(f"  {line}")
        self.say()
        self.say("Or with the CLI (from any directory: it finds this cluster's URL and token):")
        ftrain = cli_command()
        self.say(f"  {ftrain} submit {shlex.quote(example_job_path())}")
        self.say(f"  {ftrain} list")
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
