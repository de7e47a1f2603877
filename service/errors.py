"""Domain errors of the control plane.

They are raised by the store and the state machine and mapped to HTTP responses in
one place, `error_response` (the app's exception handler and `service.fastpath` call it).
A handler never catches `Exception` itself.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from service.decide.retention import RetentionPolicy, describe


class FtrainError(Exception):
    """Base class of every error the control plane maps to an HTTP response."""

    status_code = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class StoreUnavailable(FtrainError):
    """etcd did not answer; worth retrying once it is back."""

    status_code = 503


class ReplyTooLarge(StoreUnavailable):
    """One reply of etcd would pass gRPC's 4 MiB limit: the reader asks for fewer entries."""


class StoreFull(StoreUnavailable):
    """etcd's NOSPACE alarm is raised: it refuses writes until an operator frees space."""


class HistoryCompacted(StoreUnavailable):
    """A watch asked for history that was compacted away: re-read, then watch from there."""

    def __init__(self, message: str, compact_revision: int):
        super().__init__(message)
        self.compact_revision = compact_revision


class LogStorageUnavailable(FtrainError):
    """The log root could not be read or written (missing, full, an I/O error); worth retrying."""

    status_code = 503


class JobNotFound(FtrainError):
    """No such job: never submitted, or deleted by retention (the API's 404 says which rule)."""

    status_code = 404

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id} not found")
        self.job_id = job_id


class NodeNotFound(FtrainError):
    status_code = 404

    def __init__(self, name: str):
        super().__init__(f"no node named {name!r} is registered (its lease may have lapsed)")
        self.name = name


class OutdatedCredential(FtrainError):
    """A node credential that is not its node's current one (the name registered again)."""

    status_code = 401

    def __init__(self, name: str):
        super().__init__(f"outdated node credential: node {name!r} registered again since it was "
                         "issued; register again")
        self.name = name


class UserNotFound(FtrainError):
    status_code = 404

    def __init__(self, name: str):
        super().__init__(f"no user named {name!r} (`ftrain users list` shows them)")
        self.name = name


class Forbidden(FtrainError):
    """The caller is who they say, but may not do this (another user's job, an admin's task)."""

    status_code = 403


class InvalidTransition(FtrainError):
    """A state change the job's state machine does not allow (e.g. out of a terminal state)."""

    status_code = 409

    def __init__(self, job_id: str, state: str, target: str):
        super().__init__(f"job {job_id} is {state}; it cannot become {target}")
        self.job_id = job_id
        self.state = state
        self.target = target


class Conflict(FtrainError):
    """The request conflicts with what is stored (e.g. an idempotency key reused)."""

    status_code = 409


class NodeNameTaken(Conflict):
    """A registration under the name of a node that is alive (its lease has not lapsed)."""

    def __init__(self, name: str, registered_at: float, ttl_s: int):
        super().__init__(
            f"node {name!r} is already registered and alive (since {registered_at:.0f}, "
            f"unix time): is another agent running with this name? Give this one another "
            f"--name, or stop the other and let its lease lapse (within {ttl_s} s of its last "
            f"heartbeat), or drain it (`ftrain drain {name}`) and register again.")
        self.name = name


class StaleLeader(Conflict):
    """A write fenced on the leader's key, from a control plane that no longer leads."""


class StaleAttempt(Conflict):
    """A write from an attempt that is no longer the job's current one."""


class InvalidField(FtrainError):
    """A request field that its own rules accept but the state of the job refuses (a snapshot
    path outside the job's snapshot directory): 422, naming the field, as a body that fails
    validation is answered."""

    status_code = 422

    def __init__(self, field: str, message: str):
        super().__init__(f"invalid request: {field}: {message}")
        self.field = field
        self.reason = message


class SnapshotNotFound(FtrainError):
    status_code = 404

    def __init__(self, job_id: str, step: int):
        super().__init__(f"job {job_id} has no committed snapshot at step {step}")
        self.job_id = job_id
        self.step = step


class ContentionError(FtrainError):
    """A compare-and-set lost its race too many times in a row; the client may retry."""

    status_code = 503


def error_response(exc: FtrainError, retention: RetentionPolicy) -> JSONResponse:
    """The answer to a domain error; `retention` is the control plane's (a 404 says how long
    finished jobs are kept)."""
    body: dict = {"detail": exc.message}
    headers = {}
    if isinstance(exc, JobNotFound):  # it may have existed: say how long jobs are kept
        body["detail"] = f"{exc.message} ({describe(retention)})"
    if isinstance(exc, InvalidTransition):
        body["state"] = exc.state
    if isinstance(exc, InvalidField):  # the shape of a body that fails validation (`_invalid`)
        body["errors"] = [{"field": exc.field, "message": exc.reason, "type": "value_error"}]
    if isinstance(exc, StoreUnavailable | LogStorageUnavailable):
        headers["Retry-After"] = "1"
    if exc.status_code == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=exc.status_code, headers=headers)
