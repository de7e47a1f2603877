"""The "ftrain" rendezvous backend of `torchrun`: torch's own `DynamicRendezvousHandler` over
the control plane's HTTP API (`service.routes.rendezvous`).

    FTRAIN_JOB_TOKEN=<the job token> TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --rdzv-backend=ftrain --rdzv-endpoint=http://cp:8000 --rdzv-id=<job id>-a<attempt> \\
             --rdzv-conf=last_call_timeout=1,keep_alive_interval=1 ...

(`--rdzv-endpoint` may list several control-plane replicas, comma-separated: any of them
serves, and a request that gets no answer from one goes to the next; see worker/http.py.)

`handler_creator` is the `torchrun.handlers` entry point named in pyproject.toml
(`worker.rendezvous:handler_creator`); torch's registry calls it once and registers what
it returns, `create_ftrain_handler(params)`.

The parts:

- `transport.py`: HTTP calls to one rendezvous, their deadlines, retries and errors;
- `backend.py`: `FtrainRendezvousBackend`, torch's `RendezvousBackend` (get/set the pickled
  state with an etcd revision as fencing token, and a long poll of it);
- `store.py`: `HttpStore`, a `torch.distributed.Store` for the agents' small exchanges;
- `wake.py`: the patch of torch's one-second poll into a wait for a change;
- `follow.py`: a torchrun's monitor that sees a waiting node at once (a long poll per node);
- `monitor.py`: torchrun's monitor woken by that news and by its workers' exits (SIGCHLD);
- `marks.py`: phase marks of each re-rendezvous, for `bench/recovery.py` (FTRAIN_PHASE_LOG);
- `rounds.py`: each rendezvous round reported to the control plane, which counts restarts;
- `outage.py`: a group that trains through a control-plane outage of any length, and still
  sees nodes join once it is back.

Every private part of torch these use (the pickled state's classes, `_delay`, the handler's
`_state_holder`, the agent's `_stop_workers`, ...) is reached through `worker/torch_internals.py`,
which checks them all when the handler is made.

The rendezvous keep-alive (`keep_alive_interval` x `keep_alive_max_attempt`, torch's 5 s x 3)
and `last_call_timeout` (torch's 30 s) keep torch's defaults; pass them in --rdzv-conf
(docs/runtime.md says what the node agent passes, and why). With `retry_timeout` longer
than the keep-alive window, an agent that cannot reach the control plane is dropped by the
others (they still can) rather than failing itself: that is the intended outcome.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import timedelta

from torch.distributed.elastic.rendezvous.api import RendezvousHandler, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

from .. import torch_internals
from ..protocol import Timeouts
from .backend import NO_STATE_TOKEN, FtrainRendezvousBackend, LongPollUnsupported
from .follow import follow_changes
from .outage import ride_out_outages
from .store import (
    DEFAULT_READ_TIMEOUT_S,
    HttpStore,
    publish_master_in_one_call,
)
from .transport import (
    DEFAULT_PORT,
    DEFAULT_RETRY_TIMEOUT_S,
    TOKEN_ENV,
    ControlPlaneUnreachable,
    RendezvousGoneError,
    Transport,
    endpoint_url,
)
from .wake import MIN_WAKE_INTERVAL_S, SYNC_DELAY_S, wake_on_change

__all__ = [
    "DEFAULT_PORT", "DEFAULT_READ_TIMEOUT_S", "DEFAULT_RETRY_TIMEOUT_S",
    "MIN_WAKE_INTERVAL_S", "NO_STATE_TOKEN", "SYNC_DELAY_S", "TOKEN_ENV",
    "ControlPlaneUnreachable", "FtrainRendezvousBackend", "HttpStore", "LongPollUnsupported",
    "RendezvousGoneError", "Transport", "create_backend", "create_ftrain_handler", "dynamic_handler",
    "endpoint_url",
    "handler_creator", "wake_on_change",
]

log = logging.getLogger(__name__)


def create_backend(params: RendezvousParameters) -> tuple[FtrainRendezvousBackend, HttpStore]:
    """The backend and the store of one agent, from torchrun's --rdzv-* options.

    --rdzv-conf keys read here (others go to torch's `create_handler`):
      read_timeout   the store's default timeout for blocking reads, s (60)
      retry_timeout  how long a request is retried while the control plane is away, s (60)
      long_poll_s    the longest the control plane holds a long poll, s: its
                     `Timeouts.long_poll_s`, which the node agent passes (else their default)
    """
    read_timeout = params.get_as_int("read_timeout", DEFAULT_READ_TIMEOUT_S)
    retry_timeout = params.get_as_int("retry_timeout", DEFAULT_RETRY_TIMEOUT_S)
    if not read_timeout or read_timeout <= 0:
        raise ValueError(f"read_timeout must be a positive number of seconds, not {read_timeout}")
    if not retry_timeout or retry_timeout <= 0:
        raise ValueError(f"retry_timeout must be a positive number of seconds, not {retry_timeout}")
    long_poll_s = _seconds(params, "long_poll_s", Timeouts().long_poll_s)
    token = os.environ.get(TOKEN_ENV)
    if not token:
        log.warning("%s is not set: rendezvous requests go without a token and a control "
                    "plane with tokens will refuse them", TOKEN_ENV)
    transport = Transport(params.endpoint, params.run_id, token, retry_timeout_s=retry_timeout,
                          long_poll_s=long_poll_s)
    store = HttpStore(transport, timeout=timedelta(seconds=read_timeout))
    return FtrainRendezvousBackend(transport), store


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    """--rdzv-conf's `key` as a positive number of seconds, or `default` without it."""
    value = params.get(key)
    try:
        seconds = default if value is None else float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(f"{key} must be a positive number of seconds, not {value!r}")
    return seconds


def create_ftrain_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's DynamicRendezvousHandler over the ftrain backend and store.

    --rdzv-conf keys of torch (defaults): join_timeout (600), last_call_timeout (30),
    close_timeout (30), heartbeat_timeout (5), keep_alive_interval (5),
    keep_alive_max_attempt (3); plus read_timeout and retry_timeout (see create_backend).
    """
    from ..deathsig import act_on_first_death_signal
    from ..output import keep_replaced_outputs
    from .marks import watch_agent
    from .monitor import (
        note_broken_groups,
        stop_broken_groups_at_once,
        wake_monitor_on_news,
    )
    from .rounds import with_round_reports

    torch_internals.require()  # a torch that changed what ftrain uses fails here, saying what
    act_on_first_death_signal()  # before torch's agent registers its handler
    if wake_monitor_on_news():  # in torchrun: a worker's exit or a waiting node acted on at once
        stop_broken_groups_at_once()  # and a broken group stopped without SIGTERM's grace
        keep_replaced_outputs()  # and the output of a group a membership change replaced kept
    watch_agent()  # phase marks for bench/recovery.py, only with FTRAIN_PHASE_LOG set
    handler = dynamic_handler(params, follow=True)
    note_broken_groups(handler)
    return with_round_reports(handler)


def dynamic_handler(params: RendezvousParameters, follow: bool = False) -> RendezvousHandler:
    """torch's handler over the ftrain backend and store, waking on a change of the state and
    sending its joins as ops the control plane merges (`worker.rdzv_state`); without the
    agent's additions (round reports, death signals), as `bench/rendezvous.py` runs it.
    `follow`: its `num_nodes_waiting()` sees a change at once (`follow.py`; a torchrun's)."""
    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    publish_master_in_one_call()
    wake_on_change(handler, backend)
    if follow:
        follow_changes(handler, backend)
    settings = torch_internals.settings(handler)
    backend.merge_settings = (settings.min_nodes, settings.max_nodes, settings.timeout.last_call)
    backend.this_node = (torch_internals.this_node(handler), settings.keep_alive_interval)
    _leave_and_wait_in_one_write(handler, backend)
    ride_out_outages(handler, backend._transport)
    backend.keep_alive = (settings.keep_alive_interval,
                          settings.keep_alive_interval * settings.keep_alive_max_attempt)
    return handler


def _leave_and_wait_in_one_write(handler: RendezvousHandler, backend: FtrainRendezvousBackend) -> None:
    """Each `next_rendezvous` lets the backend send its leave of a complete round and its wait
    for the next as one write (`FtrainRendezvousBackend._wait_after_leaving`)."""
    inner = handler.next_rendezvous

    def next_rendezvous():
        backend.rejoining = True
        try:
            return inner()
        finally:
            backend.rejoining = False

    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]


def handler_creator() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The `torchrun.handlers` entry point: torch registers what this returns under 'ftrain'."""
    return create_ftrain_handler
