"""A small HTTP client of the control plane's REST API (v1), used by the CLI, tests and benchmarks.

Errors come back as `ApiError` subclasses whose message says what happened and what to
do, so a caller can print `str(exc)` as it is. Retries are limited to requests that are
safe to repeat: reads, and a submit that carries an `Idempotency-Key` (the server answers
a repeated key with the first job). A refused connection is never retried: there is no
server, and saying so at once is more useful than waiting. A 429 (the control plane is
shedding user load; it did nothing with the request) is retried for any request, after the
`Retry-After` it asks for, for at most `BUSY_WAIT_S` in all.

`server` may name several control planes (`http://a:8000,http://b:8000`): any of them
serves, so a request that cannot connect to one (never sent: safe for any request) goes to
the next at once, and a request safe to repeat goes on to the next after a 502/503/504 or a
lost connection too. The client sticks to the last one that answered (`worker.http.Servers`,
the node side's list, shared).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from worker.env import FTRAIN_SERVER, FTRAIN_TOKEN
from worker.http import RETRYABLE_STATUS, TOO_MANY_REQUESTS, Servers, retry_after_s
from worker.protocol import LOG_FOLLOW_MAX_WAIT_S, REVISION_HEADER

DEFAULT_SERVER = "http://127.0.0.1:8000"
DEFAULT_DATA_DIR = ".ftrain"
RETRY_ATTEMPTS = 3
MAX_RETRY_DELAY_S = 2.0
BUSY_WAIT_S = 30.0  # the most a request waits in all on 429s (each wait its Retry-After)
TERMINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


class ApiError(Exception):
    """A request to the control plane failed; `str()` is a message fit for a person."""

    retryable = False

    def __init__(self, message: str, status_code: int | None = None, body: Any = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.body = body


class ServerUnreachable(ApiError):
    pass


class Unauthorized(ApiError):
    pass


class NotFound(ApiError):
    pass


class Conflict(ApiError):
    pass


class InvalidRequest(ApiError):
    """422: `errors` is the server's list of {field, message, type}."""

    def __init__(self, message: str, errors: list[dict], body: Any = None):
        super().__init__(message, 422, body)
        self.errors = errors


class TooManyRequests(ApiError):
    """429: the control plane serves as many user requests as it can now (node traffic first)
    and kept refusing for `BUSY_WAIT_S`, each time asking to wait its `Retry-After`."""

    retryable = True


class ServiceUnavailable(ApiError):
    """503: the control plane is up but cannot serve now (etcd unreachable, contention)."""

    retryable = True

    def __init__(self, message: str, body: Any = None, retry_after_s: float = 1.0):
        super().__init__(message, 503, body)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Target:
    """Where the control plane is and how to authenticate, with where each came from."""

    server: str
    token: str | None
    server_source: str
    token_source: str


def resolve_target(server: str | None = None, token: str | None = None,
                   data_dir: str | os.PathLike | None = None, environ: dict | None = None) -> Target:
    """Flags first, then FTRAIN_SERVER / FTRAIN_TOKEN, then `<data-dir>/server` and
    `<data-dir>/token` (written by `ftrain up`), then the default local server. Without a
    --data-dir: `./.ftrain` if `ftrain up` ran here, else the one it last ran with
    (`local_cluster_dir`), so the CLI finds the local cluster from any directory."""
    env = os.environ if environ is None else environ
    base = Path(data_dir) if data_dir is not None else default_data_dir(env)
    server, server_source = _first_of(server, "--server", env, FTRAIN_SERVER, base / "server",
                                      (DEFAULT_SERVER, "default"))
    token, token_source = _first_of(token, "--token", env, FTRAIN_TOKEN, base / "token",
                                    (None, "none"))
    assert server is not None
    return Target(",".join(Servers(server).urls), token, server_source, token_source)


def local_cluster_record(environ: dict | None = None) -> Path:
    """The user's record of the data directory `ftrain up` last ran with:
    `$XDG_CONFIG_HOME/ftrain/local-cluster` (`~/.config/...` by default)."""
    env = os.environ if environ is None else environ
    config = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME") or Path.home()) / ".config")
    return config / "ftrain" / "local-cluster"


def remember_local_cluster(data_dir: Path, environ: dict | None = None) -> None:
    """Record `data_dir` (absolute) as the local cluster's for the user's CLI, readable by the
    user only. The record holds a path, never a token: the token stays in the 0700 data dir."""
    record = local_cluster_record(environ)
    record.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    temp = record.with_name(f".{record.name}.{os.getpid()}")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{data_dir.absolute()}\n")
    os.replace(temp, record)


def local_cluster_dir(environ: dict | None = None) -> Path | None:
    """The data directory `ftrain up` last ran with (`remember_local_cluster`), if recorded."""
    text = _read_file(local_cluster_record(environ))
    return Path(text) if text else None


def default_data_dir(environ: dict | None = None) -> Path:
    """`./.ftrain` where `ftrain up` ran in this directory, else the local cluster's recorded
    data directory, else `./.ftrain`."""
    here = Path(DEFAULT_DATA_DIR)
    if (here / "server").exists():
        return here
    recorded = local_cluster_dir(environ)
    return recorded if recorded is not None and (recorded / "server").exists() else here


def _first_of(flag: str | None, flag_name: str, env, env_name: str, path: Path,
              default: tuple[str | None, str]) -> tuple[str | None, str]:
    """The value and where it came from: the flag, the environment, the file, the default."""
    if flag:
        return flag, flag_name
    if env.get(env_name):
        return env[env_name], env_name
    if (saved := _read_file(path)) is not None:
        return saved, str(path)
    return default


def _read_file(path: Path) -> str | None:
    try:
        text = path.read_text().strip()
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None
    return text or None


def new_idempotency_key() -> str:
    return f"cli-{uuid.uuid4()}"


class FtrainClient:
    """The control plane's v1 API over one `httpx.Client` (use it as a context manager)."""

    def __init__(self, server: str = DEFAULT_SERVER, token: str | None = None, timeout_s: float = 10.0,
                 token_source: str | None = None, transport: httpx.BaseTransport | None = None):
        self._servers = Servers(server)  # one URL or several, comma-separated
        self.token_source = token_source
        headers = {"User-Agent": "ftrain-cli/1"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(headers=headers, timeout=timeout_s, transport=transport)
        # The highest X-Ftrain-Revision answered so far, sent with every request: a read is
        # never older than this client's own writes, whichever replica answers it.
        self.revision_seen: int | None = None

    @property
    def server(self) -> str:
        """The control plane requests go to now (the last that answered)."""
        return self._servers.current

    @classmethod
    def from_target(cls, target: Target, **kw) -> FtrainClient:
        return cls(target.server, target.token, token_source=target.token_source, **kw)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> FtrainClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # Jobs

    def submit(self, spec: dict, idempotency_key: str | None = None) -> dict:
        """Submit a job spec; with a key (the default makes one), a retry cannot create a second job."""
        key = idempotency_key or new_idempotency_key()
        return self._request("POST", "/v1/jobs", json=spec, headers={"Idempotency-Key": key},
                             safe_to_retry=True)

    def list_jobs(self, states: list[str] | None = None, page_size: int = 100) -> Iterator[dict]:
        """Every job (oldest first), following the server's pagination."""
        after: str | None = None
        while True:
            params: dict[str, Any] = {"limit": page_size}
            if states:
                params["state"] = states
            if after:
                params["after"] = after
            page = self._request("GET", "/v1/jobs", params=params)
            yield from page["items"]
            after = page.get("next")
            if not after:
                return

    def get_job(self, job_id: str) -> dict:
        return self._request("GET", f"/v1/jobs/{_segment(job_id)}")

    def cancel_job(self, job_id: str) -> dict:
        return self._request("POST", f"/v1/jobs/{_segment(job_id)}/cancel")

    def events(self, job_id: str) -> list[dict]:
        return self._request("GET", f"/v1/jobs/{_segment(job_id)}/events")["items"]

    def goodput(self, job_id: str) -> dict:
        """Where the job's wall time went: {"wall_s", "seconds": {cause: s}}."""
        return self._request("GET", f"/v1/jobs/{_segment(job_id)}/goodput")

    def logs(self, job_id: str, rank: int | None = None, since: int = 0, limit: int | None = None,
             tail: int | None = None) -> dict:
        """One page of the job's log: {"items": [{seq, time, node, rank, stream, line}],
        "next_seq", "end_seq", "first_seq", "cut_bytes", "cut_lines", "cap_bytes"}; with
        `tail`, its last `tail` lines (read from the end by the server)."""
        params: dict[str, Any] = {"since": since}
        if tail is not None:
            params["tail"] = tail
        if rank is not None:
            params["rank"] = rank
        if limit is not None:
            params["limit"] = limit
        return self._request("GET", f"/v1/jobs/{_segment(job_id)}/logs", params=params)

    def log_pages(self, job_id: str, rank: int | None = None, since: int = 0) -> Iterator[dict]:
        """Every page of the job's log as it is now, oldest first."""
        while True:
            page = self.logs(job_id, rank, since)
            yield page
            end = page.get("end_seq")
            if end is None or page["next_seq"] >= end or page["next_seq"] <= since:
                return
            since = page["next_seq"]

    def follow_logs(self, job_id: str, rank: int | None = None, since: int = 0) -> Iterator[dict]:
        """Log lines as they come (newline-delimited JSON) until the job has ended and the
        server has sent every line. A stream the server ended while the job goes on (no line
        for `wait_s`), or one that dropped, is followed again after the last line seen."""
        url = f"/v1/jobs/{_segment(job_id)}/logs"
        cursor, failures, over, busy_s = since, 0, False, 0.0
        while True:
            params: dict[str, Any] = {"follow": "true", "since": cursor, "wait_s": LOG_FOLLOW_MAX_WAIT_S}
            if rank is not None:
                params["rank"] = rank
            try:
                server = self.server
                with self._http.stream("GET", server + url, params=params,
                                       timeout=httpx.Timeout(10.0, read=None)) as resp:
                    if resp.status_code >= 400:
                        resp.read()
                        if resp.status_code == TOO_MANY_REQUESTS:
                            busy_s = self._wait_if_busy(resp, busy_s)
                            continue
                        raise self._error(resp)
                    busy_s = 0.0
                    for raw in resp.iter_lines():
                        if raw.strip():
                            item = json.loads(raw)
                            cursor = max(cursor, int(item.get("seq", cursor - 1)) + 1)
                            failures = 0
                            yield item
                if over:  # this stream began after the job had ended: it sent every line
                    return
                over = self.get_job(job_id)["state"] in TERMINAL_STATES
            except httpx.ConnectError as exc:
                self._servers.failed(server)
                failures += 1
                if failures >= len(self._servers):
                    raise self._transport_error(exc) from exc
            except httpx.TransportError as exc:
                self._servers.failed(server)
                failures += 1
                if failures >= RETRY_ATTEMPTS:
                    raise self._transport_error(exc) from exc
                time.sleep(min(0.2 * failures, MAX_RETRY_DELAY_S))

    # Nodes

    def nodes(self) -> list[dict]:
        return self._request("GET", "/v1/nodes")["items"]

    def drain(self, name: str) -> dict:
        return self._request("POST", f"/v1/nodes/{_segment(name)}/drain")

    def undrain(self, name: str) -> dict:
        return self._request("POST", f"/v1/nodes/{_segment(name)}/undrain")

    # Users

    def add_user(self, name: str, team: str | None = None) -> dict:
        return self._request("POST", "/v1/users", json={"name": name, **({"team": team} if team else {})})

    def users(self) -> list[dict]:
        return self._request("GET", "/v1/users")["items"]

    def remove_user(self, name: str) -> None:
        self._request("DELETE", f"/v1/users/{_segment(name)}")

    def whoami(self) -> dict:
        return self._request("GET", "/v1/users/me")

    # Teams and quotas, the queue

    def set_quota(self, *, user: str | None = None, team: str | None = None, **quota: int | None) -> dict:
        """PATCH a user's (or a team's) quota: the fields given (None clears one)."""
        path = f"/v1/users/{_segment(user)}" if user is not None else f"/v1/teams/{_segment(team)}"
        return self._request("PATCH", path, safe_to_retry=True, json=quota)

    def teams(self) -> list[dict]:
        return self._request("GET", "/v1/teams")["items"]

    def queue(self, limit: int = 100) -> list[dict]:
        return self._request("GET", "/v1/queue", params={"limit": limit})["items"]

    # Plumbing

    def _request(self, method: str, path: str, safe_to_retry: bool | None = None, **kw) -> Any:
        if safe_to_retry is None:
            safe_to_retry = method == "GET"
        attempts = RETRY_ATTEMPTS if safe_to_retry else 1
        others = len(self._servers) - 1  # replicas still to ask at once, before any sleep
        busy_s = 0.0  # waited so far on 429s (they spend no attempt)
        attempt = 0
        answered = False  # a replica answered (a 503, say) while another refuses connections
        while attempt < attempts:
            attempt += 1
            server = self.server
            if self.revision_seen is not None:
                kw["headers"] = {**kw.get("headers", {}), REVISION_HEADER: str(self.revision_seen)}
            try:
                resp = self._http.request(method, server + path, **kw)
            except httpx.ConnectError as exc:
                # Never sent: any request may go to another replica, none is repeated here.
                self._servers.failed(server)
                if others > 0:
                    others, attempt = others - 1, attempt - 1
                    continue
                if answered and attempt < attempts:  # back to the one that answered, later
                    time.sleep(min(0.2 * attempt, MAX_RETRY_DELAY_S))
                    continue
                raise self._transport_error(exc) from exc
            except httpx.TransportError as exc:
                # The request may or may not have arrived; repeating it is safe only here.
                if safe_to_retry:
                    self._servers.failed(server)
                    if others > 0:
                        others, attempt = others - 1, attempt - 1
                        continue
                if attempt < attempts:
                    time.sleep(min(0.2 * attempt, MAX_RETRY_DELAY_S))
                    continue
                raise self._transport_error(exc) from exc
            self._saw(resp)
            answered = True
            if resp.status_code < 400:
                return resp.json() if resp.content else None
            if resp.status_code == TOO_MANY_REQUESTS:
                busy_s = self._wait_if_busy(resp, busy_s)
                attempt -= 1
                continue
            if safe_to_retry and resp.status_code in RETRYABLE_STATUS:
                self._servers.failed(server)
                if others > 0:
                    others, attempt = others - 1, attempt - 1
                    continue
            error = self._error(resp)
            if error.retryable and attempt < attempts:
                time.sleep(min(getattr(error, "retry_after_s", 1.0), MAX_RETRY_DELAY_S))
                continue
            raise error
        raise AssertionError("unreachable")

    def _wait_if_busy(self, resp: httpx.Response, busy_s: float) -> float:
        """After a 429: sleep its Retry-After (and a little more, so that clients told the same
        do not all come back at once); the time waited on 429s so far, `busy_s` included.
        TooManyRequests when that would pass `BUSY_WAIT_S`."""
        wait_s = retry_after_s(resp) * random.uniform(1.0, 1.2)
        if busy_s + wait_s > BUSY_WAIT_S:
            raise self._error(resp, busy_s)
        time.sleep(wait_s)
        return busy_s + wait_s

    def _saw(self, resp: httpx.Response) -> None:
        value = resp.headers.get(REVISION_HEADER, "")
        if value.isdigit():
            self.revision_seen = max(self.revision_seen or 0, int(value))

    def _transport_error(self, exc: httpx.TransportError) -> ApiError:
        if isinstance(exc, httpx.ConnectError):
            where = ", ".join(self._servers.urls)
            return ServerUnreachable(f"no ftrain control plane at {where}; start one with "
                                     "`make up` (or pass --server / set FTRAIN_SERVER)")
        if isinstance(exc, httpx.TimeoutException):
            return ServerUnreachable(f"the control plane at {self.server} did not answer in time "
                                     f"({type(exc).__name__}); is it overloaded or stuck?")
        return ServerUnreachable(f"lost the connection to {self.server}: {exc!r}")

    def _error(self, resp: httpx.Response, busy_s: float = 0.0) -> ApiError:
        try:
            body = resp.json()
        except ValueError:
            body = None
        detail = body.get("detail") if isinstance(body, dict) else None
        if not isinstance(detail, str):
            detail = resp.text.strip()[:500] or resp.reason_phrase
        code = resp.status_code
        if code == 401:
            source = f" (the token came from {self.token_source})" if self.token_source else ""
            return Unauthorized(
                f"401 from {self.server}: {detail}{source}. Use the user token: the one `ftrain up` "
                "wrote to <data-dir>/token (pass --token or set FTRAIN_TOKEN), or the server's "
                "FTRAIN_USER_TOKEN.", code, body)
        if code == 403:
            return Unauthorized(f"403 from {self.server}: {detail}. This command needs the user "
                                "token, not the node token.", code, body)
        if code == 404:
            return NotFound(detail, code, body)
        if code == 409:
            return Conflict(detail, code, body)
        if code == 422:
            errors = body.get("errors", []) if isinstance(body, dict) else []
            if not isinstance(errors, list):
                errors = []
            lines = [f"  {e.get('field', '?')}: {e.get('message', '')}" for e in errors]
            message = "the server rejected the request:\n" + "\n".join(lines) if lines else detail
            return InvalidRequest(message, errors, body)
        if code == 429:
            return TooManyRequests(f"the control plane at {self.server} is too busy to serve this "
                                   f"now ({detail}); it kept refusing for {busy_s:.0f} s of waits. "
                                   "Try again later, or send fewer requests at once.", code, body)
        if code == 503:
            reason = body.get("reason", detail) if isinstance(body, dict) else detail
            return ServiceUnavailable(f"the control plane at {self.server} cannot serve now: {reason}",
                                      body, retry_after_s(resp))
        return ApiError(f"{code} from {self.server}: {detail}", code, body)


def _segment(value: str) -> str:
    """A path segment, percent-encoded so an odd id cannot change the path."""
    from urllib.parse import quote

    return quote(str(value), safe="")
