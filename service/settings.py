"""Control-plane settings.

Built by whoever starts the app (`ftrain serve`, `ftrain up`, a test) and passed to
`create_app(settings)`; nothing reads them at import time.
"""

from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from service.decide.retention import DAY_S, RetentionPolicy, parse_duration
from worker.protocol import Timeouts


class Settings(BaseSettings, Timeouts):
    """Every setting of a control plane; the fields of `Timeouts` (node_ttl_s, long_poll_s,
    presence_hold_s, control_ack_timeout_s) are among them, read as FTRAIN_<FIELD> like the
    rest, and sent to each node when it registers (`timeouts`)."""

    model_config = SettingsConfigDict(env_prefix="FTRAIN_", extra="ignore")

    etcd_endpoints: str = Field(
        "http://127.0.0.1:2379", description="Comma-separated etcd v3 endpoints (http://host:port)."
    )
    etcd_prefix: str = Field("/ftrain", description="Key prefix under which all state is kept.")
    etcd_timeout_s: float = Field(3.0, gt=0, description="Deadline of one etcd request.")
    etcd_user: str | None = Field(None, description="etcd user to authenticate as (etcd's own auth).")
    etcd_password_file: str | None = Field(
        None, description="File holding that user's password (its first line); never the password itself.")

    user_token: str | None = Field(None, description="Bearer token of users (submit, list, cancel).")
    node_token: str | None = Field(None, description="Bearer token of node agents.")

    secret_dir: str = Field(
        ".ftrain/secrets",
        description="Directory (0700) of the control-plane secret (`key`, from which job tokens "
                    "are derived) and of the jobs' secret env values (never in etcd); several "
                    "control-plane replicas share one, as they share the log root.")

    max_body_bytes: int = Field(64 * 1024, gt=0, description="Largest accepted request body.")
    # What a client may make the server hold before the app sees a request (service.http_limits).
    max_head_bytes: int = Field(
        32 * 1024, ge=1024, description="Largest request head (request line and headers); 431 past it.")
    max_headers: int = Field(100, ge=8, description="Most header lines in a request; 431 past it.")
    request_timeout_s: float = Field(
        15.0, gt=0, description="A request (head and body) not received whole this long after its "
                                "first byte (or after its connection opened) is ended: 408.")
    max_connections: int = Field(
        10_000, ge=16, description="Open connections served at once; a new one past it is answered "
                                   "503 (every node agent holds one or two; the process's open-file "
                                   "limit must be above this).")
    user_max_in_flight: int = Field(
        16, ge=1, description="User requests (submissions, reads, the dashboard) waiting for their "
        "answer at once, at most; more get 429 with Retry-After. Node traffic (heartbeats, "
        "rendezvous, reports) is never counted nor refused (service/admission.py).")
    admission_lag_s: float = Field(
        0.25, gt=0, description="When the event loop runs later than this, or etcd takes longer "
        "than this to answer the nodes' lease keep-alives, the number of user requests served at "
        "once is halved (it grows back by one every 50 ms once nothing was late for a second), so "
        "that node traffic is answered first (service/admission.py).")
    admission_wait_s: float = Field(
        1.0, ge=0, description="A user request over that number waits up to this long for a place "
        "(in order of arrival) before its 429; 0: 429 at once.")
    presence_blip_s: float = Field(
        5.0, gt=0, description="An agent's dropped presence connection not back within this is a lost "
        "node even without a second signal (a survivor's broken-peer report makes it 1 s); a shorter "
        "network blip costs nothing (service/presence.py).")
    scheduler_interval_s: float = Field(0.5, gt=0, description="Scheduler tick when nothing changes.")
    queue_policy: Literal["priority", "fifo"] = Field(
        "priority", description="How waiting jobs are served: \"priority\" (higher priority first, "
        "then fair share, then age; a higher-priority job may preempt: docs/scheduling.md) or "
        "\"fifo\" (submission order, nothing preempted). Quotas hold under both.")
    fair_share_settle_s: float = Field(
        60.0, ge=0, le=3600,
        description="A running job gives nodes back to a starved user by fair share only once it "
        "has run this long since it started or resumed (so the job that just received them is not "
        "shrunk again at once: docs/scheduling.md).")
    fair_share_half_life_s: float = Field(
        3600.0, gt=0,
        description="Fair share orders a priority's waiting jobs by the node-seconds their owners' "
        "jobs of that priority have held; what was held this long ago counts half (docs/scheduling.md).")
    memory_hold_s: float = Field(
        120.0, ge=0, le=300,
        description="A job that lost a node and waits for another holds the survivors that keep its "
                    "memory copy this long: no other job is given them (service/decide/keep.py). At "
                    "most 300 s, the time an agent keeps the copy of a job it left; 0: no hold.")
    gc_freeze_s: float = Field(
        1.0, ge=0, description="Objects that live this long are left out of the garbage collector's "
                               "passes (its full passes paused the API for hundreds of ms with "
                               "many jobs; service.gc_pauses); 0: off.")
    gc_reclaim_s: float = Field(
        600.0, gt=0, description="Every this many seconds, everything left out is collected once.")
    leader_ttl_s: int = Field(
        2, ge=2, le=60,
        description="Lease of the scheduler leader's key: after the leader dies, another replica "
                    "leads within about this long (the lead is renewed every quarter of it).")
    cancel_grace_s: float = Field(5.0, ge=0, description="SIGTERM to SIGKILL grace period on cancel.")
    snapshot_root: str | None = Field(
        None, description="Directory every node sees; each job snapshots under <root>/<job id>."
    )
    progress_min_interval_s: float = Field(
        1.0, ge=0, description="A job's progress is written at most once per this many seconds.")
    metric_points: int = Field(
        240, ge=8, le=4096, description="Points kept of each job's metric history (the history "
                                         "halves its resolution when full).")
    compaction_interval_s: float = Field(
        60.0, gt=0, description="The leader compacts etcd's history to the revision it saw this "
                                "long ago, every this many seconds.")
    log_root: str = Field(
        ".ftrain/job-logs",
        description="Directory of the workers' logs (a folder per job); with several control-plane "
                    "replicas, one directory they all share (NFS or similar, with POSIX locks).")
    log_cap_bytes: int = Field(64 * 1024 * 1024, ge=64 * 1024,
                               description="Bytes of log kept per job; the oldest are cut past it.")
    retention_s: float = Field(
        7 * DAY_S, gt=0,
        description="Finished jobs (record, events, logs, snapshot records, idempotency key) "
                    "are deleted this long after they end; seconds, or e.g. 7d, 12h, 30m, 90s.")
    drain_keep_s: float = Field(
        7 * DAY_S, gt=0,
        description="A drained node's stored drain is deleted once no node of its name has been "
                    "registered for this long (a node back sooner is still drained); seconds, or "
                    "e.g. 7d, 12h, 30m, 90s.")
    retention_jobs: int | None = Field(
        None, ge=1, description="Keep at most this many finished jobs (the oldest finished go "
                                "first); none: no cap.")

    def etcd_credentials(self) -> tuple[str, str] | None:
        """(user, password) for etcd, the password read from its file; None without a user.

        Raises:
            ValueError: a user without a password file (or the reverse), or a file that
                cannot be read or is empty; the message says which.
        """
        if self.etcd_user is None and self.etcd_password_file is None:
            return None
        if self.etcd_user is None or self.etcd_password_file is None:
            raise ValueError("give both an etcd user and its password file "
                             "(--etcd-user and --etcd-password-file), or neither")
        try:
            with open(self.etcd_password_file) as f:
                password = f.readline().rstrip("\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read the etcd password file {self.etcd_password_file}: "
                             f"{exc.strerror}") from None
        if not password:
            raise ValueError(f"the etcd password file {self.etcd_password_file} is empty")
        return self.etcd_user, password

    @field_validator("retention_s", "drain_keep_s", mode="before")
    @classmethod
    def _duration(cls, v):
        return parse_duration(v) if isinstance(v, str) else v

    @property
    def timeouts(self) -> Timeouts:
        """The timing contract this control plane states to its nodes (`RegisterReply`)."""
        return Timeouts.model_validate(self.model_dump(include=set(Timeouts.model_fields)))

    @property
    def retention(self) -> RetentionPolicy:
        return RetentionPolicy(retention_s=self.retention_s, keep_jobs=self.retention_jobs)
