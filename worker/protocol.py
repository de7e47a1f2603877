"""The wire contract between a node (agent, torchrun's rendezvous, a training worker) and the
control plane: every request and response body that crosses it, as pydantic models.

Both sides import these models: the control plane's routes declare them as their bodies and
response models, and the worker side builds its requests and reads its replies with them, so
a field renamed on one side is renamed on the other. User-facing resources (job specs, job
views, the CLI's shapes) are the control plane's own, in `service.models`.

Groups, in the order a job meets them:
- node agent: register (with the control plane's `Timeouts`), heartbeat (the `Assignment`),
  report, log shipments;
- torchrun's rendezvous (`/v1/rdzv/{rdzv_id}`): state compare-and-set and the c10d store;
  bytes travel base64 (standard alphabet) in JSON;
- torchrun's round reports (`/v1/jobs/{id}/rounds`);
- the training runtime: snapshot commits and lists, corrupt reports, progress, control.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import math
import re
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    computed_field,
    field_validator,
    model_validator,
)

from .jsontypes import JsonBody, JsonBool, JsonFloat, JsonInt, integral
from .rdzv_state import MergeSpec

NODE_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,62}[A-Za-z0-9])?$")
MAX_LINE_CHARS = 4000  # a log line longer than this is cut by the agent (`cut_line`)
# The most bytes of JSON an agent puts in one log shipment: well under the control plane's
# default body limit (64 KiB), since even a line of escapes (6 bytes a character) fits.
# A control plane with a smaller limit answers 413, and the agent halves its shipments.
MAX_SHIPMENT_BYTES = 48 * 1024
# The etcd revision a job write made (answered with it, and with reads); a client sends back
# the highest it has seen, and no control plane answers it anything older.
REVISION_HEADER = "X-Ftrain-Revision"
# The longest a log follow (`GET /v1/jobs/{id}/logs?follow=true`) may be held with no new line
# (its `wait_s`); the CLI follows for this long at a time.
LOG_FOLLOW_MAX_WAIT_S = 30.0
MAX_SHIPMENT_LINES = 2000


def cut_line(text: str) -> str:
    """`text`, or its start with a visible mark when it is longer than MAX_LINE_CHARS."""
    if len(text) <= MAX_LINE_CHARS:
        return text
    mark = f" [ftrain: line cut, {len(text)} characters in all]"
    return text[:MAX_LINE_CHARS - len(mark)] + mark


# ---------------------------------------------------------------------------- node agent

# The bodies a node or a job's workers send are JsonBody: their numbers and booleans follow JSON
# Schema (worker/jsontypes.py): true is not a number, nor "3", nor 1 a boolean; 3.0 is an integer.


class RunningGroup(JsonBody):
    """A job attempt whose workers an agent is running."""

    job_id: str = Field(..., max_length=64)
    attempt: JsonInt = Field(..., ge=0)


class HealthCheck(JsonBody):
    name: str = Field(..., max_length=64, description="devices, matmul, memory, collective, or own "
                                                      "(the operator's --health-check).")
    ok: JsonBool
    detail: str = Field("", max_length=4096, description="What it found; the own check's output.")


class HealthReport(JsonBody):
    """A node's health checks (worker/health.py): run when it registers and between jobs."""

    ok: JsonBool = Field(..., description="Every check passed; false: the node is QUARANTINED.")
    checks: list[HealthCheck] = Field(default_factory=list, max_length=16)

    def reason(self) -> str:
        """What failed, for the node's quarantine."""
        failed = [c for c in self.checks if not c.ok]
        return "health check failed: " + "; ".join(f"{c.name}: {c.detail}".rstrip(": ") for c in failed)


class RegisterRequest(JsonBody):
    name: str = Field(..., max_length=64, json_schema_extra={"pattern": NODE_NAME.pattern})
    nproc_per_node: JsonInt = Field(1, ge=1, le=1024)
    gpus: JsonInt = Field(0, ge=0, le=1024, description="GPUs this node's workers may use.")
    gpu_model: str | None = Field(None, max_length=128, description="Their model, as nvidia-smi names it.")
    address: str | None = Field(None, max_length=255)
    running: RunningGroup | None = Field(
        None, description="What this agent still runs when it registers again because its lease "
                          "lapsed (say, while no control plane could hear it); null: nothing (a new "
                          "agent). A member that matches keeps its place instead of being stopped.")
    health: HealthReport | None = Field(
        None, description="The node's health checks, run before it registers; failing: it "
                          "registers QUARANTINED. Null: none were run.")
    previous_credential: str | None = Field(
        None, max_length=256,
        description="The credential this node's last registration returned (its agent keeps it "
                    "in a 0600 file in its data directory): a restarted agent takes its live name "
                    "back with it at once instead of waiting for the old lease to lapse. Any other "
                    "value (another node's, an outdated one) leaves a live name taken: 409.")

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not NODE_NAME.match(v):
            raise ValueError("letters, digits, '-', '_' and '.', at most 64, starting and ending "
                             "with a letter or digit")
        return v


class Timeouts(BaseModel):
    """The timing contract between the control plane and its nodes, in one place.

    The control plane owns it: its settings (`service.settings.Settings`, FTRAIN_<FIELD>)
    hold these fields, and every registration's reply carries them, so an agent (and the
    torchrun it starts, through --rdzv-conf) times its calls by the control plane it talks
    to. The defaults here are the only ones; a process that has not heard from a control
    plane (an agent before it registers, a torchrun started by hand) uses them.
    """

    node_ttl_s: int = Field(6, ge=2, description="A node that does not heartbeat for this long "
                                                 "is gone (the TTL of its etcd lease).")
    long_poll_s: float = Field(
        5.0, gt=0, le=60, description="The longest the control plane holds a rendezvous long poll "
                                      "(a blocking store read, a wait for the state to change) "
                                      "before it answers \"not yet\"; clients ask again.")
    presence_hold_s: float = Field(
        1.0, gt=0, le=30, description="How long the control plane holds an agent's presence "
                                      "request before answering it (service/presence.py).")
    control_ack_timeout_s: float = Field(
        15.0, gt=0, le=3600, description="How long rank 0 gets to snapshot at a step boundary "
                                         "before a planned change (a drain, a node leaving) goes "
                                         "ahead without it; a leaving agent waits this and a second.")

    @computed_field(description="How often an agent heartbeats: a quarter of the lease, so that "
                                "three beats may go missing before it lapses.")
    @property
    def heartbeat_interval_s(self) -> float:
        return max(self.node_ttl_s / 4, 0.5)


class RegisterReply(BaseModel):
    name: str
    timeouts: Timeouts = Field(..., description="The control plane's timing contract: the agent "
                                                "heartbeats, long-polls and waits by it.")
    lease_id: int = Field(..., description="Send it back with each heartbeat.")
    credential: str | None = Field(
        None, description="This node's own credential, bound to its name and lease: the bearer "
                          "token of its heartbeats, reports, log shipments and rendezvous calls. "
                          "Shown once; the control plane keeps only its hash.")


class Known(JsonBody):
    job_id: str
    attempt: JsonInt
    action: Literal["run", "stop"]


MAX_LEASE_ID = 2**63 - 1  # etcd's lease ids are int64s


class HeartbeatRequest(JsonBody):
    # etcd lease ids are positive int64s; a larger one is no lease of etcd's and is set aside (the
    # lease is read, as without one) rather than refused: the description has no maximum,
    # since near 2**63 a client comparing JSON numbers as doubles (as JSON Schema validators
    # may) takes ids past any bound for within it.
    lease_id: JsonInt | None = Field(None, ge=1, description="From the registration; saves a read. One "
                                     "past int64 is no etcd lease: set aside (the lease is read).")
    known: Known | None = Field(None, description="The assignment the node acts on now.")
    wait_s: JsonFloat = Field(0.0, ge=0, le=30,
                                description="Hold the answer this long while the assignment is `known`.")

    @field_validator("lease_id")
    @classmethod
    def _etcd_lease(cls, v: int | None) -> int | None:
        return v if v is None or v <= MAX_LEASE_ID else None


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
    # The attempt the control plane took for hung: before its group is stopped, the agent
    # collects every worker's Python stacks and reports them (`StacksReport`, worker/stacks.py).
    stacks_of: int | None = None


class HeartbeatReply(BaseModel):
    assignment: Assignment | None
    # With no assignment: the attempt this node runs (its `known`) ended taken for hung; the
    # agent collects its workers' stacks before it stops them (as `Assignment.stacks_of`).
    hung: Known | None = None


class ReportRequest(JsonBody):
    job_id: str = Field(..., max_length=100)
    attempt: JsonInt
    state: Literal["running", "succeeded", "failed", "stopped"]
    exit_code: JsonInt | None = None
    reason: str | None = Field(None, max_length=8000)


MAX_STACKS_CHARS = 64 * 1024  # of one rank's dump (worker.stacks.MAX_DUMP_BYTES)


class GroupCollectives(JsonBody):
    """Where one process group of a rank's flight recorder stood (worker/flight.py)."""

    pg: str = Field(..., max_length=200, description="the process group's name")
    last_enqueued: JsonInt = Field(..., ge=-1, description="the sequence number of the last "
                                   "collective this rank entered in the group (-1: none)")
    last_completed: JsonInt = Field(-1, ge=-1)
    op: str | None = Field(None, max_length=200, description="the last entered collective's op")


MAX_GROUPS = 64  # process groups of one rank reported


class RankStacks(JsonBody):
    rank: JsonInt = Field(..., ge=0)
    text: str = Field("", max_length=MAX_STACKS_CHARS, description="faulthandler's dump of every "
                      "thread ('' where the worker gave none).")
    collectives: list[GroupCollectives] | None = Field(
        None, max_length=MAX_GROUPS, description="its flight recorder's process groups (None: no "
        "dump came, the recorder is off or the worker did not answer)")


class StacksReport(JsonBody):
    """A node's workers' Python stacks, for an attempt the control plane took for hung."""

    job_id: str = Field(..., max_length=100)
    attempt: JsonInt = Field(..., ge=0)
    ranks: list[RankStacks] = Field(default_factory=list, max_length=1024)


class ReportReply(BaseModel):
    accepted: bool
    detail: str


class RoundReport(JsonBody):
    attempt: JsonInt
    node: str = Field(..., max_length=64)
    phase: Literal["joining", "joined"]
    call: JsonInt = Field(..., ge=0, description="How many times this torchrun re-rendezvoused before.")
    group_rank: JsonInt | None = Field(None, ge=0)
    group_world_size: JsonInt | None = Field(None, ge=1)
    round: JsonInt | None = Field(None, ge=0, description="torch's rendezvous round that formed the "
                                  "group (the same on every member node); null: not known.")


class LogLineIn(BaseModel):
    # its integers: see LogShipment (one call per shipment, not one per line)
    rank: JsonInt | None = Field(None, ge=0)
    stream: Literal["stdout", "stderr"] = "stdout"
    line: str = Field(..., max_length=MAX_LINE_CHARS)
    time: JsonFloat
    round: JsonInt | None = Field(None, ge=0, description="The rendezvous round of the group whose "
                                  "worker printed it (`RoundReport.round`), so that a replaced "
                                  "group's late lines are told apart; null: not known.")


class LogShipment(JsonBody):
    node: str = Field(..., max_length=64)
    attempt: JsonInt = 0
    lines: list[LogLineIn] = Field(..., max_length=MAX_SHIPMENT_LINES)

    @field_validator("lines", mode="before")
    @classmethod
    def _integral_lines(cls, lines):
        """The lines' integers (rank, round) as JsonBody makes a body's: 3.0 is 3."""
        if type(lines) is not list:
            return lines
        out = None
        for i, x in enumerate(lines):
            if type(x) is dict and (type(x.get("rank")) is float or type(x.get("round")) is float):
                out = out or list(lines)
                out[i] = {**x, **{k: integral(x[k]) for k in ("rank", "round") if k in x}}
        return lines if out is None else out


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


# Standard base64 with its padding, as `base64.b64decode(validate=True)` takes it.
_B64_PATTERN = r"^(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?$"
B64 = Annotated[bytes, BeforeValidator(_b64decode),
                PlainSerializer(lambda b: base64.b64encode(b).decode(), return_type=str),
                WithJsonSchema({"type": "string", "contentEncoding": "base64", "pattern": _B64_PATTERN})]
StoreKey = Annotated[str, Field(min_length=1, max_length=1024)]
OpId = Annotated[str | None, Field(None, pattern=r"^[A-Za-z0-9_-]{1,64}$",
                                   description="Makes a retried add/append apply once.")]


# A rendezvous state is stored and sent sealed: this header, the SHA-256 of the pickled state,
# then the state. The client seals what torch gives it and opens what it reads, so a state
# damaged at rest (or written by anything but a rendezvous client) is told from a valid one
# (torch's own backends do the same with their base64 layer); the control plane refuses to
# store a state that is not sealed.
# Version 1 holds torch's pickle, which the control plane never opens; version 2 holds the same
# state as JSON (`worker.rdzv_state.RdzvDoc`), which the control plane reads to merge joins.
STATE_SEAL = b"ftrain-rdzv-state/1\n"
STATE_SEAL_V2 = b"ftrain-rdzv-state/2\n"
_DIGEST_BYTES = 32


class StateNotSealed(ValueError):
    """Bytes that are not a sealed rendezvous state, or whose seal does not match them."""


def seal_state(state: bytes, version: int = 1) -> bytes:
    """`state` as it is stored and sent: the seal, its SHA-256, the state."""
    return (STATE_SEAL_V2 if version == 2 else STATE_SEAL) + hashlib.sha256(state).digest() + state


def state_version(sealed: bytes) -> int:
    """2 for a state sealed as JSON (`RdzvDoc`), else 1 (`open_state` checks the seal)."""
    return 2 if sealed.startswith(STATE_SEAL_V2) else 1


def open_state(sealed: bytes) -> bytes:
    """The state inside `sealed`; StateNotSealed if it is not one `seal_state` made."""
    head = len(STATE_SEAL)
    if not sealed.startswith((STATE_SEAL, STATE_SEAL_V2)) or len(sealed) < head + _DIGEST_BYTES:
        raise StateNotSealed(f"{len(sealed)} bytes that do not start with the rendezvous state's "
                             f"seal {STATE_SEAL!r}")
    digest, state = sealed[head:head + _DIGEST_BYTES], sealed[head + _DIGEST_BYTES:]
    if hashlib.sha256(state).digest() != digest:
        raise StateNotSealed(f"a sealed state of {len(state)} bytes whose SHA-256 does not match its seal")
    return state


def _sealed(value: bytes) -> bytes:
    open_state(value)  # a ValueError: 422, with its message
    return value


class ControlPlaneOutage(BaseModel):
    """A time in which the control plane answering could not reach etcd (it was down, stopped,
    or cut off from it): no rendezvous keep-alive could land through it then."""

    started: float = Field(..., description="Wall clock (s); 0: unknown (it had just started).")
    ended: float = Field(..., description="Wall clock (s) when it was in touch again.")


class RdzvState(BaseModel):
    state: B64 | None = Field(None, description="The sealed rendezvous state (`seal_state` of the "
                                                "pickle torch made); null: none yet.")
    token: str | None = Field(None, description="Its fencing token (the etcd mod_revision).")
    outage: ControlPlaneOutage | None = Field(
        None, description="The answering control plane's last outage, if it ended within a minute.")


class StateChange(RdzvState):
    changed: bool = Field(..., description="The token is no longer `after`; false: the wait ended.")
    kept_alive: bool = Field(False, description="The node named in `alive` is kept alive while it "
                                                "polls; with `changed` false, `state` is left out.")


class SetStateRequest(BaseModel):
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["state"], "properties": {"state": {"type": "string"}}},
        {"required": ["merge"], "properties": {"merge": {"type": "object"}}}]})

    state: Annotated[B64, AfterValidator(_sealed)] | None = Field(
        None, description="The whole new state; null only with `merge`, which then says the change "
                          "(a join does not send N nodes' state).")
    token: str | None = Field(None, max_length=64,
                              description="Token of the state this one replaces; null: create only.")
    merge: MergeSpec | None = Field(None, description="The change this write makes (a version-2 "
                                                      "state only): merged into a newer state "
                                                      "instead of losing to it (worker.rdzv_state).")

    @model_validator(mode="after")
    def _state_or_merge(self) -> SetStateRequest:
        if self.state is None and self.merge is None:
            raise ValueError("give the new state, or the change as `merge`")
        return self


class SetStateResult(RdzvState):
    written: bool = Field(..., description="This request wrote `state`; else it is what won.")


class GetRequest(JsonBody):
    keys: list[StoreKey] = Field(..., min_length=1, max_length=4096)
    wait_s: JsonFloat = Field(0.0, ge=0, le=600,
                                description="Wait this long (at most the control plane's "
                                            "`long_poll_s`) for missing keys.")
    values: JsonBool = Field(True, description="false: only say whether all keys exist (wait, check).")


class GetResult(BaseModel):
    found: bool
    values: list[B64] | None = None


class StoreItem(BaseModel):
    key: StoreKey
    value: B64


class SetRequest(BaseModel):
    items: list[StoreItem] = Field(..., min_length=1, max_length=4096)


class AddRequest(JsonBody):
    key: StoreKey
    # No bounds: the store keeps the sum as a decimal string (Python's ints do not overflow), and
    # bounds near 2**62 read as doubles let a client take a value past them for within them.
    amount: JsonInt
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


MAX_RANKS_TIMED = 4096  # the most ranks whose step times one progress report carries


class RankTime(JsonBody):
    """One rank's step time since its group started (after its warm-up steps), summed: what
    rank 0 gathers from every rank and reports with its progress (worker/step_timing.py)."""

    rank: JsonInt = Field(..., ge=0)
    node: str | None = Field(None, max_length=64, description="The node the rank runs on.")
    steps: JsonInt = Field(..., ge=0, description="Steps timed so far.")
    compute_s: JsonFloat = Field(..., ge=0, description="Seconds of those steps not spent waiting "
                                 "in collectives (nor in the runtime's own snapshot copies).")
    wait_s: JsonFloat = Field(..., ge=0, description="Seconds of those steps spent waiting in "
                              "collectives (the gradient all-reduce, the step's control broadcast).")


class StragglerSample(BaseModel):
    """One interval between two stored reports: the ranks whose compute time per step was at
    least the job's straggler factor times the median of the others' (`over`: rank -> ratio)."""

    time: float
    over: dict[int, float] = Field(default_factory=dict)


class Progress(BaseModel):
    step: int = Field(..., ge=0)
    loss: float | None = None
    samples_per_s: float | None = None
    time: float | None = None
    total_steps: int | None = Field(None, description="The steps the script means to make, if it said.")
    steps_per_s: float | None = Field(None, description="Recent training speed (smoothed over reports).")
    percent: float | None = Field(None, description="step / total_steps, in percent.")
    eta_s: float | None = Field(None, description="Seconds to total_steps at steps_per_s, as of `time`.")
    metrics: dict[str, float] = Field(default_factory=dict,
                                      description="The latest value of each scalar the script logs.")
    ranks: list[RankTime] = Field(default_factory=list, description="Each rank's step time, split "
                                  "into compute and waiting in collectives (summed since its group "
                                  "started), as last reported.")
    ranks_since: float | None = Field(None, description="When the group whose `ranks` these are "
                                      "was first timed here.")
    ranks_of: str | None = Field(None, description="That group: '<attempt>:<group>'.")
    straggler_samples: list[StragglerSample] = Field(
        default_factory=list, description="The intervals of the straggler window (service/decide/stragglers.py).")


class ControlAction(str, enum.Enum):
    """What the control plane asks rank 0 of a running job to do at its next step boundary."""

    NONE = "none"
    CHECKPOINT_PAUSE = "checkpoint_pause"  # snapshot, commit, then wait to be restarted (join, drain)
    CHECKPOINT_STOP = "checkpoint_stop"  # snapshot, commit, then exit 0 (cancel)


# A sharded snapshot's manifest, written last by rank 0 (worker/sharded.py); the agent's
# hand-over checks a sharded snapshot by it (worker/handoff.py), without importing torch.
SHARDED_MANIFEST = "ftrain-manifest.json"
SHARDS_DOC = ("A sharded snapshot (an FSDP2 model): `path` is a directory holding this many ranks' "
              "shards (torch.distributed.checkpoint), loadable at any world size; none: one file.")


class SnapshotRecord(SnapshotMeta):
    """A committed snapshot as stored under `keys.snapshot(job, step)`."""

    tier: Literal["disk"] = Field("disk", description="The durable tier: a file in the snapshot store.")

    bad: bool = Field(False, description="Failed its checksum when a worker read it back.")
    control_id: int | None = Field(None, description="The planned change this snapshot answered.")
    stall_s: float | None = Field(None, description="How long the training loop stalled for it.")
    write_s: float | None = Field(None, description="Background write and fsync time.")
    shards: int | None = Field(None, description=SHARDS_DOC)

    def meta(self) -> SnapshotMeta:
        return SnapshotMeta(**self.model_dump(include=set(SnapshotMeta.model_fields)))


class CommitRequest(JsonBody):
    step: JsonInt = Field(..., ge=0)
    path: str = Field(..., min_length=1, max_length=4096)
    size: JsonInt = Field(..., ge=0)
    checksum: str = Field(..., min_length=1, max_length=200)
    attempt: JsonInt = Field(..., ge=0, description="FTRAIN_ATTEMPT of the writer (fencing).")
    control_id: JsonInt | None = Field(None, ge=1, description="Acknowledges this control request.")
    stall_s: JsonFloat | None = Field(None, ge=0)
    write_s: JsonFloat | None = Field(None, ge=0)
    shards: JsonInt | None = Field(None, ge=1, le=1_000_000, description=SHARDS_DOC)


class CommitResult(BaseModel):
    committed: SnapshotRecord
    latest: int | None = Field(None, description="Step of the job's latest snapshot after this commit.")
    prune: list[str] = Field(default_factory=list,
                             description="Snapshot files the writer should delete now (never the latest).")


def steps_to_prune(bad_by_step: dict[int, bool], latest_step: int | None, keep: int) -> list[int]:
    """Which committed snapshots a commit prunes (`CommitResult.prune`), oldest first: all but
    the latest and the newest good ones, `keep` in all. The one rule for both sides: the
    control plane's commit (`service.decide.snapshots`) and the local twin (`LocalLink`)."""
    kept: set[int] = set()
    if latest_step is not None and latest_step in bad_by_step:
        kept.add(latest_step)
    for step in sorted(bad_by_step, reverse=True):
        if len(kept) >= keep:
            break
        if not bad_by_step[step]:
            kept.add(step)
    return sorted(step for step in bad_by_step if step not in kept)


class MemoryReport(JsonBody):
    """A node's first worker: the newest whole copy in the node's memory tier (worker/memory.py)."""

    step: JsonInt = Field(..., ge=0)
    attempt: JsonInt = Field(..., ge=0, description="FTRAIN_ATTEMPT of the reporter (fencing).")


class MemorySnapshot(BaseModel):
    """What a member node's memory tier holds, as it last reported (about once a second)."""

    tier: Literal["memory"] = "memory"
    node: str
    step: int
    attempt: int = Field(..., description="The attempt whose worker reported it.")
    time: float | None = None


class SnapshotList(BaseModel):
    items: list[SnapshotRecord]
    latest: int | None = None
    memory: list[MemorySnapshot] = Field(
        default_factory=list, description="Each member node's memory-tier copy (tier \"memory\"); a "
        "restart resumes from the newest copy a surviving node holds when it is at least as new as "
        "`latest`, else from `latest`.")


class RestoreRequest(JsonBody):
    """Rank 0 of a (re)started group: which state should every rank load?"""

    attempt: JsonInt = Field(..., ge=0, description="FTRAIN_ATTEMPT of the asker (fencing).")


class RestorePoint(BaseModel):
    """The control plane's answer (service/decide/restore.py): the newest step a member
    node's memory tier holds (reported under this attempt) when it is at least the disk's
    latest, else the disk's latest, else nothing."""

    attempt: int
    tier: Literal["memory", "disk", "none"]
    step: int | None = None
    nodes: list[str] = Field(default_factory=list, description="The members that hold `step` in memory.")
    reason: str = ""


class BrokenPeer(JsonBody):
    """A worker's process group broke (a peer's connection closed, a collective failed)."""

    attempt: JsonInt = Field(..., ge=0)
    node: str = Field(..., max_length=253, description="The reporter's node (FTRAIN_NODE).")
    detail: str = Field("", max_length=500)


class RunFinished(JsonBody):
    """A node's workers finished the run: the ftrain runtime's clean `finish()`, sent by the
    node's first worker once every rank has passed the run's last barrier."""

    attempt: JsonInt = Field(..., ge=0)
    node: str = Field(..., max_length=253, description="The node whose workers finished (FTRAIN_NODE).")


class Suspects(BaseModel):
    """The member nodes a broken-peer report made suspect (lost if their agent's connection
    dropped too)."""

    nodes: list[str] = Field(default_factory=list)


class MemoryCorrupt(JsonBody):
    """A worker found its node's memory copy damaged (checksum) and fell back."""

    attempt: JsonInt = Field(..., ge=0)
    step: JsonInt = Field(..., ge=0)
    reason: str = Field("checksum mismatch", max_length=500)


class CorruptReport(BaseModel):
    reason: str = Field("checksum mismatch", max_length=500)


MAX_METRICS = 16  # scalars a job may log besides loss and throughput (more are refused)
METRIC_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_./-]{0,63}$")


def _check_metrics(metrics: dict[str, float]) -> dict[str, float]:
    if len(metrics) > MAX_METRICS:
        raise ValueError(f"{len(metrics)} metrics in one report; at most {MAX_METRICS}")
    for name, value in metrics.items():
        if not METRIC_NAME.match(name):
            raise ValueError(f"metric name {name!r}: use letters, digits, _ . / - (at most 64, "
                             "starting with a letter or _)")
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} is {value}: only finite values are kept")
    return metrics


class ProgressReport(JsonBody):
    step: JsonInt = Field(..., ge=0)
    loss: JsonFloat | None = None
    samples_per_s: JsonFloat | None = Field(None, ge=0)
    total_steps: JsonInt | None = Field(None, ge=1, description="The steps the script means to make.")
    metrics: Annotated[dict[str, JsonFloat], AfterValidator(_check_metrics)] = Field(
        json_schema_extra={"propertyNames": {"pattern": METRIC_NAME.pattern}, "maxProperties": MAX_METRICS},
        default_factory=dict, description=f"Scalars the script logged (`rt.log`), at most {MAX_METRICS}.")
    attempt: JsonInt | None = Field(None, ge=0, description="If given, a stale attempt is refused.")
    group: str | None = Field(None, max_length=200, description="FTRAIN_GROUP of the reporter: the "
                              "rendezvous round its group formed in ('<node>/<round>').")
    ranks: list[RankTime] = Field(default_factory=list, max_length=MAX_RANKS_TIMED,
                                  description="Every rank's step time, gathered by rank 0.")
    final: JsonBool = Field(False, description="Rank 0's last report of its run (its script is "
                              "ending): stored whatever the rate limit, so a finished job shows its "
                              "last step.")


class ControlView(BaseModel):
    id: int = 0
    action: ControlAction = ControlAction.NONE
    reason: str = ""


# One-line failure reasons: the node's report and the control plane's "restarts spent" both
# pick the line that says why from the workers' last lines (the lines stay in the logs).

COMMAND_NOT_FOUND = "ftrain: command not found: "  # worker/launch.py prints it (exit 127)
COMMAND_NOT_EXECUTABLE = "ftrain: command not executable: "  # (exit 126)
ERROR_LINE = re.compile(r"^(\[rank\d+( stderr)?\] )?[\w.]*(Error|Exception|Interrupt|Exit)\b")


def telling_line(lines: list[str], width: int = 300) -> str | None:
    """The line of a failed run's last `lines` that says why: a missing command named as
    such, else the last error line (`ValueError: ...`), else the last stderr line (marked
    `[rankN stderr]` by the log store), else the last line; None if none."""
    for line in lines:
        for said in (COMMAND_NOT_FOUND, COMMAND_NOT_EXECUTABLE):
            if said in line:
                return line[line.index(said) + len("ftrain: "):][:width]
    errors = [x.strip() for x in lines if ERROR_LINE.match(x.strip())]
    if errors:
        return errors[-1][:width]
    said = [x.strip() for x in lines if x.strip()]
    last = next((x for x in reversed(said) if " stderr] " in x), said[-1] if said else None)
    return last[:width] if last else None


_TORCH_RANK_PREFIX = re.compile(r"^(\[rank\d+\]:\s*)+")
# What an error says when a worker's process group lost a peer (gloo's and NCCL's words; the
# runtime's excepthook and the agent's reading of a plain script's output both use them).
PEER_GONE = ("connection closed by peer", "connection reset by peer", "broken pipe", "econnreset",
             "socket closed", "remote process exited", "nccl communicator was aborted")


def says_peer_gone(line: str) -> bool:
    """Whether a worker's output line is the error of a process group that lost a peer
    (`RuntimeError: [...] Connection closed by peer`, `...DistNetworkError: ...`; torch may
    put its own `[rank0]: ` before a worker's uncaught error)."""
    text = _TORCH_RANK_PREFIX.sub("", line.strip())
    if not ERROR_LINE.match(text):
        return False
    lowered = text.lower()
    return "distnetworkerror" in lowered.split(":", 1)[0] or any(s in lowered for s in PEER_GONE)
