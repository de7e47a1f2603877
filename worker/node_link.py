"""The node agent's link to the control plane: registration, heartbeats, reports, leaving.

One `NodeLink` per agent. It registers with the node token, which is only a bootstrap
secret, and gets back the node's own credential, which it sends with every later call (never
in a child's environment); the node token is used again only to register again. The
credential is also kept in a file of the agent's data directory (0600, the agent's user
only), so that an agent restarted under the same name presents it when it registers: the
control plane then gives it its live name back at once (the old agent's workers are
gone, and the job hears so now) instead of refusing the name until the old lease lapses.

The control plane's timing contract comes back with each registration (`Timeouts`): the
agent heartbeats every `heartbeat_interval_s` of it, waits out its presence hold and its
planned changes by it, and hands its long poll to torchrun; never by defaults of its own.

It keeps what the control plane needs from this node between calls: the lease id it was
given, the assignment last heard of (so an idle node's heartbeat is a long poll that the
control plane answers as soon as that changes), and the reports not yet delivered, oldest
first.

Each call is a single try (`worker.http`, no retry budget): the agent's loop is the retry,
once a heartbeat interval, and a control plane that does not answer never stops training.
A report is kept until the control plane answers it; a 5xx keeps it for the next beat, a
4xx is an answer (the control plane is done with it).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from . import gpus
from .http import ApiError, ControlPlaneClient, HttpError, server_urls
from .protocol import (
    Assignment,
    HealthReport,
    HeartbeatReply,
    HeartbeatRequest,
    MAX_GROUPS,
    MAX_STACKS_CHARS,
    GroupCollectives,
    Known,
    RankStacks,
    RegisterReply,
    RegisterRequest,
    ReportRequest,
    RunningGroup,
    StacksReport,
    Timeouts,
)

log = logging.getLogger("ftrain.agent")

# Each request's timeout; a heartbeat's is its long-poll wait plus this, a presence request's
# the control plane's hold of it plus this.
REQUEST_TIMEOUT_S = 5.0
PRESENCE_CONNECTIONS = 2  # presence requests held side by side, each on its own connection
# How often an agent that is not registered tries again (it has no control plane's interval yet).
REGISTER_RETRY_S = 1.0
# A reason longer than the control plane takes would have the whole report refused.
REPORT_REASON_MAX_CHARS = next(m.max_length for m in ReportRequest.model_fields["reason"].metadata
                               if hasattr(m, "max_length"))
PREVIOUS_CREDENTIAL_MAX_CHARS = next(
    m.max_length for m in RegisterRequest.model_fields["previous_credential"].metadata
    if hasattr(m, "max_length"))


def write_private(path: Path, text: str) -> None:
    """Replace the agent's file `path` whole with `text` (0600; a temporary file beside it, not
    followed if a link, then renamed); OSError if it cannot (the temporary file removed)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a leftover of a killed agent of the same pid
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


class NodeForgotten(Exception):
    """The control plane no longer knows this node (its lease lapsed): register again."""


class NameInUse(Exception):
    """Another agent of this name runs on this data directory (it holds the name's lock)."""


def lock_name(data_dir: Path, name: str) -> int:
    """Hold this node name's lock in `data_dir` for the life of the process; returns its fd.

    Two live agents of one name on one data directory would take the name from each other
    with the credential file, turn by turn; the second one is refused instead. The kernel
    drops the lock when the process dies, SIGKILL included, so a restart finds it free.
    The file holds the holder's PID: `ftrain up` stops the agents started by hand on its
    data directory with its own (`service.up.hand_started_agents`).
    """
    import fcntl

    path = data_dir / f"node-credential.{name}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise NameInUse(f"another agent named {name!r} is running on {data_dir} (it holds {path}); "
                        f"stop it, or give this one another --name or --data-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


class NodeLink:
    """This node's registration, heartbeats and reports, over one `ControlPlaneClient`."""

    def __init__(self, server: str, token: str | None, name: str, nproc_per_node: int = 1,
                 address: str | None = None, credential_file: Path | None = None):
        self.server = ",".join(server_urls(server))  # one URL or several (worker/http.py)
        self.name = name
        self.nproc_per_node = nproc_per_node
        self.address = address
        self.credential_file = credential_file  # None: the credential lives in memory only
        # Registration goes with the node token; every other call with the node's credential.
        self._enrol = ControlPlaneClient(self.server, token, timeout=REQUEST_TIMEOUT_S)
        self.client = ControlPlaneClient(self.server, token, timeout=REQUEST_TIMEOUT_S)
        # The presence request has two connections (and threads) of its own (hold_presence):
        # a dead process closes both at once, a blip one (service/presence.py).
        self._presence = [ControlPlaneClient(self.server, token, timeout=REQUEST_TIMEOUT_S)
                          for _ in range(PRESENCE_CONNECTIONS)]
        # So has the lease's keep-alive while the agent's loop is busy stopping a group (keep_alive).
        self._keep_alive = ControlPlaneClient(self.server, token, timeout=REQUEST_TIMEOUT_S)
        # The control plane's timing contract, from its last registration's reply; until one
        # comes, the defaults every control plane starts from.
        self.timeouts = Timeouts()
        self.lease_id: int | None = None
        self.known: Known | None = None  # the assignment last heard of, for the long poll
        self.health: HealthReport | None = None  # the latest health checks, sent when it registers
        self.hung: Known | None = None  # the attempt it ran, ended taken for hung (`HeartbeatReply.hung`)
        self.registered = False
        self.reports: list[ReportRequest] = []

    def register(self, running: tuple[str, int] | None = None) -> None:
        """Register this node (again); its credential, heartbeat interval and lease come back.

        `running`: the (job id, attempt) whose workers this agent still runs, when it
        registers again after its lease lapsed; the control plane then keeps it a member.
        The credential kept in the data directory goes with it: a restarted agent takes its
        live name back at once. A 409 (a node of this name is alive under another credential)
        raises `ApiError`: the agent's loop tries again a beat later, and takes the name once
        the other's lease lapses.
        """
        found = gpus.detect()
        request = RegisterRequest(name=self.name, nproc_per_node=self.nproc_per_node, address=self.address,
                                  gpus=found.count, gpu_model=found.model,
                                  running=None if running is None else RunningGroup(job_id=running[0],
                                                                                    attempt=running[1]),
                                  previous_credential=self._read_credential(), health=self.health)
        reply = RegisterReply.model_validate(self._enrol.call("POST", "/v1/nodes/register", request))
        if reply.credential is not None:  # an older control plane issues none: keep the node token
            self.client.set_token(reply.credential)
            for presence in self._presence:
                presence.set_token(reply.credential)
            self._keep_alive.set_token(reply.credential)
            self._write_credential(reply.credential)
        self.timeouts = reply.timeouts
        self.lease_id = reply.lease_id
        self.registered = True
        log.info("registered node %s with %s (lease %g s, a heartbeat every %g s)", self.name,
                 self._enrol.base_url, reply.timeouts.node_ttl_s, self.heartbeat_interval_s)

    @property
    def heartbeat_interval_s(self) -> float:
        """How often this node heartbeats: the control plane's interval once registered."""
        return self.timeouts.heartbeat_interval_s if self.registered else REGISTER_RETRY_S

    def heartbeat(self, wait_s: float = 0.0) -> Assignment | None:
        """What this node should be doing now, waiting up to `wait_s` (at most an interval)
        for it to change from what this node last heard.

        Raises:
            NodeForgotten: the control plane answered 404 (the lease lapsed) or 401 (the
                credential is outdated): the node must register again.
        """
        request = HeartbeatRequest(lease_id=self.lease_id, known=self.known,
                                   wait_s=min(wait_s, self.heartbeat_interval_s))
        try:
            got = self.client.call("POST", f"/v1/nodes/{self.name}/heartbeat", request,
                                   timeout=self.heartbeat_interval_s + REQUEST_TIMEOUT_S)
        except ApiError as exc:
            if node_forgotten(exc):
                self.registered = False
                raise NodeForgotten(exc.detail) from exc
            raise
        reply = HeartbeatReply.model_validate(got)
        a = reply.assignment
        self.hung = reply.hung
        self.known = None if a is None else Known(job_id=a.job_id, attempt=a.attempt, action=a.action)
        return a

    def keep_alive(self) -> None:
        """A heartbeat that only keeps the node's lease alive: no wait, and its answer (the
        assignment) left for the agent's loop to hear on its next beat. For a thread of its own,
        while the loop is busy (`NodeAgent.stop_group`); raises `HttpError` like `heartbeat`."""
        request = HeartbeatRequest(lease_id=self.lease_id, known=None, wait_s=0.0)
        self._keep_alive.call("POST", f"/v1/nodes/{self.name}/heartbeat", request)

    def report(self, job_id: str, attempt: int, state: str, code: int | None = None,
               reason: str | None = None) -> None:
        """Queue a report of a job attempt's state on this node (sent by `send_reports`)."""
        self.reports.append(ReportRequest(job_id=job_id, attempt=attempt, state=state, exit_code=code,
                                          reason=_fit(reason, REPORT_REASON_MAX_CHARS)))

    def report_stacks(self, job_id: str, attempt: int, dumps: dict[int, str],
                      collectives: dict[int, list[dict]] | None = None) -> None:
        """Send the workers' stacks (and their flight recorders' groups, `flight.groups`, where
        they came) of an attempt taken for hung (one try: the group is being restarted, and the
        dumps are in the job's log as well)."""
        collectives = collectives or {}
        body = StacksReport(job_id=job_id, attempt=attempt, ranks=[
            RankStacks(rank=r, text=text[-MAX_STACKS_CHARS:], collectives=_groups(collectives.get(r)))
            for r, text in sorted(dumps.items())])
        try:
            self.client.call("POST", f"/v1/nodes/{self.name}/stacks", body)
        except HttpError as exc:
            log.warning("the stacks of job %s attempt %d did not reach the control plane: %s",
                        job_id, attempt, exc)

    def ending(self) -> tuple[str, int] | None:
        """The (job id, attempt) whose end this node has yet to deliver (its last queued report
        that ends an attempt), or None. A registration after a lapsed lease names it as still
        running: the group has exited, but the control plane must keep the node a member until
        its end report lands, not take it for a restarted agent (which would fail a job whose
        other nodes finished, or restart one that had ended)."""
        for r in reversed(self.reports):
            if r.state != "running":
                return (r.job_id, r.attempt)
        return None

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
                if node_forgotten(exc):  # kept: sent again once the node has registered again
                    self.registered = False
                    raise NodeForgotten(str(exc)) from exc
            self.reports.pop(0)

    def send_reports_best_effort(self) -> None:
        """`send_reports`, for a node on its way out: no answer is no error."""
        try:
            self.send_reports()
        except (HttpError, NodeForgotten):
            pass

    def leave(self) -> None:
        """Ask the control plane to take this node out at its jobs' next step boundary
        (`POST /v1/nodes/{name}/leave`); the heartbeat's assignment then stops the group."""
        self.client.call("POST", f"/v1/nodes/{self.name}/leave")

    def deregister(self) -> None:
        """Leave the cluster (best effort: the node's lease lapses anyway)."""
        try:
            self.client.call("DELETE", f"/v1/nodes/{self.name}")
        except HttpError:
            pass
        if self.credential_file is not None:  # dead with the lease either way
            self.credential_file.unlink(missing_ok=True)

    def _read_credential(self) -> str | None:
        """The credential of this node's last registration, if the data directory kept one."""
        if self.credential_file is None:
            return None
        try:
            text = self.credential_file.read_text().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        except OSError as exc:
            log.warning("could not read %s (%s): registering without it", self.credential_file, exc)
            return None
        return text if 0 < len(text) <= PREVIOUS_CREDENTIAL_MAX_CHARS else None

    def _write_credential(self, credential: str) -> None:
        """Keep `credential` in its file (0600, replaced whole), for a restart of this agent."""
        if self.credential_file is None:
            return
        try:
            write_private(self.credential_file, credential)
        except OSError as exc:  # the node works on; only a restart would wait for the lease
            log.warning("could not keep the node credential in %s (%s): a restarted agent will "
                        "wait for this one's lease to lapse", self.credential_file, exc)

    def send_health(self, report: HealthReport) -> None:
        """Tell the control plane what this node's checks found between jobs (failing: the
        node is QUARANTINED)."""
        self.health = report
        self.client.call("POST", f"/v1/nodes/{self.name}/health", report)

    def hold_presence(self, connection: int = 0) -> None:
        """One presence request on connection `connection` (of PRESENCE_CONNECTIONS): the
        control plane holds it `presence_hold_s` (a second). While they are held, this
        process's death closes both connections, and the control plane treats the node as lost
        at once instead of when its lease lapses (service/presence.py). Called in a loop by a
        thread of its own per connection (the agent's)."""
        self._presence[connection].call("GET", f"/v1/nodes/{self.name}/presence",
                                        timeout=self.timeouts.presence_hold_s + REQUEST_TIMEOUT_S)

    def close(self) -> None:
        self._enrol.close()
        self.client.close()
        for presence in self._presence:
            presence.close()
        self._keep_alive.close()


def node_forgotten(exc: HttpError) -> bool:
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


def _groups(found: list[dict] | None) -> list[GroupCollectives] | None:
    """A rank's flight-recorder groups as the wire carries them (the first MAX_GROUPS, names cut)."""
    if found is None:
        return None
    return [GroupCollectives(pg=g["pg"][:200], last_enqueued=max(-1, g["last_enqueued"]),
                             last_completed=max(-1, g["last_completed"]),
                             op=None if g["op"] is None else g["op"][:200]) for g in found[:MAX_GROUPS]]
