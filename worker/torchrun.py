"""This node's torchrun: its command line and environment, its start and stop, its output.

The node agent runs at most one torchrun (a `WorkerGroup`: one attempt of one job) and,
next to it, the job's fork server (`worker/fork_server.py`, one per job per node, kept
across attempts). No worker outlives its owner: torchrun is started with a parent-death
signal (SIGTERM: torchrun then stops its workers), each worker through `worker/launch.py`
with one too (SIGKILL when torchrun dies), and a stop or an exit kills what is left of the
tree, the workers the fork server forked included.

Each worker writes its output to files of its own under torchrun's --log-dir, and torchrun its
own lines to two files; `Torchrun` follows all of them (worker/output.py: a line is shipped
once it is whole, tagged with the rank and rendezvous round of the worker that wrote it): each
line goes to the `LogShipper`, and the last lines of each rank are kept for the failure reason.
torchrun's own shutdown is not the job's output: once the agent stops a group (a new
attempt replaces it, a cancel) or torchrun starts a traceback of its own, torchrun's lines
(those without a rank) are held until it exits; then they go out as they were if torchrun
failed by itself, else (stopped, or its rendezvous closed by the control plane:
`RendezvousGoneError`) one line says how many were hidden (`shutdown_summary`). The
workers' lines (the user's output) are shipped as they come, always.
A worker stopped (state T) for longer than `STOPPED_WORKER_GRACE_S` is killed, so that
torch restarts the group instead of the other ranks waiting out a collective's timeout.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import flight, gpus, memory_dirs, safe_files, stacks
from .env import (
    FTRAIN_ATTEMPT,
    FTRAIN_FORK_SERVER,
    FTRAIN_FORK_SERVER_SOCKET,
    FTRAIN_GLOBAL_BATCH_SIZE,
    FTRAIN_JOB_ID,
    FTRAIN_JOB_TOKEN,
    FTRAIN_MEMORY_DIR,
    FTRAIN_NODE,
    FTRAIN_NODE_TOKEN,
    FTRAIN_SERVER,
    FTRAIN_SNAPSHOT_DIR,
    FTRAIN_SNAPSHOT_EVERY,
    FTRAIN_SNAPSHOT_KEEP,
    FTRAIN_TOKEN,
    FTRAIN_USER_TOKEN,
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE,
    TORCH_ELASTIC_WORKER_IDENTICAL,
)
from .handoff import AgentHandoff, handoff_path
from .launch import signal_name
from .following import (  # noqa: F401 - shutdown_summary, starts_shutdown, MASK: for `torchrun.` users
    MASK,
    GroupOutput,
    mask_secrets,
    secrets_to_mask,
    shutdown_summary,
    starts_shutdown,
)
from .links import ServiceLink
from .log_shipper import LogShipper
from .output import STREAMS, WorkerDirs
from .procs import (
    FORK_SERVER,
    cmdline,
    descendants,
    is_alive,
    is_fork_server,
    is_standby,
    kill_all,
    pdeathsig_argv,
    state_of,
    worker_launch_prefix,
)
from .protocol import (
    ERROR_LINE,
    Assignment,
    LogLineIn,
    Timeouts,
    telling_line,
)
from .run_as import MISSING, NO_CWD, RunAs, command_search, command_search_as, job_dir

log = logging.getLogger("ftrain.agent")

# Rendezvous tuning (docs/architecture.md, "Traps"): a lost node is noticed after
# keep_alive_interval x keep_alive_max_attempt = 3 s, and a round that has its minimum
# waits 1 s for latecomers instead of torch's 30 s. (The control plane's own long poll,
# `Timeouts.long_poll_s`, goes with them: `rdzv_conf`.)
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3,join_timeout=600"
# How often torchrun looks at its workers (and asks num_nodes_waiting(), answered from a
# cached state that worker/rendezvous/follow.py expires on a change): a dead worker is seen
# 0.05 s later on average, instead of 0.1 s at 0.2.
MONITOR_INTERVAL_S = 0.1
# How long a new fork server may take to listen on its socket (`unix_listening`) before
# torchrun is started anyway (its launcher then runs torchrun itself).
FORK_SERVER_LISTEN_S = 5.0
# torch must never give up by itself: ftrain counts failures (not membership changes)
# against the job's max_restarts and stops the job when they are spent.
TORCHRUN_MAX_RESTARTS = 1_000_000
# A worker stopped (SIGSTOP, a debugger gone away) for this long is killed, so that torch
# restarts the group instead of the others waiting out the collective's timeout.
STOPPED_WORKER_GRACE_S = 3.0
# How long the agent waits for its workers' stack dumps (a hung attempt) before it stops them:
# faulthandler writes from the signal handler, in milliseconds, even in a stuck collective.
STACKS_WAIT_S = 2.0
# How long a group's end waits for its output to be shipped (`Torchrun.draining`).
DRAIN_S = 60.0
# How long a node without an assignment keeps the memory tier of the job it left (`park_memory`).
MEMORY_KEEP_S = 300.0


def rdzv_conf(timeouts: Timeouts) -> str:
    """torchrun's --rdzv-conf: this node's tuning of torch's rendezvous, and the control
    plane's long poll, which the "ftrain" backend reads (worker/rendezvous `create_backend`)."""
    return f"{RDZV_CONF},long_poll_s={timeouts.long_poll_s:g}"


class CouldNotStart(Exception):
    """torchrun could not be started (a missing working directory, a bad interpreter)."""


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
    secrets: tuple[str, ...] = ()  # values masked in the output it ships (mask_secrets)
    # torchrun's own lines held back since its shutdown began (see the module's docstring)
    held: list = field(default_factory=list)
    holding: bool = False
    outputs: dict = field(default_factory=dict)  # stream -> torchrun's output file
    # (local rank, stream) -> (the newest file of that worker, its rank), for `tails_of_files`
    worker_files: dict = field(default_factory=dict)
    exited_at: float | None = None  # monotonic: when its exit was first seen (`Torchrun.draining`)
    tails_final: bool = False  # `tails` read from the files' ends (a reader was behind)
    released: bool = False  # its held lines were handed to the shipper (`GroupOutput.release_held`)
    job_token: str | None = None  # for the broken-peer report its workers' output can call for
    snapshot_dir: Path | None = None  # FTRAIN_SNAPSHOT_DIR: where rank 0 leaves its commits (handoff)
    handoff: AgentHandoff | None = None  # the commits its rank 0 left to this agent, being made
    # the rounds whose workers' broken peer was reported (once a round: `_report_broken_peer`)
    peer_reported: set = field(default_factory=set)
    flight_on: bool = False  # its workers record their collectives (worker/flight.py)

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)

    def outcome(self) -> tuple[str, int | None, str | None]:
        """(state, exit code, reason) of an exited group, as the node reports it."""
        code = self.proc.returncode
        if self.stop_requested:
            return "stopped", code, "stopped by the control plane"
        note = None if self.handoff is None else self.handoff.note()  # commits not made: said
        if code == 0:
            return "succeeded", 0, note
        worker_ranks = sorted(r for r in self.tails if r is not None)
        lines = []
        for r in worker_ranks:
            lines += [f"[rank{r}] {x}" for x in list(self.tails[r])[-8:]]
        lines += list(self.tails[None])[-6:]
        return "failed", code, (headline(self.tails, code, self.proc.pid) + "\nlast lines:\n" + "\n".join(lines)
                                + (f"\n{note}" if note else ""))


def tails_of_files(files: list[tuple[Path, int | None]], secrets: tuple[str, ...],
                   nbytes: int = 64 * 1024) -> dict:
    """The last lines of each rank in its files (torchrun's own: rank None), read from their
    ends, as `WorkerGroup.tails` holds them."""
    tails: dict = collections.defaultdict(lambda: collections.deque(maxlen=20))
    for path, rank in files:
        try:  # a worker's file is in its user's folder: never through a link (safe_files)
            with safe_files.open_reader(path) as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - nbytes))
                raw = f.read()
        except OSError:
            continue
        lines = raw.decode("utf-8", errors="replace").split("\n")
        for text in lines[1 if size > nbytes else 0:]:
            if text:
                tails[rank].append(mask_secrets(text, secrets))
    return tails


def headline(tails: Mapping, code: int | None, pid: int | None = None) -> str:
    """One line that says why a group failed: the missing command named as such; torchrun
    killed by a signal (from outside: no worker's line is the cause, least of all the last
    one a worker logged); else the first rank's error line (`ValueError: ...`), else
    torchrun's own (`ftrain: the worker's fork server went away`), else the first rank's last
    line; the log lines follow it in the report (they stay in the logs and in the event's
    detail, not in the job's reason)."""
    ranks = sorted(r for r in tails if r is not None)
    said = [(r, why) for r in ranks if (why := telling_line(list(tails[r]))) is not None]
    for _, why in said:
        if why.startswith("command not"):
            return why
    if code is not None and code < 0:
        return f"torchrun{'' if pid is None else f' (pid {pid})'} was killed by {signal_name(-code)}"
    exited = f"torchrun exited with code {code}"
    errors = [(r, w) for r, w in said if ERROR_LINE.match(w)]
    if errors:
        return f"rank {errors[0][0]}: {errors[0][1]} ({exited})"
    own = [x for x in tails.get(None, ()) if x.startswith("ftrain: ") or ERROR_LINE.match(x)]
    if own:
        return f"{exited}: {own[-1]}"
    return exited if not said else f"rank {said[0][0]}: {said[0][1]} ({exited})"


def unix_listening(name: str) -> bool:
    """Whether a unix socket of this network namespace listens on the abstract name `name`
    (/proc/net/unix: the flag __SO_ACCEPTCON, 0x10000, marks a listening socket)."""
    want = "@" + name
    try:
        with open("/proc/net/unix") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 8 and fields[7] == want and int(fields[3], 16) & 0x10000:
                    return True
    except (OSError, ValueError):
        return False
    return False


@dataclass
class ForkServer:
    """The job's `worker/fork_server.py` on this node; it outlives attempts, not the job."""

    job_id: str
    name: str  # its abstract unix socket
    proc: subprocess.Popen


class Torchrun:
    """Starts, follows and stops this node's one torchrun and its job's fork server."""

    def __init__(self, node: str, server: str, data_dir: Path, address: str | None, shipper: LogShipper,
                 run_as: RunAs | None = None):
        self.node = node
        self.run_as = run_as
        self.server = server
        self.data_dir = data_dir
        self.address = address
        self.shipper = shipper
        self.output = GroupOutput(node, server, shipper)  # how its output is read and shipped
        self.group: WorkerGroup | None = None
        self.fork_server: ForkServer | None = None
        self.memory: tuple[str, Path] | None = None  # (job, its memory tier on this node)
        self.memory_parked_at: float | None = None  # when the node was left without an assignment

    # ------------------------------------------------------------------ command and environment
    def argv(self, a: Assignment, timeouts: Timeouts) -> list[str]:
        """torchrun's command line for assignment `a`, guarded by a parent-death signal;
        `timeouts`: the control plane's, from this node's registration."""
        nproc = a.nproc_per_node
        if nproc == "auto":
            nproc = gpu_count() or 1
        command = self.job_command(a)
        argv = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={a.nodes_min}:{a.nodes_max}", f"--nproc-per-node={nproc}",
            "--rdzv-backend=ftrain", f"--rdzv-endpoint={self.server}", f"--rdzv-id={a.rdzv_id}",
            f"--rdzv-conf={rdzv_conf(timeouts)}", f"--max-restarts={TORCHRUN_MAX_RESTARTS}",
            f"--monitor-interval={MONITOR_INTERVAL_S}",
            # each worker's output to files of its own, which the agent follows (worker/output.py)
            "--redirects=3", f"--log-dir={self.torchrun_log_dir(a)}",
        ]
        if self.address:
            argv.append(f"--local-addr={self.address}")
        argv += ["--no-python", *worker_launch_prefix(), *command]
        z = self.fork_server
        if z is not None and z.job_id == a.job_id and z.proc.poll() is None:
            # torchrun itself comes from the fork server too (torch imported: no import of its
            # own, and a new attempt starts sooner, docs/runtime.md); a job's first torchrun
            # waits while the new server imports torch (the server forks it before the modules
            # only workers need). The launcher stands in for it and gets SIGTERM when this
            # agent dies, which it forwards to torchrun.
            return worker_launch_prefix(signal.SIGTERM) + argv
        return pdeathsig_argv(argv, signal.SIGTERM)

    def torchrun_log_dir(self, a: Assignment) -> Path:
        """Where torchrun keeps its per-worker files (`--redirects` writes each worker's output
        to files of its own, which the agent follows): in the job's log folder, which
        `log_retention` bounds, one folder per node (the agents of `ftrain up` share a data
        directory, and each must find its own torchrun's files). Left to torchrun, a
        `torchelastic_*` folder in $TMPDIR with every attempt's output stays there for good
        (bench/soak.py --minutes found one per attempt after an hour)."""
        return self.data_dir / "logs" / a.job_id / "torchrun" / self.node

    @staticmethod
    def job_command(a: Assignment) -> list[str]:
        """The command each worker runs: the job's, `python` being the agent's interpreter."""
        command = list(a.command)
        if command[0] in ("python", "python3"):
            command[0] = sys.executable  # the agent's interpreter: the venv with torch
        return command

    def job_env(self, a: Assignment) -> dict[str, str]:
        """The environment of torchrun and its workers: the agent's, the job's, ftrain's."""
        root = Path(a.snapshot_root) if a.snapshot_root else self.data_dir / "snapshots"
        snapshot_dir = job_dir(root / a.job_id, self.run_as,
                               agent_dirs=(self.data_dir, self.data_dir / "snapshots"))
        env = {**os.environ, **a.env, **a.secret_env}
        if self.run_as is not None:
            env = self.run_as.environ(env)
        env.update({
            FTRAIN_JOB_ID: a.job_id,
            FTRAIN_ATTEMPT: str(a.attempt),
            FTRAIN_SERVER: self.server,
            FTRAIN_JOB_TOKEN: a.job_token,
            FTRAIN_NODE: self.node,
            FTRAIN_SNAPSHOT_DIR: str(snapshot_dir),
            FTRAIN_SNAPSHOT_EVERY: str(a.snapshot_every),
            FTRAIN_SNAPSHOT_KEEP: str(a.snapshot_keep),
            # Restarts with torch's shared rendezvous TCPStore can hang (pytorch #135712).
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1",
            "PYTHONUNBUFFERED": "1",
        })
        flight.default_env(env)  # what a hang's report names the missing ranks by
        if a.global_batch_size:
            env[FTRAIN_GLOBAL_BATCH_SIZE] = str(a.global_batch_size)
        if a.nproc_per_node != "auto":  # the same count on every node (worker/env.py)
            env.setdefault(TORCH_ELASTIC_WORKER_IDENTICAL, "1")
        # Workers run the user's code: the node's and a user's tokens stay with the agent.
        for name in (FTRAIN_NODE_TOKEN, FTRAIN_TOKEN, FTRAIN_USER_TOKEN):
            env.pop(name, None)
        return env

    def _as_job_user(self) -> dict:
        """Popen arguments that start a job's process as the run-as user (none without one)."""
        return self.run_as.popen_kwargs() if self.run_as is not None else {}

    # ------------------------------------------------------------------ the fork server
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
        name = f"ftrain-{self.node}-{a.job_id}-{secrets.token_hex(8)}"
        try:
            with _private_file(log_dir / f"{self.node}-fork-server.log", "ab") as out:
                proc = subprocess.Popen(
                    pdeathsig_argv([sys.executable, str(FORK_SERVER), name], signal.SIGKILL),
                    cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                    start_new_session=True, **self._as_job_user())
        except OSError as exc:
            log.warning("could not start the fork server for job %s (%s); workers start cold",
                        a.job_id, exc)
            return None
        self.fork_server = ForkServer(a.job_id, name, proc)
        log.info("started the fork server (pid %d) for job %s", proc.pid, a.job_id)
        # torchrun's launcher, started next, connects at once and starts torchrun itself if
        # nobody listens yet: wait for the server's socket (its interpreter starts in ~50 ms).
        deadline = time.monotonic() + FORK_SERVER_LISTEN_S
        while not unix_listening(name) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return name

    def stop_fork_server(self) -> None:
        """Kill the fork server and everything it forked."""
        z, self.fork_server = self.fork_server, None
        if z is None:
            return
        kill_all([z.proc.pid, *descendants(z.proc.pid)])
        z.proc.wait()

    # ------------------------------------------------------------------ the memory tier
    def memory_dir(self, a: Assignment) -> Path | None:
        """The job's memory tier on this node (worker/memory.py): made for its first
        attempt here, kept across attempts while the node works on the job, so that a
        restarted group finds the copies of the one before."""
        if self.memory is not None and self.memory[0] == a.job_id and safe_files.is_dir(self.memory[1]):
            self.memory_parked_at = None
            return self.memory[1]
        self.drop_memory()
        try:
            path = memory_dirs.make_job_dir(self.data_dir, self.node, a.job_id)
            if self.run_as is not None:
                safe_files.give_dir(path, self.run_as.uid, self.run_as.gid, 0o700)
        except OSError as exc:
            log.warning("no memory tier for job %s (%s): restarts resume from the disk", a.job_id, exc)
            return None
        self.memory = (a.job_id, path)
        return path

    def drop_memory(self) -> None:
        """Delete the memory tier of the job this node worked on (it left the job)."""
        held, self.memory = self.memory, None
        self.memory_parked_at = None
        if held is not None:
            try:  # the job's user's folder: nothing in it followed or opened but folders
                safe_files.remove_tree(held[1])
            except OSError as exc:
                log.warning("could not remove the memory tier %s of job %s: %s", held[1], held[0], exc)

    def park_memory(self, now: float) -> None:
        """The node has no assignment: keep the memory tier of the job it left for
        `MEMORY_KEEP_S` (a job that lost a node is PENDING, its survivors let go; when it
        starts again here, the copy is its restore point: at most a step lost, where the
        disk's latest may be `every_steps` behind), then delete it. Called on every idle beat;
        another job's assignment deletes it at once (`memory_dir`)."""
        if self.memory is None:
            return
        if self.memory_parked_at is None:
            self.memory_parked_at = now
        elif now - self.memory_parked_at >= MEMORY_KEEP_S:
            self.drop_memory()

    # ------------------------------------------------------------------ the group
    def group_tree(self, g: WorkerGroup) -> list[int]:
        """Every process of the group below `g.proc`: torchrun's tree and what the job's
        fork server forked (workers, and torchrun itself when it came from there), but not
        its standbys (no group's yet: a new group's workers start in them)."""
        z = self.fork_server
        roots = (g.proc.pid, z.proc.pid) if z is not None else (g.proc.pid,)
        return [p for p in descendants(*roots) if not is_standby(p)]

    def workers_gone(self) -> bool:
        """Whether every worker of the group has exited (its torchrun may live on, re-forming
        the group, or shutting down): nothing under it but torchrun itself where that came from
        the job's fork server (a live worker has a `worker/launch.py` under torchrun, or runs
        the job's own command; anything else, a zombie included, counts as a worker)."""
        g = self.group
        return g is None or all(is_fork_server(cmdline(p)) for p in self.group_tree(g))

    def start(self, a: Assignment, timeouts: Timeouts) -> WorkerGroup:
        """Start torchrun for assignment `a` (and the job's fork server, if it has none), with
        the control plane's `timeouts`.

        Raises:
            CouldNotStart: with the reason the node reports.
        """
        cwd = a.working_dir or os.getcwd()
        # The agent's copy of the job's output: the agent's alone (it hands torchrun the open files).
        log_dir = self.data_dir / "logs" / a.job_id
        for d in (self.data_dir / "logs", log_dir):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        # torchrun's own files (it runs as the job's user, if there is one)
        job_dir(self.torchrun_log_dir(a), self.run_as,
                agent_dirs=(self.data_dir, self.data_dir / "logs", log_dir, log_dir / "torchrun"))
        env = self.job_env(a)
        if (why := missing_command(self.job_command(a), env, cwd, self.run_as)) is not None:
            # Said before anything starts: the reason must not depend on whether the
            # launcher's line is shipped before torchrun's restart round is reported.
            self.shipper.add(a.job_id, a.attempt, LogLineIn(
                rank=None, stream="stderr", line=f"ftrain: {why}", time=time.time()))
            raise CouldNotStart(why)
        if (memory_dir := self.memory_dir(a)) is not None:
            env[FTRAIN_MEMORY_DIR] = str(memory_dir)
        if (fork_server := self.start_fork_server(a, env, cwd, log_dir)) is not None:
            env[FTRAIN_FORK_SERVER_SOCKET] = fork_server
        # torchrun writes to files, not pipes: an agent that dies must not leave torchrun
        # writing into a broken pipe.
        outputs = {s: log_dir / f"{self.node}-attempt{a.attempt}.{s}" for s in STREAMS}
        dirs = WorkerDirs.before_start(self.torchrun_log_dir(a), a.rdzv_id)
        try:
            with _private_file(outputs["stdout"], "wb") as out, _private_file(outputs["stderr"], "wb") as err:
                proc = subprocess.Popen(
                    self.argv(a, timeouts), cwd=cwd,
                    env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    start_new_session=True, **self._as_job_user())
        except OSError as exc:
            raise CouldNotStart(f"could not start torchrun in {cwd}: {exc}") from exc
        g = WorkerGroup(a.job_id, a.attempt, proc, secrets=secrets_to_mask(a.secret_env, a.job_token),
                        outputs=outputs, job_token=a.job_token, snapshot_dir=Path(env[FTRAIN_SNAPSHOT_DIR]),
                        flight_on=flight.is_on(env))
        self.follow(g, dirs)
        self.group = g
        log.info("started torchrun (pid %d) for job %s attempt %d", proc.pid, g.job_id, g.attempt)
        return g

    def follow(self, g: WorkerGroup, dirs: WorkerDirs) -> None:
        """Follow `g`'s output until its torchrun has exited (worker/following.py)."""
        self.output.follow(g, dirs)

    def _release_held(self, g: WorkerGroup) -> None:
        self.output.release_held(g)

    def exited(self) -> WorkerGroup | None:
        """The group, once its torchrun has exited (what is left of its tree is killed)."""
        g = self.group
        if g is None or g.proc.poll() is None or self.draining(g):
            return None
        deadline = time.monotonic() + 2
        for t in g.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in g.threads):
            # A reader is behind (it waits for the shipper: a flood of output): the last lines,
            # which a failure's reason quotes, from the ends of the files instead.
            files = [(p, None) for p in g.outputs.values()] + list(g.worker_files.values())
            g.tails_final, g.tails = True, tails_of_files(files, g.secrets)
        if not g.released:
            self._release_held(g)
        self.group = None
        kill_all(self.group_tree(g))
        return g

    def draining(self, g: WorkerGroup) -> bool:
        """Whether torchrun, which exited by itself, still has output on its way: a reader
        behind a flood of lines, or lines queued (torchrun's held ones too, once the readers
        are done). Its end is reported once every line is shipped, so that whoever reads the
        job's log when it has ended sees them all: a report sent after an outage of the
        control plane overtook the lines queued meanwhile (`test_control_plane_killed...`
        read rank 0's steps as [1, 2]). At most DRAIN_S; a stopped group is not waited for.
        Before that, and with no bound, whatever rank 0 left to this agent (`handing_over`)."""
        if g.stop_requested:
            return False
        if g.exited_at is None:
            g.exited_at = time.monotonic()
        if self.handing_over(g):
            return True
        if time.monotonic() - g.exited_at > DRAIN_S:
            return False
        if any(t.is_alive() for t in g.threads):
            return True
        if not g.released:
            self._release_held(g)
        return self.shipper.pending_of(g.job_id, g.attempt) > 0

    def handing_over(self, g: WorkerGroup | None = None) -> bool:
        """Whether what rank 0 left to this agent (worker/handoff.py) is being made: its
        snapshot commits, its final progress report. Started as soon as the file is there
        (the agent's loop looks every check, so a group that torchrun restarts in the same
        attempt resumes from those snapshots), again for a file left later; the group's end is
        reported after them, however long the control plane is away (a job must not end
        before its last snapshot is listed). A stopped group's is not started."""
        g = g or self.group
        if g is None:
            return False
        if g.handoff is not None and not g.handoff.done():
            return True
        if g.snapshot_dir is None or not g.job_token or g.stop_requested:
            return False
        path = handoff_path(g.snapshot_dir, self.node, g.attempt)
        if not safe_files.lexists(path):
            return False
        link = ServiceLink(self.server, g.job_id, g.job_token, g.attempt, timeout_s=5.0)
        earlier = None if g.handoff is None else g.handoff.not_committed
        g.handoff = AgentHandoff(path, link, earlier).start()
        return True

    def kill_stopped_workers(self) -> None:
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

    def collect_stacks(self, g: WorkerGroup, wait_s: float = STACKS_WAIT_S) -> tuple[dict[int, str], dict[int, dict]]:
        """Every worker's Python stacks (rank -> faulthandler's dump; '' where none came) and
        flight-recorder trace (rank -> the dump, for those that came), for an attempt taken for
        hung: each worker of the group that registered (worker/stacks.py) is asked for its trace
        (worker/flight.py) and sent STACKS_SIGNAL, and the answers are read within `wait_s`."""
        deadline = time.monotonic() + wait_s
        files = {rank: path.parent / stacks.STACKS_FILE
                 for (_local, stream), (path, rank) in g.worker_files.items() if stream == "stderr"}
        tree = set(self.group_tree(g))
        # this group's workers, not pids a job's user wrote there
        pids = {rank: pid for rank, pid in stacks.pids(files).items() if pid in tree}
        asked = flight.ask(pids) if g.flight_on else {}  # first: answered at once, as torchrun may stop them
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, stacks.STACKS_SIGNAL)
        dumps = stacks.read_dumps(files, wait_s)
        return dumps, flight.read_dumps(asked, max(0.0, deadline - time.monotonic()))

    def stop(self, why: str, grace_s: float = 5.0) -> None:
        """SIGTERM torchrun (it stops its workers), then SIGKILL whatever is left (at once
        with no grace)."""
        g = self.group
        if g is None:
            return
        g.stop_requested = True
        if g.handoff is not None:  # a new attempt (its commits would be refused), a cancel: not waited for
            g.handoff.cancel()
            g.handoff.join(2.0)
        tree = self.group_tree(g)
        log.info("stopping job %s attempt %d (%s)", g.job_id, g.attempt, why)
        if g.proc.poll() is None and grace_s > 0:
            g.proc.send_signal(signal.SIGTERM)
            kill_all(tree, signal.SIGTERM)
            sent = time.monotonic()
            try:
                g.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._let_them_finish_last_words(g, sent)
        kill_all([g.proc.pid, *tree, *self.group_tree(g)])
        g.proc.wait()
        deadline = time.monotonic() + 5
        while any(is_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.02)


    def _let_them_finish_last_words(self, g: WorkerGroup, sent: float) -> None:
        """The grace is over: a worker of the group that is saying its last words on the
        SIGTERM sent at `sent` (a CPU runtime worker copying its last step into the node's
        memory tier: 0.46 s at 100M parameters, more than a replaced attempt's 0.3 s) is given
        up to LAST_WORDS_WAIT_S from then, the bound torchrun's stop of a broken group gives it
        (worker/rendezvous/monitor.py); a copy cut short is safe (never committed) but loses the
        steps. None speaking (a GPU, a plain script, a worker stuck in a collective): no wait."""
        if self.memory is None or self.memory[0] != g.job_id:
            return
        left = sent + memory_dirs.LAST_WORDS_WAIT_S - time.monotonic()
        waited = memory_dirs.wait_for_speakers(self.memory[1], max(0.0, left))
        if waited is not None:
            log.info("waited %.3f s past the grace for the last words of job %s attempt %d",
                     waited, g.job_id, g.attempt)


def missing_command(command: list[str], env: Mapping[str, str], cwd: str,
                    run_as: RunAs | None = None) -> str | None:
    """`command not found: X` when the job's command X is nowhere the workers' exec would
    look (X itself, relative to `cwd`, if it has a slash; else each directory of the job's
    PATH), so the node fails the attempt with that reason before starting torchrun; None
    when it is there or when this agent cannot tell (a directory it may not read, a missing
    `cwd`): then the launcher says what exec said (`worker/launch.py`). With `run_as`, the
    search is the job's user's (`command_search_as`), and a `cwd` that user cannot enter,
    absent or not, is the reason (the agent would enter it as root)."""
    name = command[0]
    if not name:
        return None
    if "/" in name:
        candidates = [os.path.join(cwd, name)]
    else:  # an empty PATH entry is the working directory, as for execvp
        candidates = [os.path.join(cwd, d or ".", name)
                      for d in env.get("PATH", os.defpath).split(os.pathsep)]
    if run_as is None:
        found = command_search(cwd, candidates)
    elif (found := command_search_as(run_as, cwd, candidates)) == NO_CWD:
        return f"working directory {cwd} is not a folder that user {run_as.name} may enter"
    if found == MISSING:
        return f"command not found: {name}"
    if (script := python_script(command)) is not None:
        # A mistyped script name fails every attempt the same way: say so once, before torchrun
        # restarts it (the node's failure ends the job: no restart can cure it).
        path = [os.path.join(cwd, script)]
        there = command_search(cwd, path) if run_as is None else command_search_as(run_as, cwd, path)
        if there == MISSING:
            return f"no such file: {script} (in {cwd})"
    return None


_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
_OPTION_WITH_VALUE = ("-W", "-X")


def python_script(command: list[str]) -> str | None:
    """The script a Python interpreter `command` runs (`python -u train.py ...`: train.py);
    None when it is not a Python interpreter or runs no file (`-m`, `-c`, stdin)."""
    if not _PYTHON.fullmatch(os.path.basename(command[0])):
        return None
    args = iter(command[1:])
    for arg in args:
        if arg in ("-m", "-c", "-"):
            return None
        if arg in _OPTION_WITH_VALUE:
            next(args, None)
        elif not arg.startswith("-"):
            return arg
    return None


def _private_file(path: Path, mode: str):
    """`open(path, mode)` for writing, the file created 0600 (the job's output is not for all)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    return os.fdopen(os.open(path, flags, 0o600), mode)


def gpu_count() -> int:
    """How many GPUs this node's workers may use: nvidia-smi's, narrowed by CUDA_VISIBLE_DEVICES
    (which `ftrain node --gpus` sets); 0 without any."""
    return gpus.detect().count
