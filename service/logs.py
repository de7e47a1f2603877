"""Worker log lines of a job, in files under the log root (never in etcd).

Layout: `<root>/<job id>/` holds the job's log as one stream of newline-delimited JSON
records (`LogRecord` below), split into segment files named by where they start:
`<byte offset>-<line number>.ndjson`. A line's `seq` is its byte offset in that stream:
stable, never reused, and a reader resumes from it exactly (`?since=` the last page's
`next_seq`). The offset is counted from the job's first byte, so it survives the cut.

Several control-plane replicas may append to one job (a node fails over between them), so
the directory may be shared (NFS or similar). One shipment is one append, made under an
exclusive lock of the job (`.lock`, a POSIX lock, which NFS honours across machines, plus a
thread lock, since a POSIX lock does not exclude threads of one process): the writer looks
up the newest segment, appends, starts a new segment when that one has reached a
segment's size, and deletes the oldest segments once the job holds more than `cap_bytes`.
So the newest bytes are kept, and what was cut is known from the oldest segment's name:
its offset is the bytes cut, its line number the lines cut. A write torn by a crash is
closed with a newline by the next writer; a reader skips a record it cannot parse.

Readers take no lock: they list the segments, read whole lines up to the last newline
(a line being appended is left for the next read), and list again if a segment they want
was deleted under them. Every read is bounded: a page scans at most `PAGE_SCAN_BYTES`, the
tail for `last_lines` at most `TAIL_MAX_BYTES`, a tail page (`read_tail`, `?tail=N`, read
from the end in growing blocks) at most `TAIL_PAGE_MAX_BYTES`; nothing loads a whole log.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from service.errors import LogStorageUnavailable
from service.models import LogLine, LogPage
from worker.protocol import LogShipment

log = logging.getLogger(__name__)

SEGMENTS_PER_CAP = 8  # a job's log is cut a segment at a time: 1/8 of the cap
PAGE_LIMIT = 1000  # lines a page holds unless the reader asks for fewer (or more)
PAGE_MAX_LINES = 10_000
PAGE_SCAN_BYTES = 4 * 1024 * 1024  # a page (filtered by rank) reads at most this much log
TAIL_FIRST_BYTES = 64 * 1024
TAIL_MAX_BYTES = 1024 * 1024
TAIL_PAGE_MAX_BYTES = 8 * 1024 * 1024  # `GET /logs?tail=N` looks at most this far back
_T = TypeVar("_T")
_READ_TRIES = 5  # a reader lists the segments again when the cap deleted one under it
_LOCKS = 64  # thread locks, shared by the jobs whose ids hash alike
_FILE_MODE = 0o600  # the log files: the control plane's user alone reads them
_SEGMENT = re.compile(r"^(\d{16})-(\d{12})\.ndjson$")


@dataclass(frozen=True)
class Segment:
    start: int  # the byte offset of its first byte in the job's stream
    line: int  # how many lines of the job came before it
    path: Path
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


def segment_name(start: int, line: int) -> str:
    return f"{start:016d}-{line:012d}.ndjson"


class LogStore:
    """Append, page through, tail and delete the worker logs of jobs, one folder per job."""

    def __init__(self, root: str | Path, cap_bytes: int):
        self.root = Path(root).absolute()
        self.cap_bytes = cap_bytes
        self.segment_bytes = max(1, cap_bytes // SEGMENTS_PER_CAP)
        self._locks = [threading.Lock() for _ in range(_LOCKS)]

    # ------------------------------------------------------------------ the async surface
    async def ship(self, job_id: str, shipment: LogShipment) -> None:
        """Append one shipment of lines to the job's log (one write), then apply the cap."""
        if not shipment.lines:
            return
        data = b"".join(
            _encode({"time": x.time, "node": shipment.node, "attempt": shipment.attempt,
                     "rank": x.rank, "stream": x.stream, "line": x.line})
            for x in shipment.lines)
        await self._io("store log lines of", job_id, self._append, job_id, data)

    async def read_page(self, job_id: str, since: int = 0, limit: int = PAGE_LIMIT,
                        rank: int | None = None) -> LogPage:
        """Up to `limit` lines with seq >= `since` (of one rank, if given), oldest first.

        A page may hold fewer lines while more are stored (a rank filter that skipped many
        lines): `next_seq < end_seq` says there is more to read now.
        """
        return await self._io("read the log of", job_id, self._read, job_id, since, limit, rank)

    async def read_tail(self, job_id: str, n: int, rank: int | None = None) -> LogPage:
        """The last `n` lines (of one rank, if given), oldest first, read from the end: at most
        the last `TAIL_PAGE_MAX_BYTES` of the log are looked at, however long it is. The
        page's `next_seq` is where the lines read end (follow on from it)."""
        return await self._io("read the log of", job_id, self._read_tail, job_id, n, rank)

    async def last_lines(self, job_id: str, n: int) -> list[str]:
        """The last `n` worker lines of a job, as text (for failure reasons); reads the tail only.

        Best effort: a log root that cannot be read costs the quote, never the caller's
        request (a rendezvous round report must not fail for it).
        """
        try:
            return await self._io("read the log of", job_id, self._tail, job_id, n)
        except LogStorageUnavailable as exc:
            log.warning("%s", exc)
            return [f"(the job's last lines could not be read: {exc.__cause__})"]

    async def delete(self, job_id: str) -> None:
        """Remove every file of the job's log (retention of a finished job)."""
        await self._io("delete the log of", job_id, self._delete, job_id)

    async def _io(self, what: str, job_id: str, fn, *args):
        try:
            return await asyncio.to_thread(fn, *args)
        except OSError as exc:
            # The server's own paths go to its log, not to the client: the answer names the
            # failure and who can fix it.
            log.warning("could not %s job %s under the log root %s: %s", what, job_id, self.root, exc)
            reason = exc.strerror or str(exc)  # strerror: without the file's name
            raise LogStorageUnavailable(
                f"could not {what} job {job_id}: the control plane's log storage failed ({reason}); "
                "try again, and if it lasts ask its operator to check the log root (FTRAIN_LOG_ROOT, "
                "`ftrain serve --log-root`: exists, writable, has space)") from exc

    # ------------------------------------------------------------------ files
    def _dir(self, job_id: str) -> Path:
        if not job_id or "/" in job_id or "\0" in job_id or job_id in (".", ".."):
            raise ValueError(f"not a job id: {job_id!r}")
        return self.root / job_id

    def _segments(self, job_id: str) -> list[Segment]:
        """The job's segments, oldest first (none if it has no log)."""
        out = []
        try:
            entries = list(os.scandir(self._dir(job_id)))
        except FileNotFoundError:
            return []
        for entry in entries:
            m = _SEGMENT.match(entry.name)
            if m is None:
                continue
            try:
                size = entry.stat().st_size
            except FileNotFoundError:  # cut meanwhile
                continue
            out.append(Segment(int(m.group(1)), int(m.group(2)), Path(entry.path), size))
        return sorted(out, key=lambda s: s.start)

    @contextlib.contextmanager
    def _locked(self, job_id: str) -> Iterator[Path]:
        """The job's folder, held exclusively (threads of this process, and other processes)."""
        folder = self._dir(job_id)
        # Workers' output is for the control plane to serve, to whom the API lets see it:
        # not for every local user (folders 0700, files 0600, whatever the umask).
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        with self._locks[zlib.crc32(job_id.encode()) % _LOCKS]:
            fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, _FILE_MODE)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX)
                yield folder
            finally:
                os.close(fd)  # releases the lock

    def _append(self, job_id: str, data: bytes) -> None:
        with self._locked(job_id) as folder:
            segments = self._segments(job_id)
            last = segments[-1] if segments else Segment(0, 0, folder / segment_name(0, 0), 0)
            fd = os.open(last.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, _FILE_MODE)
            try:
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    data = b"\n" + data  # close a line that a crashed writer left open
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                size += len(data)
            finally:
                os.close(fd)
            if size >= self.segment_bytes:
                start, line = last.start + size, last.line + _count_lines(last.path)
                os.close(os.open(folder / segment_name(start, line), os.O_WRONLY | os.O_CREAT, _FILE_MODE))
                segments = self._segments(job_id)
            end = segments[-1].end if segments else size
            for old in segments[:-1]:  # the newest segment stays, whatever its size
                if end - old.start <= self.cap_bytes:
                    break
                old.path.unlink(missing_ok=True)

    def _listed(self, job_id: str, read: Callable[[list[Segment]], _T]) -> _T:
        """`read` over the job's segments, listed again if the cap deleted one under the read."""
        for _ in range(_READ_TRIES):
            segments = self._segments(job_id)
            try:
                return read(segments)
            except FileNotFoundError:
                continue  # the cap deleted a segment we were about to read: list again
        raise FileNotFoundError(f"the log of job {job_id} kept changing under the reader")

    def _read(self, job_id: str, since: int, limit: int, rank: int | None) -> LogPage:
        return self._listed(job_id, lambda segments: self._read_segments(segments, since, limit, rank))

    def _read_segments(self, segments: list[Segment], since: int, limit: int,
                       rank: int | None) -> LogPage:
        first = segments[0] if segments else Segment(0, 0, Path(), 0)
        end = segments[-1].end if segments else 0
        if since >= end:  # nothing there yet: no file is opened (nor sought past its end)
            return LogPage(items=[], next_seq=since, end_seq=end, first_seq=first.start,
                           cut_bytes=first.start, cut_lines=first.line, cap_bytes=self.cap_bytes)
        cursor = max(since, first.start)
        items: list[LogLine] = []
        scanned = 0
        for i, seg in enumerate(segments):
            if len(items) >= limit or scanned >= PAGE_SCAN_BYTES:
                break
            is_last = i == len(segments) - 1
            # Where the next segment starts is final; this one's listed size may be stale.
            if not is_last and segments[i + 1].start <= cursor:
                continue
            with open(seg.path, "rb") as f:
                pos = cursor - seg.start
                if pos > 0:
                    f.seek(pos - 1)
                    if f.read(1) != b"\n":  # `since` fell inside a line: start at the next one
                        rest = f.readline()
                        if not rest.endswith(b"\n") and is_last:
                            break
                        pos += len(rest)
                        cursor = seg.start + pos
                while len(items) < limit and scanned < PAGE_SCAN_BYTES:
                    raw = f.readline()
                    if not raw or (not raw.endswith(b"\n") and is_last):
                        break  # the end, or a line still being written
                    seq = seg.start + pos
                    pos += len(raw)
                    scanned += len(raw)
                    cursor = seg.start + pos
                    line = _decode(seq, raw)
                    if line is not None and (rank is None or line.rank == rank):
                        items.append(line)
        return LogPage(items=items, next_seq=cursor, end_seq=max(end, cursor), first_seq=first.start,
                       cut_bytes=first.start, cut_lines=first.line, cap_bytes=self.cap_bytes)

    def _last(self, job_id: str, want: int) -> tuple[list[Segment], bytes, bool]:
        """The job's segments and up to `want` bytes from the end of its log (whether that is
        all of it), read again if the cap deleted a segment under the read."""
        return self._listed(job_id, lambda segments: (segments, *_last_bytes(segments, want)))

    def _read_tail(self, job_id: str, n: int, rank: int | None) -> LogPage:
        want = TAIL_FIRST_BYTES
        while True:
            segments, data, complete = self._last(job_id, want)
            end = segments[-1].end if segments else 0
            start = end - len(data)  # the stream's offset of data[0]
            whole = data[:data.rfind(b"\n") + 1]  # a line still being written is left out
            pos = start
            if not complete:  # the first line may have begun before what was read
                skip = whole.find(b"\n") + 1
                whole, pos = whole[skip:], pos + skip
            lines: list[LogLine] = []
            for raw in whole.splitlines(keepends=True):
                line = _decode(pos, raw)
                pos += len(raw)
                if line is not None and (rank is None or line.rank == rank):
                    lines.append(line)
            if len(lines) >= n or complete or want >= TAIL_PAGE_MAX_BYTES:
                first = segments[0] if segments else Segment(0, 0, Path(), 0)
                next_seq = start + len(data[:data.rfind(b"\n") + 1])
                return LogPage(items=lines[len(lines) - n:] if n else [], next_seq=next_seq,
                               end_seq=max(end, next_seq), first_seq=first.start,
                               cut_bytes=first.start, cut_lines=first.line, cap_bytes=self.cap_bytes)
            want = min(want * 4, TAIL_PAGE_MAX_BYTES)

    def _tail(self, job_id: str, n: int) -> list[str]:
        want = TAIL_FIRST_BYTES
        while True:
            segments, data, complete = self._last(job_id, want)
            raws = data.split(b"\n")[:-1]  # the last piece is empty or still being written
            if not complete:
                raws = raws[1:]  # the first may have begun before what was read
            lines = [x for x in (_decode(0, r + b"\n") for r in raws) if x is not None and x.rank is not None]
            if len(lines) >= n or complete or want >= TAIL_MAX_BYTES:
                # stderr marked: a failure's one-line reason prefers its last stderr line
                return [f"[rank{x.rank}{' stderr' if x.stream == 'stderr' else ''}] {x.line}"
                        for x in lines[-n:]] if n > 0 else []
            want *= 4

    def _delete(self, job_id: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(self._dir(job_id))


def _encode(record: dict) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


def _decode(seq: int, raw: bytes) -> LogLine | None:
    try:
        record = json.loads(raw)
        return LogLine(seq=seq, time=record["time"], node=record["node"], rank=record["rank"],
                       stream=record["stream"], line=record["line"], attempt=record.get("attempt", 0))
    except (ValueError, KeyError, TypeError):
        return None  # a record torn by a crash


def _count_lines(path: Path) -> int:
    count = 0
    with open(path, "rb") as f:
        while block := f.read(1024 * 1024):
            count += block.count(b"\n")
    return count


def _last_bytes(segments: list[Segment], want: int) -> tuple[bytes, bool]:
    """The last `want` bytes of the stream, and whether that is all of it that is kept."""
    pieces: list[bytes] = []
    got = 0
    for seg in reversed(segments):
        take = min(seg.size, want - got)
        if take <= 0:
            break
        with open(seg.path, "rb") as f:
            f.seek(seg.size - take)
            pieces.append(f.read(take))
        got += take
    complete = not segments or got >= segments[-1].end - segments[0].start
    return b"".join(reversed(pieces)), complete
