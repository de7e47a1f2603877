"""Real processes for the benchmarks and the integration tests: etcd, the control plane
(uvicorn), node agents; and rank 0's lines of a job's log, read back through the API.

Every process is started by PID and stopped by PID; nothing is matched by name. The tests
reach these through `tests.helpers` (processes, elastic, faults); a benchmark imports this
module, never the tests' helpers.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from service.embedded import EtcdProcess as EtcdProcess  # the benchmarks' and tests' etcd
from service.embedded import free_port
from service.keyring import Keyring
from service.models import JobRecord
from worker import memory_dirs
from worker.procs import cmdline, descendants, is_fork_server, is_launcher, is_standby, parent_of
from worker.procs import is_alive as pid_alive

REPO = Path(__file__).resolve().parents[1]


# A wait polls every FAST_POLL_S for FAST_POLL_FOR_S, then every SLOW_POLL_S: most probes ask
# the control plane (a whole job log, say), and a suite of such waits at 20 a second cost CI
# minutes of CPU.
FAST_POLL_S = 0.05
FAST_POLL_FOR_S = 1.0
SLOW_POLL_S = 0.2


def publish(table: str, figures: dict, out: str | None) -> None:
    """Print a benchmark's table; with `out`, also write it there with its figures as JSON
    (the form of the files under docs/measurements/)."""
    print(table)
    if out:
        Path(out).write_text(table + "\n\n" + json.dumps(figures, indent=2) + "\n")


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str,
             interval_s: float | None = None):
    """Poll `predicate` until it returns something truthy; fail with `what` at the deadline.
    Every `interval_s` if given; else every `FAST_POLL_S` for the first `FAST_POLL_FOR_S`,
    then every `SLOW_POLL_S`."""
    started = time.monotonic()
    deadline = started + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ProcessExited:
            raise
        except Exception as exc:  # noqa: BLE001 - a probe may fail until the thing is up
            last_exc = exc
        if interval_s is not None:
            time.sleep(interval_s)
        else:
            time.sleep(SLOW_POLL_S if time.monotonic() - started > FAST_POLL_FOR_S else FAST_POLL_S)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}"
                         + (f" (last error: {last_exc!r})" if last_exc else ""))



def stop_tree(proc: subprocess.Popen, sig: int, wait_s: float) -> None:
    """Test clean-up of a process this test started and of everything it left: `sig` to
    it (SIGKILL after `wait_s`), then SIGKILL to its descendants still alive."""
    left = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in left:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)

class ProcessExited(AssertionError):
    """A process a test waits on has died: waiting longer will not help."""


def workers_under(pid: int, script: Path) -> list[int]:
    """The live training processes under `pid`: those running `script` (not torchrun, not
    the exec shim, not worker/launch.py) and those a fork server started (its children,
    which keep the server's argv; a forked torchrun is told apart by its name; a standby
    is no worker yet)."""
    out = []
    for child in descendants(pid):
        argv = cmdline(child)
        if any(str(script).encode() in a for a in argv) and b"torch.distributed.run" not in argv \
                and b"-c" not in argv[:3] and not is_launcher(argv) and pid_alive(child):
            out.append(child)
        elif is_fork_server(argv) and pid_alive(child) and not forked_torchrun(child):
            out.extend(c for c in descendants(child) if parent_of(c) == child and pid_alive(c)
                       and not forked_torchrun(c) and not is_standby(c))
    return out


def forked_torchrun(pid: int) -> bool:
    """True for a torchrun a fork server forked: the launcher it watches (through a pidfd,
    worker/fork_server.py) stands in for torchrun, whether or not it has workers now."""
    return any(b"torch.distributed.run" in cmdline(watched) for watched in _pidfds(pid))


def _pidfds(pid: int) -> list[int]:
    """The processes `pid` holds pidfds of (/proc/PID/fdinfo says "Pid:" for those)."""
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fdinfo")
    except OSError:
        return out
    for fd in fds:
        try:
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except OSError:
            continue
        out += [int(line.split()[1]) for line in info.splitlines() if line.startswith("Pid:")]
    return out


class ControlPlane:
    """A real `ftrain serve` (uvicorn) process on a free port (loopback unless `host` is given;
    in the network namespace `netns` if given); `open_`: without tokens (loopback only)."""

    def __init__(self, etcd_endpoint: str, workdir: Path, user_token: str | None = None,
                 node_token: str | None = None, port: int | None = None, env: dict | None = None,
                 host: str = "127.0.0.1", netns: str | None = None, open_: bool = False):
        self.open = open_
        self.host = host
        self.netns = netns  # a network namespace to run in (`ip netns exec`)
        self.etcd_endpoint = etcd_endpoint
        self.workdir = workdir
        self.user_token = user_token or secrets.token_urlsafe(16)
        self.node_token = node_token or secrets.token_urlsafe(16)
        self.port = port or free_port()
        self.env = env or {}
        self.proc: subprocess.Popen | None = None
        self.snapshot_root = workdir / "snapshots"
        self.log_root = workdir / "job-logs"
        self.secret_dir = workdir / "secrets"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ControlPlane:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tokens = {"FTRAIN_USER_TOKEN": self.user_token, "FTRAIN_NODE_TOKEN": self.node_token}
        env = {**{k: v for k, v in os.environ.items() if k not in tokens},
               **({} if self.open else tokens), **self.env}
        log = open(self.workdir / f"control-plane-{self.port}.log", "ab")  # noqa: SIM115
        argv = [sys.executable, "-m", "service.cli", "serve", "--etcd", self.etcd_endpoint,
                "--host", self.host, "--port", str(self.port), "--snapshot-root", str(self.snapshot_root),
                "--log-root", str(self.log_root), "--secret-dir", str(self.secret_dir)]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        try:
            wait_for(self._healthy, timeout_s, f"control plane on {self.url}")
        except BaseException:
            # A fixture whose start failed has no teardown: stopped here, or it would outlive
            # the test, asking an etcd that is gone twice a second.
            self.stop(signal.SIGKILL)
            raise
        return self

    def job_token(self, job: JobRecord) -> str:
        """The token the control plane gives `job`'s workers (derived, never stored)."""
        return Keyring.load(self.secret_dir).job_token(job.id, job.token_nonce)

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            log = (self.workdir / f"control-plane-{self.port}.log").read_text()[-3000:]
            raise ProcessExited(f"control plane exited with {self.proc.returncode}:\n{log}")
        return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def node_token_file(self) -> Path:
        """The node token in a file of mode 0600 (what `ftrain node --token-file` reads)."""
        path = self.workdir / f"node-token-{self.port}"
        if not path.exists():
            self.workdir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(self.node_token + "\n")
        return path

    def enrol(self, name: str, nproc_per_node: int = 1) -> str:
        """Register node `name` with the node token; its own credential."""
        with self.client("node") as c:
            resp = c.post("/v1/nodes/register", json={"name": name, "nproc_per_node": nproc_per_node})
            assert resp.status_code == 200, resp.text
            return resp.json()["credential"]

    def member_of(self, job_id: str, name: str, timeout_s: float = 20.0) -> str:
        """Register node `name` and heartbeat until the scheduler gives it job `job_id`; its
        credential (the job must be able to start on this one node)."""
        return self.members_of(job_id, [name], timeout_s)[name]

    def members_of(self, job_id: str, names: list[str], timeout_s: float = 20.0) -> dict[str, str]:
        """`member_of` for a job of len(names) nodes: each node's credential, by name."""
        credentials = {name: self.enrol(name) for name in names}
        for name, credential in credentials.items():
            with self.client(credential) as c:
                def assigned() -> bool:
                    resp = c.post(f"/v1/nodes/{name}/heartbeat", json={})  # noqa: B023 - called at once
                    assert resp.status_code == 200, resp.text
                    a = resp.json()["assignment"]
                    return a is not None and a["job_id"] == job_id
                wait_for(assigned, timeout_s, f"job {job_id} to be assigned to node {name}")
        return credentials

    def job_token_of(self, job_id: str) -> str:
        """Job `job_id`'s token, as its workers get it (read its record, derive the token)."""
        import asyncio

        from service.jobs import JobStore
        from service.keys import Keys
        from service.store.etcd import EtcdStore

        async def read() -> JobRecord:
            store = EtcdStore(self.etcd_endpoint)
            try:
                return await JobStore(store, Keys()).get(job_id)
            finally:
                await store.close()

        return self.job_token(asyncio.run(read()))

    def client(self, token: str | None = "user") -> httpx.Client:
        headers = {}
        if token == "user":
            headers["Authorization"] = f"Bearer {self.user_token}"
        elif token == "node":
            headers["Authorization"] = f"Bearer {self.node_token}"
        elif token:
            headers["Authorization"] = f"Bearer {token}"
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)


class NodeAgentProc:
    """A real node agent (`ftrain node`) as a subprocess."""

    def __init__(self, cp: ControlPlane, name: str, workdir: Path, nproc_per_node: int = 1,
                 address: str | None = None, netns: str | None = None, env: dict | None = None,
                 args: list[str] | None = None, prefix: list[str] | None = None):
        self.cp = cp
        # More `ftrain node` options. The built-in health checks cost a process that imports
        # torch at every start: off unless a test asks for them (tests/integration/test_health.py).
        self.args = [*(args or [])]
        if "--builtin-checks" not in self.args:
            self.args.append("--no-builtin-checks")
        self.prefix = prefix or []  # a command the agent runs under (it execs the rest)
        self.env = env
        self.name = name
        self.workdir = workdir
        self.nproc_per_node = nproc_per_node
        self.address = address
        self.netns = netns
        self.proc: subprocess.Popen | None = None
        self._stopping: list[int] = []  # asked to stop: its process tree then

    def start(self, server: str | None = None) -> NodeAgentProc:
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "service.cli", "node", "--server", server or self.cp.url,
                "--name", self.name,
                "--nproc-per-node", str(self.nproc_per_node), "--data-dir", str(self.workdir)]
        if "FTRAIN_NODE_TOKEN" not in (self.env or {}):  # else the agent reads it from there
            argv += ["--token-file", str(self.cp.node_token_file)]
        if self.address:
            argv += ["--address", self.address]
        argv += [*self.args]
        argv = [*self.prefix, *argv]
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns, *argv]
        log = open(self.workdir / f"agent-{self.name}.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, cwd=REPO, env={**os.environ, **(self.env or {})}, stdout=log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def tree(self) -> list[int]:
        return [self.pid, *descendants(self.pid)] if self.proc and self.proc.poll() is None else []

    def kill_tree(self) -> list[int]:
        """SIGKILL the agent and every process under it; returns the PIDs killed."""
        pids = self.tree()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc:
            self.proc.wait()
        return pids

    def ask_to_stop(self) -> None:
        """SIGTERM, without waiting for the exit (`stop` waits): agents stop side by side."""
        if self.proc and self.proc.poll() is None and not self._stopping:
            self._stopping = self.tree()  # the processes to sweep once it has exited
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20) -> None:
        self.ask_to_stop()
        pids, self._stopping = self._stopping, []
        if self.proc and pids:
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()
        # The memory tier an agent killed by the test left in /dev/shm (worker/memory_dirs.py).
        memory_dirs.remove_leftovers(self.workdir, self.name)


def stop_agents(agents: list[NodeAgentProc]) -> None:
    """Stop every agent: all told at once, then each waited for (each ends its own way out,
    side by side rather than one after another)."""
    for agent in agents:
        agent.ask_to_stop()
    for agent in agents:
        agent.stop()


def etcd_metrics(endpoint: str) -> dict:
    """etcd's database size (in use, total) and key count, from its /metrics."""
    text = httpx.get(f"{endpoint}/metrics", timeout=10).text
    want = {"etcd_mvcc_db_total_size_in_use_in_bytes": "db_in_use", "etcd_mvcc_db_total_size_in_bytes":
            "db_total", "etcd_debugging_mvcc_keys_total": "keys"}
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in want:
            out[want[name]] = int(float(value))
    return out


# Lines of the runtime's own (worker/runtime.py) in rank 0's output.
STEP_LINE = re.compile(r"^step=(\d+)\b")
RUN_START = re.compile(r"^start step=(\d+)")  # the runtime's own start, not a script's "resumed"
FROM_MEMORY = re.compile(r"resumed from memory \(step (\d+)")


def log_items(api: httpx.Client, job_id: str, rank: int | None = None) -> list[dict]:
    """Every line of the job's log as it is now (of one rank, if given), page by page."""
    items: list[dict] = []
    since = 0
    while True:
        params = {"since": since, **({"rank": rank} if rank is not None else {})}
        resp = api.get(f"/v1/jobs/{job_id}/logs", params=params)
        resp.raise_for_status()
        page = resp.json()
        items += page["items"]
        if page["next_seq"] >= page["end_seq"]:
            return items
        since = page["next_seq"]


def rank0_lines(api: httpx.Client, job_id: str) -> list[dict]:
    """Rank 0's lines in the order they were written (the agents' read times; the log's
    own order is the order they were shipped, which after an outage mixes nodes), once each."""
    items = log_items(api, job_id, rank=0)
    # Shipping is at-least-once: a batch whose write reached the log just before it died is
    # sent again (same node, attempt, read time and text). Count such a line once.
    unique = {(i["node"], i["attempt"], i["time"], i["line"]): i for i in items}
    return sorted(unique.values(), key=lambda i: (i["time"], i["seq"]))


def runs(api, job_id: str) -> list[tuple[int, list[int]]]:
    """Rank 0's runs in order: (the step it started from, the steps it logged)."""
    out: list[tuple[int, list[int]]] = []
    for item in rank0_lines(api, job_id):
        if m := RUN_START.match(item["line"]):
            out.append((int(m.group(1)), []))
        elif (m := STEP_LINE.match(item["line"])) and out:
            out[-1][1].append(int(m.group(1)))
    return out
