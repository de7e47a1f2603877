"""Worker output on its way to the control plane: batched, shipped in the background.

The node agent follows torchrun's output files and hands each line to a `LogShipper`,
which posts them every half second, at most 1000 lines a request. A control plane that
does not answer (or answers 5xx, etcd away) costs nothing: the lines wait for the next
try, up to `MAX_PENDING_LINES` per job attempt, beyond which new lines are dropped rather
than memory grown. A 4xx is the control plane's answer: those lines are dropped.
"""

from __future__ import annotations

import collections
import threading

from worker.http import ControlPlaneClient, HttpError
from worker.protocol import LogLineIn, LogShipment

SHIP_EVERY_S = 0.5
LINES_PER_REQUEST = 1000
MAX_PENDING_LINES = 50_000


class LogShipper:
    """Batches worker lines and ships them to the control plane in the background."""

    def __init__(self, client: ControlPlaneClient, node: str):
        self._client = client
        self._node = node
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int], list[LogLineIn]] = collections.defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipper", daemon=True)
        self._thread.start()

    def add(self, job_id: str, attempt: int, line: LogLineIn) -> None:
        """Queue one line of a job attempt's output."""
        with self._lock:
            batch = self._pending[(job_id, attempt)]
            if len(batch) < MAX_PENDING_LINES:
                batch.append(line)

    def flush(self) -> None:
        """Ship what is queued now; what the control plane did not take stays queued."""
        with self._lock:
            pending, self._pending = self._pending, collections.defaultdict(list)
        for (job_id, attempt), lines in pending.items():
            for i in range(0, len(lines), LINES_PER_REQUEST):
                shipment = LogShipment(node=self._node, attempt=attempt,
                                       lines=lines[i:i + LINES_PER_REQUEST])
                try:
                    self._client.call("POST", f"/v1/jobs/{job_id}/logs", shipment)
                    lost = False
                except HttpError as exc:
                    lost = exc.status is None or exc.status >= 500
                if lost:
                    with self._lock:  # keep for the next try
                        self._pending[(job_id, attempt)][:0] = lines[i:]
                    break

    def _run(self) -> None:
        while not self._stop.wait(SHIP_EVERY_S):
            self.flush()

    def close(self) -> None:
        """Stop the background thread and ship what is left, once."""
        self._stop.set()
        self._thread.join(5)
        self.flush()
