"""Worker output on its way to the control plane: batched, shipped in the background, and
never dropped without a trace.

The node agent follows torchrun's output files and hands each line to a `LogShipper`
(cut to `MAX_LINE_CHARS` with a visible mark first). Every half second the shipper posts
what it holds, oldest first, in shipments of at most `MAX_SHIPMENT_BYTES` of JSON, so a
burst never meets the control plane's body limit; a control plane configured with a
smaller one answers 413, and the shipper halves its shipments and tries again.

What the control plane does not take stays queued: no answer, a 5xx (etcd or the log root
away) or a timeout keeps the lines for the next try. The queue of a job attempt is bounded
(`MAX_PENDING_LINES`, `MAX_PENDING_BYTES`): past it the *oldest* lines go, and the next
shipment starts with a line that says how many went ("ftrain: N lines dropped on node X
while the control plane was away"). While the control plane answers, a full queue drops
nothing: the agent's readers of torchrun's output files wait for room (`add`'s
`wait_for_room`; the output is on the node's disk meanwhile), so a script that prints faster
than the lines can be shipped loses none (a burst of 200,000 lines lost 60% of them before).
A 4xx is the control plane's answer: 404 (the job no
longer exists) drops the job's queue, another 4xx the shipment; either is logged.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .env import FTRAIN_LOG_QUEUE_LINES
from .http import ControlPlaneClient, HttpError
from .node_link import node_forgotten
from .protocol import MAX_SHIPMENT_BYTES, MAX_SHIPMENT_LINES, LogLineIn, LogShipment

log = logging.getLogger("ftrain.agent")

SHIP_EVERY_S = 0.5
MAX_PENDING_LINES = int(os.environ.get(FTRAIN_LOG_QUEUE_LINES) or 50_000)  # per job attempt
MAX_PENDING_BYTES = 32 * 1024 * 1024  # per job attempt, as JSON
MIN_SHIPMENT_BYTES = 1024  # 413s halve shipments down to this (one line goes alone anyway)
AWAY = "while the control plane was away"
TOO_LARGE = "the control plane refused them as too large (HTTP 413)"


def json_size(line: LogLineIn) -> int:
    """The line's size in a shipment's JSON as `worker.http` sends it (httpx: UTF-8, compact)."""
    return len(json.dumps(line.model_dump(mode="json"), ensure_ascii=False,
                          separators=(",", ":")).encode()) + 1


@dataclass
class _Queue:
    """The lines of one job attempt not yet taken by the control plane, oldest first."""

    lines: collections.deque[tuple[int, LogLineIn]] = field(default_factory=collections.deque)
    nbytes: int = 0
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)  # why -> lines

    def push(self, size: int, line: LogLineIn) -> None:
        self.lines.append((size, line))
        self.nbytes += size
        self.trim()

    def push_front(self, batch: list[tuple[int, LogLineIn]]) -> None:
        self.lines.extendleft(reversed(batch))
        self.nbytes += sum(size for size, _ in batch)
        self.trim()

    def full(self, size: int) -> bool:
        """Whether a line of `size` bytes would make it drop its oldest."""
        return len(self.lines) >= MAX_PENDING_LINES or self.nbytes + size > MAX_PENDING_BYTES

    def trim(self) -> None:
        while len(self.lines) > MAX_PENDING_LINES or self.nbytes > MAX_PENDING_BYTES:
            size, _ = self.lines.popleft()
            self.nbytes -= size
            self.dropped[AWAY] += 1

    def take(self, max_bytes: int, max_lines: int) -> list[tuple[int, LogLineIn]]:
        """The oldest lines that fit one shipment (at least one)."""
        batch: list[tuple[int, LogLineIn]] = []
        total = 0
        while self.lines and len(batch) < max_lines:
            size = self.lines[0][0]
            if batch and total + size > max_bytes:
                break
            batch.append(self.lines.popleft())
            total += size
            self.nbytes -= size
        return batch


class LogShipper:
    """Batches worker lines and ships them to the control plane in the background."""

    def __init__(self, client: ControlPlaneClient, node: str, *, start: bool = True,
                 clock: Callable[[], float] = time.time):
        self._client = client
        self._node = node
        self._clock = clock
        self.max_shipment_bytes = MAX_SHIPMENT_BYTES
        self._lock = threading.Lock()  # the queues
        self._flushing = threading.Lock()  # one flush at a time keeps the lines in order
        self._queues: dict[tuple[str, int], _Queue] = {}
        self._room = threading.Condition(self._lock)  # notified when a queue has room again
        self._answering = True  # the last shipment was answered (the control plane is there)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
        if start:
            self._thread.start()

    def add(self, job_id: str, attempt: int, line: LogLineIn, *, wait_for_room: bool = False) -> None:
        """Queue one line of a job attempt's output. `wait_for_room`: while the control plane
        answers, wait until the attempt's queue has room rather than drop its oldest line
        (for a reader whose lines stay on disk meanwhile; never the agent's own loop)."""
        size = json_size(line)
        with self._lock:
            while wait_for_room and self._answering and not self._stop.is_set():
                q = self._queues.get((job_id, attempt))
                if q is None or not q.full(size):
                    break
                self._room.wait(SHIP_EVERY_S)
            self._queues.setdefault((job_id, attempt), _Queue()).push(size, line)

    @property
    def answering(self) -> bool:
        """Whether the last shipment was answered (True until one was not)."""
        return self._answering

    def pending_of(self, job_id: str, attempt: int) -> int:
        """Lines of one job attempt queued now."""
        with self._lock:
            q = self._queues.get((job_id, attempt))
            return 0 if q is None else len(q.lines)

    def pending(self) -> int:
        """Lines queued now (all jobs)."""
        with self._lock:
            return sum(len(q.lines) for q in self._queues.values())

    def flush(self) -> None:
        """Ship what is queued now; what the control plane did not take stays queued."""
        with self._flushing:
            with self._lock:  # what is queued now; lines that come meanwhile wait for the next flush
                queued = {key: len(q.lines) for key, q in self._queues.items()}
            for (job_id, attempt), n in queued.items():
                if not self._ship_queue(job_id, attempt, n):
                    return  # no answer: the other jobs' lines wait too

    def _ship_queue(self, job_id: str, attempt: int, budget: int) -> bool:
        """Ship about `budget` lines of one job attempt's queue; False when the control plane
        did not answer."""
        shipped = 0
        while True:
            with self._lock:
                q = self._queues.get((job_id, attempt))
                if q is None:
                    return True
                dropped, q.dropped = q.dropped, collections.Counter()
                markers = [self._marker(n, why) for why, n in dropped.items()]
                room = self.max_shipment_bytes - 200 - len(self._node) - sum(map(json_size, markers))
                batch = q.take(max(room, 1), MAX_SHIPMENT_LINES - len(markers)) if shipped < budget else []
                self._room.notify_all()
                if not batch and not markers:
                    if not q.lines:
                        del self._queues[(job_id, attempt)]
                    return True
            shipment = LogShipment(node=self._node, attempt=attempt,
                                   lines=markers + [line for _, line in batch])
            try:
                self._client.call("POST", f"/v1/jobs/{job_id}/logs", shipment)
                shipped += len(batch)
                self._answering = True
                continue
            except HttpError as exc:
                status = exc.status
                problem = str(exc)
                forgotten = node_forgotten(exc)
            # Not an answer, or one about the node and not the lines (its lease lapsed, e.g. in
            # an outage of the control plane: 404 "no node named"; its credential outdated:
            # 401; it registers again): keep everything for the next try. (A 404 about the node
            # taken for the job's dropped every line queued in an outage.)
            if status is None or status >= 500 or forgotten:
                self._put_back(job_id, attempt, batch, dropped)
                with self._lock:  # the readers waiting for room drop the oldest meanwhile
                    self._answering = False
                    self._room.notify_all()
                return False
            self._answering = True
            if status == 413 and len(batch) > 1 and self.max_shipment_bytes > MIN_SHIPMENT_BYTES:
                self.max_shipment_bytes = max(MIN_SHIPMENT_BYTES, self.max_shipment_bytes // 2)
                log.warning("the control plane refused a log shipment as too large; shipping at "
                            "most %d bytes at a time from now on", self.max_shipment_bytes)
                self._put_back(job_id, attempt, batch, dropped)
                continue
            if status == 413:  # as small as shipments go: these lines cannot be shipped
                shipped += len(batch)
                self._put_back(job_id, attempt, [], dropped + collections.Counter({TOO_LARGE: len(batch)}))
                log.warning("the control plane refused %d log line(s) of job %s as too large; "
                            "dropped (a marker line says so): %s", len(batch), job_id, problem)
                continue
            if status == 404:
                with self._lock:
                    q = self._queues.pop((job_id, attempt), None)
                left = len(q.lines) if q else 0
                log.warning("dropped %d log lines of job %s attempt %d: the control plane no longer "
                            "knows the job (%s)", len(batch) + left, job_id, attempt, problem)
                return True
            shipped += len(batch)
            log.warning("dropped %d log lines of job %s attempt %d: the control plane refused "
                        "them (%s)", len(batch), job_id, attempt, problem)

    def _put_back(self, job_id: str, attempt: int, batch: list[tuple[int, LogLineIn]],
                  dropped: collections.Counter[str]) -> None:
        with self._lock:
            q = self._queues.setdefault((job_id, attempt), _Queue())
            q.dropped.update(dropped)
            q.push_front(batch)

    def _marker(self, n: int, why: str) -> LogLineIn:
        return LogLineIn(rank=None, stream="stderr", time=self._clock(),
                         line=f"ftrain: {n} lines dropped on node {self._node} {why}")

    def _run(self) -> None:
        while not self._stop.wait(0 if self._backlog() else SHIP_EVERY_S):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the shipper must outlive any one bad shipment
                log.exception("shipping worker logs failed; trying again")

    def _backlog(self) -> bool:
        """A full shipment is queued already and the control plane answers: ship again at
        once (a flood that readers feed as room is made goes at the speed of the answers)."""
        with self._lock:
            return self._answering and any(
                len(q.lines) >= MAX_SHIPMENT_LINES or q.nbytes >= self.max_shipment_bytes
                for q in self._queues.values())

    def close(self) -> None:
        """Stop the background thread and ship what is left, once."""
        self._stop.set()
        with self._lock:
            self._room.notify_all()
        if self._thread.is_alive():
            self._thread.join(5)
        self.flush()
