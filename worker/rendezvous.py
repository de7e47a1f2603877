"""The "ftrain" rendezvous backend of `torchrun`: torch's own `DynamicRendezvousHandler` over
the control plane's HTTP API (`service.routes.rendezvous`).

    FTRAIN_JOB_TOKEN=<job or node token> TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --rdzv-backend=ftrain --rdzv-endpoint=http://cp:8000 --rdzv-id=<job id>-a<attempt> \\
             --rdzv-conf=last_call_timeout=1,keep_alive_interval=1 ...

`handler_creator` is the `torchrun.handlers` entry point named in pyproject.toml; torch's
registry calls it once and registers what it returns, `create_handler(params)`.

Two clients of the same HTTP transport:

- `FtrainRendezvousBackend`, torch's `RendezvousBackend` (get/set the pickled state with an
  etcd revision as fencing token);
- `HttpStore`, a `torch.distributed.Store` for the agents' small exchanges (master address,
  rank assignment, barriers). Workers never use it: with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
  rank 0's agent publishes a free port and the workers build their own TCPStore on it.

Failures. A refused connection, a reset, a timeout, a 502/503/504 (etcd briefly away, the
control plane restarting) are retried with the retry policy of `worker.http` (capped
exponential backoff and jitter) until `retry_timeout` (or a blocking read's own
deadline), so restarting the control plane while a
job trains costs nothing: the agent's periodic `num_nodes_waiting()` and heartbeats just take
longer. A 410 (this attempt is over) is never retried: `RendezvousGoneError`. Other 4xx are
bugs or bad tokens: `RendezvousError` with the server's reason.
Retrying is safe: `set_state` is a compare-and-set (a lost answer to a write that applied
makes the retry report "lost" with the current state, which torch handles by re-deciding),
`add`/`append` carry an op id the server uses to apply them once.

Timeouts and keep-alive, chosen on purpose:

- HTTP connections are kept alive, idle ones dropped after 2 s (`worker.http` says why).
- connect 2 s (loopback/LAN; a dead control plane fails fast and is retried), write 5 s,
  read = the long-poll wait + 5 s. A blocking `get` polls at most `LONG_POLL_S` = 5 s per
  request, so a lost connection is noticed within seconds, not at the store timeout.
- `read_timeout` (store timeout, like the c10d backend's) defaults to 60 s; torch's barriers
  set their own through `store.set_timeout`.
- The rendezvous keep-alive (`keep_alive_interval` × `keep_alive_max_attempt`, torch's 5 s × 3)
  and `last_call_timeout` (torch's 30 s) keep torch's defaults; pass them in --rdzv-conf.
  Measured here (DESIGN.md): last_call 1 s and keep-alive 1 s × 3 recover a lost node in
  about 5 s instead of 46 s, while 1 s × 2 split a job during a join. With `retry_timeout`
  longer than the keep-alive window, an agent that cannot reach the control plane is dropped
  by the others (they still can) rather than failing itself: that is the intended outcome.

Waking on a change. Stock torch polls: a node waiting for others (to join, to complete the
round) re-reads the state once a second (`_delay(seconds=1)` after each `_Action.SYNC`), and
its state holder serves a cached copy for a second after each read. A restart goes through
several such waits: they were most of the time from a worker's death to the next round.
`wake_on_change` turns that one delay into a long poll of the state
(`FtrainRendezvousBackend.wait_for_change`, answered by an etcd watch on the server) that
ends as soon as another node writes, and still after at most that second, so torch's timers
(keep-alive, last call, deadlines) are looked at at least as often as before; a wait that
ends expires the holder's cache, so the read after it is fresh. The cache itself stays: the
agent's monitor asks `num_nodes_waiting()` every --monitor-interval (0.2 s), which must not
become five reads a second per node.
dynamic_rendezvous's `_delay` is a module-level name, so the patch is process-wide; it
dispatches on a thread-local that the backend sets on each read or write, i.e. in the sync
that precedes the delay in the same thread, so each handler waits for its own state; a
thread with no such read pending (and every other delay, such as the random one before a
first join) gets torch's own `_delay`. Waits are at least `MIN_WAKE_INTERVAL_S` apart (N
nodes' heartbeats change the state N times a second), and a failed wait sleeps the rest of
the second. A torch whose handler lacks these internals keeps the stock polling (a warning
says so).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import torch
import torch.distributed as dist
from pydantic import BaseModel, ValidationError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    create_handler,
)

from worker.env import FTRAIN_JOB_TOKEN
from worker.http import ApiError, ControlPlaneClient, Timeout, Unreachable
from worker.protocol import (
    AddRequest,
    AddResult,
    AppendRequest,
    CompareSetRequest,
    DeleteRequest,
    DeleteResult,
    GetRequest,
    GetResult,
    NumKeysResult,
    RdzvState,
    SetRequest,
    SetStateRequest,
    SetStateResult,
    StateChange,
    StoreItem,
    ValueResult,
)

log = logging.getLogger(__name__)
Reply = TypeVar("Reply", bound=BaseModel)

TOKEN_ENV = FTRAIN_JOB_TOKEN
DEFAULT_PORT = 8000  # `ftrain serve`'s default
LONG_POLL_S = 5.0  # the server caps one blocking request at this too
CONNECT_TIMEOUT_S = 2.0
WRITE_TIMEOUT_S = 5.0
READ_MARGIN_S = 5.0
DEFAULT_READ_TIMEOUT_S = 60
DEFAULT_RETRY_TIMEOUT_S = 60
SYNC_DELAY_S = 1  # the delay torch's op executor takes after each _Action.SYNC
MIN_WAKE_INTERVAL_S = 0.05
NO_STATE_TOKEN = "0"  # the long poll's token for "no state yet"


class RendezvousGoneError(RendezvousClosedError):
    """The control plane closed this rendezvous: its job attempt is over. Do not retry."""


class ControlPlaneUnreachable(Exception):
    """No answer from the control plane before the deadline (retries exhausted)."""


class LongPollUnsupported(RendezvousError):
    """The control plane answers a state long poll as a plain read (it predates the long poll)."""


class Transport:
    """HTTP calls to one rendezvous on the control plane, with retries up to a deadline."""

    def __init__(self, endpoint: str, rdzv_id: str, token: str | None,
                 retry_timeout_s: float = DEFAULT_RETRY_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        if not rdzv_id:
            raise ValueError("the rendezvous id must be '<job id>-a<attempt>', not empty")
        self.base_url = endpoint_url(endpoint)
        self.rdzv_id = rdzv_id
        self.retry_timeout_s = retry_timeout_s
        self._clock = clock
        self._client = ControlPlaneClient(f"{self.base_url}/v1/rdzv/{quote(rdzv_id, safe='')}", token,
                                          clock=clock, on_retry=self._retrying)

    def close(self) -> None:
        self._client.close()

    def deadline(self) -> float:
        """When a non-blocking call gives up retrying."""
        return self._clock() + self.retry_timeout_s

    def call(self, method: str, path: str, body: Any = None, *,
             deadline: float | None = None, wait_s: float = 0.0,
             params: dict | None = None) -> dict:
        """One request, retried on connection failures and 502/503/504 until `deadline`."""
        deadline = self.deadline() if deadline is None else deadline
        timeout = Timeout(connect=CONNECT_TIMEOUT_S, write=WRITE_TIMEOUT_S,
                          read=wait_s + READ_MARGIN_S, pool=CONNECT_TIMEOUT_S)
        try:
            result = self._client.call(method, path, body, retry_s=deadline - self._clock(),
                                       timeout=timeout, params=params)
        except Unreachable as exc:
            raise ControlPlaneUnreachable(
                f"the control plane at {self.base_url} did not answer {method} {path} of "
                f"rendezvous {self.rdzv_id} after {exc.attempts} tries ({exc.problem}); is it "
                "running? Raise retry_timeout in --rdzv-conf to wait longer.") from exc
        except ApiError as exc:
            if exc.status == 410:
                raise RendezvousGoneError(f"rendezvous {self.rdzv_id} is closed: {exc.detail}") from exc
            hint = ""
            if exc.status in (401, 403):
                hint = f" (set {TOKEN_ENV} to the job token or the node token)"
            raise RendezvousError(f"the control plane refused a request of rendezvous "
                                  f"{self.rdzv_id}: HTTP {exc.status}: {exc.detail}{hint}") from exc
        return {} if result is None else result

    def _retrying(self, method: str, path: str, problem: str) -> None:
        log.info("rendezvous %s: %s %s failed (%s); retrying", self.rdzv_id, method, path, problem)


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


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):  # a std::vector<uint8_t> from C++
        return bytes(value)
    raise TypeError(f"store values are bytes or str, not {type(value).__name__}")


# Per thread: (backend, token) of the state this thread last read or wrote through a backend
# that wakes on change (`synced`), and a state a wait read for the next `get_state` of this
# thread (`prefetched`, (backend, decoded state)). See the module docstring.
_this_thread = threading.local()
_stock_delay: Callable[..., None] | None = None  # dynamic_rendezvous's own `_delay`
_patch_lock = threading.Lock()


class FtrainRendezvousBackend(RendezvousBackend):
    """torch's `RendezvousBackend` kept by the control plane (etcd compare-and-set)."""

    def __init__(self, transport: Transport):
        self._transport = transport
        self._seen_token: str | None = None  # of the last state read or written, any thread
        self._wakes_on_change = False  # set by `wake_on_change`
        self._expire_cache: Callable[[], None] = lambda: None  # ditto
        self._long_poll = True  # False once the control plane turned out not to have it
        self._last_wake = -MIN_WAKE_INTERVAL_S

    @property
    def name(self) -> str:
        return "ftrain"

    def get_state(self) -> tuple[bytes, Any] | None:
        prefetched = getattr(_this_thread, "prefetched", None)
        _this_thread.prefetched = None
        if prefetched is not None and prefetched[0] is self:
            decoded = prefetched[1]  # read by this thread's wait a moment ago
        else:
            decoded = self._decode(self._read(RdzvState, self._call("GET", "/state")))
        self._saw(None if decoded is None else decoded[1])
        return decoded

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        _this_thread.prefetched = None
        # A token that is not ours (torch only hands back what we gave it) cannot match.
        body = SetStateRequest(state=state, token=None if token is None else str(token))
        result = self._read(SetStateResult, self._call("PUT", "/state", body))
        decoded = self._decode(result)
        self._saw(None if decoded is None else decoded[1])
        if decoded is None:
            return None
        return decoded[0], decoded[1], result.written

    def wait_for_change(self, timeout_s: float, after: str | None = None) -> bool:
        """Wait until the state's token is no longer `after` (default: the last one this
        backend read or wrote) or `timeout_s` has passed; True if it changed.

        The state that came back is handed to this thread's next `get_state`, which then
        makes no request of its own.

        Raises:
            LongPollUnsupported: the control plane predates the long poll.
        """
        after = after if after is not None else (self._seen_token or NO_STATE_TOKEN)
        timeout_s = max(0.0, timeout_s)
        result = self._call("GET", "/state", params={"after": after, "wait_s": f"{timeout_s:.3f}"},
                            deadline=time.monotonic() + timeout_s, wait_s=timeout_s)
        if "changed" not in result:
            raise LongPollUnsupported(f"the control plane at {self._transport.base_url} has no "
                                      "long poll on the rendezvous state; upgrade it")
        change = self._read(StateChange, result)
        decoded = self._decode(change)
        _this_thread.prefetched = (self, decoded)
        return change.changed

    def wait_instead_of_poll(self, seconds: float, after: str | None) -> None:
        """What torch's `_delay(seconds=1)` after a SYNC does for a handler over this backend:
        return when the state changes, after at most `seconds`."""
        clock = time.monotonic
        start = clock()
        deadline = start + seconds
        pause = self._last_wake + MIN_WAKE_INTERVAL_S - start
        if pause > 0:
            time.sleep(pause)
        try:
            if self._long_poll:
                self.wait_for_change(deadline - clock(), after or NO_STATE_TOKEN)
                return
        except LongPollUnsupported as exc:
            self._long_poll = False
            log.warning("rendezvous %s: %s; re-reading the state once a second instead",
                        self._transport.rdzv_id, exc)
        except RendezvousGoneError:
            return  # the next read raises it at once
        except Exception as exc:  # never worse than torch's own poll
            log.info("rendezvous %s: waiting for a state change failed (%s: %s); re-reading "
                     "it in a second instead", self._transport.rdzv_id, type(exc).__name__, exc)
        finally:
            self._last_wake = clock()
            self._expire_cache()
        time.sleep(max(0.0, deadline - clock()))

    def _saw(self, token: Any) -> None:
        self._seen_token = None if token is None else str(token)
        if self._wakes_on_change:
            _this_thread.synced = (self, self._seen_token)

    def _call(self, method: str, path: str, body: Any = None, **kwargs) -> dict:
        try:
            return self._transport.call(method, path, body, **kwargs)
        except ControlPlaneUnreachable as exc:
            raise RendezvousConnectionError(str(exc)) from exc

    @staticmethod
    def _read(model: type[Reply], result: dict) -> Reply:
        try:
            return model.model_validate(result)
        except ValidationError as exc:
            raise RendezvousStateError("the control plane sent a corrupt rendezvous state") from exc

    @staticmethod
    def _decode(result: RdzvState) -> tuple[bytes, Any] | None:
        return None if result.state is None else (result.state, result.token)


class HttpStore(dist.Store):
    """A c10d `Store` kept by the control plane, for torch's agents (not for workers).

    Blocking reads long-poll the server `LONG_POLL_S` at a time until the store timeout,
    then raise `DistStoreError` as TCPStore does. Keep a reference to this object for as long
    as a `PrefixStore` wraps it: the C++ side does not keep the Python object alive.
    """

    def __init__(self, transport: Transport,
                 timeout: timedelta = timedelta(seconds=DEFAULT_READ_TIMEOUT_S)):
        super().__init__()
        self._transport = transport
        self.set_timeout(timeout)

    # -- writes --------------------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: Sequence[str], values: Sequence[Any]) -> None:
        if len(keys) != len(values):
            raise ValueError(f"multi_set got {len(keys)} keys and {len(values)} values")
        items = [StoreItem(key=k, value=_bytes(v)) for k, v in zip(keys, values)]
        self._call("POST", "/store/set", SetRequest(items=items))

    def add(self, key: str, amount: int) -> int:
        body = AddRequest(key=key, amount=int(amount), op_id=secrets.token_hex(12))
        return self._read(AddResult, self._call("POST", "/store/add", body)).value

    def append(self, key: str, value: Any) -> None:
        body = AppendRequest(key=key, value=_bytes(value), op_id=secrets.token_hex(12))
        self._call("POST", "/store/append", body)

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        body = CompareSetRequest(key=key, expected=_bytes(expected_value), desired=_bytes(desired_value))
        return self._read(ValueResult, self._call("POST", "/store/compare_set", body)).value

    def delete_key(self, key: str) -> bool:
        return self._read(DeleteResult, self._call("POST", "/store/delete", DeleteRequest(key=key))).deleted

    deleteKey = delete_key  # noqa: N815 - the name torch's C++ trampoline calls

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        return self._wait(list(keys), self.timeout, values=True)

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait(list(keys), self.timeout if timeout is None else timeout, values=False)

    def check(self, keys: Sequence[str]) -> bool:
        body = GetRequest(keys=list(keys), wait_s=0, values=False)
        return self._read(GetResult, self._call("POST", "/store/get", body)).found

    def num_keys(self) -> int:
        return self._read(NumKeysResult, self._call("GET", "/store/num_keys")).count

    getNumKeys = num_keys  # noqa: N815 - the name torch's C++ trampoline calls

    def has_extended_api(self) -> bool:
        return True  # append, multi_get and multi_set are real operations here

    # -- helpers -------------------------------------------------------------------------

    def _wait(self, keys: list[str], timeout: timedelta, values: bool) -> list[bytes]:
        if not keys:
            return []
        timeout_s = timeout.total_seconds()
        clock = time.monotonic
        deadline = clock() + timeout_s
        while True:
            wait_s = max(0.0, min(LONG_POLL_S, deadline - clock()))
            # A connection problem is retried until the read's own deadline: it is the
            # caller's timeout that decides how long to wait, not retry_timeout.
            body = GetRequest(keys=keys, wait_s=wait_s, values=values)
            result = self._read(GetResult, self._call("POST", "/store/get", body,
                                                      deadline=max(deadline, clock() + 1.0), wait_s=wait_s))
            if result.found:
                return result.values or []
            if clock() >= deadline:
                raise dist.DistStoreError(
                    f"wait timeout after {int(timeout_s * 1000)}ms, keys: {', '.join(keys)} "
                    f"(rendezvous {self._transport.rdzv_id} on {self._transport.base_url})")

    def _call(self, method: str, path: str, body: Any = None, **kwargs) -> dict:
        try:
            return self._transport.call(method, path, body, **kwargs)
        except ControlPlaneUnreachable as exc:
            raise dist.DistNetworkError(str(exc)) from exc

    @staticmethod
    def _read(model: type[Reply], result: dict) -> Reply:
        try:
            return model.model_validate(result)
        except ValidationError as exc:
            raise dist.DistStoreError(f"the control plane sent a malformed {model.__name__}: {exc}") from exc


def create_backend(params: RendezvousParameters) -> tuple[FtrainRendezvousBackend, HttpStore]:
    """The backend and the store of one agent, from torchrun's --rdzv-* options.

    --rdzv-conf keys read here (others go to torch's `create_handler`):
      read_timeout   the store's default timeout for blocking reads, s (60)
      retry_timeout  how long a request is retried while the control plane is away, s (60)
    """
    read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
    retry_timeout = params.get_as_int("retry_timeout", DEFAULT_RETRY_TIMEOUT_S)
    if not read_timeout or read_timeout <= 0:
        raise ValueError(f"read_timeout must be a positive number of seconds, not {read_timeout}")
    if not retry_timeout or retry_timeout <= 0:
        raise ValueError(f"retry_timeout must be a positive number of seconds, not {retry_timeout}")
    token = os.environ.get(TOKEN_ENV)
    if not token:
        log.warning("%s is not set: rendezvous requests go without a token and a control "
                    "plane with tokens will refuse them", TOKEN_ENV)
    transport = Transport(params.endpoint, params.run_id, token, retry_timeout_s=retry_timeout)
    store = HttpStore(transport, timeout=timedelta(seconds=read_timeout))
    return FtrainRendezvousBackend(transport), store


def create_ftrain_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler over the ftrain backend and store.

    --rdzv-conf keys of torch (defaults): join_timeout (600), last_call_timeout (30),
    close_timeout (30), heartbeat_timeout (5), keep_alive_interval (5),
    keep_alive_max_attempt (3); plus read_timeout and retry_timeout (see create_backend).
    """
    from worker.deathsig import act_on_first_death_signal
    from worker.rounds import with_round_reports

    act_on_first_death_signal()  # before torch's agent registers its handler
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    wake_on_change(handler, backend)
    return with_round_reports(handler)


def wake_on_change(handler: RendezvousHandler, backend: FtrainRendezvousBackend) -> bool:
    """Make `handler` (torch's, over `backend`) re-read the state as soon as another node
    changes it rather than once a second (module docstring); False: this torch's handler is
    not built as expected, and it keeps polling as stock torch does."""
    holder = getattr(handler, "_state_holder", None)
    executor = getattr(dynamic_rendezvous, "_DistributedRendezvousOpExecutor", None)
    run_code = getattr(getattr(executor, "run", None), "__code__", None)
    if not callable(getattr(dynamic_rendezvous, "_delay", None)) \
            or "_delay" not in getattr(run_code, "co_names", ()):
        problem = "its op executor does not call dynamic_rendezvous._delay"
    elif getattr(holder, "_backend", None) is not backend \
            or not isinstance(getattr(holder, "_last_sync_time", None), (int, float)):
        problem = "its state holder has no _backend and _last_sync_time"
    else:
        _patch_delay()
        # torch's state cache stays (the agent's monitor asks num_nodes_waiting() every
        # 0.2 s: that must not become five reads a second per node); a wait that ends
        # expires it, so the read after the wait is a fresh one.
        backend._expire_cache = lambda: setattr(holder, "_last_sync_time", -1)
        backend._wakes_on_change = True
        return True
    log.warning("rendezvous %s: torch %s's DynamicRendezvousHandler is not built as ftrain expects "
                "(%s); it re-reads the state once a second, as stock torch does",
                backend._transport.rdzv_id, torch.__version__, problem)
    return False


def _patch_delay() -> None:
    global _stock_delay
    with _patch_lock:
        if dynamic_rendezvous._delay is not _delay_or_wait_for_change:
            _stock_delay = dynamic_rendezvous._delay
            dynamic_rendezvous._delay = _delay_or_wait_for_change


def _delay_or_wait_for_change(seconds: float | tuple[float, float]) -> None:
    """dynamic_rendezvous's `_delay`: after a SYNC of a handler over a backend that wakes on
    change, wait for that handler's state to change; any other delay is torch's."""
    synced = getattr(_this_thread, "synced", None)
    _this_thread.synced = None
    if synced is None or isinstance(seconds, tuple) or seconds != SYNC_DELAY_S:
        assert _stock_delay is not None
        _stock_delay(seconds=seconds)
        return
    backend, token = synced
    backend.wait_instead_of_poll(seconds, token)


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torch registers what this returns under 'ftrain'."""
    return create_ftrain_handler
