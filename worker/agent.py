"""The node agent (`ftrain node`): registers, heartbeats, runs torchrun for its job.

The agent is a reconcile loop. Each heartbeat returns what this node should be doing
(an `Assignment`: run job J attempt A, or stop); the agent compares that with the one
torchrun it may be running and starts, stops or leaves it, and reports every start and
every exit. The parts it drives:

- `worker.node_link.NodeLink`: registration, heartbeats and reports (the control plane);
- `worker.torchrun.Torchrun`: torchrun's command line and environment, the job's fork
  server, start and stop of the group, its output, and no worker left behind;
- `worker.log_shipper.LogShipper`: worker output on its way to the control plane.

A control plane that does not answer does not stop training: the agent keeps its
workers running and keeps trying. A 404 on heartbeat (the node's lease lapsed: the node
was cut off, or no control plane could hear it for a while) makes it register again,
saying which job attempt it still runs, without stopping its workers: the control plane
keeps it a member if the job still counts on it (after an outage of its own it waits for
such nodes, `service.decide.liveness`), and otherwise the next heartbeat's assignment
stops the group as usual.

Stopping a group blocks the loop for up to the grace (and a SIGKILL's aftermath), which can
outlast the node lease; a thread keeps the lease alive meanwhile (`_beating_meanwhile`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from . import flight, log_retention, memory_dirs
from .end_record import EndRecord, EndRecords, recover
from .env import FTRAIN_LOG_LEVEL
from .http import HttpError, server_urls
from .log_shipper import LogShipper
from .health import HealthChecks
from .node_link import PRESENCE_CONNECTIONS, NameInUse, NodeForgotten, NodeLink, lock_name
from .protocol import Assignment, LogLineIn
from .run_as import RunAs
from .torchrun import CouldNotStart, Torchrun

log = logging.getLogger("ftrain.agent")

# SIGTERM-to-SIGKILL grace when a group is replaced by a new attempt of the same job. Short
# on purpose: whatever the old attempt had to save is saved (a planned change snapshots
# first), and after a lost NCCL peer its workers are stuck in a collective and never exit
# on SIGTERM (docs/runtime.md, "Stopping a group"). None at all when its workers have all
# exited (a gloo survivor's, after a lost peer): torchrun alone took the whole 0.3 s. A CPU
# worker still saying its last words when it ends is waited for, up to 2.5 s from the SIGTERM
# (worker/torchrun.py `_let_them_finish_last_words`).
REPLACE_GRACE_S = 0.3
# SIGTERM-to-SIGKILL grace of a group stopped for good (a cancel's own comes with it): a plain
# script saves on SIGTERM within it.
STOP_GRACE_S = 5.0
# How often a node that runs a group looks for its exit.
RUNNING_CHECK_S = 0.5
# An agent told to stop (SIGTERM) waits, while its node leaves, for the control plane to let
# its group go at a step boundary: a runtime script saves there first, for as long as the
# control plane gives rank 0 (`Timeouts.control_ack_timeout_s`, from the registration), and
# the control plane's answer takes a beat more; this much more, and it stops the group itself.
LEAVE_MARGIN_S = 1.0


class _Stopping(BaseException):
    """Raised by the stop signal's handler into an idle heartbeat's long poll, and only
    there, so that a stop does not wait for the poll's answer (up to a quarter of the node
    lease: 15 s under a 60 s lease). A BaseException, so no retry loop takes it for an error."""


class NodeAgent:
    """One node's reconcile loop: the control plane's assignment in, torchrun out."""

    def __init__(self, server: str, token: str | None, name: str, nproc_per_node: int = 1,
                 data_dir: str | Path = ".ftrain", address: str | None = None,
                 run_as: RunAs | None = None, keep_logs_jobs: int = log_retention.KEEP_JOBS,
                 keep_logs_s: float = log_retention.MAX_AGE_S, health: HealthChecks | None = None):
        self.server = ",".join(server_urls(server))  # one URL or several, comma-separated
        self.health = health or HealthChecks()
        self.name = name
        self.data_dir = Path(data_dir).resolve()
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Per name: agents may share a data directory (tests do), each keeps its own.
        self._name_lock = lock_name(self.data_dir, name)
        self.link = NodeLink(self.server, token, name, nproc_per_node, address,
                             credential_file=self.data_dir / f"node-credential.{name}")
        self.shipper = LogShipper(self.link.client, name)
        memory_dirs.remove_leftovers(self.data_dir, name)  # of an agent of this name that was killed
        memory_dirs.remove_orphans(self.data_dir)  # of any killed agent of this data directory
        self.torchrun = Torchrun(name, self.server, self.data_dir, address, self.shipper, run_as)
        self.finished: set[tuple[str, int]] = set()
        # The end this agent owes for its group, kept for a restart (worker/end_record.py), and
        # the one a killed predecessor of this name owed, being delivered.
        self.ends = EndRecords(self.data_dir, name)
        self.recovering = recover(self.ends, self.server)
        if self.recovering is not None:
            self.finished.add(self.recovering.key)  # never started again here
        self.keep_logs = (keep_logs_jobs, keep_logs_s)
        self._shutdown = threading.Event()
        self._leave_by: float | None = None  # after a stop signal with a group: the leave's deadline
        self._gone = threading.Event()  # the loop has ended: the presence thread ends too
        self._in_idle_poll = False  # where the stop signal's handler may cut in (`_beat`)

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Heartbeat and reconcile until `shutdown`; then stop everything and leave."""
        link = self.link
        self.prune_logs()
        link.health = self.health.run()  # before it registers: a sick node never gets a job
        for connection in range(PRESENCE_CONNECTIONS):
            threading.Thread(target=self.hold_presence, args=(connection,), name=f"presence-{connection}",
                             daemon=True).start()
        while not self._shutdown.is_set() or self._leaving():
            beat_started, known_before = time.monotonic(), link.known
            try:
                if not link.registered:
                    group = self.torchrun.group
                    link.register(running=self.still_running() if group is None else group.key)
                link.send_reports()
                # The heartbeat long-polls: an idle node learns of its job, a running one of a
                # new attempt (a lost peer's node), as soon as the control plane decides it; a
                # running node's wait is its exit-check interval.
                running = self.torchrun.group is not None
                wait_s = 0.0 if link.reports else RUNNING_CHECK_S if running else link.heartbeat_interval_s
                assignment = self._beat(wait_s, idle=not running and not link.reports)
                self.reconcile(assignment)
                link.send_reports()
            except NodeForgotten:
                group = self.torchrun.group
                log.warning("the control plane no longer knows node %s (its lease lapsed); registering "
                            "again%s", self.name, "" if group is None else
                            f", with the workers of job {group.job_id} attempt {group.attempt} still running")
                continue
            except (HttpError, ValidationError) as exc:
                log.warning("control plane at %s: %s; workers keep running", self.server, exc)
            except _Stopping:
                break
            self.check_exit()
            self.torchrun.handing_over()  # what rank 0 left to this agent: made as soon as it is there
            self.keep_end()
            self.torchrun.kill_stopped_workers()
            # Running: check exits often. Idle: the heartbeat itself waited for a change (a
            # long poll), so go again at once after a change, else keep the beat's interval.
            if self.torchrun.group:
                pause = max(0.0, RUNNING_CHECK_S - (time.monotonic() - beat_started))
            elif link.known != known_before:
                pause = 0.05
            else:
                pause = max(0.05, link.heartbeat_interval_s - (time.monotonic() - beat_started))
            if self._leave_by is None:
                self._shutdown.wait(pause)
            else:  # (the stop signal has set the event already)
                time.sleep(pause)
        self._gone.set()
        self.stop_group("node agent shutting down")
        self.torchrun.stop_fork_server()
        self.torchrun.drop_memory()
        link.send_reports_best_effort()
        link.deregister()
        self.shipper.close()
        link.close()

    def _leaving(self) -> bool:
        """After a stop signal: whether the loop goes on because the node is leaving. A node
        that runs a group leaves as a drained one does (`NodeLink.leave`): its job stops at a
        step boundary with its state saved, and the next assignment lets the group go. Until
        then, or the control plane's ack timeout and LEAVE_MARGIN_S, the loop goes on; a
        control plane that does not answer the leave gets no wait."""
        if self.torchrun.group is None:
            return False
        if self._leave_by is None:
            grace_s = self.link.timeouts.control_ack_timeout_s + LEAVE_MARGIN_S
            self._leave_by = time.monotonic() + grace_s
            g = self.torchrun.group
            try:
                self.link.leave()
            except HttpError as exc:
                log.warning("stopping: could not take node %s out at a step boundary (%s); stopping "
                            "the workers of job %s now", self.name, exc, g.job_id)
                return False
            log.info("stopping: node %s leaves; job %s stops here at a step boundary (up to %g s)",
                     self.name, g.job_id, grace_s)
        return time.monotonic() < self._leave_by

    def hold_presence(self, connection: int) -> None:
        """A thread's loop: keep a presence request open on `connection` while registered
        (service/presence.py). The second starts half a hold after the first, so that one is
        held while the other is between two requests."""
        self._gone.wait(connection * self.link.timeouts.presence_hold_s / PRESENCE_CONNECTIONS)
        while not self._gone.is_set():  # held while the node leaves, too
            if not self.link.registered:
                self._gone.wait(0.1)
                continue
            try:
                self.link.hold_presence(connection)
            except HttpError:  # no answer, or 404 (the loop registers again): soon again
                self._gone.wait(0.2)

    def _beat(self, wait_s: float, idle: bool) -> Assignment | None:
        """The heartbeat, waiting up to `wait_s` for news; an idle one (a long poll of a whole
        interval) is cut short by a stop signal."""
        self._in_idle_poll = idle
        try:
            if idle and self._shutdown.is_set():  # the signal came before the flag was up
                raise _Stopping
            return self.link.heartbeat(wait_s)
        finally:
            self._in_idle_poll = False

    def shutdown(self, *_args) -> None:
        """Ask the loop to end."""
        self._shutdown.set()

    def on_stop_signal(self, *_args) -> None:
        """SIGTERM, SIGINT: end the loop, at once if it waits in an idle long poll."""
        self.shutdown()
        if self._in_idle_poll:
            self._in_idle_poll = False
            raise _Stopping

    def reconcile(self, a: Assignment | None) -> None:
        """Start, stop or leave this node's torchrun so that it matches assignment `a`."""
        g = self.torchrun.group
        if a is None:
            if g is not None:
                hung = self.link.hung
                if hung is not None and (hung.job_id, hung.attempt) == g.key:
                    self.report_stacks(g)
                self.stop_group("no longer assigned")
            self.torchrun.stop_fork_server()
            # Kept a while: a job that lost a node went back to PENDING and let this one go;
            # its next attempt here resumes from this copy, not from the disk.
            self.torchrun.park_memory(time.monotonic())
            return
        key = (a.job_id, a.attempt)
        if g is not None and (g.key != key or a.action == "stop"):
            if a.stacks_of == g.attempt and a.job_id == g.job_id:
                self.report_stacks(g)
            if g.key == key:  # a cancel or a preemption: give a plain script time to save on SIGTERM
                self.stop_group("stop requested", grace_s=a.cancel_grace_s)
            else:  # a new attempt replaces this one: nothing to wait for (workers may be
                # blocked in an NCCL collective with a dead peer and never see SIGTERM), and
                # nothing at all once they have exited: torchrun's own tidy exit is no use
                gone = self.torchrun.workers_gone()
                why = "the job moved to a new attempt" + ("; its workers had exited" if gone else "")
                self.stop_group(why, grace_s=0.0 if gone else REPLACE_GRACE_S)
            g = None
        if g is None and key not in self.finished:
            if a.action == "run":
                self.start_group(a)
            else:  # told to stop before it started: say so, so the job can end
                self.finished.add(key)
                self.link.report(a.job_id, a.attempt, "stopped", None, "stopped before it started")

    # ------------------------------------------------------------------ the group's life
    def start_group(self, a: Assignment) -> None:
        """Start torchrun for `a` and report it running (or failed, if it could not start)."""
        try:
            g = self.torchrun.start(a, self.link.timeouts)
        except CouldNotStart as exc:
            self.finished.add((a.job_id, a.attempt))
            self.link.report(a.job_id, a.attempt, "failed", None, str(exc))
            return
        self.link.report(g.job_id, g.attempt, "running")

    def check_exit(self) -> None:
        """Report the group's outcome once its torchrun has exited."""
        g = self.torchrun.exited()
        if g is None:
            return
        self.finished.add(g.key)
        outcome = g.outcome()
        self._keep_end_of(g, outcome)
        self.link.report(g.job_id, g.attempt, *outcome)
        self.shipper.flush()
        self.prune_logs()
        threading.Thread(target=self.check_health, name="health", daemon=True).start()

    def check_health(self) -> None:
        """Between jobs: run the checks again and send what they found (worker/health.py)."""
        report = self.health.run()
        if report is None:
            return
        try:
            self.link.send_health(report)
        except HttpError as exc:  # sent again with its next registration
            log.warning("could not send the health checks' result: %s", exc)

    # ------------------------------------------------------------------ an end owed across a restart
    def still_running(self) -> tuple[str, int] | None:
        """The attempt a registration names as still this node's when no group runs: one whose
        end report is queued (`NodeLink.ending`), or whose end a killed predecessor owed."""
        ending = self.link.ending()
        if ending is None and self.recovering is not None:
            return self.recovering.key
        return ending

    def keep_end(self) -> None:
        """Keep the record of the end this agent owes (worker/end_record.py) up to date: the
        group's, with its outcome once torchrun has exited; dropped once its report landed.
        And report the end a killed predecessor owed once its commits are made."""
        r = self.recovering
        if r is not None and r.done():
            self.link.report(r.key[0], r.key[1], *r.outcome())
            self.recovering = None
        g = self.torchrun.group
        if g is not None:
            kept = self.ends.kept
            seen = kept.outcome if kept is not None and kept.key == g.key else None
            if seen is None and g.proc.poll() is not None and not g.stop_requested:
                seen = g.outcome()  # exited, its hand-over being made: the end it owes is known
            self._keep_end_of(g, seen)
        elif self.recovering is None and (kept := self.ends.kept) is not None:
            owed = {(x.job_id, x.attempt) for x in self.link.reports if x.state != "running"}
            if kept.stop_requested or kept.key not in owed:
                self.ends.drop()

    def _keep_end_of(self, g, outcome: tuple[str, int | None, str | None] | None) -> None:
        if g.snapshot_dir is None or not g.job_token:
            return
        self.ends.keep(EndRecord(g.job_id, g.attempt, str(g.snapshot_dir), g.job_token,
                                 g.stop_requested, outcome))

    def prune_logs(self) -> None:
        """Delete the local output of jobs this node no longer runs, past the count or age kept."""
        g = self.torchrun.group
        log_retention.prune(self.data_dir / "logs", () if g is None else (g.job_id,), *self.keep_logs)

    def report_stacks(self, g) -> None:
        """The control plane took `g`'s attempt for hung: every worker's Python stacks and a line
        on its flight recorder into the job's log, and both to the control plane (its events),
        before the group is stopped."""
        with self._beating_meanwhile():
            dumps, traces = self.torchrun.collect_stacks(g)
        if not dumps:  # no worker's output files found: nothing to say
            return
        found = {rank: flight.groups(trace) for rank, trace in traces.items()}
        now = time.time()
        for rank, text in sorted(dumps.items()):
            lines = text.splitlines() or ["(no stacks: the worker did not answer)"]
            lines = [f"ftrain: rank {rank}'s stacks (the job was taken for hung):", *lines]
            if g.flight_on:
                lines.append(flight.summary(rank, found.get(rank)))
            for line in lines:
                self.shipper.add(g.job_id, g.attempt, LogLineIn(rank=rank, stream="stderr", time=now, line=line))
        self.shipper.flush()
        self.link.report_stacks(g.job_id, g.attempt, dumps, found)

    def stop_group(self, why: str, grace_s: float = STOP_GRACE_S) -> None:
        """Stop the group (SIGTERM, then SIGKILL after `grace_s`) and report it stopped."""
        with self._beating_meanwhile():
            self.torchrun.stop(why, grace_s)
        self.check_exit()

    @contextmanager
    def _beating_meanwhile(self) -> Iterator[None]:
        """Keep the node's lease alive from a thread of its own while the loop is held up.

        A group's stop can take longer than the node lease (the cancel grace is 5 s, workers
        that ignore SIGTERM take all of it, a loaded machine more; one took 7.2 s against a 6 s
        lease): without a heartbeat meanwhile, the node would be declared lost in the middle
        of a cancel. The loop's own heartbeat (the one that hears assignments) resumes after."""
        done = threading.Event()

        def beat() -> None:
            while not done.wait(self.link.heartbeat_interval_s):
                try:
                    self.link.keep_alive()
                except HttpError as exc:  # the loop's next heartbeat says what to do
                    log.info("heartbeat while stopping a group: %s", exc)

        thread = threading.Thread(target=beat, name="heartbeat-while-stopping", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()


def take_from_environ(name: str) -> str | None:
    """Remove variable `name` from this process's environment and return its value.

    `os.environ.pop` alone leaves the value in /proc/<pid>/environ, which is the block of
    memory the process started with, readable by its user (a worker of any job) for the
    process's whole life: the value is overwritten there too, through libc's own pointer to it.
    """
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.getenv.restype = ctypes.c_void_p
        libc.getenv.argtypes = [ctypes.c_char_p]
        address = libc.getenv(name.encode())
        if address:
            ctypes.memset(address, 0, len(os.fsencode(value)))
    except (OSError, AttributeError):  # no libc to ask (not Linux): the pop below still holds
        pass
    os.environ.pop(name, None)
    return value


def main(server: str, token: str | None, name: str | None = None, nproc_per_node: int = 1,
         data_dir: str | Path = ".ftrain", address: str | None = None,
         run_as: RunAs | None = None, keep_logs_jobs: int = log_retention.KEEP_JOBS,
         keep_logs_s: float = log_retention.MAX_AGE_S, health: HealthChecks | None = None) -> int | None:
    # What the agent and the job's processes create (logs, the job's output, snapshots)
    # is their user's alone unless they say otherwise.
    os.umask(0o077)
    logging.basicConfig(level=os.environ.get(FTRAIN_LOG_LEVEL, "INFO"),
                        format=f"%(asctime)s %(levelname)s node {name or socket.gethostname()}: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per heartbeat
    try:
        agent = NodeAgent(server, token, name or socket.gethostname(), nproc_per_node, data_dir, address,
                          run_as, keep_logs_jobs, keep_logs_s, health)
    except NameInUse as exc:
        log.error("%s", exc)
        return 2
    if run_as is not None:
        log.info("the jobs' processes run as %s (uid %d)", run_as.name, run_as.uid)
    signal.signal(signal.SIGTERM, agent.on_stop_signal)
    signal.signal(signal.SIGINT, agent.on_stop_signal)
    agent.run()


if __name__ == "__main__":  # python -m worker.agent SERVER TOKEN NAME
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None,
         sys.argv[3] if len(sys.argv) > 3 else None)
