"""How a node agent reads a worker group's output and ships it: torchrun's own files and each
worker's (found as torch makes them, worker/output.py), one line at a time, masked
(`mask_secrets`), kept for the failure's reason (`WorkerGroup.tails`), and shipped; torchrun's
own shutdown lines held once its shutdown begins and, for a group the agent stopped or whose
rendezvous the control plane closed, shipped as one line (`shutdown_summary`). A worker's line
that says its group lost a peer is reported to the control plane at once, once a round."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .links import ServiceLink, report_broken_peer
from .log_shipper import LogShipper
from .output import POLL_S, QUIET_S, LineReader, WorkerDir, WorkerDirs
from .protocol import LogLineIn, cut_line, says_peer_gone

if TYPE_CHECKING:
    from .torchrun import WorkerGroup

# Lines read from one worker's file before the next file's turn (one reader follows them all).
LINES_PER_TURN = 200

MASK = "***"
MIN_MASKED_CHARS = 4  # a shorter value ("1", "on") would mask half of every line: left as is


def secrets_to_mask(secret_env: dict[str, str], job_token: str | None = None) -> tuple[str, ...]:
    """The values to mask in a job's output, longest first (one may contain another): its
    secret env values and its token (whoever holds it commits the job's snapshots). Output is
    shipped line by line, so a multi-line value (a PEM key) is masked line by line, each line
    without the blanks around it."""
    values = {line.strip() for v in (*secret_env.values(), job_token or "") for line in v.splitlines()}
    return tuple(sorted({v for v in values if len(v) >= MIN_MASKED_CHARS}, key=lambda v: (-len(v), v)))


def mask_secrets(line: str, secrets: tuple[str, ...]) -> str:
    """`line` with every secret value replaced by MASK, before it is shipped or reported."""
    for value in secrets:
        line = line.replace(value, MASK)
    return line


TRACEBACK = "Traceback (most recent call last):"
# What torchrun raises when ftrain's control plane closed the attempt's rendezvous (a new
# attempt, the job ended): its own exit, never the job's failure.
_CLOSED_BY_FTRAIN = ("RendezvousGoneError", "RendezvousClosedError")


def starts_shutdown(line: str) -> bool:
    """A line of torchrun's own that begins its exit: a traceback of its own, or word that the
    control plane closed its rendezvous (its keep-alive's warning comes before the agent's stop)."""
    return line.startswith(TRACEBACK) or any(w in line for w in _CLOSED_BY_FTRAIN)


def shutdown_summary(held: list[str], stop_requested: bool, attempt: int, node: str) -> str | None:
    """The one line that stands for torchrun's `held` shutdown lines, or None when they are
    the job's to read: torchrun failed by itself (not stopped by the agent, its rendezvous
    not closed by the control plane)."""
    if not held:
        return None
    if not stop_requested and not any(w in x for x in held for w in _CLOSED_BY_FTRAIN):
        return None
    return f"ftrain: attempt {attempt}'s torchrun on {node} shut down ({len(held)} lines of its own hidden)"


@dataclass
class _Followed:
    """A worker's file that `GroupOutput._follow_workers` reads."""

    dir: WorkerDir
    stream: str
    reader: LineReader
    rank: int
    round: int | None
    last_data: float  # monotonic: when bytes were last read from it
    finished: bool = False


class GroupOutput:
    """Follows a group's output until its torchrun has exited, and ships it (see the module
    docstring)."""

    def __init__(self, node: str, server: str, shipper: LogShipper):
        self.node = node
        self.server = server
        self.shipper = shipper

    def follow(self, g: WorkerGroup, dirs: WorkerDirs) -> None:
        """Start the threads that follow `g`'s output until its torchrun has exited: one per
        file of torchrun's own, one that finds the workers' files (`dirs`), one that reads them."""
        targets = [(self._follow_torchrun, (g, stream, path), f"out-{stream}")
                   for stream, path in g.outputs.items()]
        targets += [(self._watch_workers, (g, dirs), "out-dirs"),
                    (self._follow_workers, (g, dirs), "out-workers")]
        for target, args, name in targets:
            t = threading.Thread(target=target, args=args, daemon=True, name=name)
            t.start()
            g.threads.append(t)

    def _follow_torchrun(self, g: WorkerGroup, stream: str, path: Path) -> None:
        """Follow one of torchrun's own output files, line by line, until torchrun has exited."""
        with open(path, "rb") as f:
            reader = LineReader(f)
            while True:
                final = g.proc.poll() is not None  # then what it wrote is all there: read to the end
                raw = reader.next_line(final)
                if raw is None:
                    if final:
                        return
                    time.sleep(POLL_S)
                    continue
                self._take(g, None, None, stream, raw)

    @staticmethod
    def _watch_workers(g: WorkerGroup, dirs: WorkerDirs) -> None:
        """Find the workers' folders and files as torchrun makes them (never waiting for the
        shipper: worker/output.py says why), until torchrun has exited."""
        try:
            while True:
                final = g.proc.poll() is not None
                dirs.scan(final)
                if final:
                    return
                time.sleep(POLL_S)
        finally:
            dirs.close()

    def _follow_workers(self, g: WorkerGroup, dirs: WorkerDirs) -> None:
        """Read every worker's files that `_watch_workers` found, in turns, until each is final
        (torchrun has exited, or its group was replaced and it has been quiet for QUIET_S)."""
        followed: list[_Followed] = []
        try:
            while True:
                done = dirs.done.is_set()  # first: then every file was handed out, and is final
                while not dirs.ready.empty():
                    followed += self._followers(g, dirs.ready.get())
                now, read = time.monotonic(), False
                for fo in followed:
                    final = done or (fo.dir.replaced and now - fo.last_data >= QUIET_S)
                    before = fo.reader.bytes_read
                    for _ in range(LINES_PER_TURN):
                        raw = fo.reader.next_line(final)
                        if raw is None:
                            fo.finished = final
                            break
                        self._take(g, fo.rank, fo.round, fo.stream, raw)
                    if fo.reader.bytes_read != before:
                        fo.last_data, read = now, True
                for fo in [fo for fo in followed if fo.finished]:
                    fo.reader.f.close()
                    followed.remove(fo)
                if done and not followed and dirs.ready.empty():
                    return
                if not read:
                    time.sleep(POLL_S)
        finally:
            for fo in followed:
                fo.reader.f.close()

    @staticmethod
    def _followers(g: WorkerGroup, d: WorkerDir) -> list[_Followed]:
        who = d.who()
        for stream in d.files:
            g.worker_files[(d.local_rank, stream)] = (d.path / f"{stream}.log", who.rank)
        return [_Followed(d, stream, LineReader(f), who.rank, who.round, time.monotonic())
                for stream, f in d.files.items()]

    def _take(self, g: WorkerGroup, rank: int | None, round_: int | None, stream: str, raw: bytes) -> None:
        """One whole line of a worker (`rank`, of the group that rendezvous round `round_`
        formed) or of torchrun (rank None): masked, kept for the failure reason, shipped
        (torchrun's own held once its shutdown has begun)."""
        line = mask_secrets(raw.decode("utf-8", errors="replace"), g.secrets)
        if rank is not None and round_ not in g.peer_reported and says_peer_gone(line):
            self._report_broken_peer(g, round_, line)
        if not g.tails_final:
            g.tails[rank].append(line)
        out = LogLineIn(rank=rank, stream=stream, line=cut_line(line), time=time.time(),
                        round=round_ if rank is not None else None)
        if rank is None and (g.holding or g.stop_requested or starts_shutdown(line)):
            g.holding = True
            g.held.append(out)
            return
        self.shipper.add(g.job_id, g.attempt, out, wait_for_room=True)  # (the files keep them)

    def _report_broken_peer(self, g: WorkerGroup, round_: int | None, line: str) -> None:
        """A worker printed that its process group lost a peer: tell the control plane now,
        from a thread (a node whose agent's connection dropped is then lost at once,
        service/presence.py). The runtime's workers report it themselves; a plain script's
        worker does not, and spends seconds in the interpreter's teardown after the traceback
        before torchrun re-forms the group and the control plane hears of it. Once per
        rendezvous round (`round_`): a group that torchrun re-formed may break again."""
        g.peer_reported.add(round_)
        if g.stop_requested or not g.job_token:
            return
        link = ServiceLink(self.server, g.job_id, g.job_token, g.attempt, timeout_s=5.0)
        report_broken_peer(link, self.node, f"worker output: {line}", close=True)

    def release_held(self, g: WorkerGroup) -> None:
        """torchrun has exited: ship its held lines, or the one line that stands for them."""
        held, g.held, g.released = g.held, [], True
        summary = shutdown_summary([x.line for x in held], g.stop_requested, g.attempt, self.node)
        if summary is None:
            for x in held:
                self.shipper.add(g.job_id, g.attempt, x)
        else:
            self.shipper.add(g.job_id, g.attempt, LogLineIn(
                rank=None, stream="stderr", line=summary, time=held[-1].time))
