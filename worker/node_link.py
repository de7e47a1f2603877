"""The node agent's link to the control plane: registration, heartbeats, reports, leaving.

One `NodeLink` per agent. It registers with the node token, which is only a bootstrap
secret, and gets back the node's own credential, which it keeps in memory (never on disk,
never in a child's environment) and sends with every later call; the node token is used
again only to register again, when the lease has lapsed. It keeps what the control plane
needs from this node between calls: the lease id it was given, the assignment last heard
of (so an idle node's heartbeat is a long poll that the control plane answers as soon as
that changes), and the reports not yet delivered, oldest first.

Each call is a single try (`worker.http`, no retry budget): the agent's loop is the retry,
once a heartbeat interval, and a control plane that does not answer never stops training.
A report is kept until the control plane answers it; a 5xx keeps it for the next beat, a
4xx is an answer (the control plane is done with it).
"""

from __future__ import annotations

import logging

from worker.http import ApiError, ControlPlaneClient, HttpError, server_urls
from worker.protocol import (
    Assignment,
    HeartbeatReply,
    HeartbeatRequest,
    Known,
    RegisterReply,
    RegisterRequest,
    ReportRequest,
    RunningGroup,
)

log = logging.getLogger("ftrain.agent")

# Each request's timeout; a heartbeat's is its long-poll wait plus this.
REQUEST_TIMEOUT_S = 5.0
# A reason longer than the control plane takes would have the whole report refused.
REPORT_REASON_MAX_CHARS = next(m.max_length for m in ReportRequest.model_fields["reason"].metadata
                               if hasattr(m, "max_length"))


class NodeForgotten(Exception):
    """The control plane no longer knows this node (its lease lapsed): register again."""


class NodeLink:
    """This node's registration, heartbeats and reports, over one `ControlPlaneClient`."""

    def __init__(self, server: str, token: str | None, name: str, nproc_per_node: int = 1,
                 address: str | None = None):
        self.server = ",".join(server_urls(server))  # one URL or several (worker/http.py)
        self.name = name
        self.nproc_per_node = nproc_per_node
        self.address = address
        # Registration goes with the node token; every other call with the node's credential.
        self._enrol = ControlPlaneClient(self.server, token, timeout=REQUEST_TIMEOUT_S)
        self.client = ControlPlaneClient(self.server, token, timeout=REQUEST_TIMEOUT_S)
        self.heartbeat_interval_s = 1.0
        self.lease_id: int | None = None
        self.known: Known | None = None  # the assignment last heard of, for the long poll
        self.registered = False
        self.reports: list[ReportRequest] = []

    def register(self, running: tuple[str, int] | None = None) -> None:
        """Register this node (again); its credential, heartbeat interval and lease come back.

        `running`: the (job id, attempt) whose workers this agent still runs, when it
        registers again after its lease lapsed; the control plane then keeps it a member.
        A 409 (a node of this name is still alive) raises `ApiError`: the agent's loop tries
        again a beat later, so a restarted agent takes its name back once the old lease lapses.
        """
        request = RegisterRequest(name=self.name, nproc_per_node=self.nproc_per_node, address=self.address,
                                  running=None if running is None else RunningGroup(job_id=running[0],
                                                                                    attempt=running[1]))
        reply = RegisterReply.model_validate(self._enrol.call("POST", "/v1/nodes/register", request))
        if reply.credential is not None:  # an older control plane issues none: keep the node token
            self.client.set_token(reply.credential)
        self.heartbeat_interval_s = reply.heartbeat_interval_s
        self.lease_id = reply.lease_id
        self.registered = True
        log.info("registered node %s with %s (lease %ss)", self.name, self._enrol.base_url, reply.lease_ttl_s)

    def heartbeat(self, idle: bool) -> Assignment | None:
        """What this node should be doing now; an idle node waits up to an interval for it.

        Raises:
            NodeForgotten: the control plane answered 404 (the lease lapsed) or 401 (the
                credential is outdated): the node must register again.
        """
        request = HeartbeatRequest(lease_id=self.lease_id, known=self.known,
                                   wait_s=self.heartbeat_interval_s if idle else 0)
        try:
            got = self.client.call("POST", f"/v1/nodes/{self.name}/heartbeat", request,
                                   timeout=self.heartbeat_interval_s + REQUEST_TIMEOUT_S)
        except ApiError as exc:
            if _is_forgotten(exc):
                self.registered = False
                raise NodeForgotten(exc.detail) from exc
            raise
        a = HeartbeatReply.model_validate(got).assignment
        self.known = None if a is None else Known(job_id=a.job_id, attempt=a.attempt, action=a.action)
        return a

    def report(self, job_id: str, attempt: int, state: str, code: int | None = None,
               reason: str | None = None) -> None:
        """Queue a report of a job attempt's state on this node (sent by `send_reports`)."""
        self.reports.append(ReportRequest(job_id=job_id, attempt=attempt, state=state, exit_code=code,
                                          reason=_fit(reason, REPORT_REASON_MAX_CHARS)))

    def send_reports(self) -> None:
        """Deliver the queued reports, oldest first, until the control plane does not answer."""
        while self.reports:
            try:
                self.client.call("POST", f"/v1/nodes/{self.name}/report", self.reports[0])
            except HttpError as exc:
                if exc.status is None:
                    raise  # no connection: the agent's loop says so, and the report waits
                if exc.status >= 500:
                    return  # etcd or the control plane is away: keep it for the next beat
                if _is_forgotten(exc):  # kept: sent again once the node has registered again
                    self.registered = False
                    raise NodeForgotten(str(exc)) from exc
            self.reports.pop(0)

    def send_reports_best_effort(self) -> None:
        """`send_reports`, for a node on its way out: no answer is no error."""
        try:
            self.send_reports()
        except (HttpError, NodeForgotten):
            pass

    def deregister(self) -> None:
        """Leave the cluster (best effort: the node's lease lapses anyway)."""
        try:
            self.client.call("DELETE", f"/v1/nodes/{self.name}")
        except HttpError:
            pass

    def close(self) -> None:
        self._enrol.close()
        self.client.close()


def _is_forgotten(exc: HttpError) -> bool:
    """The control plane does not know this node as registered: its lease lapsed (404 on a
    node endpoint) or its credential is outdated (401)."""
    if exc.status == 401:
        return True
    return exc.status == 404 and "no node named" in str(getattr(exc, "detail", "") or exc)


def _fit(text: str | None, limit: int) -> str | None:
    """`text` cut to `limit` characters in the middle: its start and its last lines stay."""
    if text is None or len(text) <= limit:
        return text
    marker = "\n[...]\n"
    head = (limit - len(marker)) // 4
    return text[:head] + marker + text[len(text) - (limit - len(marker) - head):]
