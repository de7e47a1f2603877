"""A group's output as the node agent reads it: each worker's own files, and torchrun's.

torchrun runs with `--redirects=3 --log-dir=D` (no `--tee`): each worker writes its stdout and
stderr to files of its own, `D/<run id>_<random>/attempt_<restart>/<local rank>/stdout.log`
and `stderr.log` (torch's `DefaultLogsSpecs`; `<run id>` is the rendezvous id, `<restart>`
torch's restart count), and torchrun's own lines go to its stdout and stderr, files the agent
opened for it. The agent follows all of them (worker/torchrun.py) and ships each line once.

Why not `--tee`: torch's tailer inside torchrun copies whatever `readline` returns at the end
of a worker's file to torchrun's stdout, a line caught half-written included, and the rest of
it later under a second rank header; the agent then saw one broken line (2 of 240,000 lines
in 8 runs of plain torchrun; 1 of 15,000 in a soak's job). Here a line is shipped once its
newline is there (`LineReader`), and an unterminated last line once its file is final: torchrun
has exited, or the worker's group was replaced and the file has been quiet for `QUIET_S`.

torchrun names a worker's folder by its local rank; its global rank, and the rendezvous round
that formed its group, are in the note the worker's launcher leaves there before the worker
starts (worker/launch.py `WORKER_NOTE`). A membership change does not move torch's restart
count: torch deletes the folder `attempt_<restart>` and makes it again for the new group.
`keep_replaced_outputs` (in torchrun) moves it aside first, to `attempt_<restart>.<n>`, so the
node keeps every group's output, as it did in torchrun's --tee copy. Either way the agent may
still be reading the old group's lines (it waits for the shipper): so `WorkerDirs`, from a
thread that never waits for the shipper, opens each worker's folder and files as soon as they
appear and holds them open: a moved or deleted file is still read to its end, and a folder
made again at the same path is a new folder (its inode differs from the one held open).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from . import safe_files, torch_internals
from .env import TORCHELASTIC_RESTART_COUNT
from .launch import WORKER_NOTE

log = logging.getLogger(__name__)

STREAMS = ("stdout", "stderr")
# How often the folders are looked at, and a file at its end read again.
POLL_S = 0.05
# A replaced group's file is final once nothing was written to it for this long (its worker is
# gone; one forked by the fork server dies just after its launcher, which torch waited for).
QUIET_S = 1.0
# A line without a newline is shipped (cut, `protocol.cut_line`) once this much of it is read:
# a progress bar redrawn with "\r" for an hour must not grow without a bound.
MAX_PENDING_BYTES = 1 << 20
_RESTART = re.compile(r"^attempt_(\d+)$")


class LineReader:
    """The whole lines of a file that another process is writing."""

    def __init__(self, f: BinaryIO, max_pending_bytes: int = MAX_PENDING_BYTES):
        self.f = f
        self.max_pending_bytes = max_pending_bytes
        self.partial = b""
        self.bytes_read = 0

    def next_line(self, final: bool) -> bytes | None:
        """The next line, without its newline, or None if no whole line is there yet; once the
        file is `final` (its writer is done), a last line without a newline is one too."""
        while True:
            raw = self.f.readline(self.max_pending_bytes - len(self.partial))
            self.bytes_read += len(raw)
            if not raw:
                if final and self.partial:
                    line, self.partial = self.partial, b""
                    return line
                return None
            self.partial += raw
            if raw.endswith(b"\n") or len(self.partial) >= self.max_pending_bytes:
                line, self.partial = self.partial, b""
                return line[:-1] if line.endswith(b"\n") else line


@dataclass(frozen=True)
class WorkerNote:
    """Who wrote a worker's files: its global rank, and its group's rendezvous round."""

    rank: int
    round: int | None


def read_note(dir_fd: int) -> WorkerNote | None:
    """The note in the folder open as `dir_fd` (worker/launch.py `leave_note`); None if it is
    not there (yet) or not readable."""
    try:
        data = json.loads(safe_files.read_bytes(WORKER_NOTE, 4096, dir_fd=dir_fd))
        rank, round_ = data["rank"], data.get("round")
        if not isinstance(rank, int) or not (round_ is None or isinstance(round_, int)):
            return None
        return WorkerNote(rank, round_)
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass
class WorkerDir:
    """One worker's folder under torchrun's --log-dir, open, with its files as they appear."""

    path: Path
    restart: int
    local_rank: int
    fd: int  # the folder, held open
    ino: int
    files: dict[str, BinaryIO] = field(default_factory=dict)  # stream -> its file, opened at once
    note: WorkerNote | None = None
    replaced: bool = False  # a newer group's folder is there: this worker is gone
    handed_out: bool = False

    def who(self) -> WorkerNote:
        """Its note, or, without one (a launcher that could not write it), its local rank."""
        return self.note or WorkerNote(self.local_rank, None)

    def open_files(self) -> None:
        for stream in STREAMS:
            if stream not in self.files:
                try:  # the job's user's folder: never through a link, only its own file
                    self.files[stream] = safe_files.open_reader(f"{stream}.log", dir_fd=self.fd)
                except OSError:
                    continue

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class WorkerDirs:
    """The worker folders of one torchrun (`<log_dir>/<run_id>_*`), found as they appear.

    `scan` is called from one thread, often; the folders it finds ready to be read (their note
    is there, or none will come) are put on `ready` for the reader.
    """

    def __init__(self, log_dir: Path, run_id: str, ignore: frozenset[str] = frozenset()):
        self.log_dir = log_dir
        self.prefix = f"{run_id}_"
        self.ignore = ignore  # run folders of an earlier torchrun with this id
        self.run_dir: Path | None = None
        self.latest = -1  # the highest restart seen
        self.current: dict[Path, WorkerDir] = {}  # by path: the folder there now
        self.waiting: list[WorkerDir] = []  # found, not handed out yet
        self.ready: queue.SimpleQueue[WorkerDir] = queue.SimpleQueue()
        self.done = threading.Event()  # set after the last scan: nothing more comes on `ready`
        self._held: list[WorkerDir] = []  # every folder opened, closed by `close`

    @classmethod
    def before_start(cls, log_dir: Path, run_id: str) -> WorkerDirs:
        """For a torchrun about to start: its run folder is one that is not there yet."""
        return cls(log_dir, run_id, frozenset(cls._run_dirs(log_dir, f"{run_id}_")))

    @staticmethod
    def _run_dirs(log_dir: Path, prefix: str) -> list[str]:
        try:
            return [n for n in safe_files.listdir(log_dir) if n.startswith(prefix)]
        except OSError:
            return []

    def scan(self, final: bool = False) -> None:
        """Open the folders and files that appeared, mark the replaced, and put on `ready` those
        that can be read (all of them when `final`: torchrun has exited)."""
        if self.run_dir is None:
            names = [n for n in self._run_dirs(self.log_dir, self.prefix) if n not in self.ignore]
            if names:
                self.run_dir = self.log_dir / sorted(names)[0]  # one per torchrun
        if self.run_dir is not None:
            self._find_new()
        for d in self.waiting:
            d.open_files()
            if d.note is None and d.fd >= 0:
                d.note = read_note(d.fd)
                if d.note is not None:
                    d.open_files()  # there before the launcher ran: all of them now
            if d.note is not None or d.replaced or final:
                d.handed_out = True
                self.ready.put(d)
        self.waiting = [d for d in self.waiting if not d.handed_out]
        for d in [d for d in self._held if d.handed_out and d.replaced]:
            d.close()  # its files are the reader's; a new folder at its path has been told apart
            self._held.remove(d)

    def _find_new(self) -> None:
        # Each folder is opened through no link, from the run folder down (the job's user's
        # folders: worker/safe_files.py), and told apart from the one known by its inode.
        try:
            run_fd = safe_files.open_dir(self.run_dir)
        except OSError:
            return
        try:
            restarts = sorted(int(m.group(1)) for n in os.listdir(run_fd)
                              if (m := _RESTART.match(n)) and int(m.group(1)) >= self.latest)
            for restart in restarts:
                self._find_in(run_fd, restart)
        finally:
            os.close(run_fd)

    def _find_in(self, run_fd: int, restart: int) -> None:
        """Open the worker folders of `attempt_<restart>` that are new."""
        if restart > self.latest:  # torch restarted the group: the older workers are gone
            for d in self.current.values():
                d.replaced = True
            self.current = {}
            self.latest = restart
        attempt = f"attempt_{restart}"
        try:
            names = [n for n in safe_files.listdir(attempt, dir_fd=run_fd) if n.isdigit()]
        except OSError:
            return
        for name in sorted(names, key=int):
            path = self.run_dir / attempt / name
            try:
                fd = safe_files.open_dir(f"{attempt}/{name}", dir_fd=run_fd)
            except OSError:
                continue
            ino = os.fstat(fd).st_ino
            known = self.current.get(path)
            if known is not None and known.ino == ino:
                os.close(fd)
                continue
            if known is not None:
                known.replaced = True  # a membership change: the same path, a new group
            d = WorkerDir(path, restart, int(name), fd, ino)
            self.current[path] = d
            self.waiting.append(d)
            self._held.append(d)

    def close(self) -> None:
        """Close the folders (the reader owns the files handed out); no more on `ready`."""
        for d in self.waiting:
            for f in d.files.values():
                f.close()
        self.waiting = []
        for d in self._held:
            d.close()
        self._held = []
        self.done.set()


def keep_replaced_outputs() -> None:
    """In torchrun: before torch's `DefaultLogsSpecs.reify` deletes the folder of the restart
    it is about to make (`attempt_<restart>`: a group that a membership change replaced, at the
    same restart count), move it aside to `attempt_<restart>.<n>`, so the node keeps that
    group's output."""
    torch_internals.patch(torch_internals.LOGS_REIFY, _keeping_replaced)


def _keeping_replaced(stock):
    """torch's `DefaultLogsSpecs.reify` (`stock`) that first moves a replaced group's folder aside."""

    def reify(self, envs):
        run_dir = torch_internals.run_log_dir(self)
        restart = envs[0].get(TORCHELASTIC_RESTART_COUNT) if envs and 0 in envs else None
        if run_dir and restart is not None:
            folder = os.path.join(run_dir, f"attempt_{restart}")
            n = 1
            while os.path.exists(f"{folder}.{n}"):
                n += 1
            try:
                os.rename(folder, f"{folder}.{n}")
            except FileNotFoundError:
                pass  # the first group of this restart
            except OSError as exc:
                log.warning("could not keep the output of the group replaced (%s): torch deletes it", exc)
        return stock(self, envs)

    return reify
