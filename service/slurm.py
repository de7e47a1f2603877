"""Nodes from SLURM: `ftrain slurm nodes` and `ftrain slurm run`.

SLURM supplies machines; ftrain's control plane still schedules the jobs. Two ways:

- `ftrain slurm nodes --nodes N`: an allocation (sbatch) whose every node runs one node
  agent (`srun`, one task per node), named by its SLURM node name (SLURMD_NODENAME), that
  joins a long-lived control plane (--server). The agents serve until the allocation ends.
- `ftrain slurm run --nodes MIN:MAX -- COMMAND`: one allocation holds everything. On its
  first node (where the batch script runs) it starts etcd and a control plane (`ftrain up
  --nodes 0`), one agent step per node (`srun -N1 -w NODE`), submits COMMAND as a job and
  follows it; it exits with the job's code. Run outside an allocation it submits one that
  runs itself (`sbatch --wait`).

The node token. It never travels on a command line (`ps` shows those to every user) nor in
the job's environment: sbatch's environment is sent to slurmctld (munge signs SLURM's
messages, it does not encrypt them), kept in its state directory for the job's life (and in
the accounting database where the site stores job environments), and inherited by the batch
shell and srun, whose /proc/PID/environ show it for the whole allocation. It goes in a file
of mode 0600 in a directory of mode 0700 on a filesystem the nodes share (the one the job's
snapshots need anyway), and the script names only the file. sbatch is run without any token
variable in its environment.

The end of an allocation. SLURM ends one (scancel, a time limit, preemption) by sending
SIGCONT and SIGTERM to every process of its steps, then SIGKILL after KillWait (30 s by
default; a preempting partition's GraceTime). The agent's SIGTERM is its drain: it asks the
control plane to let its node go (`POST /v1/nodes/{name}/leave`), its job stops at a step
boundary on the other nodes or goes back to PENDING with its state saved, and the agent
exits 0 (worker/agent.py, up to the control plane's ack timeout and 1 s, 16 s by default).
The workers get the same SIGTERM at once: a runtime worker copies its last step into the
memory tier (its last words), and a plain script's torchrun stops it. The scripts are
`--requeue`: an allocation SLURM requeues starts its agents again, under the same names.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from worker.env import FTRAIN_NODE_TOKEN, FTRAIN_TOKEN, FTRAIN_USER_TOKEN

SECRET_VARIABLES = (FTRAIN_NODE_TOKEN, FTRAIN_TOKEN, FTRAIN_USER_TOKEN)
# `ftrain slurm run`: how long the control plane on the first node may take to answer.
CONTROL_PLANE_TIMEOUT_S = 60.0
# An agent step that ended while the job runs (a node's step was cancelled, its agent died)
# is started again after this long: the node comes back to the job.
STEP_RESTART_DELAY_S = 2.0
POLL_S = 0.2
# The agents' and the control plane's stop: the agents' drain (16 s) and 5 s more.
STOP_GRACE_S = 25.0


class SlurmError(RuntimeError):
    """SLURM cannot be used as asked; the message says why and what to do."""


# ---------------------------------------------------------------- pieces that decide

def agent_argv(server: str, token_file: Path, data_dir: Path, nproc_per_node: int) -> list[str]:
    """`ftrain node` as each node runs it; its name comes from SLURMD_NODENAME (set per task)."""
    return [sys.executable, "-m", "service.cli", "node", "--server", server, "--token-file",
            str(token_file), "--data-dir", str(data_dir), "--nproc-per-node", str(nproc_per_node)]


def batch_script(directives: list[str], command: list[str], why: str) -> str:
    """An sbatch script: #SBATCH `directives` (the command line's options override them), a
    comment that says what it does, and `command`, exec'd so SLURM's signals reach it."""
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in directives), f"# {why}", f"exec {shlex.join(command)}", ""]
    return "\n".join(lines)


def nodes_script(nodes: int, argv: list[str]) -> str:
    """The script of `ftrain slurm nodes`: one agent per node, for the allocation's life."""
    srun = ["srun", "--kill-on-bad-exit=0", "--ntasks-per-node=1", *argv]
    return batch_script([f"--nodes={nodes}", "--ntasks-per-node=1", "--job-name=ftrain-nodes", "--requeue",
                         "--open-mode=append"], srun,
                        "ftrain: one node agent on each node of this allocation (ftrain slurm nodes)")


def sbatch_nodes(node_range: dict[str, int]) -> str:
    """sbatch's --nodes for a job's range: `2` or `2-4`."""
    lo, hi = node_range["min"], node_range["max"]
    return str(lo) if lo == hi else f"{lo}-{hi}"


def check_private(path: Path) -> None:
    """Refuse a token file that another user could read, or that is not a file of ours."""
    try:
        st = path.stat()
    except OSError as exc:
        raise SlurmError(f"cannot read the node token file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        raise SlurmError(f"{path} is not a file of yours; pass a node token file you own")
    if st.st_mode & 0o077:
        raise SlurmError(f"{path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                         f"`chmod 600 {path}` and submit again")


def write_private(path: Path, text: str) -> Path:
    """Write `text` to `path`, mode 0600, in a directory made 0700 if it is new."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
    return path


def node_token_file(given: str | None, environ: dict[str, str], data_dir: Path) -> Path:
    """The file the agents read the node token from: --token-file (checked private), else
    `ftrain up`'s <data-dir>/node-token, else FTRAIN_NODE_TOKEN written to a private file."""
    if given is not None:
        path = Path(given).resolve()
    elif (data_dir / "node-token").is_file():
        path = (data_dir / "node-token").resolve()
    elif environ.get(FTRAIN_NODE_TOKEN):
        return write_private(data_dir.resolve() / "slurm" / "node-token", environ[FTRAIN_NODE_TOKEN])
    else:
        raise SlurmError(f"no node token: pass --token-file (mode 0600), set {FTRAIN_NODE_TOKEN}, or "
                         f"run in the data directory of `ftrain up` ({data_dir}/node-token)")
    check_private(path)
    return path


def without_secrets(environ: dict[str, str]) -> dict[str, str]:
    """sbatch's environment: the caller's (sbatch exports it to the job), less every token."""
    return {k: v for k, v in environ.items() if k not in SECRET_VARIABLES}


def require(program: str) -> str:
    found = shutil.which(program)
    if found is None:
        raise SlurmError(f"`{program}` is not on PATH: run this on a SLURM login or compute node "
                         "(Debian's package: slurm-client)")
    return found


def sbatch(script: str, options: list[str], wait: bool = False) -> subprocess.CompletedProcess:
    """Submit `script` (on stdin); `options` are sbatch's own and override the script's."""
    argv = [require("sbatch"), *(["--wait"] if wait else ["--parsable"]), *options]
    return subprocess.run(argv, input=script, text=True, env=without_secrets(dict(os.environ)),
                          stdout=None if wait else subprocess.PIPE)


def submit_nodes(script: str, options: list[str]) -> str:
    """Submit the agents' allocation; its SLURM job id."""
    done = sbatch(script, options)
    if done.returncode != 0:
        raise SlurmError(f"sbatch failed (exit {done.returncode}); its message is above")
    return done.stdout.strip().split(";")[0]


# ---------------------------------------------------------------- one allocation, all of ftrain

def allocation_nodes(environ: dict[str, str]) -> list[str]:
    """The node names of the allocation this process runs in (SLURM_JOB_NODELIST expanded)."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise SlurmError("SLURM_JOB_NODELIST is not set: not inside a SLURM allocation")
    done = subprocess.run([require("scontrol"), "show", "hostnames", nodelist], capture_output=True, text=True)
    if done.returncode != 0:
        raise SlurmError(f"scontrol show hostnames {nodelist}: {done.stderr.strip()}")
    return done.stdout.split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@dataclass
class AllocationRun:
    """`ftrain slurm run` inside an allocation: etcd and the control plane here (the first
    node), an agent step on every node (started again when one ends while the job runs), and
    the job, followed to its end."""

    command: list[str]
    node_range: str
    nproc_per_node: int
    data_dir: Path
    nodes: list[str]
    port: int = field(default_factory=free_port)
    up: subprocess.Popen | None = None
    steps: dict[str, subprocess.Popen] = field(default_factory=dict)
    ended_at: dict[str, float] = field(default_factory=dict)  # a node's step: when it ended

    @property
    def server(self) -> str:
        return f"http://{socket.gethostname()}:{self.port}"

    def run(self) -> int:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            self.start_control_plane()
            for node in self.nodes:
                self.start_step(node)
            return self.follow_job()
        finally:
            self.stop()

    def start_control_plane(self) -> None:
        """`ftrain up --nodes 0` on all interfaces (its tokens keep others out); wait for it."""
        log = open(self.data_dir / "control-plane.log", "ab")  # noqa: SIM115
        with log:
            self.up = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "up", "--nodes", "0", "--host", "0.0.0.0",
                 "--port", str(self.port), "--data-dir", str(self.data_dir)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + CONTROL_PLANE_TIMEOUT_S
        while not self._answers():
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise SlurmError(f"the control plane did not start on {socket.gethostname()}:{self.port}; "
                                 f"its log: {self.data_dir / 'control-plane.log'}")
            time.sleep(POLL_S)

    def _answers(self) -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def start_step(self, node: str) -> None:
        """One agent on `node`, as a step of its own: `scancel JOB.STEP` ends that node alone."""
        argv = agent_argv(self.server, self.data_dir / "node-token", self.data_dir / "nodes", self.nproc_per_node)
        self.steps[node] = subprocess.Popen(
            [require("srun"), "--overlap", "-N1", "-n1", "-w", node, "--kill-on-bad-exit=0", *argv],
            stdin=subprocess.DEVNULL, start_new_session=True)
        self.ended_at.pop(node, None)

    def keep_steps(self) -> None:
        """Start again, after a short delay, the agent step of a node that ended."""
        now = time.monotonic()
        for node, proc in self.steps.items():
            if proc.poll() is None:
                continue
            ended = self.ended_at.setdefault(node, now)
            if now - ended >= STEP_RESTART_DELAY_S:
                print(f"ftrain: the agent step on {node} ended ({proc.returncode}); starting it again",
                      file=sys.stderr, flush=True)
                self.start_step(node)

    def follow_job(self) -> int:
        """Submit the job (`ftrain run`, its logs on this script's output) and wait for its end."""
        job = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "run", "--server", self.server, "--data-dir", str(self.data_dir),
             "--nodes", self.node_range, "--nproc-per-node", str(self.nproc_per_node), "--", *self.command],
            stdin=subprocess.DEVNULL, env=without_secrets(dict(os.environ)))
        while job.poll() is None:
            self.keep_steps()
            time.sleep(POLL_S)
        return job.returncode

    def stop(self) -> None:
        """The agents first (they leave), then the control plane and etcd (by its PID).

        The agents get SIGTERM from SLURM (`scancel --signal=TERM JOB`: every step of the
        allocation, not its batch step): a SIGTERM to srun itself makes it kill its step."""
        if any(proc.poll() is None for proc in self.steps.values()):
            subprocess.run([require("scancel"), "--signal=TERM", os.environ["SLURM_JOB_ID"]], check=False)
        for proc in self.steps.values():
            _wait_or_kill(proc, STOP_GRACE_S)
        if self.up is not None:
            _signal(self.up, signal.SIGTERM)
            _wait_or_kill(self.up, STOP_GRACE_S)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)


def _wait_or_kill(proc: subprocess.Popen, grace_s: float) -> None:
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_script(node_range: dict[str, int], inner: list[str]) -> str:
    """The script `ftrain slurm run` submits when it runs outside an allocation: itself, inside one."""
    return batch_script([f"--nodes={sbatch_nodes(node_range)}", "--ntasks-per-node=1",
                         "--job-name=ftrain-run", "--requeue", "--open-mode=append"], inner,
                        "ftrain: etcd, the control plane, an agent per node and the job (ftrain slurm run)")
