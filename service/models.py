"""The control plane's resources: what comes in (`JobSpec`), what is stored (`JobRecord`)
and what goes out (`JobView`, `JobList`, `EventView`, `NodeView`, `LogPage`)."""

from __future__ import annotations

import enum
import re
import typing
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from service.keyring import new_nonce
from worker.env import JOB_KNOBS
from worker.jsontypes import JsonBody, JsonFloat, JsonInt
from worker.protocol import ControlAction, GroupCollectives, Progress, RestorePoint, SnapshotMeta

ADMIN = "admin"  # the user of the single user token (`ftrain serve --token`)
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def dns_label(v: str) -> str:
    """`v` if it is a DNS label (a job's or a user's name), else the error a 422 names."""
    if not DNS_LABEL.match(v):
        raise ValueError("must be a DNS label: lower-case letters, digits and '-', "
                         "starting and ending with a letter or digit")
    return v
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_ENV_ENTRIES = 128
MAX_ENV_VALUE_CHARS = 4096
MAX_HANG_TIMEOUT_S = 7 * 24 * 3600
# torchrun stops its workers on SIGTERM with SIGKILL 30 s later (torch's `PContext.close`): a
# longer grace would not be given.
MAX_PREEMPT_GRACE_S = 30
MAX_DURATION_S = 365 * 24 * 3600  # a job's `max_duration_s`, at most (a year)
# Size limits of a spec, in UTF-8 bytes, so that one job record (the spec and a few KiB of
# state) stays far below etcd's 1.5 MiB request limit and 16 records fit one page of a
# read (service.jobs.JOB_PAGE_SIZE) well under gRPC's 4 MiB reply cap.
MAX_COMMAND_BYTES = 16 * 1024  # every argument together
MAX_ENV_BYTES = 32 * 1024  # every name and value together
MAX_SPEC_BYTES = 64 * 1024  # the whole spec as stored (JSON)
# The service sets these itself; a spec may not override them.
# The job's own knobs among the FTRAIN_* names: log level, the fork server (worker/fork_server.py).
USER_FTRAIN_ENV = JOB_KNOBS
# CUDA_VISIBLE_DEVICES is the node's GPU assignment (`ftrain node --gpus`): a job that set its
# own would put two nodes' ranks on one GPU, or use GPUs another agent was given.
RESERVED_ENV = ("FTRAIN_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_",
                "CUDA_VISIBLE_DEVICES")


class JobState(str, enum.Enum):
    PENDING = "PENDING"
    STARTING = "STARTING"  # given its nodes; no step (nor, for a plain script, output) seen yet
    RUNNING = "RUNNING"
    RECOVERING = "RECOVERING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    def is_active(self) -> bool:
        """Holds nodes: workers may be running."""
        return self in (JobState.STARTING, JobState.RUNNING, JobState.RECOVERING, JobState.CANCELLING)


class _Strict(JsonBody):
    """A user's body: no unknown fields, and numbers as JSON Schema types them (JsonInt,
    JsonFloat: `"3"` and `true` are not 3, `3.0` is), so a 422 names a field sent as a string."""

    model_config = ConfigDict(extra="forbid")


def _utf8(text: str, what: str) -> str:
    """`text` if it can be written as UTF-8: a lone surrogate ("\\ud800" in JSON) cannot be
    stored, logged or passed to a process, so it is a 422 naming `what`, not a 500 later."""
    try:
        text.encode()
    except UnicodeEncodeError:
        raise ValueError(f"{what} is not valid Unicode (a lone surrogate such as \\ud800); "
                         "send UTF-8 text") from None
    return text


def _env_name_pattern() -> str:
    """The env names a spec may set, as one regular expression (for the OpenAPI): a valid
    name not set by ftrain (`RESERVED_ENV`, a prefix each), or one of the job's own knobs."""
    reserved = "|".join(re.escape(p) for p in RESERVED_ENV)
    knobs = "|".join(re.escape(k) for k in sorted(USER_FTRAIN_ENV))
    return f"^(?:(?!{reserved})[A-Za-z_][A-Za-z0-9_]*|{knobs})$"


_ENV_SCHEMA = {"propertyNames": {"pattern": _env_name_pattern()}, "maxProperties": MAX_ENV_ENTRIES,
               "additionalProperties": {"type": "string", "maxLength": MAX_ENV_VALUE_CHARS,
                                        "pattern": "^[^\\x00]*$"}}


class NodesSpec(_Strict):
    min: JsonInt = Field(1, ge=1, le=1024, description="Nodes needed to start (gang size).")
    max: JsonInt = Field(1, ge=1, le=1024, description="Most nodes the job will use.")

    @model_validator(mode="after")
    def _min_le_max(self) -> NodesSpec:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must be <= max ({self.max})")
        return self


class SnapshotSpec(_Strict):
    every_steps: JsonInt = Field(100, ge=1, le=10_000_000, description="Snapshot every N steps.")
    keep: JsonInt = Field(3, ge=1, le=1000, description="Committed snapshots kept; older ones are pruned.")


class JobSpec(_Strict):
    """A training job as submitted (JSON over REST, or YAML/JSON through the CLI)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{  # examples/job.json
        "name": "example", "command": ["python", "examples/train.py", "--steps", "400"],
        "nodes": {"min": 1, "max": 2}, "nproc_per_node": 1, "max_restarts": 3,
        "snapshot": {"every_steps": 20, "keep": 3}, "env": {"OMP_NUM_THREADS": "1"}}]})

    name: str = Field(..., min_length=1, max_length=40,
                      description="DNS label: lower-case letters, digits and '-'.",
                      json_schema_extra={"pattern": DNS_LABEL.pattern})
    command: list[Annotated[str, Field(min_length=1, max_length=4096,
                                       json_schema_extra={"pattern": "^[^\\x00]*$"})]] = Field(
        ..., min_length=1, max_length=256,
        description="The worker command, as torchrun would run it, e.g. ['python', 'train.py']; "
                    f"at most {MAX_COMMAND_BYTES} bytes in all (UTF-8).")
    working_dir: str | None = Field(None, max_length=4096,
                                    description="Directory the command runs in, on every node.",
                                    json_schema_extra={"pattern": "^/[^\\x00]*$"})
    env: dict[str, str] = Field(default_factory=dict, description=(
        f"Extra environment for workers; names and values of env and secret_env at most "
        f"{MAX_ENV_BYTES} bytes in all (UTF-8), no name in both."),
                                json_schema_extra=_ENV_SCHEMA)
    secret_env: dict[str, str] = Field(
        default_factory=dict, json_schema_extra=_ENV_SCHEMA,
        description="Environment for workers whose values are secret: never stored in etcd, never "
                    "returned by the API (a job shows their names only), masked in the job's logs.")
    nodes: NodesSpec = Field(default_factory=NodesSpec)
    nproc_per_node: JsonInt | str = Field(
        1, union_mode="left_to_right",
        json_schema_extra={"anyOf": [{"type": "integer", "minimum": 1, "maximum": 1024},
                                     {"type": "string", "const": "auto"}]},
        description="Worker processes per node, or 'auto' (one per GPU the node has, else one).")
    gpus_per_node: JsonInt | None = Field(
        None, ge=1, le=1024,
        description="Place the job only on nodes with at least this many GPUs (their workers' "
                    "CUDA_VISIBLE_DEVICES); null: any node.")
    max_restarts: JsonInt = Field(3, ge=0, le=1000, description="Worker failures tolerated.")
    snapshot: SnapshotSpec = Field(default_factory=SnapshotSpec)
    global_batch_size: JsonInt | None = Field(
        None, ge=1, description="Kept constant across resizes by the runtime (optional).")
    hang_timeout_s: JsonFloat | None = Field(
        None, ge=2, le=MAX_HANG_TIMEOUT_S,
        description="Restart the workers (as a worker failure) when rank 0, having reported "
                    "progress through the runtime, does not advance its step for this long.")
    priority: JsonInt = Field(0, ge=-1000, le=1000,
                              description="Higher starts first and may preempt lower (default 0).")
    preempt_grace_s: JsonFloat = Field(
        30, ge=0, le=MAX_PREEMPT_GRACE_S,
        description="When preempted, a script that does not use the ftrain runtime gets SIGTERM and "
                    "this long to save before its workers are stopped (a runtime script snapshots at "
                    "a step boundary instead).")
    max_duration_s: JsonFloat | None = Field(
        None, gt=0, le=MAX_DURATION_S,
        description="The longest one run of the job may take, from its start (or its resumption "
                    "after a suspension): a job still running past it is stopped and FAILED. "
                    "Declaring it lets the job start on nodes a job of higher priority waits for "
                    "when it ends before that job could start anyway (backfill: docs/scheduling.md).")
    straggler_factor: JsonFloat = Field(
        1.3, ge=1.05, le=100,
        description="Flag a rank whose compute time per step is at least this many times the median "
                    "of the other ranks' over `straggler_window_s` (runtime scripts; docs/stragglers.md).")
    straggler_window_s: JsonFloat = Field(
        60.0, ge=2, le=3600, description="The window over which a straggler is judged, in seconds.")
    straggler_action: Literal["report", "replace"] = Field(
        "report", description="'report': flag a straggler (an event, `stragglers`, a metric); "
                              "'replace': also swap its node for a free one at a step boundary.")

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        return dns_label(v)

    @field_validator("nproc_per_node", mode="before")
    @classmethod
    def _positive(cls, v):
        # One error naming the field, not one per member of the union (a string other than
        # 'auto', true, 2.5).
        if v != "auto" and (type(v) is not int):
            raise ValueError("must be a positive integer or 'auto'")
        if isinstance(v, int) and not 1 <= v <= 1024:
            raise ValueError("must be between 1 and 1024, or 'auto'")
        return v

    @field_validator("working_dir")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path")
        if v is not None and "\0" in v:
            raise ValueError("must not contain NUL")
        return v if v is None else _utf8(v, "the path")

    @field_validator("command")
    @classmethod
    def _no_nul(cls, v: list[str]) -> list[str]:
        if any("\0" in part for part in v):
            raise ValueError("must not contain NUL characters")
        for i, part in enumerate(v):
            _utf8(part, f"argument {i}")
        return v

    @field_validator("env", "secret_env")
    @classmethod
    def _bounded_env(cls, v: dict[str, str]) -> dict[str, str]:
        if len(v) > MAX_ENV_ENTRIES:
            raise ValueError(f"at most {MAX_ENV_ENTRIES} entries")
        for key, value in v.items():
            _utf8(value, f"the value of {key!r}")
            if not ENV_NAME.match(key):
                raise ValueError(f"{key!r} is not a valid variable name ([A-Za-z_][A-Za-z0-9_]*)")
            if key.startswith(RESERVED_ENV) and key not in USER_FTRAIN_ENV:
                raise ValueError(f"{key!r} is set by ftrain and cannot be overridden")
            if len(value) > MAX_ENV_VALUE_CHARS or "\0" in value:
                raise ValueError(f"value of {key!r} must be at most {MAX_ENV_VALUE_CHARS} "
                                 "characters, without NUL")
        return v

    @model_validator(mode="after")
    def _env_names_once(self) -> JobSpec:
        if both := sorted(self.env.keys() & self.secret_env.keys()):
            raise ValueError(f"{', '.join(both)} in both env and secret_env: give each name once")
        return self

    def without_secrets(self) -> JobSpec:
        """The spec as stored and shown: the secret values left out (their names are kept
        in the record, `JobRecord.secret_env_names`)."""
        return self.model_copy(update={"secret_env": {}})

    def size_errors(self) -> list[dict]:
        """What makes this spec too large to store, as 422 errors naming each field.

        Checked at submit only (`POST /v1/jobs`), not when a stored record is read: a
        record written before a limit existed must stay readable.
        """
        errors = []

        def too_large(field: str, message: str) -> None:
            errors.append({"loc": ("body", field), "msg": message, "type": "too_large"})

        command = sum(len(part.encode()) for part in self.command)
        if command > MAX_COMMAND_BYTES:
            too_large("command", f"must be at most {MAX_COMMAND_BYTES} bytes in all (UTF-8), "
                                 f"not {command}; pass large inputs in a file")
        env = sum(len(k.encode()) + len(v.encode())
                  for k, v in (self.env | self.secret_env).items())
        if env > MAX_ENV_BYTES:
            too_large("env", f"names and values must be at most {MAX_ENV_BYTES} bytes in all "
                             f"(UTF-8), not {env}; pass large inputs in a file")
        stored = len(self.model_dump_json().encode())
        if not errors and stored > MAX_SPEC_BYTES:
            too_large("spec", f"takes {stored} bytes as stored (JSON), more than {MAX_SPEC_BYTES}; "
                              "shorten command, env or working_dir")
        return errors


# A member in one of these holds its node (`MemberStatus.holds_node`): live or finished.
HOLDING_STATES = frozenset(("assigned", "running", "succeeded"))


class HungRank(BaseModel):
    """What one rank's node reported of it for an attempt taken for hung (its stacks' verdict,
    its flight recorder's groups), kept until every node's report is in to compare ranks."""

    waits: bool | None = None  # its main thread waits in a collective (None: no stacks)
    collectives: list[GroupCollectives] | None = None


class MemberStatus(BaseModel):
    """One node's part in the current attempt."""

    state: Literal["assigned", "running", "succeeded", "failed", "stopped"] = "assigned"
    exit_code: int | None = None
    reason: str | None = None
    nproc: int | None = None
    # Its workers said, at their clean finish after every rank's last collective, that they
    # finished the run (`POST /v1/jobs/{id}/finished`): if its agent then vanishes before it
    # reports their exit, the node is finished, not lost (`service.decide.outcome.vanished`).
    run_finished: bool = False

    def is_live(self) -> bool:
        """The node holds (or is about to hold) workers of the job."""
        return self.state in ("assigned", "running")

    def is_finished(self) -> bool:
        """Every worker on the node exited 0: its part of the job is done."""
        return self.state == "succeeded"

    def holds_node(self) -> bool:
        """The node belongs to the job until the job ends: live, or finished (a finished node
        is neither lost nor free; `service.decide.outcome` says why)."""
        return self.state in HOLDING_STATES


class KeptCopies(BaseModel):
    """The nodes that hold a PENDING job's memory copy (worker/memory.py) after it lost a node:
    held for it, no other job given them, until `until` (`service.decide.keep`)."""

    steps: dict[str, int] = Field(default_factory=dict, description="node -> the step its memory tier "
                                  "holds, as its worker last reported")
    since: float = Field(..., description="When the job let them go (went back to PENDING).")
    until: float = Field(..., description="The end of the hold: past it, they are free like any node.")


RestartCause = Literal["failure", "lost_node", "preemption", "resize"]
RESTART_CAUSES: tuple[RestartCause, ...] = typing.get_args(RestartCause)


class RestartCounts(BaseModel):
    """How often a job's group was stopped and started again, by cause. Only failures spend
    `max_restarts`: a lost node, a preemption or a resize (a node joining, a drain) is no
    fault of the job's (`docs/scheduling.md`)."""

    failure: int = Field(0, description="Its workers failed, crashed or hung.")
    lost_node: int = Field(0, description="A node it ran on was lost.")
    preemption: int = Field(0, description="A job of higher priority took some or all of its nodes.")
    resize: int = Field(0, description="A planned membership change: a node joined or was drained.")

    def plus(self, cause: RestartCause) -> RestartCounts:
        """These counts with one more restart of `cause`."""
        return self.model_copy(update={cause: getattr(self, cause) + 1})

    def total(self) -> int:
        return self.failure + self.lost_node + self.preemption + self.resize


class Preemption(BaseModel):
    """On a running job: a job of higher priority takes `leave` (some of its nodes: it shrinks at
    a step boundary) or every node (`suspend`: it goes back to PENDING, its state kept)
    (`service.decide.preempt`)."""

    by: str = Field(..., description="The id of the waiting job that takes the nodes.")
    by_priority: int
    leave: list[str] = Field(..., description="The nodes it gives up.")
    suspend: bool = False
    requested_at: float
    # A give-back to a starved user of the same priority (`decide.giveback`), not a preemption
    # by priority: its restart counts as a resize.
    fair_share: bool = False
    for_user: str | None = None

    def describe(self) -> str:
        return f"job {self.by} (priority {self.by_priority})"


class Borrow(BaseModel):
    """On a job of the ftrain runtime that took free nodes kept for the queue's head, a waiting
    job of its priority (`service.decide.backfill`): it gives `nodes` back (a shrink, else a
    suspension, 0 steps lost) once that job, or another of its priority ahead of that job in the
    queue, could start with them (`service.decide.preempt`): the jobs that could have taken them
    while they were free."""

    head: str = Field(..., description="The id of the waiting job the nodes were kept for.")
    priority: int
    head_created_at: float | None = Field(
        None, description="When that job was submitted: its place in the queue, where only it and "
        "the jobs of its priority ahead of it take the nodes back (None, on a record of before: "
        "the jobs ahead of the borrower).")
    nodes: list[str] = Field(..., description="The kept nodes it took.")
    since: float

    def describe(self) -> str:
        return f"job {self.head} (priority {self.priority})"


class Control(BaseModel):
    id: int
    action: ControlAction
    reason: str
    requested_at: float


class Straggler(BaseModel):
    """A rank flagged as slower than the job's others (service/decide/stragglers.py)."""

    rank: int
    node: str | None = None
    factor: float = Field(..., description="Its compute time per step over the median of the other "
                          "ranks', over the window.")
    since: float = Field(..., description="When it was flagged.")


class JobRecord(BaseModel):
    """What etcd holds for a job (one key; every write is a CAS on its mod_revision)."""

    id: str
    spec: JobSpec = Field(..., description="As submitted, without the secret env values.")
    owner: str = Field(ADMIN, description="The user who submitted the job.")
    # That user's id (service.users): a user added again under the owner's name is not the
    # owner. None: the admin's job, or one stored before user ids.
    owner_id: str | None = None
    state: JobState = JobState.PENDING
    reason: str = "submitted"
    created_at: float
    updated_at: float
    # The job token is derived from the id and this nonce with the control-plane secret,
    # never stored (service.keyring); the nonce also names the file of its secret env.
    token_nonce: str = Field(default_factory=new_nonce)
    # The token of a record written before tokens were derived: honoured until the job ends.
    legacy_token: str | None = None
    secret_env_names: list[str] = Field(default_factory=list)
    attempt: int = 0
    members: dict[str, MemberStatus] = Field(default_factory=dict)
    # Nodes that were members and are no longer (drained, lost, left by a new attempt): they
    # may still ship the lines their workers wrote (`decide.members.note_former_members`).
    former_members: list[str] = Field(default_factory=list)
    world_size: int = 0
    restarts_by_cause: RestartCounts = Field(default_factory=RestartCounts)
    rounds: int = 0
    event_seq: int = 0
    latest_snapshot: SnapshotMeta | None = None
    # Set by the job's first progress report: its rank 0 runs the ftrain runtime, so it can
    # acknowledge planned changes. The reports themselves live under `keys.progress(id)`.
    reports_progress: bool = False
    finished_at: float | None = None
    # When its current run started (left PENDING): `spec.max_duration_s` counts from here.
    started_at: float | None = None
    # Planned membership changes: the request to rank 0, and the id it last acknowledged
    # (by committing a snapshot with that control id) with the step it stopped at.
    control: Control | None = None
    control_acked: int = 0
    control_acked_step: int | None = None
    # Set once the scheduler has told the members to stop their workers (cancel, failure).
    stopping: bool = False
    # When the current round of the rendezvous formed, and with how many nodes.
    round_nodes: int = 0
    # The group that trains now, as '<node>/<round>' of the rendezvous round that formed it
    # (group rank 0's node and its torchrun's round: `worker.env.FTRAIN_GROUP`); None while a
    # group re-forms. Only a step reported by this group ends a recovery (`decide.recovery`).
    group: str | None = None
    # torch's rendezvous round that formed `group` (the same on every member node; None: not
    # reported): a plain script's worker lines carry it, so a replaced group's late lines do
    # not end a recovery (`decide.recovery.first_output`).
    group_round: int | None = None
    # Set from the moment a fault (RECOVERING) or a planned change (RUNNING) stops the group
    # until the first step of the group that replaces it: then "training again" is recorded.
    regrouping: bool = False
    # The group that stopped (its name), while the job re-forms in the same attempt: a step of
    # any other group of this attempt is the new group's, should its 'joined' report be lost.
    stopped_group: str | None = None
    # sha256 of the Idempotency-Key it was submitted with: that key is deleted with the job.
    idempotency_digest: str | None = None
    # Where the current attempt's group resumes (service.decide.restore): decided once per attempt.
    restore: RestorePoint | None = None
    # While PENDING after losing a node: the survivors that hold its memory copy, kept for it a
    # while (service.decide.keep); None once it starts again.
    kept: KeptCopies | None = None
    # While a job of higher priority takes some or all of its nodes (`decide.preempt`).
    preempt: Preemption | None = None
    # While it runs on free nodes kept for a waiting job of its priority (`decide.backfill`); gone
    # once it gives them back, goes back to PENDING, ends, or that job no longer waits.
    borrowed: Borrow | None = None
    # The training loop's stalls for the snapshots it committed, added up (each commit reports its
    # own; the snapshot records themselves are pruned to `keep`): the goodput ledger's `snapshot`.
    snapshot_stall_s: float = 0.0
    # The ranks of the group that trains now flagged as stragglers (cleared with the group).
    stragglers: list[Straggler] = Field(default_factory=list)
    # The attempt last taken for hung: its nodes report their workers' stacks before they stop
    # them (`service.decide.hangs.decide_stacks`).
    hung_attempt: int | None = None
    # Its ranks as their nodes reported them so far (`decide_stacks` compares all of them).
    hung_ranks: dict[int, HungRank] = Field(default_factory=dict)
    # Nodes swapped out of the job as stragglers (`straggler_action: replace`): not taken back
    # while it runs (the last REPLACED_KEPT).
    replaced: list[str] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _progress_moved_out(cls, data):
        # Records written before restarts were counted by cause counted failures only.
        if isinstance(data, dict) and "restarts" in data:
            restarts = data["restarts"]
            data = {k: v for k, v in data.items() if k != "restarts"}
            data.setdefault("restarts_by_cause", {"failure": restarts})
        # Records written before progress had a key of its own carried it here.
        if isinstance(data, dict) and data.get("progress") is not None:
            data = {**data, "reports_progress": True}
        # Records written before job tokens were derived held the token itself.
        if isinstance(data, dict) and "token" in data:
            data = {k: v for k, v in data.items() if k != "token"} | {"legacy_token": data["token"]}
        return data

    @property
    def restarts(self) -> int:
        """The restarts that spend `max_restarts`: failures (`restarts_by_cause` has the rest)."""
        return self.restarts_by_cause.failure

    @property
    def rdzv_id(self) -> str:
        return f"{self.id}-a{self.attempt}"

    def view(self, progress: Progress | None = None) -> JobView:
        """What users see of the job; `progress` is read from its own key."""
        return JobView(
            id=self.id, name=self.spec.name, owner=self.owner, state=self.state, reason=self.reason,
            spec=self.spec.without_secrets(), secret_env_names=self.secret_env_names,
            created_at=self.created_at, updated_at=self.updated_at,
            finished_at=self.finished_at, attempt=self.attempt,
            nodes=sorted(n for n, m in self.members.items() if m.state != "stopped"),
            world_size=self.world_size, restarts=self.restarts,
            restarts_by_cause=self.restarts_by_cause,
            latest_snapshot=self.latest_snapshot, progress=progress,
            regrouping=self.regrouping or self.state in (JobState.STARTING, JobState.RECOVERING),
            stragglers=self.stragglers,
        )


class JobView(BaseModel):
    id: str
    name: str
    owner: str
    state: JobState = Field(..., description="PENDING (waiting for nodes), STARTING (given its nodes; no "
                            "step yet), RUNNING (steps are being made), RECOVERING (after a fault, until "
                            "the new group's first step), CANCELLING, then SUCCEEDED, FAILED or CANCELLED.")
    reason: str
    spec: JobSpec = Field(..., description="As submitted, without the secret env values.")
    secret_env_names: list[str] = Field(default_factory=list,
                                        description="The names of its secret env (never the values).")
    created_at: float
    updated_at: float
    finished_at: float | None = None
    attempt: int
    nodes: list[str]
    world_size: int
    restarts: int = Field(..., description="Restarts after a failure of its workers: the ones that "
                          "count against `spec.max_restarts` (`restarts_by_cause.failure`).")
    restarts_by_cause: RestartCounts = Field(
        default_factory=RestartCounts,
        description="Restarts by cause: failure (as `restarts`), lost_node, preemption, resize. Only "
                    "failures count against `spec.max_restarts`.")
    latest_snapshot: SnapshotMeta | None = None
    progress: Progress | None = None
    regrouping: bool = Field(False, description="Its group stopped (or has yet to start) and no step of "
                             "the new one has been seen yet: at the start (state STARTING), after a fault "
                             "(state RECOVERING) or for a planned change (a node joining, a drain: state "
                             "RUNNING); `reason` says which.")
    stragglers: list[Straggler] = Field(default_factory=list, description="Ranks of the group that "
                                        "trains now that are slower than the others (docs/stragglers.md).")
    waiting: str | None = Field(None, description="PENDING only: what it waits for, as of this read (the "
                                "nodes it needs against those registered, fitting and free, and the jobs "
                                "holding the rest).")


class MetricHistory(BaseModel):
    """A job's scalars over its steps, downsampled to a bounded number of points: columns of
    equal length (`steps[i]`, `times[i]`, `series[name][i]`; null where a scalar was not
    logged at that point). `stride`: the steps between two kept points at least (doubled
    each time the history fills up)."""

    stride: int = Field(1, ge=1)
    steps: list[int] = Field(default_factory=list)
    times: list[float] = Field(default_factory=list)
    series: dict[str, list[float | None]] = Field(default_factory=dict)


class JobList(BaseModel):
    items: list[JobView]
    next: str | None = Field(None, description="Pass as ?after= to get the next page.")


class Replay(BaseModel):
    """On the event of the first step of a group that replaced a stopped one (a fault, a lost
    node, a planned change): the steps it trains again, for the goodput ledger
    (service/decide/goodput.py)."""

    from_step: int = Field(..., description="The step the new group resumed from (its restore point).")
    reached_step: int = Field(..., description="The last step the stopped group reported.")
    reached_at: float = Field(..., description="When that report was stored.")
    step_s: float | None = Field(None, description="The stopped group's step time then (seconds), "
                                 "null if not known.")

    @property
    def steps(self) -> int:
        """The steps redone: those the stopped group had made past the restore point."""
        return max(0, self.reached_step - self.from_step)


class EventView(BaseModel):
    seq: int
    time: float
    state: JobState
    reason: str = Field(..., description="One line.")
    detail: str | None = Field(None, description="More than the line: e.g. the last log lines of a "
                                                 "failure (they are in the job's logs too).")
    by: str | None = Field(None, description="The user whose request caused it (submit, cancel).")
    leader: str | None = Field(None, description="For an event of the leader-only loops (the "
                               "scheduler, the hang watch): the leading control plane that wrote it "
                               "(its identity in the leader key: host, PID, ...).")
    term: int | None = Field(None, description="With `leader`: its term, the etcd revision at which it "
                             "took the lead; a later lead has a larger one.")
    replay: Replay | None = Field(None, description="On a job's first step after its group was replaced "
                                  "(ftrain runtime only): the steps it trains again.")


class GoodputView(BaseModel):
    """Where a job's wall time went (service/decide/goodput.py)."""

    wall_s: float = Field(..., description="From its submission to its end, or to now while it runs.")
    seconds: dict[str, float] = Field(..., description="The wall time by cause; the parts add up to "
                                      "`wall_s`: waiting, starting, training, replayed, snapshot, "
                                      "recovering, hung, resizing, preempted, suspended, stopping, "
                                      "unrecorded.")


class ClusterGoodput(GoodputView):
    """Every job's goodput added up: `wall_s` is the sum of their wall times."""

    jobs: int = Field(..., description="The jobs counted: those that exist and those retention deleted.")


class EventList(BaseModel):
    items: list[EventView]


class CancelResult(BaseModel):
    id: str
    state: JobState


class NewUser(_Strict):
    name: str = Field(..., min_length=1, max_length=40,
                      description="DNS label: lower-case letters, digits and '-'; not 'admin'.",
                      json_schema_extra={"pattern": DNS_LABEL.pattern, "not": {"const": ADMIN}})
    team: str | None = Field(None, min_length=1, max_length=40,
                             description="The team the user belongs to (a DNS label): its quota "
                                         "and its share of the cluster count the user's jobs.",
                             json_schema_extra={"pattern": DNS_LABEL.pattern})

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        dns_label(v)
        if v == ADMIN:
            raise ValueError(f"{ADMIN!r} is the admin (the server's own user token); choose another name")
        return v

    @field_validator("team")
    @classmethod
    def _team_label(cls, v: str | None) -> str | None:
        return None if v is None else dns_label(v)


MAX_QUOTA = 1_000_000


class QuotaPatch(_Strict):
    """A change of a user's or a team's quota: the fields sent are set, null clears one."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        "examples": [{"max_nodes": 2, "max_gpus": 16}], "minProperties": 1})

    max_nodes: JsonInt | None = Field(None, ge=0, le=MAX_QUOTA, description=(
        "The most nodes its running jobs may hold at once; null: no limit."))
    max_gpus: JsonInt | None = Field(None, ge=0, le=MAX_QUOTA, description=(
        "The most GPUs its running jobs may hold at once (a node's GPUs are held with it); "
        "null: no limit."))

    @model_validator(mode="after")
    def _some_field(self) -> QuotaPatch:
        if not self.model_fields_set:
            raise ValueError("send max_nodes, max_gpus or both (a number, or null to clear it)")
        return self

    def applied_to(self, record: _Quotas) -> dict[str, int | None]:
        """The quota fields of `record` with this change made."""
        return {"max_nodes": record.max_nodes, "max_gpus": record.max_gpus,
                **self.model_dump(include=self.model_fields_set)}


class _Quotas(BaseModel):
    max_nodes: int | None = Field(None, description="The most nodes its running jobs may hold at "
                                                    "once (null: no limit).")
    max_gpus: int | None = Field(None, description="The most GPUs its running jobs may hold at "
                                                   "once (null: no limit).")


class TeamRecord(_Quotas):
    """What etcd holds for a team: its quota (a team exists as its users name it)."""

    name: str


class TeamView(_Quotas):
    name: str
    members: list[str] = Field(default_factory=list, description="Its users, by name.")
    nodes_in_use: int = Field(0, description="Nodes its members' unfinished jobs hold now.")
    gpus_in_use: int = Field(0, description="The GPUs of those nodes.")


class TeamList(BaseModel):
    items: list[TeamView]


class UserRecord(_Quotas):
    """What etcd holds for a named user (its team and quota): never the token, only its SHA-256."""

    name: str
    id: str | None = Field(None, description="Minted at creation, never given again (None: a user "
                                             "stored before ids); its jobs store it.")
    token_sha256: str
    created_at: float
    team: str | None = None


class UserView(BaseModel):
    name: str
    created_at: float | None = None
    admin: bool = False


class UserAccount(UserView, _Quotas):
    """A user as the admin sees it: its team, its quota and what its jobs hold."""

    team: str | None = None
    nodes_in_use: int | None = Field(None, description="Nodes its unfinished jobs hold now "
                                                       "(in the list of users).")
    gpus_in_use: int | None = Field(None, description="The GPUs of those nodes.")


class UserList(BaseModel):
    items: list[UserAccount]


class WouldPreempt(BaseModel):
    """A running job that a waiting one takes nodes from if it is the next to start."""

    job_id: str
    priority: int
    how: Literal["shrink", "suspend"] = Field(..., description="shrink: it gives up `nodes` and goes "
                                                               "on on the rest; suspend: it gives up "
                                                               "every node and waits, its state kept.")
    nodes: list[str] = Field(..., description="The nodes it gives up.")
    under_way: bool = Field(False, description="The preemption is already going on (the job is "
                                               "giving these nodes up now).")
    fair_share: bool = Field(False, description="A give-back by fair share to a user holding no node, "
                                                "from a job of the same priority (docs/scheduling.md).")


class QueuedJob(BaseModel):
    position: int = Field(..., description="1: the next to start, as the scheduler orders the "
                                           "queue now (priority, then fair share, then age).")
    id: str
    name: str
    owner: str
    team: str | None = None
    priority: int
    nodes_min: int
    nodes_max: int
    created_at: float
    waiting: str | None = Field(None, description="What it waits for, as of this read.")
    would_preempt: list[WouldPreempt] = Field(
        default_factory=list, description="The running jobs it would take nodes from if it were the "
                                          "next to start, as the scheduler chooses them now (empty: "
                                          "none, it does not outrank enough of them, or it needs none).")


class QueueView(BaseModel):
    items: list[QueuedJob]


class UserCreated(UserView):
    team: str | None = None
    token: str = Field(..., description="The user's token: shown this once, stored only hashed.")


class NodeState(str, enum.Enum):
    READY = "READY"
    DRAINING = "DRAINING"  # drained, still holding a job's work
    DRAINED = "DRAINED"  # drained and idle (views only: the record says DRAINING)
    QUARANTINED = "QUARANTINED"  # sick (a failed health check, or failures that follow it): no work

    def takes_no_work(self) -> bool:
        """Out of service: given no new work, and its job goes on without it."""
        return self in (NodeState.DRAINING, NodeState.QUARANTINED)


class NodeRecord(BaseModel):
    """What etcd holds for a registered node, on a key bound to the node's lease."""

    name: str
    nproc_per_node: int = 1
    gpus: int = 0
    gpu_model: str | None = None
    address: str | None = None
    state: NodeState = NodeState.READY
    reason: str | None = None  # why it is QUARANTINED
    registered_at: float
    lease_id: int
    # sha256 (hex) of the node's credential (service.deps.new_node_credential); never the
    # credential itself. None: a record from before node credentials (it must register again).
    credential_sha256: str | None = None


class NodeView(BaseModel):
    name: str
    state: NodeState
    reason: str | None = Field(None, description="Why the node is QUARANTINED (a failed health check "
                               "and its output, or failures that followed it across jobs); "
                               "`ftrain undrain` puts it back in service.")
    nproc_per_node: int
    gpus: int = Field(0, description="GPUs this node's workers may use.")
    gpu_model: str | None = Field(None, description="Their model (null without GPUs).")
    address: str | None
    registered_at: float
    job: str | None = Field(None, description="The unfinished job this node belongs to, if any: it "
                                              "works on it, or has finished its part of it.")
    member_state: Literal["assigned", "running", "succeeded"] | None = Field(
        None, description="The node's part in `job`: assigned, running, or succeeded (its workers "
                          "exited 0; the node stays the job's, not free, until the job ends).")
    held_for: str | None = Field(None, description="A free node that holds the memory copy of a job "
                                 "waiting for nodes (it lost one): held for that job, given to no other, "
                                 "until the hold ends (FTRAIN_MEMORY_HOLD_S, 120 s by default, after the "
                                 "job went back to PENDING).")


class NodeList(BaseModel):
    items: list[NodeView]


class LogLine(BaseModel):
    seq: int = Field(..., description="The line's byte offset in the job's log: stable; "
                                      "`?since=seq` reads from this line on.")
    time: float
    node: str
    rank: int | None
    stream: str
    line: str
    attempt: int = 0


class LogPage(BaseModel):
    """A page of a job's log, and what the per-job cap has cut from its start."""

    items: list[LogLine]
    next_seq: int = Field(..., description="Pass it as `since` for the next page.")
    end_seq: int = Field(..., description="Where the log ends now: `next_seq == end_seq` means "
                                          "this page read to the end.")
    first_seq: int = Field(..., description="The oldest line still kept; earlier ones were cut.")
    cut_bytes: int = Field(..., description="Bytes of the log cut by the cap (its oldest).")
    cut_lines: int = Field(..., description="Lines of the log cut by the cap.")
    cap_bytes: int = Field(..., description="The per-job cap: only the newest this many bytes are kept.")
