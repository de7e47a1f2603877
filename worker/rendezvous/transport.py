"""HTTP calls to one rendezvous on the control plane (`/v1/rdzv/{rdzv_id}`).

Failures. A refused connection, a reset, a timeout, a 502/503/504 (etcd briefly away, the
control plane restarting) are retried with the retry policy of `worker.http` (capped
exponential backoff and jitter) until `retry_timeout` (or a blocking read's own deadline),
so restarting the control plane while a job trains costs nothing: the agent's periodic
`num_nodes_waiting()` and heartbeats just take longer. A 410 (this attempt is over) is
never retried: `RendezvousGoneError`. Other 4xx are bugs or bad tokens: `RendezvousError`
with the server's reason. Retrying is safe: `set_state` is a compare-and-set (a lost answer
to a write that applied makes the retry report "lost" with the current state, which torch
handles by re-deciding), `add`/`append` carry an op id the server uses to apply them once.

Timeouts, chosen on purpose: connect 2 s (loopback/LAN; a dead control plane fails fast
and is retried), write 5 s, read = the long-poll wait + 5 s. HTTP connections are kept
alive, idle ones dropped after 2 s (`worker.http` says why). A caller that has an answer
of its own for "no answer" (the agent's monitor, the keep-alive; see `outage.py`) asks
`briefly()`: one try with a short read timeout instead of `retry_timeout`.

Outages. The transport notes when its requests began to fail and, at the first answer
after that, the outage that just ended (`last_outage`): the rendezvous state read then
has keep-alives that no node could write meanwhile (`outage.py` says what is done).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from torch.distributed.elastic.rendezvous.api import RendezvousClosedError, RendezvousError

from ..env import FTRAIN_JOB_TOKEN
from ..http import ApiError, ControlPlaneClient, Timeout, Unreachable
from ..protocol import Timeouts

log = logging.getLogger(__name__)

TOKEN_ENV = FTRAIN_JOB_TOKEN
DEFAULT_PORT = 8000  # `ftrain serve`'s default
CONNECT_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 5.0
READ_MARGIN_S = 5.0
DEFAULT_RETRY_TIMEOUT_S = 60
BRIEF_READ_TIMEOUT_S = 2.0  # a `briefly` call's read timeout (beyond a long poll's wait)


class RendezvousGoneError(RendezvousClosedError):
    """The control plane closed this rendezvous: its job attempt is over. Do not retry."""


class ControlPlaneUnreachable(Exception):
    """No answer from the control plane before the deadline (retries exhausted)."""


@dataclass(frozen=True)
class Outage:
    """A time (wall clock, s) without answers: from the last answer before requests began to
    fail to the first answer after."""

    started: float
    ended: float


class Transport:
    """HTTP calls to one rendezvous on the control plane, with retries up to a deadline.

    `long_poll_s`: the longest the control plane holds one long poll (its
    `Timeouts.long_poll_s`, which the node agent passes in --rdzv-conf); a blocking call asks
    for at most this much at a time."""

    def __init__(self, endpoint: str, rdzv_id: str, token: str | None,
                 retry_timeout_s: float = DEFAULT_RETRY_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time,
                 long_poll_s: float = Timeouts().long_poll_s):
        if not rdzv_id:
            raise ValueError("the rendezvous id must be '<job id>-a<attempt>', not empty")
        # One control plane or several, comma-separated: any of them serves (worker/http.py).
        self.endpoints = [endpoint_url(e) for e in endpoint.split(",") if e.strip()] or [endpoint_url("")]
        self.rdzv_id = rdzv_id
        self.retry_timeout_s = retry_timeout_s
        self.long_poll_s = long_poll_s
        self._clock = clock
        self._wall = wall_clock
        self._client = ControlPlaneClient(self.endpoints, token, suffix=f"/v1/rdzv/{quote(rdzv_id, safe='')}",
                                          clock=clock, on_retry=self._retrying)
        self._brief = threading.local()  # this thread's (retry_s, read timeout) in `briefly`
        self._lock = threading.Lock()
        # While requests fail: the last moment (wall clock) the control plane was known to
        # answer (the outage began after it; the first failure is seen a timeout later).
        self.failing_since: float | None = None
        self.last_outage: Outage | None = None
        self._last_answer: float | None = None

    @property
    def base_url(self) -> str:
        """The control plane requests go to now (the last that answered)."""
        return self.endpoints[self._client.servers.urls.index(self._client.base_url)]

    def close(self) -> None:
        self._client.close()

    def deadline(self) -> float:
        """When a non-blocking call gives up retrying."""
        brief = getattr(self._brief, "value", None)
        return self._clock() + (self.retry_timeout_s if brief is None else brief[0])

    @contextlib.contextmanager
    def briefly(self, retry_s: float = 0.0, read_timeout_s: float = BRIEF_READ_TIMEOUT_S) -> Iterator[None]:
        """In this block, this thread's non-blocking calls retry for `retry_s` (not
        `retry_timeout`) and wait at most `read_timeout_s` for an answer."""
        self._brief.value = (retry_s, read_timeout_s)
        try:
            yield
        finally:
            self._brief.value = None

    def call(self, method: str, path: str, body: Any = None, *,
             deadline: float | None = None, wait_s: float = 0.0,
             params: dict | None = None) -> dict:
        """One request, retried on connection failures and 502/503/504 until `deadline`."""
        deadline = self.deadline() if deadline is None else deadline
        brief = getattr(self._brief, "value", None)
        read_s = wait_s + READ_MARGIN_S if brief is None else wait_s + brief[1]
        timeout = Timeout(connect=CONNECT_TIMEOUT_S, write=WRITE_TIMEOUT_S, read=read_s,
                          pool=CONNECT_TIMEOUT_S)
        try:
            result = self._client.call(method, path, body, retry_s=deadline - self._clock(),
                                       timeout=timeout, params=params)
        except Unreachable as exc:
            self._failed()
            raise ControlPlaneUnreachable(
                f"the control plane at {self.base_url} did not answer {method} {path} of "
                f"rendezvous {self.rdzv_id} after {exc.attempts} tries ({exc.problem}); is it "
                "running? Raise retry_timeout in --rdzv-conf to wait longer.") from exc
        except ApiError as exc:
            self._answered()  # an answer, if not the one asked for
            if exc.status == 410:
                raise RendezvousGoneError(f"rendezvous {self.rdzv_id} is closed: {exc.detail}") from exc
            hint = ""
            if exc.status in (401, 403):
                hint = f" (set {TOKEN_ENV} to the job's token; the node token is refused)"
            raise RendezvousError(f"the control plane refused a request of rendezvous "
                                  f"{self.rdzv_id}: HTTP {exc.status}: {exc.detail}{hint}") from exc
        self._answered()
        return {} if result is None else result

    def _retrying(self, method: str, path: str, problem: str) -> None:
        self._failed()
        log.info("rendezvous %s: %s %s failed (%s); retrying", self.rdzv_id, method, path, problem)

    def _failed(self) -> None:
        with self._lock:
            if self.failing_since is None:
                self.failing_since = self._last_answer or self._wall()

    def _answered(self) -> None:
        with self._lock:
            self._last_answer = self._wall()
            if self.failing_since is None:
                return
            self.last_outage = Outage(self.failing_since, self._last_answer)
            self.failing_since = None
        outage = self.last_outage
        log.log(logging.WARNING if outage.ended - outage.started >= 1 else logging.INFO,
                "rendezvous %s: the control plane at %s answers again after %.1f s without",
                self.rdzv_id, self.base_url, outage.ended - outage.started)


def endpoint_url(endpoint: str) -> str:
    """'cp:8000' or 'http://cp:8000/' -> 'http://cp:8000' (default port 8000)."""
    endpoint = endpoint.strip().rstrip("/")
    if not endpoint:
        raise ValueError("--rdzv-endpoint is empty; pass the control plane's URL, "
                         "e.g. http://127.0.0.1:8000")
    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    url = urlsplit(endpoint)
    if url.port is None and url.scheme == "http":
        endpoint = f"{endpoint}:{DEFAULT_PORT}"
    return endpoint
