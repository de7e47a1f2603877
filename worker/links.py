"""The control plane as rank 0 of a training job sees it: the `Link` seam and its two sides.

`ServiceLink` is the job's endpoints on the control plane (snapshots, corrupt reports,
progress, control), over HTTP with the job token; `LocalLink` is its local twin for a
script run without the service, a `snapshots.json` index next to the snapshot files. The
runtime uses either through `Link` and cannot tell them apart, except where the twin
deliberately differs: it takes no progress reports, never asks for a planned change, and
has no attempts to fence (tests/contract/test_link.py runs the same cases against both).

Calls that must not be lost (listing, committing, reporting a corrupt snapshot) are
retried while the control plane does not answer, for `ServiceLink.RETRY_S`; a progress
report or a control poll is tried once, as the next one comes within a second anyway. A
commit that still gets no answer (or a server error) raises `CommitUnreachable`, which the
snapshot writer keeps trying in the background for as long as it takes (`worker.snapshot`);
a refused one (409) raises `Fenced`, which ends the worker.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from pydantic import BaseModel, ValidationError

from .http import ApiError, CommitUnavailable, ControlPlaneClient, HttpError, Unreachable
from .protocol import (
    BrokenPeer,
    CommitRequest,
    CommitResult,
    ControlView,
    CorruptReport,
    MemoryCorrupt,
    MemoryReport,
    ProgressReport,
    RankTime,
    ReportReply,
    RestorePoint,
    RestoreRequest,
    RunFinished,
    SnapshotList,
    SnapshotRecord,
    steps_to_prune,
)

if TYPE_CHECKING:  # (worker/snapshot.py imports torch: the node agent reports through here)
    from . import snapshot as snap

log = logging.getLogger("ftrain.runtime")
Model = TypeVar("Model", bound=BaseModel)


class Fenced(RuntimeError):
    """The control plane refused a commit: this worker belongs to an attempt that is over."""


class LinkError(RuntimeError):
    """The control plane answered with an error (or not at all)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class CommitUnreachable(LinkError, CommitUnavailable):
    """A commit got no answer (or a server error) within `ServiceLink.RETRY_S`: try it later."""


@dataclass(frozen=True)
class ControlRequest:
    """What the control plane last asked rank 0 to do; id 0 and "none": nothing."""

    id: int = 0
    action: str = "none"
    reason: str = ""


@dataclass(frozen=True)
class CommittedSnapshot:
    """A snapshot the link lists as committed; `bad` once it failed its checksum."""

    step: int
    path: str
    size: int
    checksum: str
    bad: bool = False


class Link(Protocol):
    """The control plane as rank 0 sees it; `ServiceLink` or the local twin `LocalLink`."""

    def snapshots(self) -> tuple[list[CommittedSnapshot], int | None]: ...
    def commit(self, written: snap.WrittenSnapshot, stall_s: float, control_id: int | None) -> list[str]: ...
    def report_corrupt(self, step: int, reason: str) -> None: ...
    def report_progress(self, step: int, loss: float | None, samples_per_s: float | None,
                        final: bool = False, metrics: dict[str, float] | None = None,
                        total_steps: int | None = None, ranks: list[RankTime] | None = None) -> int | None: ...
    def control(self) -> ControlRequest: ...
    def report_memory(self, node: str, step: int) -> None: ...
    def restore_point(self, held: int | None) -> RestorePoint: ...
    def report_memory_corrupt(self, node: str, step: int, reason: str) -> None: ...
    def report_broken(self, node: str, detail: str) -> None: ...


def _committed(items: list[dict]) -> list[CommittedSnapshot]:
    return [CommittedSnapshot(step=i["step"], path=i["path"], size=i["size"], checksum=i["checksum"],
                              bad=bool(i.get("bad", False))) for i in items]


def _committed_records(items: list[SnapshotRecord]) -> list[CommittedSnapshot]:
    return [CommittedSnapshot(step=i.step, path=i.path, size=i.size, checksum=i.checksum, bad=i.bad)
            for i in items]


class ServiceLink:
    """The job's endpoints on the control plane, over HTTP with the job token."""

    # How long a call that must not be lost (a commit, a listing, a corrupt report) is
    # retried while the control plane does not answer: the 0.2 s doubling to 2 s between
    # six tries that it was before there was one retry policy.
    RETRY_S = 5.0
    # The control planes' time, all together, to answer the final progress report
    # (`report_progress`); within the 5 s that the worker's end waits for it.
    FINAL_REPORT_S = 4.0

    def __init__(self, server: str, job_id: str, token: str, attempt: int, timeout_s: float = 10.0,
                 group: str | None = None):
        self.attempt = attempt
        self.group = group  # FTRAIN_GROUP: the rendezvous round this worker's group formed in
        self.timeout_s = timeout_s
        # `server`: one URL or several, comma-separated (any replica serves; see worker/http.py).
        self._client = ControlPlaneClient(server, token, suffix=f"/v1/jobs/{job_id}", timeout=timeout_s)

    def _call(self, method: str, path: str, body: Any = None, retry_s: float = 0.0,
              timeout: float | None = None) -> Any:
        try:
            return self._client.call(method, path, body, retry_s=retry_s, timeout=timeout)
        except ApiError as exc:
            raise LinkError(str(exc), exc.status) from exc
        except Unreachable as exc:  # its message names the request
            raise LinkError(f"control plane unreachable: {exc}", exc.status) from exc
        except HttpError as exc:
            raise LinkError(f"control plane request failed: {exc}", exc.status) from exc

    def _retrying(self, method: str, path: str, body: Any = None) -> Any:
        """Retry what is worth retrying (no answer, 502/503/504); a 4xx is an answer."""
        return self._call(method, path, body, retry_s=self.RETRY_S)

    @staticmethod
    def _read(model: type[Model], got: Any) -> Model:
        try:
            return model.model_validate(got)
        except ValidationError as exc:
            raise LinkError(f"the control plane sent an unexpected {model.__name__}: {exc}") from exc

    def snapshots(self) -> tuple[list[CommittedSnapshot], int | None]:
        got = self._read(SnapshotList, self._retrying("GET", "/snapshots"))
        return _committed_records(got.items), got.latest

    def request_of(self, written: snap.WrittenSnapshot, stall_s: float,
                   control_id: int | None) -> CommitRequest:
        """The commit of `written` as this worker sends it (or leaves it to its agent: worker/handoff.py)."""
        return CommitRequest(step=written.step, path=written.path, size=written.size,
                             checksum=written.checksum, attempt=self.attempt, control_id=control_id,
                             stall_s=round(stall_s, 6), write_s=round(written.write_s, 6),
                             shards=written.shards)

    def commit(self, written: snap.WrittenSnapshot, stall_s: float, control_id: int | None) -> list[str]:
        return self.commit_request(self.request_of(written, stall_s, control_id))

    def commit_request(self, body: CommitRequest, retry_s: float | None = None) -> list[str]:
        """Send one commit (its attempt is the writer's), retried for `retry_s` (default
        `RETRY_S`) while no control plane answers; the paths it prunes."""
        retry_s = self.RETRY_S if retry_s is None else retry_s
        try:
            return self._read(CommitResult, self._call("POST", "/snapshots", body, retry_s=retry_s)).prune
        except LinkError as exc:
            if exc.status == 409:
                raise Fenced(f"snapshot of step {body.step} refused: {exc}") from exc
            if isinstance(exc.__cause__, Unreachable) or (exc.status or 0) >= 500:
                raise CommitUnreachable(f"commit of step {body.step}: {exc}", exc.status) from exc
            raise

    def report_corrupt(self, step: int, reason: str) -> None:
        self._retrying("POST", f"/snapshots/{step}/corrupt", CorruptReport(reason=reason[:500]))

    def report_progress(self, step: int, loss: float | None, samples_per_s: float | None,
                        final: bool = False, metrics: dict[str, float] | None = None,
                        total_steps: int | None = None, ranks: list[RankTime] | None = None) -> int | None:
        """The step the control plane holds after it (a report within its rate limit of the
        stored one is answered, not stored)."""
        body = self.progress_request(step, loss, samples_per_s, final, metrics, total_steps, ranks)
        # The final one is awaited by the worker's end (`ControlChannel.stop`, worker/control.py, 5 s): it must
        # fail within that when no control plane answers (a stopped one never does), so that
        # it is left to the node agent (worker/handoff.py) rather than lost with the process.
        each = self.FINAL_REPORT_S / max(1, len(self._client.servers))  # one try at each
        return self.send_progress(body, timeout=each if final else None)

    def progress_request(self, step: int, loss: float | None, samples_per_s: float | None,
                         final: bool = False, metrics: dict[str, float] | None = None,
                         total_steps: int | None = None, ranks: list[RankTime] | None = None) -> ProgressReport:
        # int(): the report's numbers are strict (a script's step may be a numpy integer)
        return ProgressReport(step=int(step), loss=loss, samples_per_s=samples_per_s, attempt=self.attempt,
                              group=self.group, final=final, metrics=metrics or {}, ranks=ranks or [],
                              total_steps=None if total_steps is None else int(total_steps))

    def send_progress(self, body: ProgressReport, retry_s: float = 0.0,
                      timeout: float | None = None) -> int | None:
        """One progress report (tried once unless `retry_s`); `LinkError` if it did not land;
        the step the control plane holds after it."""
        got = self._call("POST", "/progress", body, retry_s=retry_s, timeout=timeout)
        return got.get("step") if isinstance(got, dict) else None

    def report_finished(self, node: str, final: bool = True) -> bool:
        """`node`'s workers finished the run (`Progress.say_finished`, worker/progress.py); whether the control
        plane took it (False: not a live member of this attempt). `final`: one try at each
        control plane within FINAL_REPORT_S, as the final progress report (a worker on its way
        out leaves it to its agent instead, worker/handoff.py); else one plain try."""
        each = self.FINAL_REPORT_S / max(1, len(self._client.servers)) if final else None
        got = self._call("POST", "/finished", RunFinished(attempt=self.attempt, node=node), timeout=each)
        return self._read(ReportReply, got).accepted

    def control(self) -> ControlRequest:
        got = self._read(ControlView, self._call("GET", "/control"))
        return ControlRequest(id=got.id, action=got.action.value, reason=got.reason)

    def report_memory(self, node: str, step: int) -> None:
        """What this node's memory tier holds (tried once: the next report comes soon)."""
        self._call("PUT", f"/memory/{node}", MemoryReport(step=step, attempt=self.attempt))

    def report_memory_held(self, node: str, step: int) -> None:
        """The same, at a restart: retried, since the restore point is decided from it."""
        self._retrying("PUT", f"/memory/{node}", MemoryReport(step=step, attempt=self.attempt))

    def restore_point(self, held: int | None) -> RestorePoint:
        """The control plane's restore point of this attempt (decided from the members'
        reports of it; `held` is not sent: this node's first worker reported it)."""
        try:
            return self._read(RestorePoint, self._retrying("POST", "/restore",
                                                           RestoreRequest(attempt=self.attempt)))
        except LinkError as exc:
            if exc.status == 409:
                raise Fenced(f"no restore point for attempt {self.attempt}: {exc}") from exc
            raise

    def report_broken(self, node: str, detail: str) -> None:
        """This worker's process group broke (tried once: the worker is on its way out)."""
        self._call("POST", "/broken", BrokenPeer(attempt=self.attempt, node=node, detail=detail[:500]))

    def report_memory_corrupt(self, node: str, step: int, reason: str) -> None:
        self._retrying("POST", f"/memory/{node}/corrupt",
                       MemoryCorrupt(attempt=self.attempt, step=step, reason=reason[:500]))

    def close(self) -> None:
        """Close its connections (a link made for one report; a worker's lives as long as it)."""
        self._client.close()


def report_broken_peer(link: Link, node: str, detail: str, *, close: bool = False) -> threading.Thread:
    """Tell the control plane that `node`'s process group lost a peer, from a daemon thread
    started here; the one way a worker (the runtime's exit hook and peer watch) and an agent
    (a plain script's worker line, `worker.torchrun`) report it. Its callers must not wait
    long: a worker on its way out joins the thread for a moment at most, an agent's output
    reader not at all. Tried once; a failure is logged (the node lease and the blip bound of
    service/presence.py remain). `close`: close `link` afterwards (one made for this report)."""

    def send() -> None:
        try:
            link.report_broken(node, detail)
        except Exception as exc:  # noqa: BLE001 - a report is help, not a duty
            log.info("could not report the broken peer of %s: %s", node, exc)
        finally:
            if close and isinstance(link, ServiceLink):
                link.close()

    thread = threading.Thread(target=send, name="broken-peer-report", daemon=True)
    thread.start()
    return thread


class LocalLink:
    """The local twin of the control plane: a `snapshots.json` index next to the files."""

    def __init__(self, directory: str | Path, keep: int):
        self.directory = Path(directory)
        self.keep = keep
        self.index = self.directory / "snapshots.json"

    def _read(self) -> dict:
        try:
            return json.loads(self.index.read_text())
        except FileNotFoundError:
            return {"items": [], "latest": None}

    def _write(self, data: dict) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        tmp = self.index.with_suffix(f".tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.index)

    def snapshots(self) -> tuple[list[CommittedSnapshot], int | None]:
        data = self._read()
        return _committed(data["items"]), data["latest"]

    def commit(self, written: snap.WrittenSnapshot, stall_s: float, control_id: int | None) -> list[str]:
        data = self._read()
        items = {i["step"]: i for i in data["items"]}
        items[written.step] = {"step": written.step, "path": written.path, "size": written.size,
                               "checksum": written.checksum, "bad": False, "stall_s": stall_s,
                               "shards": written.shards}
        latest = data["latest"]
        if latest is None or written.step >= latest:
            latest = written.step
        doomed = steps_to_prune({step: item["bad"] for step, item in items.items()}, latest, self.keep)
        pruned = [items.pop(step)["path"] for step in doomed]
        self._write({"items": [items[s] for s in sorted(items)], "latest": latest})
        return pruned

    def report_corrupt(self, step: int, reason: str) -> None:
        data = self._read()
        good = []
        for item in data["items"]:
            if item["step"] == step:
                item["bad"] = True
            if not item["bad"]:
                good.append(item["step"])
        if data["latest"] == step:
            data["latest"] = max(good) if good else None
        log.warning("snapshot at step %d is corrupt (%s); skipped", step, reason)
        self._write(data)

    def report_progress(self, step: int, loss: float | None, samples_per_s: float | None,
                        final: bool = False, metrics: dict[str, float] | None = None,
                        total_steps: int | None = None, ranks: list[RankTime] | None = None) -> int | None:
        return None

    def control(self) -> ControlRequest:
        return ControlRequest()

    def report_memory(self, node: str, step: int) -> None:
        pass

    def restore_point(self, held: int | None) -> RestorePoint:
        """The control plane's rule, for one process: its copy if at least the latest."""
        _, latest = self.snapshots()
        if held is not None and (latest is None or held >= latest):
            return RestorePoint(attempt=0, tier="memory", step=held, reason="this process's memory copy")
        if latest is not None:
            return RestorePoint(attempt=0, tier="disk", step=latest, reason="the latest snapshot")
        return RestorePoint(attempt=0, tier="none")

    def report_broken(self, node: str, detail: str) -> None:
        pass

    def report_memory_corrupt(self, node: str, step: int, reason: str) -> None:
        log.warning("memory copy at step %d is corrupt (%s); falling back", step, reason)
