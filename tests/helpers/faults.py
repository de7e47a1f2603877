"""Shared pieces of the fault-injection suite: job specs, the invariants, the fault tools.

Every fault test checks the same three things after its fault:

* the job's final state;
* the training log: rank 0's step numbers go up by one, and the only other move allowed
  is a restart at `S + 1` where `S` is a committed snapshot (or 0, the start) that was
  the latest one when the group restarted -- `check_steps`;
* no committed snapshot is lost: `SnapshotWatch` polls the job's snapshot list while the
  test runs; "latest" never moves back (unless to skip one marked bad), every snapshot
  ever listed is still listed at the end, and every good one still matches its checksum
  on disk -- `SnapshotWatch.check`.

Jobs keep every snapshot (`keep` 1000) so the final list is the whole history.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.harness import (
    FROM_MEMORY,
    REPO,
    STEP_LINE,
    ControlPlane,
    NodeAgentProc,
    forked_torchrun,
    rank0_lines,
    wait_for,
)
from bench.harness import runs as runs  # the tests' name for it
from tests.helpers.elastic import job, job_spec, worker_pids
from worker import snapshot as snap
from worker.launch import WORKER_NOTE
from worker.procs import cmdline, descendants, is_fork_server, is_launcher, is_standby, parent_of

TRAIN = REPO / "examples" / "train.py"
KEEP_ALL = 1000
_START = re.compile(r"^(?:start|resumed) step=(\d+)")


def train_spec(name: str, steps: int, *, every: int = 5, nproc: int = 1, mn: int = 1, mx: int = 1,
               delay_s: float = 0.05, max_restarts: int = 3, width: int = 32, **extra) -> dict:
    """examples/train.py (the ftrain runtime) as a job that snapshots every `every` steps."""
    args = ["--steps", str(steps), "--batch", "8", "--width", str(width), "--step-delay", str(delay_s)]
    return job_spec(name, *args, script=TRAIN, mn=mn, mx=mx, max_restarts=max_restarts,
                    nproc_per_node=nproc, snapshot={"every_steps": every, "keep": KEEP_ALL}, **extra)


def plain_spec(name: str, steps: int, *, every: int = 5, nproc: int = 1, mn: int = 1, mx: int = 1,
               step_time_s: float = 0.05, max_restarts: int = 3, **extra) -> dict:
    """tests/scripts/ddp_steps.py (a tutorial-style script, its own snapshot.pt) as a job."""
    return job_spec(name, "--steps", str(steps), "--step-time", str(step_time_s),
                    "--snapshot-every", str(every), mn=mn, mx=mx, max_restarts=max_restarts,
                    nproc_per_node=nproc, **extra)


# ---------------------------------------------------------------------------- processes

def workers(agent: NodeAgentProc, script: Path = TRAIN) -> list[int]:
    """The live training processes (running `script`) under an agent."""
    return worker_pids(agent, script)


def wait_workers(agent: NodeAgentProc, n: int, script: Path = TRAIN, timeout_s: float = 30) -> list[int]:
    return wait_for(lambda: len(w := workers(agent, script)) == n and w, timeout_s,
                    f"{n} worker(s) of {script.name} under agent {agent.name}")


def found_by_grep(agent: NodeAgentProc, script: Path) -> int | None:
    """The process that `ps ax | grep <script>` lists first under `agent` (the lowest pid
    whose command line names the script): torchrun's, whose argv carries the worker's
    command, started before any worker."""
    named = [p for p in descendants(agent.pid) if any(str(script).encode() in a for a in cmdline(p))]
    return min(named, default=None)


def worker_launchers(agent: NodeAgentProc) -> list[int]:
    """The `worker/launch.py` of each worker under `agent` (not the one standing in for torchrun)."""
    return [p for p in descendants(agent.pid)
            if is_launcher(argv := cmdline(p)) and b"torch.distributed.run" not in argv]


def fork_servers(agent: NodeAgentProc) -> list[int]:
    """The job's fork server under `agent` (its children keep its argv: the agent's child only)."""
    return [p for p in descendants(agent.pid) if parent_of(p) == agent.pid and is_fork_server(cmdline(p))]


def forked_torchruns(agent: NodeAgentProc) -> list[int]:
    """torch's elastic agent itself, forked by the fork server (the launcher stands in for it)."""
    return [p for z in fork_servers(agent) for p in descendants(z) if parent_of(p) == z and forked_torchrun(p)]


def standbys(agent: NodeAgentProc) -> list[int]:
    """The fork server's standbys under `agent` (worker/standby.py)."""
    return [p for p in descendants(agent.pid) if is_standby(p)]


def state_letter(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


@dataclass(frozen=True)
class RankOutput:
    """What one rank's workers wrote to stdout on a node, in the files torchrun's --log-dir
    keeps per worker (readable while the control plane or etcd is away): every group of the
    job's `attempt` (of every attempt when None), oldest first."""

    agent: NodeAgentProc
    job_id: str
    attempt: int | None
    rank: int = 0

    def files(self) -> list[Path]:
        runs = self.agent.workdir / "logs" / self.job_id / "torchrun" / self.agent.name
        pattern = f"{self.job_id}-a{'*' if self.attempt is None else self.attempt}_*/attempt_*/*/stdout.log"
        found = []
        for path in runs.glob(pattern):
            try:
                note = json.loads((path.parent / WORKER_NOTE).read_text())
            except (OSError, ValueError):
                continue
            if note.get("rank") == self.rank:
                found.append((_group_order(path), path))
        return [p for _, p in sorted(found)]

    def exists(self) -> bool:
        return bool(self.files())

    def read_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.files())


def _group_order(path: Path) -> tuple:
    """Where a worker's file comes among its node's: by job attempt, by torch's restart, and a
    group that a membership change replaced (`attempt_<restart>.<n>`) before the next."""
    run, restart = path.parent.parent.parent.name, path.parent.parent.name
    attempt = int(re.search(r"-a(\d+)_[^/]*$", run).group(1))
    number, _, replaced = restart.removeprefix("attempt_").partition(".")
    return attempt, int(number), int(replaced) if replaced else float("inf"), str(path)


def agent_stdout(agent: NodeAgentProc, job_id: str, attempt: int | None, rank: int = 0) -> RankOutput:
    """A rank's stdout on a node for one attempt (every attempt: None)."""
    return RankOutput(agent, job_id, attempt, rank)


def local_steps(out: RankOutput) -> list[int]:
    """Steps the rank printed, read from its files on the node."""
    return [int(m.group(1)) for m in re.finditer(r"^step=(\d+)\b", out.read_text(), re.M)]


@contextlib.contextmanager
def tmpfs(mountpoint: Path, size: str):
    """A small tmpfs mounted at `mountpoint` for the block; unmounted after, even on failure."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", f"ftrain-test-{os.getpid()}",
                    str(mountpoint)], check=True, capture_output=True, text=True)
    try:
        yield mountpoint
    finally:
        done = subprocess.run(["umount", str(mountpoint)], capture_output=True, text=True)
        if done.returncode != 0:  # something still has a file open: detach it now, free it later
            subprocess.run(["umount", "-l", str(mountpoint)], check=False, capture_output=True)


def is_mountpoint(path: Path) -> bool:
    return any(line.split()[4] == str(path) for line in Path("/proc/self/mountinfo").read_text().splitlines())


def fill_disk(directory: Path, chunk: int = 1 << 16) -> Path:
    """Write a file in `directory` until its filesystem is full; returns the file."""
    filler = directory / "filler.bin"
    block = b"\0" * chunk
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            if exc.errno != 28:  # ENOSPC is what we want; anything else is a real error
                raise
        small = 4096
        with contextlib.suppress(OSError):  # the last few pages
            while True:
                f.write(block[:small])
    return filler


# ---------------------------------------------------------------------------- invariants

@dataclass
class Snap:
    step: int
    checksum: str
    path: str
    bad: bool


@dataclass
class SnapshotWatch:
    """Polls the job's committed snapshots in a thread; remembers everything it saw."""

    cp: ControlPlane
    job_id: str
    interval_s: float = 0.1
    # (seen at, step, checksum) of every latest snapshot seen
    latest: list[tuple[float, int | None, str | None]] = field(default_factory=list)
    seen: dict[tuple[int, str], Snap] = field(default_factory=dict)
    bad: set[tuple[int, str]] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> SnapshotWatch:
        self._thread = threading.Thread(target=self._run, daemon=True, name="snapshot-watch")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                with self.cp.client() as c:  # a new client: the control plane may be restarted
                    self.poll(c)
            self._stop.wait(self.interval_s)

    def poll(self, api: httpx.Client) -> dict:
        resp = api.get(f"/v1/jobs/{self.job_id}/snapshots")
        if resp.status_code != 200:
            return {}
        body = resp.json()
        now = time.time()
        for item in body["items"]:
            key = (item["step"], item["checksum"])
            self.seen[key] = Snap(item["step"], item["checksum"], item["path"], item["bad"])
            if item["bad"]:
                self.bad.add(key)
        checksum = next((i["checksum"] for i in body["items"] if i["step"] == body["latest"]), None)
        self.latest.append((now, body["latest"], checksum))
        return body

    def mark_bad(self, step: int, checksum: str) -> None:
        """The test damaged this snapshot itself: it no longer counts as a good one."""
        self.bad.add((step, checksum))

    def good_steps(self) -> set[int]:
        return {s.step for k, s in self.seen.items() if k not in self.bad}

    def latest_before(self, t: float) -> int | None:
        """The newest latest-pointer seen before time `t` that still names a good snapshot."""
        good_latest = [step for when, step, checksum in self.latest
                       if when < t and step is not None and (step, checksum) not in self.bad]
        return max(good_latest, default=None)

    def check(self, api: httpx.Client) -> dict:
        """No committed snapshot lost: see the module docstring. Returns the final list."""
        final = self.poll(api)
        assert final, "could not list the job's snapshots at the end"
        listed = {(i["step"], i["checksum"]) for i in final["items"]}
        for key, s in self.seen.items():
            # A snapshot found bad may be listed under a new checksum (its step committed again)
            # or not at all (nothing good of it to keep); a good one is never dropped.
            assert key in listed or key in self.bad, \
                f"committed snapshot of step {s.step} ({s.checksum}) is no longer listed: {final}"
        previous = None
        for when, step, _ in self.latest:
            if previous is not None and (step is None or step < previous):
                skipped = [k for k in self.bad if k[0] == previous]
                assert skipped, f"latest moved back from {previous} to {step} at {when} " \
                                f"without the snapshot of step {previous} being marked bad"
            previous = step
        good = [i for i in final["items"] if not i["bad"]]
        for item in good:
            snap.verify(item["path"], item["checksum"], item["size"])
        assert final["latest"] == max((i["step"] for i in good), default=None), final
        return final


@dataclass
class Trace:
    steps: list[int]
    resumes: list[tuple[float, int, int]]  # (time of the first step after, resumed from, last step before)


def check_steps(api: httpx.Client, job_id: str, *, watch: SnapshotWatch | None = None,
                every: int | None = None, margin_s: float = 0.2) -> Trace:
    """Rank 0's steps never go backwards except to a committed snapshot.

    With a `watch` (the runtime's committed snapshots), a restart must resume from a good
    committed snapshot or a copy of the memory tier (which rank 0 says it loaded), and from
    one at least as new as every latest seen before it restarted. Without one (a tutorial
    script's own snapshot.pt every `every` steps), it must resume from a multiple of
    `every`, at most one snapshot behind the last step.
    """
    assert (watch is None) != (every is None)
    steps: list[int] = []
    resumes: list[tuple[float, int, int]] = []
    marker: int | None = None  # "start step=S" (the runtime) or "resumed step=S" (the script)
    lines = rank0_lines(api, job_id)
    # Steps rank 0 loaded from the memory tier (worker/memory.py). Gathered first: the line
    # that says so is the runtime's log on stderr, read apart from the steps on stdout, so
    # its read time may come after the first step it resumed to.
    from_memory = {int(m.group(1)) for i in lines if (m := FROM_MEMORY.search(i["line"]))}
    for item in lines:
        if FROM_MEMORY.search(item["line"]):
            continue
        if m := _START.match(item["line"]):
            marker = int(m.group(1))
            continue
        if not (m := STEP_LINE.match(item["line"])):
            continue
        n = int(m.group(1))
        if marker is None and steps and n == steps[-1] + 1:
            steps.append(n)
            continue
        # A (re)start: from the step its marker names, else (a script that found no
        # snapshot says nothing) from the start.
        resumed_from = marker if marker is not None else 0
        marker = None
        last = steps[-1] if steps else 0
        assert n == resumed_from + 1, f"resumed from step {resumed_from} but the next step logged is {n}"
        if watch is not None:
            good = watch.good_steps() | {0}
            assert resumed_from in good | from_memory, \
                f"step {n} after step {last}: {resumed_from} is not a committed snapshot ({sorted(good)}) " \
                f"nor a copy of the memory tier ({sorted(from_memory)})"
            floor = watch.latest_before(item["time"] - margin_s)
            assert floor is None or resumed_from >= floor, \
                f"resumed at step {n} although snapshot {floor} was committed before: a snapshot was lost"
        else:
            assert resumed_from % every == 0, f"step {n} after step {last}: not a snapshot of every {every}"
            assert resumed_from >= (last // every) * every - every, \
                f"resumed at step {n} after step {last}: more than one snapshot lost"
        if steps or resumed_from:
            resumes.append((item["time"], resumed_from, last))
        steps.append(n)
    assert steps, f"job {job_id}: rank 0 logged no step"
    return Trace(steps, resumes)


def steps_lost(api, job_id: str, last: int, restarts: int = 1) -> int:
    """Check that every run trained on from where it started, to `last` at the end; return
    how many steps the restarts retrained (those logged before one, from its start on). A
    killed node's last lines may never have been shipped: a step it trained and did not
    log is not counted as lost."""
    got = runs(api, job_id)
    assert len(got) == restarts + 1 and got[0][0] == 0, got
    for start, steps in got:
        assert steps == list(range(start + 1, start + 1 + len(steps))), (start, steps)
    assert got[-1][1][-1] == last, got
    return sum(max(0, max(before[1]) - after[0]) for before, after in zip(got, got[1:]))


def events_of(api: httpx.Client, job_id: str) -> list[dict]:
    return api.get(f"/v1/jobs/{job_id}/events").json()["items"]


def states_of(api: httpx.Client, job_id: str) -> list[str]:
    """The job's state after each event, with repeats (notes) collapsed."""
    out: list[str] = []
    for e in events_of(api, job_id):
        if not out or out[-1] != e["state"]:
            out.append(e["state"])
    return out


def latest_step(api: httpx.Client, job_id: str) -> int | None:
    return api.get(f"/v1/jobs/{job_id}/snapshots").json()["latest"]


def wait_latest(api: httpx.Client, job_id: str, at_least: int, timeout_s: float = 60) -> int:
    return wait_for(lambda: (s := latest_step(api, job_id)) is not None and s >= at_least and s,
                    timeout_s, f"job {job_id} to commit a snapshot of step >= {at_least}")


def attempt_of(api: httpx.Client, job_id: str) -> int:
    return job(api, job_id)["attempt"]
