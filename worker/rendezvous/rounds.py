"""Tell the control plane about each rendezvous round of a job's torchrun; never close it.

torch's agent re-rendezvouses both after a worker failure and when nodes join or leave,
and counts only the first against its restart budget. ftrain wants the count the other
way round (failures count, membership changes do not), so torchrun runs with an
unlimited budget and this wrapper reports every round: 'joining' when this node starts
re-forming the group (the job is RECOVERING; sent from a thread while the node joins, so the
round does not wait for its answer), 'joined' from the new group's rank 0 with the number
of nodes (the control plane compares it with the round before; sent after the 'joining'
report's answer, before the workers start).

Each round also names the group it formed, '<node>/<round>' of group rank 0, in this
process's environment (`FTRAIN_GROUP`), which torch passes to the workers it starts next:
rank 0 sends it with its progress, and the control plane ends a recovery only on a step of
the group that its 'joined' report named (`service.decide.recovery`). The round itself goes
to every worker the same way (`FTRAIN_ROUND`): each worker's launcher notes it beside the
worker's output files, and the agent tags the worker's lines with it (worker/output.py).
"""

from __future__ import annotations

import logging
import os
import threading

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo

from .. import torch_internals
from ..env import (
    FTRAIN_ATTEMPT,
    FTRAIN_GROUP,
    FTRAIN_JOB_ID,
    FTRAIN_JOB_TOKEN,
    FTRAIN_NODE,
    FTRAIN_ROUND,
    FTRAIN_SERVER,
)
from ..http import ControlPlaneClient, HttpError
from ..protocol import RoundReport
from . import marks

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 3.0
# How long a report is retried while the control plane does not answer: what the sleeps
# between its five tries (0.1, 0.3, 1 and 2 s) came to before there was one retry policy.
RETRY_S = 3.4


class RoundReporter:
    def __init__(self, server: str, token: str, job_id: str, attempt: int, node: str):
        self._client = ControlPlaneClient(server, token, timeout=REQUEST_TIMEOUT_S)
        self._path = f"/v1/jobs/{job_id}/rounds"
        self._attempt = attempt
        self.node = node
        self._sending: threading.Thread | None = None  # a report sent in the background

    @classmethod
    def from_env(cls) -> RoundReporter | None:
        env = os.environ
        needed = (FTRAIN_SERVER, FTRAIN_JOB_TOKEN, FTRAIN_JOB_ID, FTRAIN_ATTEMPT, FTRAIN_NODE)
        if not all(env.get(k) for k in needed):
            return None
        return cls(env[FTRAIN_SERVER], env[FTRAIN_JOB_TOKEN], env[FTRAIN_JOB_ID],
                   int(env[FTRAIN_ATTEMPT]), env[FTRAIN_NODE])

    def report_soon(self, phase: str, call: int) -> None:
        """`report` from a thread: the round goes on meanwhile (a 'joining' report needs no
        answer before the node joins; the next `report` waits for it, so they stay in order)."""
        self.flush()
        sending = threading.Thread(target=self.report, args=(phase, call),
                                   name="ftrain-round-report", daemon=True)
        self._sending = sending  # before it starts: `report` tells it from the main thread by it
        sending.start()

    def flush(self) -> None:
        """Wait for the report sent in the background, if any (at most its retries)."""
        sending, self._sending = self._sending, None
        if sending is not None:
            sending.join(RETRY_S + REQUEST_TIMEOUT_S)

    def report(self, phase: str, call: int, info: RendezvousInfo | None = None,
               round_: int | None = None) -> None:
        if threading.current_thread() is not self._sending:
            self.flush()
        body = RoundReport(attempt=self._attempt, node=self.node, phase=phase, call=call,
                           group_rank=None if info is None else info.rank,
                           group_world_size=None if info is None else info.world_size, round=round_)
        try:
            self._client.call("POST", self._path, body, retry_s=RETRY_S)
            return
        except HttpError as exc:
            if exc.status is not None and exc.status < 500:
                return  # the control plane's answer (e.g. the attempt is over): nothing to add
            log.debug("round report failed: %s", exc)
        log.warning("could not report rendezvous round (%s) to the control plane", phase)


class ReportingHandler(RendezvousHandler):
    """A RendezvousHandler that reports each round and otherwise defers to `inner`."""

    def __init__(self, inner: RendezvousHandler, reporter: RoundReporter):
        self._inner = inner
        self._reporter = reporter
        self._calls = 0

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        call = self._calls
        self._calls += 1
        marks.mark("rdzv_enter", call=call)
        self._reporter.report_soon("joining", call)
        info = self._inner.next_rendezvous()
        round_ = rendezvous_round(self._inner)
        marks.mark("rdzv_done", call=call, round=round_, rank=info.rank, world=info.world_size)
        os.environ[FTRAIN_ROUND] = str(round_)  # for the group's workers, which torch starts next
        self._reporter.report("joined", call, info, round_)
        if info.rank == 0:
            # The group's name as rank 0's node reports it; other nodes' workers do not
            # report progress, so they need no name (and cannot know rank 0's round).
            os.environ[FTRAIN_GROUP] = f"{self._reporter.node}/{call}"
        else:
            os.environ.pop(FTRAIN_GROUP, None)
        return info

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        waiting = self._inner.num_nodes_waiting()
        if waiting:
            marks.mark("nodes_waiting", waiting=waiting)
        return waiting

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        """Leave without closing the rendezvous for the others.

        torch's agent closes the whole rendezvous when it shuts down, so one node that is
        drained, cancelled or cut off would end every other node's torchrun at their next
        re-rendezvous. Under ftrain the control plane decides when a job's rendezvous ends
        (and deletes it then); an agent leaving only stops its keep-alive.
        """
        torch_internals.stop_heartbeats(self._inner)
        return True


def rendezvous_round(handler: RendezvousHandler) -> int:
    """The round of torch's dynamic rendezvous that `handler` last completed (the same on every
    member node: torch names the group's store by it)."""
    return torch_internals.cached_state(handler).round


def with_round_reports(handler: RendezvousHandler) -> RendezvousHandler:
    """Wrap `handler` when running under an ftrain node agent; unchanged otherwise."""
    reporter = RoundReporter.from_env()
    return handler if reporter is None else ReportingHandler(handler, reporter)
