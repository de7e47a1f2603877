"""The worker side's one HTTP client to the control plane, with its one retry policy.

Every request a node makes (the agent's registration, heartbeats and reports, its log
shipments, torchrun's rendezvous and round reports, a training worker's snapshot commits,
progress and control polls) goes through `ControlPlaneClient.call`; nothing else in
`worker/` opens a connection (tests/worker/test_http_seam.py checks it).

The policy. A refused connection, a reset, a timeout, a 502/503/504 (etcd briefly away,
the control plane restarting behind a proxy) and a 429 (too busy now: it asks to wait
`Retry-After` seconds, and is never waited on for less) are not answers: they are retried
with capped exponential backoff and jitter until the caller's retry budget (`retry_s`) is
spent, and then raised as `Unreachable`. A budget of 0 is a single try. Every other status of 400 or
more is the control plane's answer, raised at once as `ApiError` with the status and the
server's `detail`, so a caller tells "refused" (4xx: a bug, a bad token, a fenced attempt,
410 for an attempt that is over) from "no answer" (`Unreachable`) and from a server error
(5xx). Each caller chooses its budget and timeouts; the policy is the same for all.

Several control planes. `servers` is one URL or several (a list, or one string with commas:
`http://a:8000,http://b:8000`, as `--server` and `FTRAIN_SERVER` take them); every replica
serves every request, so a request that gets no answer from one (the same failures as
above) goes to the next at once, and only after every one has failed in turn does the
backoff sleep. The client sticks to the last one that answered (`Servers`), so a node
talks to one replica until it fails. A budget of 0 is one try at each.

Connections are kept alive (a heartbeat a second should not cost a TCP handshake), but an
idle one is dropped after `KEEPALIVE_EXPIRY_S`, before uvicorn's 5 s keep-alive closes it
from its side: reusing a connection that the server is closing at that moment is the
classic source of spurious "connection reset" errors. Environment proxies are ignored
(`trust_env=False`): node-to-control-plane traffic is loopback or LAN.
"""

from __future__ import annotations

import email.utils
import logging
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

# httpx imports httpcore at its first client; imported here, the fork server's preload covers
# it (otherwise each worker pays ~20 ms for it when its link is made).
import httpcore  # noqa: F401
import httpx

log = logging.getLogger("ftrain.http")

BACKOFF_FIRST_S = 0.1
BACKOFF_MAX_S = 2.0
RETRYABLE_STATUS = frozenset({502, 503, 504})
TOO_MANY_REQUESTS = 429  # the server refused before doing anything: any request may be repeated
KEEPALIVE_EXPIRY_S = 2.0
MAX_CONNECTIONS = 16
MAX_KEEPALIVE_CONNECTIONS = 4


# Callers give per-request timeouts as `Timeout(connect=..., read=..., write=..., pool=...)`
# without importing httpx themselves.
Timeout = httpx.Timeout


class CommitUnavailable(Exception):
    """A snapshot commit did not reach the control plane (no answer, or a server error): the
    file is whole and the commit is worth trying again later (`worker.snapshot`). Any other
    error of a commit is final. Here, not in worker/snapshot.py (which imports torch), so that
    the node agent, which reports through `worker.links`, starts without torch."""


class HttpError(Exception):
    """A request to the control plane did not get the answer it asked for."""

    status: int | None = None  # the HTTP status, where there was one


class ApiError(HttpError):
    """The control plane answered with an error status: a 4xx, or a 5xx that is not retried."""

    def __init__(self, method: str, url: str, status: int, detail: str):
        super().__init__(f"{method} {url}: HTTP {status}: {detail}")
        self.method, self.url, self.status, self.detail = method, url, status, detail


class Unreachable(HttpError):
    """No answer before the retry budget was spent (connection errors, 502/503/504, 429)."""

    def __init__(self, method: str, url: str, attempts: int, problem: str, status: int | None):
        super().__init__(f"{method} {url}: no answer after {attempts} tries ({problem})")
        self.method, self.url, self.attempts, self.problem = method, url, attempts, problem
        self.status = status  # the last 502/503/504/429, or None after a connection error


def server_urls(servers: str | Sequence[str]) -> list[str]:
    """'http://a:8000, http://b:8000/' (or a list) -> ['http://a:8000', 'http://b:8000']."""
    parts = servers.split(",") if isinstance(servers, str) else [p for s in servers for p in s.split(",")]
    urls = [p.strip().rstrip("/") for p in parts if p.strip()]
    if not urls:
        raise ValueError("no control plane URL given; pass one or several, comma-separated, "
                         "e.g. http://127.0.0.1:8000")
    return urls


class Servers:
    """The control planes' URLs (each with `suffix`), and the one in use: the last that
    answered. `failed(url)` moves on to the next, unless another thread already has."""

    def __init__(self, servers: str | Sequence[str], suffix: str = ""):
        self.urls = [u + suffix for u in server_urls(servers)]
        self._current = 0

    def __len__(self) -> int:
        return len(self.urls)

    @property
    def current(self) -> str:
        return self.urls[self._current]

    def failed(self, url: str) -> None:
        i = self._current
        if self.urls[i] == url:
            self._current = (i + 1) % len(self.urls)


def retry_after_s(response: httpx.Response, default_s: float = 1.0) -> float:
    """The wait a 429 or 503 asks for: its `Retry-After` in seconds or as an HTTP date
    (`default_s` without one, or with one that cannot be read)."""
    value = response.headers.get("Retry-After", "").strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return default_s
    return max(0.0, when.timestamp() - time.time())


def detail_of(response: httpx.Response) -> str:
    """The server's `detail` (FastAPI's error body), else the start of the body."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    return str(body.get("detail", response.text)) if isinstance(body, dict) else response.text[:500]


class ControlPlaneClient:
    """HTTP calls to the control plane(s) under `servers` (each URL followed by `suffix`),
    with the retry policy above."""

    def __init__(self, servers: str | Sequence[str], token: str | None = None, *,
                 suffix: str = "",
                 timeout: httpx.Timeout | float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_retry: Callable[[str, str, str], None] | None = None):
        """`on_retry(method, path, problem)` is told of each retry (default: a debug line)."""
        self.servers = Servers(servers, suffix.rstrip("/"))
        self._clock = clock
        self._on_retry = on_retry
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            headers=headers, timeout=timeout, trust_env=False,
            # A TLS context costs ~15 ms to build (the CA bundle is read), in every worker a
            # restart starts: build one only for a control plane that speaks https.
            verify=any(u.startswith("https://") for u in self.servers.urls),
            limits=httpx.Limits(max_connections=MAX_CONNECTIONS,
                                max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS,
                                keepalive_expiry=KEEPALIVE_EXPIRY_S))

    @property
    def base_url(self) -> str:
        """The URL (with the suffix) requests go to now."""
        return self.servers.current

    def set_token(self, token: str | None) -> None:
        """Send `token` as the bearer token from the next request on (None: no token)."""
        if token:
            self._client.headers["Authorization"] = f"Bearer {token}"
        else:
            self._client.headers.pop("Authorization", None)

    def close(self) -> None:
        self._client.close()

    def call(self, method: str, path: str, body: Any = None, *,
             retry_s: float = 0.0, timeout: httpx.Timeout | float | None = None,
             params: dict | None = None) -> Any:
        """One request, retried for `retry_s` seconds; the decoded JSON answer (None if empty).

        `body` is a dict or a pydantic model of `worker.protocol` (sent as its JSON dump).

        Raises:
            ApiError: the control plane answered 4xx other than 429, or a 5xx other than
                502/503/504.
            Unreachable: no answer (connection error, 502/503/504, 429) within `retry_s`.
            HttpError: another failure of the request (a redirect loop, a bad encoding).
        """
        if hasattr(body, "model_dump"):
            body = body.model_dump(mode="json")
        extra = {} if timeout is None else {"timeout": timeout}
        deadline = self._clock() + retry_s
        delay = BACKOFF_FIRST_S
        attempt = 0
        untried = len(self.servers)  # the replicas not yet tried since the last sleep
        while True:
            attempt += 1
            untried -= 1
            status = None
            wait_s = 0.0  # the least wait the server asked for (a 429's Retry-After)
            url = self.servers.current
            try:
                response = self._client.request(method, url + path, json=body, params=params, **extra)
            except httpx.TransportError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            except httpx.HTTPError as exc:
                raise HttpError(f"{method} {url}{path}: {type(exc).__name__}: {exc}") from exc
            else:
                status = response.status_code
                if status not in RETRYABLE_STATUS and status != TOO_MANY_REQUESTS:
                    return self._answer(method, url + path, response)
                problem = f"HTTP {status}: {detail_of(response)}"
                if status == TOO_MANY_REQUESTS:
                    wait_s = retry_after_s(response)
            self.servers.failed(url)
            if untried > 0:  # another replica to ask before any sleep
                log.info("%s %s%s failed (%s); trying %s", method, url, path, problem,
                         self.servers.current)
                continue
            remaining = deadline - self._clock()
            if remaining <= 0 or wait_s > remaining:  # (a 429 asking for more than is left)
                raise Unreachable(method, f"{url}{path}", attempt, problem, status)
            if self._on_retry is not None:
                self._on_retry(method, path, problem)
            else:
                log.debug("%s %s%s failed (%s); retrying", method, url, path, problem)
            time.sleep(min(remaining, max(wait_s, delay * random.uniform(0.5, 1.0))))
            delay = min(delay * 2, BACKOFF_MAX_S)
            untried = len(self.servers)

    def _answer(self, method: str, url: str, response: httpx.Response) -> Any:
        if response.status_code >= 400:
            raise ApiError(method, url, response.status_code, detail_of(response))
        if response.status_code == 204 or not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise HttpError(f"{method} {url}: the answer is not JSON: "
                            f"{response.text[:200]!r}") from exc
