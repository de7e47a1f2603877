"""Snapshot files: copy the training state off to host memory, write it atomically with a
checksum in a background thread, read it back verified.

A snapshot file is `torch.save` of one dict, written as

    <dir>/.step-<step>.pt.tmp-<pid>-<rand>  (same directory, so the rename is atomic)
    fsync(file); rename -> <dir>/step-<step:012d>.pt; fsync(dir)

and its checksum ("sha256:<hex>") is computed while the bytes go out, so there is no
second read. A process killed mid-write leaves only a temporary file behind: the
committed snapshots are never opened for writing. `cleanup_temporaries` removes the
leftovers on the next start.

The save is split so the training loop stalls as little as possible: `HostStaging`
copies every tensor off (GPU -> pinned host memory, or a copy on CPU, since training
mutates the parameters in place) into buffers kept from the previous snapshot, on the
training thread -- that copy is the *stall* -- and `AsyncWriter` writes and commits the
copy in a thread, one save in flight at a time.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import pickle
import secrets
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .http import CommitUnavailable  # noqa: F401 (a commit's error, raised by worker.links)

log = logging.getLogger(__name__)

CHECKSUM_ALGO = "sha256"
_TMP_MARK = ".pt.tmp-"
SHARDED_TMP_MARK = ".dcp.tmp-"  # worker/sharded.py's TMP_MARK


class SnapshotCorrupt(Exception):
    """A snapshot file is missing, truncated, or does not match its checksum."""


@dataclass(frozen=True)
class WrittenSnapshot:
    step: int
    path: str
    size: int
    checksum: str
    write_s: float
    shards: int | None = None  # a sharded snapshot (a directory, worker/sharded.py): the ranks that wrote it


class PendingSnapshot:
    """A snapshot whose writing someone else started (every rank's shards: worker/sharded.py);
    `AsyncWriter` completes it in its thread in place of `write_atomic`."""

    def complete(self, directory: Path, step: int) -> WrittenSnapshot:
        raise NotImplementedError


def snapshot_name(step: int) -> str:
    return f"step-{step:012d}.pt"


IO_THREADS = 16  # at most; no more than the cores


def over_chunks(size: int, chunk: int, fn: Callable[[int, int], Any]) -> list:
    """`fn(offset, length)` of each `chunk`-byte range of `size` bytes, in order, on up to
    IO_THREADS threads (no more than the cores or the ranges): reading a file of gigabytes
    into fresh memory, or hashing it, scales with cores (`os.pread` and hashlib let go of
    the GIL)."""
    spans = [(off, min(chunk, size - off)) for off in range(0, size, chunk)]
    workers = min(IO_THREADS, os.cpu_count() or 1, len(spans))
    if workers <= 1:
        return [fn(off, n) for off, n in spans]
    with ThreadPoolExecutor(workers, thread_name_prefix="ftrain-io") as pool:
        return list(pool.map(fn, *zip(*spans)))


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`obj` (dicts, lists and tuples of tensors and plain values) with `fn` of each tensor in
    its place, taken in order; the rest as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [map_tensors(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(map_tensors(v, fn) for v in obj)
    return obj  # ints, floats, strings, numpy RNG states (immutable enough: copied by pickle)


def to_host(obj: Any) -> Any:
    """A deep copy of `obj` whose tensors live in host memory and share nothing with it."""
    return map_tensors(obj, _host_copy)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()


class HostStaging:
    """Host buffers reused from one snapshot to the next, so the copy-off does not pay for
    fresh pages (on the 100M-parameter benchmark that halves the stall) and, from a GPU,
    copies into pinned memory.

    Keeps one host copy of the state alive between snapshots. Only call `copy` when the
    previous copy is no longer being written (`AsyncWriter.wait()` first).
    """

    def __init__(self) -> None:
        self._previous: Any = None

    def copy(self, obj: Any) -> Any:
        self._previous = self._copy(obj, self._previous)
        return self._previous

    def _copy(self, obj: Any, old: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            if (isinstance(old, torch.Tensor) and old.shape == t.shape and old.dtype == t.dtype
                    and old.layout == t.layout == torch.strided):
                return old.copy_(t, non_blocking=t.device.type == "cuda")
            if t.device.type == "cuda":
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                return buf.copy_(t, non_blocking=True)
            return to_host(t)
        if isinstance(obj, dict):
            old = old if isinstance(old, dict) else {}
            return {k: self._copy(v, old.get(k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            old = old if isinstance(old, type(obj)) and len(old) == len(obj) else [None] * len(obj)
            items = [self._copy(v, o) for v, o in zip(obj, old)]
            return items if isinstance(obj, list) else tuple(items)
        return obj


class _HashingWriter:
    """A write-only file object that hashes what passes through it."""

    def __init__(self, f):
        self._f = f
        self.digest = hashlib.new(CHECKSUM_ALGO)
        self.size = 0
        self.error: OSError | None = None  # torch.save may re-raise it as a RuntimeError

    def write(self, data) -> int:
        self.digest.update(data)
        self.size += len(data)
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(state: Any, directory: str | Path, step: int) -> WrittenSnapshot:
    """Write `state` as the snapshot of `step`: temp file, fsync, rename, fsync dir."""
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    final = directory / snapshot_name(step)
    tmp = directory / f".{snapshot_name(step)[:-3]}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    start = time.perf_counter()
    writer = None
    try:
        # The job's user alone reads its snapshots (the model, and a pickle that is loaded).
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            writer = _HashingWriter(f)
            torch.save(state, writer)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if writer is not None and writer.error is not None and not isinstance(exc, OSError):
            raise writer.error from exc  # the storage error, not torch's wrapping of it
        raise
    fsync_dir(directory)
    return WrittenSnapshot(step=step, path=str(final), size=writer.size,
                           checksum=f"{CHECKSUM_ALGO}:{writer.digest.hexdigest()}",
                           write_s=time.perf_counter() - start)


def file_checksum(path: str | Path) -> str:
    digest = hashlib.new(CHECKSUM_ALGO)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return f"{CHECKSUM_ALGO}:{digest.hexdigest()}"


def verify(path: str | Path, checksum: str, size: int | None = None) -> None:
    """Raise SnapshotCorrupt unless the file exists with this size and checksum."""
    try:
        actual_size = os.path.getsize(path)
        if size is not None and actual_size != size:
            raise SnapshotCorrupt(f"{path} is {actual_size} bytes, the commit said {size}")
        actual = file_checksum(path)
    except OSError as exc:
        raise SnapshotCorrupt(f"cannot read {path}: {exc}") from exc
    if actual != checksum:
        raise SnapshotCorrupt(f"{path} has checksum {actual}, the commit said {checksum}")


class SnapshotUnsafe(Exception):
    """A snapshot holds objects that torch's weights-only loading refuses (they could run code)."""


def _numpy_rng_globals() -> list:
    """What numpy's RNG state (`np.random.get_state()`: a tuple holding an array) needs of numpy
    to be loaded weights-only; nothing without numpy."""
    try:
        import numpy as np
    except ImportError:
        return []
    try:
        multiarray = importlib.import_module("numpy._core.multiarray")
    except ImportError:  # numpy before 2
        multiarray = importlib.import_module("numpy.core.multiarray")
    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load(path: str | Path) -> dict:
    """Load a snapshot written by `write_atomic` onto the CPU with torch's weights-only
    unpickler: tensors, containers, numbers, strings and numpy's RNG state load; anything
    else, which a pickle could turn into code, is refused (`SnapshotUnsafe`)."""
    with torch.serialization.safe_globals(_numpy_rng_globals()):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[-1][:300]
            raise SnapshotUnsafe(
                f"snapshot {path} holds objects that weights-only loading refuses ({first}); keep "
                "the state_dict()s given to restore() to tensors, numbers, strings, lists and dicts, "
                "or allow their classes with torch.serialization.add_safe_globals([...]) before "
                "restore()") from exc


def in_directory(path: str | Path, directory: str | Path) -> bool:
    """Whether `path` is a file directly in `directory`, links followed (a committed path that
    is not in the job's own snapshot directory is never loaded: every rank would run it)."""
    p = Path(path)
    return p.name not in ("", ".", "..") and p.parent.resolve() == Path(directory).resolve()


def cleanup_temporaries(directory: str | Path) -> list[Path]:
    """Remove the temporary files of writes that never finished (a killed writer)."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for p in directory.iterdir():
        if p.name.startswith(".step-") and _TMP_MARK in p.name:
            p.unlink(missing_ok=True)
            removed.append(p)
        elif p.name.startswith(".step-") and SHARDED_TMP_MARK in p.name:  # every rank's, a directory
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


def delete_files(paths: list[str], directory: str | Path | None = None) -> None:
    """Delete pruned snapshot files; a file already gone is fine."""
    for path in paths:
        p = Path(path)
        if directory is not None and not p.is_absolute():
            p = Path(directory) / p
        try:
            if p.is_dir() and not p.is_symlink():  # a sharded snapshot (worker/sharded.py)
                shutil.rmtree(p)
            else:
                p.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:  # pruning is housekeeping: never stop training for it
            log.warning("could not delete pruned snapshot %s: %s", p, exc)


# commit(written, stall_s, control_id) -> paths to prune
CommitFn = Callable[[WrittenSnapshot, float, "int | None"], list[str]]
# hand_over([(written, stall_s, control_id), ...] newest first): someone who outlives this
# process takes those commits over (the node agent: worker/handoff.py); OSError if it cannot
HandOverFn = Callable[[list[tuple[WrittenSnapshot, float, "int | None"]]], object]


@dataclass
class _Uncommitted:
    written: WrittenSnapshot
    stall_s: float
    control_id: int | None
    since: float  # when it was written (clock of the writer)
    tries: int = 0


class AsyncWriter:
    """Writes host copies of the state in one background thread; commits them, in step
    order, in another; deletes what the commits prune.

    Writing. At most one write is in flight: `submit` waits for the previous *write* first
    (that wait is part of the stall it reports), never for a commit. A write the storage
    refuses (OSError: a full disk, a quota, an I/O error) costs that snapshot, not the
    training: it is logged, nothing is committed (the latest committed snapshot stays the
    latest), `failed_step` says which step was lost, and the next save tries again.

    Committing. A written snapshot is handed to the committer thread, which commits the
    newest waiting one first: it is the one a restart resumes from, and a planned change's
    snapshot must not wait behind a backlog that an outage left (the older ones land after
    it; the control plane's "latest" only moves forward). A commit that does not reach the control plane
    (`CommitUnavailable`: it is restarting, or it or its etcd is away) keeps its file and is
    tried again, with a pause growing from `RETRY_FIRST_S` to `RETRY_MAX_S`, for as long as
    it takes, while training goes on and later snapshots are written and queued behind it.
    At most `keep` snapshots wait: a newer one supersedes the oldest waiting one, whose file
    is deleted, as pruning would delete it once the `keep` newer ones are committed. A
    commit that is refused (`Fenced`: a newer attempt owns the job) or any other error is
    final: nothing more is committed, and it is raised on the training thread at the next
    `submit` or `wait`.

    `wait` (a blocking save) waits for the write and then, up to `commit_wait_s`, for the
    commits; if the control plane is still away then, it returns and the commits go on being
    tried in the background while the process lives. `finish` (the end of training) waits
    the same, and then hands the commits still waiting to `hand_over` (the node agent, which
    outlives the process, makes them and reports the group's end after them:
    worker/handoff.py) and stops committing; without one (the local twin, a plain torchrun)
    they are tried until the process exits, and lost with it.
    """

    RETRY_FIRST_S = 0.5
    RETRY_MAX_S = 5.0

    def __init__(self, directory: str | Path, commit: CommitFn, keep: int = 3,
                 commit_wait_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 hand_over: HandOverFn | None = None):
        self.directory = Path(directory)
        self._commit = commit
        self._hand_over = hand_over
        self.handed_over: list[int] = []  # steps whose commits `finish` handed over
        self._handing_over = False  # `finish` is waiting, and hands over what is left (its log line)
        self.keep = max(1, keep)
        self.commit_wait_s = commit_wait_s
        self._clock = clock
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last: WrittenSnapshot | None = None  # the newest committed by this writer
        self.failed_step: int | None = None  # the last step whose write the storage refused
        self.failures = 0
        self.superseded: list[int] = []  # steps whose waiting commit a newer snapshot replaced
        self._changed = threading.Condition()
        # written, not yet committed, oldest first (committed newest first)
        self._waiting: list[_Uncommitted] = []
        self._in_flight: _Uncommitted | None = None
        self._committer: threading.Thread | None = None

    # ------------------------------------------------------------------ the training thread
    def wait_written(self) -> None:
        """Block until the write in flight (if any) is done, so its host copy may be reused."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise_error()

    def wait(self, commit_wait_s: float | None = None) -> bool:
        """Block until the write in flight is done and every commit has landed, waiting at
        most `commit_wait_s` (default `self.commit_wait_s`) for the commits; True if none is
        left waiting."""
        self.wait_written()
        limit = self.commit_wait_s if commit_wait_s is None else commit_wait_s
        deadline = self._clock() + limit
        with self._changed:
            while self._waiting and self._error is None and (left := deadline - self._clock()) > 0:
                self._changed.wait(left)
            waiting = [u.written.step for u in self._waiting]
        self._raise_error()
        if waiting:
            then = ("handed over to the node agent" if self._handing_over else
                    "the commits are tried in the background")
            log.warning("snapshot(s) of step(s) %s not committed yet: the control plane did not take "
                        "them within %g s; the files are kept and %s", ", ".join(map(str, waiting)),
                        limit, then)
        return not waiting

    def finish(self) -> bool:
        """The end of training: `wait`; then the commits still waiting go to `hand_over`, if
        there is one, and this writer commits no more. True if every commit landed here."""
        self._handing_over = self._hand_over is not None
        if self.wait() or self._hand_over is None:
            return not self.uncommitted()
        with self._changed:
            items, self._waiting = self._waiting, []
        if not items:  # they landed meanwhile
            return True
        try:
            self._hand_over([(u.written, u.stall_s, u.control_id) for u in reversed(items)])
        except OSError as exc:
            log.warning("snapshot commits of step(s) %s could not be handed over (%s); they are tried "
                        "until this process exits", ", ".join(str(u.written.step) for u in items), exc)
            with self._changed:
                self._waiting = items + self._waiting
                self._changed.notify_all()
            return False
        self.handed_over = [u.written.step for u in items]
        log.warning("snapshot commit(s) of step(s) %s handed over to the node agent: it makes them and "
                    "reports this group's end after them", ", ".join(map(str, self.handed_over)))
        return False

    def submit(self, host_state: Any, step: int, stall_s: float, control_id: int | None = None,
               blocking: bool = False) -> None:
        self.wait_written()
        self._thread = threading.Thread(target=self._run, args=(host_state, step, stall_s, control_id),
                                        name=f"snapshot-{step}", daemon=True)
        self._thread.start()
        if blocking:
            self.wait()

    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def uncommitted(self) -> list[int]:
        """Steps written and not committed yet (their commits are being tried), oldest first."""
        with self._changed:
            return [u.written.step for u in self._waiting]

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # ------------------------------------------------------------------ the writer thread
    def _run(self, host_state: Any, step: int, stall_s: float, control_id: int | None) -> None:
        try:
            if isinstance(host_state, PendingSnapshot):
                written = host_state.complete(self.directory, step)
            else:
                written = write_atomic(host_state, self.directory, step)
        except OSError as exc:
            self.failed_step, self.failures = step, self.failures + 1
            log.warning("snapshot of step %d not saved: %s; training goes on, the next save "
                        "tries again (the latest committed snapshot is unchanged)", step, exc)
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc
            return
        self.failed_step = None
        self._queue(_Uncommitted(written, stall_s, control_id, self._clock()))

    def _queue(self, item: _Uncommitted) -> None:
        dropped: list[_Uncommitted] = []
        with self._changed:
            self._waiting.append(item)
            while len(self._waiting) > self.keep:
                # the oldest that is not being committed right now (that one may land)
                i = next(i for i, u in enumerate(self._waiting) if u is not self._in_flight)
                dropped.append(self._waiting.pop(i))
            if self._committer is None:
                self._committer = threading.Thread(target=self._commit_loop, name="snapshot-commits",
                                                   daemon=True)
                self._committer.start()
            self._changed.notify_all()
        for old in dropped:
            self.superseded.append(old.written.step)
            log.warning("snapshot of step %d superseded before its commit landed (%d newer ones "
                        "wait); its file is deleted, as pruning would", old.written.step, self.keep)
            delete_files([old.written.path], self.directory)

    # ------------------------------------------------------------------ the committer thread
    def _commit_loop(self) -> None:
        pause = self.RETRY_FIRST_S
        while True:
            with self._changed:
                while not self._waiting:
                    self._changed.wait()
                # The newest first: it is the one a restart resumes from, and a planned
                # change's snapshot must not wait behind a backlog left by an outage.
                item = self._in_flight = self._waiting[-1]
            item.tries += 1
            try:
                prune = self._commit(item.written, item.stall_s, item.control_id)
            except CommitUnavailable as exc:
                if item.tries == 1:
                    log.warning("snapshot of step %d written, its commit did not reach the control "
                                "plane (%s); the file is kept, training goes on, and the commit is "
                                "tried again in the background", item.written.step, exc)
                with self._changed:
                    self._in_flight = None
                    self._changed.wait(pause)  # a new snapshot queued wakes it: try at once
                pause = min(pause * 2, self.RETRY_MAX_S)
                continue
            except BaseException as exc:  # noqa: BLE001 - final: handed to the training thread
                with self._changed:
                    self._error = exc
                    self._waiting.clear()
                    self._in_flight = None
                    self._committer = None
                    self._changed.notify_all()
                return
            pause = self.RETRY_FIRST_S
            delete_files(prune, self.directory)
            if item.tries > 1:
                log.warning("snapshot of step %d committed after %d tries, %.1f s after it was written",
                            item.written.step, item.tries, self._clock() - item.since)
            with self._changed:
                self._waiting = [u for u in self._waiting if u is not item]
                self._in_flight = None
                if self.last is None or item.written.step >= self.last.step:
                    self.last = item.written
                self._changed.notify_all()
