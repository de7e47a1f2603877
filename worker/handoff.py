"""Snapshot commits that rank 0's worker leaves to its node agent at its end.

Rank 0's runtime ends (`Runtime.finish`) waiting up to `commit_wait_s` for its snapshots'
commits. When the control plane is still away then (restarting, cut off, its etcd away),
the commits not made would die with the process, and the job would end SUCCEEDED with an
older snapshot listed as latest (seen once under load: latest 10 of 120). Instead the
worker hands them over (`leave`): it writes the very requests it would have sent (attempt
included, the fencing), and its final progress report if that did not land either, to a
file beside its snapshots, named by its node and attempt,

    <snapshot dir>/.handoff-<node>-a<attempt>.json   (temporary file, fsync, rename)

and exits. The node agent, which outlives it and already waits across control planes for
its reports, finds the file (`Torchrun.handing_over`, every loop) and makes the
commits in a thread (`AgentHandoff`: newest first, each tried again with a pause growing
from `RETRY_FIRST_S` to `RETRY_MAX_S` while no control plane answers, for as long as it
takes), then sends the progress report; it reports the group's end only after them, so the
job cannot end before its last snapshot is listed and its last step shown. While it waits
the group is still the agent's, and a registration after a lapsed lease says so, so the
node stays a member.

A commit the control plane refuses is final: a newer attempt owns the job or the job has
ended (409), and whatever this attempt wrote can no longer move "latest". A file that is
gone, or not the size or checksum written (read once to check: a group that torchrun
restarted in the same attempt may have written that step again), is not committed. Either
way the end report says which steps were not committed and why (its reason; the job's end
names it), never a silent success. A group the control plane stopped (a new attempt, a
cancel) is not waited for.

An agent SIGKILLed while it holds a hand-over leaves the taken file (`<file>.taken-<pid>`,
rewritten after each commit it made, so only what is still to do); the agent restarted
under the same name and data directory puts it back (`gather`) and makes it
(worker/end_record.py says how it knows the job's snapshot folder).

Each node's first worker leaves one more thing when no control plane answers it at a clean
end: its word that the node's workers finished the run (`leave(finished=True)`,
`Progress.say_finished`), which the agent says after the commits and the progress report,
so that the node counts as finished even if the agent dies before its end report lands.

A rank 0 that ends with an error hands over too, and torchrun may then restart the group in
the same attempt while the agent still makes the commits: the new group's rank 0 waits for
them (`wait_pending`, before it asks for its restore point), so that it cannot resume from an
older snapshot than the ones its predecessor wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from . import safe_files
from .links import CommitUnreachable, Fenced, LinkError, ServiceLink
from .protocol import CommitRequest, ProgressReport
from .protocol import SHARDED_MANIFEST as MANIFEST

log = logging.getLogger("ftrain.handoff")

# A hand-over holds at most `snapshot.keep` commits (at most 1,000; the writer keeps no more
# waiting), each a few hundred bytes (a path up to 4 KiB), and a progress report.
MAX_HANDOFF_BYTES = 8 << 20
RETRY_FIRST_S = 0.5
# A few requests at most: cheap to try often, and the end is reported soon after an outage.
RETRY_MAX_S = 1.0
# How long the rank 0 of a group that torchrun restarted in the same attempt waits, before it
# asks for its restore point, for the hand-overs an earlier group of that attempt left
# (`wait_pending`); past it (an agent that is gone left its file) it restores without them.
PENDING_WAIT_S = 60.0


def handoff_path(directory: str | Path, node: str, attempt: int) -> Path:
    return Path(directory) / f".handoff-{node}-a{attempt}.json"


def node_of(path: Path) -> str:
    """The node a hand-over file is for (`handoff_path`'s name: the attempt is its last part)."""
    return path.name.removeprefix(".handoff-").rsplit("-a", 1)[0]


def leave(directory: str | Path, node: str, attempt: int, commits: Iterable[CommitRequest] = (),
          progress: ProgressReport | None = None, finished: bool = False) -> Path:
    """The worker's side: add `commits` (and its final `progress`, and its node's word that
    its workers `finished` the run) to what it leaves its agent, in one file written whole
    (temporary file, fsync, rename); returns the file."""
    # The worker's own folder, its links resolved (the agent's side walks none: safe_files)
    path = handoff_path(safe_files.real_path(directory), node, attempt)
    old = _read(path)  # what it left before, if the agent has not taken it yet
    by_step = {r.step: r for r in [*old.commits, *commits]}
    _write(path, list(by_step.values()), progress if progress is not None else old.progress,
           finished or old.finished)
    return path


def _write(path: Path, commits: list[CommitRequest], progress: ProgressReport | None,
           finished: bool = False) -> None:
    """`path` replaced whole by these commits, progress report and word of the run's end
    (temporary file, fsync, rename; the agent's write reaches through no link, worker/safe_files.py)."""
    body = json.dumps({"commits": [r.model_dump(mode="json") for r in commits],
                       "progress": None if progress is None else progress.model_dump(mode="json"),
                       "finished": finished}).encode()
    safe_files.replace_file(path, body)


def gather(directory: str | Path, node: str, attempt: int) -> Path | None:
    """A restarted agent's: what its killed predecessor had taken and not finished
    (`<file>.taken-<pid>`, rewritten after each commit it made) put back together with what
    the worker left since, in the one file an `AgentHandoff` takes; that file, or None if
    nothing is left for (`node`, `attempt`)."""
    path = handoff_path(directory, node, attempt)
    try:
        names = [n for n in safe_files.listdir(directory)
                 if n.startswith(f"{path.name}.taken-") and ".tmp-" not in n]
    except OSError:
        return None
    if names:
        left = _read(path)  # left since the take: its progress report is the newer
        commits, progress, finished = list(left.commits), left.progress, left.finished
        for name in names:
            taken = _read(path.with_name(name))
            commits += taken.commits
            progress = progress if progress is not None else taken.progress
            finished = finished or taken.finished
        by_step = {r.step: r for r in commits}
        _write(path, list(by_step.values()), progress, finished)
        for name in names:
            safe_files.unlink(path.with_name(name))
    return path if safe_files.lexists(path) else None


def pending(directory: str | Path, attempt: int) -> list[Path]:
    """The hand-overs of `attempt` in `directory`, any node's: left by a worker and not yet
    taken, or taken by an agent that is still making them (or was killed making them)."""
    suffix = f"-a{attempt}.json"
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return [Path(directory) / n for n in names if n.startswith(".handoff-") and ".tmp-" not in n
            and (n.endswith(suffix) or f"{suffix}.taken-" in n)]


def wait_pending(directory: str | Path, attempt: int, timeout_s: float = PENDING_WAIT_S,
                 poll_s: float = 0.1) -> bool:
    """Wait until no hand-over of `attempt` is left in `directory` (its agent made its commits:
    a restore point asked for after them is no older than they are); False after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while pending(directory, attempt):
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


@dataclass(frozen=True)
class Left:
    """What a worker left its agent in one file."""

    commits: list[CommitRequest] = field(default_factory=list)  # newest first
    progress: ProgressReport | None = None  # its final progress report
    finished: bool = False  # its node's workers finished the run (`Progress.say_finished`)


def read(path: Path) -> tuple[list[CommitRequest], ProgressReport | None]:
    """What a worker left in `path`: its commits, newest first, and its final progress report;
    nothing for an unreadable file."""
    left = _read(path)
    return left.commits, left.progress


def read_finished(path: Path) -> bool:
    """Whether the worker left in `path` its node's word that its workers finished the run."""
    return _read(path).finished


def _read(path: Path) -> Left:
    try:
        with safe_files.open_reader(path) as f:
            got = json.loads(f.read(MAX_HANDOFF_BYTES))
        commits = [CommitRequest.model_validate(i) for i in got["commits"]]
        progress = None if got.get("progress") is None else ProgressReport.model_validate(got["progress"])
        finished = got.get("finished") is True
    except FileNotFoundError:  # taken by the agent meanwhile
        return Left()
    except (OSError, ValueError, TypeError, KeyError, ValidationError) as exc:
        log.warning("what the worker left in %s cannot be read (%s): nothing of it is sent", path, exc)
        return Left()
    return Left(sorted(commits, key=lambda r: r.step, reverse=True), progress, finished)


def _file_of(req: CommitRequest, directory: Path) -> Path | None:
    """The snapshot file of `req`, if it is in the job's snapshot folder (the agent reads
    nothing else for a worker: a path elsewhere would let the job's user learn of files it
    may not read through the agent's checks)."""
    path = Path(req.path) if Path(req.path).is_absolute() else directory / req.path
    if os.path.normpath(path.parent) != os.path.normpath(directory) or path.name.startswith("."):
        return None
    return path


def _identity(path: Path) -> tuple[int, int, int] | None:
    """The file as it is now (inode, size, modification time), None if it is gone: a file read
    whole once is read again only if this changed."""
    try:
        st = safe_files.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def _whole(req: CommitRequest, path: Path) -> str | None:
    """Why the file of `req` cannot be committed (gone, another size, another checksum: a
    group that torchrun restarted in the same attempt wrote that step again), or None."""
    algo, _, want = req.checksum.partition(":")
    sharded = req.shards is not None  # a directory: its checksum is its manifest's (worker/sharded.py)
    try:
        digest = hashlib.new(algo)
        with safe_files.open_reader(path / MANIFEST if sharded else path) as f:
            size = os.fstat(f.fileno()).st_size
            if not sharded and size != req.size:
                return f"its file is {size} bytes, {req.size} were written"
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    except ValueError:
        return f"its checksum {req.checksum[:40]!r} is of no algorithm known here"
    except OSError as exc:
        return f"its file cannot be read ({exc.strerror or type(exc).__name__})"
    if digest.hexdigest() != want:
        return "its file no longer has the checksum written (it was written again since)"
    return None


def _delete_pruned(paths: list[str], directory: Path) -> None:
    """Delete the files a commit pruned (only in the job's snapshot directory), as the
    worker would have."""
    for p in paths:
        path = Path(p) if Path(p).is_absolute() else directory / p
        if os.path.normpath(path.parent) != os.path.normpath(directory) or path.name.startswith("."):
            continue
        try:
            if safe_files.is_dir(path):  # a sharded snapshot
                safe_files.remove_flat_folder(path)
            else:
                safe_files.unlink(path)
        except OSError as exc:
            log.warning("could not delete pruned snapshot %s: %s", path, exc)


class AgentHandoff:
    """The agent's side: the commits a worker left in `path`, made in a thread of its own."""

    def __init__(self, path: Path, link: ServiceLink, not_committed: dict[int, str] | None = None):
        self.path = path
        self.link = link
        # step -> why (carried from the same group's earlier hand-over, if any)
        self.not_committed: dict[int, str] = dict(not_committed or {})
        self.committed: list[int] = []
        self._cancel = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"handoff-{path.name}", daemon=True)

    def start(self) -> AgentHandoff:
        self._thread.start()
        return self

    def done(self) -> bool:
        return not self._thread.is_alive()

    def cancel(self) -> None:
        """Stop trying (the group was stopped: a new attempt or a cancel); what is left is
        not committed."""
        self._cancel.set()

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def note(self) -> str | None:
        """What the end report says of the commits that were not made; None if all were."""
        if not self.not_committed:
            return None
        steps_by_why: dict[str, list[int]] = {}
        for step, why in sorted(self.not_committed.items(), reverse=True):  # newest first
            steps_by_why.setdefault(why, []).append(step)
        parts = [f"step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}: {why}"
                 for why, steps in steps_by_why.items()]
        return ("snapshot(s) written and not committed, the latest snapshot does not include them: "
                + "; ".join(parts))

    def _run(self) -> None:
        # Taken first (renamed away), so that what the worker leaves meanwhile (its final
        # progress report, a restarted group's commits) makes a new file, not lost with this one.
        taken = self.path.with_name(f"{self.path.name}.taken-{os.getpid()}")
        try:
            safe_files.rename(self.path, taken.name)
        except OSError as exc:
            log.warning("could not take %s: %s", self.path, exc)
            self.link.close()
            return
        left = _read(taken)
        requests, progress, finished = left.commits, left.progress, left.finished
        self._taken, self._rest, self._progress, self._finished = taken, list(requests), progress, finished
        if requests:
            log.warning("the worker of job attempt %d left %d snapshot commit(s) (steps %s) to this "
                        "agent: the control plane did not take them before it ended; committing them",
                        requests[0].attempt, len(requests), ", ".join(str(r.step) for r in requests))
        try:
            for i, req in enumerate(requests):
                if self._cancel.is_set():
                    for r in requests[i:]:
                        self.not_committed[r.step] = "the group was stopped first"
                    break
                refused = self._commit(req)
                if refused is not None:  # a refusal holds for the rest too (the attempt is over)
                    for r in requests[i:]:
                        self.not_committed.setdefault(r.step, refused)
                    progress, finished = None, False
                    break
            if progress is not None:
                self._report_progress(progress)
            if finished:
                self._report_finished()
        finally:
            try:
                safe_files.unlink(taken)
            except OSError as exc:
                log.warning("could not remove %s: %s", taken, exc)
            self.link.close()
            if self.not_committed:
                log.warning("%s", self.note())

    def _left(self, done: CommitRequest) -> None:
        """The taken file without the commit just made: an agent killed now leaves only what is
        still to do to the agent that restarts in its place (`gather`); a file this commit
        pruned is not looked for again."""
        self._rest = [r for r in self._rest if r.step != done.step]
        try:
            _write(self._taken, self._rest, self._progress, self._finished)
        except OSError as exc:
            log.warning("could not note the commit of step %d in %s: %s", done.step, self._taken, exc)

    def _report_progress(self, body: ProgressReport) -> None:
        """Rank 0's final progress report, which did not land: sent before the end report, so
        a finished job shows the step it ended at."""
        pause = RETRY_FIRST_S
        while not self._cancel.is_set():
            try:
                self.link.send_progress(body)
            except LinkError as exc:
                if exc.status is not None and exc.status < 500:
                    log.warning("the final progress report (step %d) left by the worker was refused: %s",
                                body.step, exc)
                    return
                self._cancel.wait(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            log.info("the final progress report (step %d) sent for the worker", body.step)
            return

    def _report_finished(self) -> None:
        """The node's word that its workers finished the run, which did not land: sent before
        the end report, so that the node counts as finished even if this agent is killed
        before that report lands (service/decide/outcome.py `vanished`)."""
        node = node_of(self.path)
        pause = RETRY_FIRST_S
        while not self._cancel.is_set():
            try:
                self.link.report_finished(node, final=False)
            except LinkError as exc:
                if exc.status is not None and exc.status < 500:
                    log.warning("the word that node %s's workers finished the run was refused: %s", node, exc)
                    return
                self._cancel.wait(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            log.info("said for the worker that node %s's workers finished the run", node)
            return

    def _commit(self, req: CommitRequest) -> str | None:
        """Commit `req`, trying again while no control plane answers; the refusal's reason
        if the control plane refused it (None otherwise)."""
        path, checked = _file_of(req, self.path.parent), None
        if path is None:
            self.not_committed[req.step] = "its path is not in the job's snapshot folder"
            return None
        pause = RETRY_FIRST_S
        while not self._cancel.is_set():
            # checked before each try, read whole only when the file changed (or at first): one
            # gone or written again while no control plane answered is not committed
            if (now := _identity(path)) is None or now != checked:
                if (why := _whole(req, path)) is not None:
                    self.not_committed[req.step] = why
                    return None
                checked = now
            try:
                prune = self.link.commit_request(req, retry_s=0)  # this loop is the retry
            except CommitUnreachable as exc:
                log.info("snapshot commit of step %d left by the worker: %s; trying again", req.step, exc)
                self._cancel.wait(pause)
                pause = min(pause * 2, RETRY_MAX_S)
                continue
            except (Fenced, LinkError) as exc:
                return f"refused: {exc}"
            self.committed.append(req.step)
            self.not_committed.pop(req.step, None)  # (an earlier hand-over's note of it is void)
            _delete_pruned(prune, self.path.parent)
            self._left(req)
            log.info("snapshot of step %d committed for the worker that wrote it", req.step)
            return None
        self.not_committed[req.step] = "the group was stopped first"
        return None
