"""The wire contract between a node (agent, torchrun's rendezvous, a training worker) and the
control plane: every request and response body that crosses it, as pydantic models.

Both sides import these models: the control plane's routes declare them as their bodies and
response models, and the worker side builds its requests and reads its replies with them, so
a field renamed on one side is renamed on the other. User-facing resources (job specs, job
views, the CLI's shapes) are the control plane's own, in `service.models`.

Groups, in the order a job meets them:
- node agent: register, heartbeat (the `Assignment`), report, log shipments;
- torchrun's rendezvous (`/v1/rdzv/{rdzv_id}`): state compare-and-set and the c10d store;
  bytes travel base64 (standard alphabet) in JSON;
- torchrun's round reports (`/v1/jobs/{id}/rounds`);
- the training runtime: snapshot commits and lists, corrupt reports, progress, control.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, Field, PlainSerializer, field_validator

NODE_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,62}[A-Za-z0-9])?$")
MAX_LINE_CHARS = 4000  # a log line longer than this is cut by the agent (`cut_line`)
# The most bytes of JSON an agent puts in one log shipment: well under the control plane's
# default body limit (64 KiB), since even a line of escapes (6 bytes a character) fits.
# A control plane with a smaller limit answers 413, and the agent halves its shipments.
MAX_SHIPMENT_BYTES = 48 * 1024
MAX_SHIPMENT_LINES = 2000


def cut_line(text: str) -> str:
    """`text`, or its start with a visible mark when it is longer than MAX_LINE_CHARS."""
    if len(text) <= MAX_LINE_CHARS:
        return text
    mark = f" [ftrain: line cut, {len(text)} characters in all]"
    return text[:MAX_LINE_CHARS - len(mark)] + mark


# ---------------------------------------------------------------------------- node agent

class RegisterRequest(BaseModel):
    name: str = Field(..., max_length=64)
    nproc_per_node: int = Field(1, ge=1, le=1024)
    address: str | None = Field(None, max_length=255)

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not NODE_NAME.match(v):
            raise ValueError("letters, digits, '-', '_' and '.', at most 64, starting and ending "
                             "with a letter or digit")
        return v


class RegisterReply(BaseModel):
    name: str
    lease_ttl_s: int
    heartbeat_interval_s: float
    lease_id: int = Field(..., description="Send it back with each heartbeat.")
    credential: str | None = Field(
        None, description="This node's own credential, bound to its name and lease: the bearer "
                          "token of its heartbeats, reports, log shipments and rendezvous calls. "
                          "Shown once; the control plane keeps only its hash.")


class Known(BaseModel):
    job_id: str
    attempt: int
    action: Literal["run", "stop"]


class HeartbeatRequest(BaseModel):
    # etcd lease ids are positive int64s; anything else would reach etcd's client and fail there.
    lease_id: int | None = Field(None, ge=1, le=2**63 - 1,
                                 description="From the registration; saves a read.")
    known: Known | None = Field(None, description="The assignment the node acts on now.")
    wait_s: float = Field(0.0, ge=0, le=30,
                          description="Hold the answer this long while the assignment is `known`.")


class Assignment(BaseModel):
    """What a node should be doing for one job; the agent reconciles towards it."""

    job_id: str
    attempt: int
    rdzv_id: str
    action: Literal["run", "stop"]
    command: list[str]
    working_dir: str | None
    env: dict[str, str]
    # The job's secret env: set in the workers' environment like `env`, and masked in the
    # output the agent ships (the control plane keeps these values out of etcd).
    secret_env: dict[str, str] = Field(default_factory=dict, repr=False)
    nproc_per_node: int | str
    nodes_min: int
    nodes_max: int
    job_token: str
    snapshot_root: str | None
    snapshot_every: int
    snapshot_keep: int
    global_batch_size: int | None
    cancel_grace_s: float


class HeartbeatReply(BaseModel):
    assignment: Assignment | None


class ReportRequest(BaseModel):
    job_id: str = Field(..., max_length=100)
    attempt: int
    state: Literal["running", "succeeded", "failed", "stopped"]
    exit_code: int | None = None
    reason: str | None = Field(None, max_length=8000)


class ReportReply(BaseModel):
    accepted: bool
    detail: str


class RoundReport(BaseModel):
    attempt: int
    node: str = Field(..., max_length=64)
    phase: Literal["joining", "joined"]
    call: int = Field(..., ge=0, description="How many times this torchrun re-rendezvoused before.")
    group_rank: int | None = Field(None, ge=0)
    group_world_size: int | None = Field(None, ge=1)


class LogLineIn(BaseModel):
    rank: int | None = Field(None, ge=0)
    stream: Literal["stdout", "stderr"] = "stdout"
    line: str = Field(..., max_length=MAX_LINE_CHARS)
    time: float


class LogShipment(BaseModel):
    node: str = Field(..., max_length=64)
    attempt: int = 0
    lines: list[LogLineIn] = Field(..., max_length=MAX_SHIPMENT_LINES)


# ---------------------------------------------------------------------------- rendezvous

def _b64decode(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if not isinstance(value, str):
        raise ValueError("must be a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"not valid base64: {exc}") from None


B64 = Annotated[bytes, BeforeValidator(_b64decode),
                PlainSerializer(lambda b: base64.b64encode(b).decode(), return_type=str)]
StoreKey = Annotated[str, Field(min_length=1, max_length=1024)]
OpId = Annotated[str | None, Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
                                   description="Makes a retried add/append apply once.")]


class RdzvState(BaseModel):
    state: B64 | None = Field(None, description="The pickled rendezvous state; null: none yet.")
    token: str | None = Field(None, description="Its fencing token (the etcd mod_revision).")


class StateChange(RdzvState):
    changed: bool = Field(..., description="The token is no longer `after`; false: the wait ended.")


class SetStateRequest(BaseModel):
    state: B64
    token: str | None = Field(None, max_length=64,
                              description="Token of the state this one replaces; null: create only.")


class SetStateResult(RdzvState):
    written: bool = Field(..., description="This request wrote `state`; else it is what won.")


class GetRequest(BaseModel):
    keys: list[StoreKey] = Field(..., min_length=1, max_length=4096)
    wait_s: float = Field(0.0, ge=0, le=600,
                          description="Wait this long (at most 5 s on the server) for missing keys.")
    values: bool = Field(True, description="false: only say whether all keys exist (wait, check).")


class GetResult(BaseModel):
    found: bool
    values: list[B64] | None = None


class StoreItem(BaseModel):
    key: StoreKey
    value: B64


class SetRequest(BaseModel):
    items: list[StoreItem] = Field(..., min_length=1, max_length=4096)


class AddRequest(BaseModel):
    key: StoreKey
    amount: int = Field(..., ge=-(2**62), le=2**62)
    op_id: OpId = None


class AddResult(BaseModel):
    value: int


class AppendRequest(BaseModel):
    key: StoreKey
    value: B64
    op_id: OpId = None


class CompareSetRequest(BaseModel):
    key: StoreKey
    expected: B64
    desired: B64


class ValueResult(BaseModel):
    value: B64


class DeleteRequest(BaseModel):
    key: StoreKey


class DeleteResult(BaseModel):
    deleted: bool


class NumKeysResult(BaseModel):
    count: int


# ---------------------------------------------------------------------------- training runtime

class SnapshotMeta(BaseModel):
    step: int = Field(..., ge=0)
    path: str = Field(..., min_length=1, max_length=4096)
    size: int = Field(..., ge=0)
    checksum: str = Field(..., min_length=1, max_length=200)
    time: float | None = None
    attempt: int | None = None


class Progress(BaseModel):
    step: int = Field(..., ge=0)
    loss: float | None = None
    samples_per_s: float | None = None
    time: float | None = None


class ControlAction(str, enum.Enum):
    """What the control plane asks rank 0 of a running job to do at its next step boundary."""

    NONE = "none"
    CHECKPOINT_PAUSE = "checkpoint_pause"  # snapshot, commit, then wait to be restarted (join, drain)
    CHECKPOINT_STOP = "checkpoint_stop"  # snapshot, commit, then exit 0 (cancel)


class SnapshotRecord(SnapshotMeta):
    """A committed snapshot as stored under `keys.snapshot(job, step)`."""

    bad: bool = Field(False, description="Failed its checksum when a worker read it back.")
    control_id: int | None = Field(None, description="The planned change this snapshot answered.")
    stall_s: float | None = Field(None, description="How long the training loop stalled for it.")
    write_s: float | None = Field(None, description="Background write and fsync time.")

    def meta(self) -> SnapshotMeta:
        return SnapshotMeta(**self.model_dump(include=set(SnapshotMeta.model_fields)))


class CommitRequest(BaseModel):
    step: int = Field(..., ge=0)
    path: str = Field(..., min_length=1, max_length=4096)
    size: int = Field(..., ge=0)
    checksum: str = Field(..., min_length=1, max_length=200)
    attempt: int = Field(..., ge=0, description="FTRAIN_ATTEMPT of the writer (fencing).")
    control_id: int | None = Field(None, ge=1, description="Acknowledges this control request.")
    stall_s: float | None = Field(None, ge=0)
    write_s: float | None = Field(None, ge=0)


class CommitResult(BaseModel):
    committed: SnapshotRecord
    latest: int | None = Field(None, description="Step of the job's latest snapshot after this commit.")
    prune: list[str] = Field(default_factory=list,
                             description="Snapshot files the writer should delete now (never the latest).")


class SnapshotList(BaseModel):
    items: list[SnapshotRecord]
    latest: int | None = None


class CorruptReport(BaseModel):
    reason: str = Field("checksum mismatch", max_length=500)


class ProgressReport(BaseModel):
    step: int = Field(..., ge=0)
    loss: float | None = None
    samples_per_s: float | None = Field(None, ge=0)
    attempt: int | None = Field(None, ge=0, description="If given, a stale attempt is refused.")


class ControlView(BaseModel):
    id: int = 0
    action: ControlAction = ControlAction.NONE
    reason: str = ""
