"""Where a job's wall time went: one ledger, derived from the job's events.

The wall time runs from the job's submission to its end (or to `now` while it is unfinished).
Every event starts a segment that lasts to the next one; a segment's cause comes from the
job's state after the event and, where one state covers several causes, the event's reason
(`STATE_CAUSES`, `REASON_CAUSES`): PENDING before the first start is `waiting`, PENDING
after a preemption `preempted`, a RUNNING job re-forming its group for a planned change
(a node joining, a drain) `resizing`, and so on. An event that names no cause of its own
(a restore point, a skipped snapshot) keeps the one before it.

Then three corrections move time out of `training`, which the events alone cannot split:
- detection: between the stopped group's last progress report and the event of the fault
  (a worker's exit, a lost node, a hang) no step that counts was made. The event of the new
  group's first step carries that report (`Replay.reached_at`); the time from it to the fault
  is `recovering`, or `hung` when the fault was a hang.
- replayed: the new group redoes the steps from its restore point to the step the stopped
  group had reached (`Replay.steps`), at the stopped group's step time: that much of the
  training after the first step is `replayed`, but never more than the new group trained
  before it stopped in turn (that estimate never takes a later fault's detection).
- snapshot stalls: the stall each commit reported, added up on the job record
  (`JobRecord.snapshot_stall_s`), is `snapshot`.

The parts always add up to the wall time: every second is in exactly one segment, and the
corrections only move seconds between causes. A job keeps its first event and its latest
MAX_EVENTS (service/jobs.py); the time between the first and the oldest kept one, whose
events are gone, is `unrecorded`.

(job, events, now) -> Goodput; no I/O and no clock.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from service.models import EventView, JobRecord, JobState

S = JobState

# Every cause, in the order tables show them.
CAUSES = ("waiting", "starting", "training", "replayed", "snapshot", "recovering", "hung",
          "resizing", "preempted", "suspended", "stopping", "unrecorded")

# The cause of the time after an event, by the job's state then; a state not named here (a
# terminal one) ends the job's wall time.
STATE_CAUSES: dict[JobState, str] = {
    S.PENDING: "waiting", S.STARTING: "starting", S.RUNNING: "training",
    S.RECOVERING: "recovering", S.CANCELLING: "stopping",
}
# Reasons that name a cause of their own, by state: (text in the event's reason, cause), the
# first match wins. An event in the same state as the one before that matches none keeps the
# cause it had (a restore point, a corrupt snapshot).
REASON_CAUSES: dict[JobState, tuple[tuple[str, str], ...]] = {
    S.PENDING: (("preempted", "preempted"), ("suspended", "suspended")),
    S.RUNNING: (("training", "training"), ("joined; scaling up", "resizing"), (" drained;", "resizing"),
                ("planned change", "resizing")),
}
# Causes of a stopped group whose last steps were lost: the time from its last report to the
# fault is `recovering`, or the cause its reason names (`STOP_CAUSES`). Others (a planned
# change, a preemption) stopped at a step boundary having lost nothing.
FAULTS = ("recovering", "waiting", "starting")
# The fault's reason -> the cause of the time from the group's last report to the fault.
STOP_CAUSES = (("hang_timeout_s", "hung"), ("hung", "hung"))


@dataclass(frozen=True)
class Goodput:
    """A job's wall time (seconds) and its parts by cause, which add up to it."""

    wall_s: float
    seconds: dict[str, float]

    def share(self, cause: str) -> float:
        """The part of the wall time spent on `cause` (0 for a job with no wall time yet)."""
        return self.seconds.get(cause, 0.0) / self.wall_s if self.wall_s > 0 else 0.0


@dataclass
class _Segment:
    start: float
    end: float
    cause: str


def causes(events: Sequence[EventView]) -> list[str | None]:
    """The cause of the time after each of `events` (oldest first); None: the job ended. A
    state change takes its state's cause (or its reason's, `REASON_CAUSES`); an event in the
    same state as the one before takes its reason's, else keeps the cause it had."""
    out: list[str | None] = []
    state, cause = None, None
    for event in events:
        base = STATE_CAUSES.get(event.state)
        reason = event.reason.lower()
        named = next((c for text, c in REASON_CAUSES.get(event.state, ()) if text in reason), None)
        if base is None:
            cause = None
        elif named is not None:
            cause = named
        elif event.state is not state or cause is None:
            cause = base
        out.append(cause)
        state = event.state
    return out


def ledger(job: JobRecord, events: Sequence[EventView], now: float) -> Goodput:
    """The job's wall time split by cause (every cause of CAUSES, 0 where none)."""
    start = job.created_at
    end = job.finished_at if job.finished_at is not None else max(now, start)
    events = sorted(events, key=lambda e: e.seq)
    after = causes(events)
    segments = _segments(events, after, start, end)
    replays = [(e, lost_to) for e, lost_to in zip(events, _stops(events, after), strict=True)
               if e.replay is not None]
    # Detections first: a stopped group's last report is a fact, a replay's length an estimate
    # (the stopped group's step time), which must not run into the next fault's detection.
    for event, lost_to in replays:
        if lost_to is not None:
            _move_window(segments, event.replay.reached_at, event.time, lost_to)
    for event, _ in replays:
        if event.replay.step_s:
            _move_amount(segments, event.time, event.replay.steps * event.replay.step_s, "replayed")
    seconds = dict.fromkeys(CAUSES, 0.0)
    for seg in segments:
        seconds[seg.cause] = seconds.get(seg.cause, 0.0) + (seg.end - seg.start)
    stall = min(job.snapshot_stall_s, seconds["training"])
    seconds["training"] -= stall
    seconds["snapshot"] += stall
    return Goodput(wall_s=end - start, seconds=seconds)


def _segments(events: Sequence[EventView], after: Sequence[str | None], start: float,
              end: float) -> list[_Segment]:
    """The wall time cut at each event, each piece with its cause. Event times are clamped into
    [start, end] and kept in order (replicas' clocks differ a little), so the pieces add up to
    end - start exactly."""
    segments: list[_Segment] = []
    t, cause, seq = start, "waiting", 0
    for event, next_cause in zip(events, after, strict=True):
        at = min(max(event.time, t), end)
        if seq >= 1 and event.seq > seq + 1:  # the events between were pruned (MAX_EVENTS)
            cause = "unrecorded"
        segments.append(_Segment(t, at, cause))
        t, seq = at, event.seq
        if next_cause is None:  # the job ended: nothing after it counts
            break
        cause = next_cause
    segments.append(_Segment(t, end, cause))
    return [s for s in segments if s.end > s.start]


def _stops(events: Sequence[EventView], after: Sequence[str | None]) -> list[str | None]:
    """For each event, what the time from the stopped group's last report to its stop was, had
    a new group made its first step there: the stop is the first of the run of causes other than
    training since the job last trained; None where that lost nothing (a planned change, a
    preemption) or the job never trained."""
    out: list[str | None] = []
    stop: tuple[EventView, str | None] | None = None  # the run's first event, and its cause
    trained = False
    for event, cause in zip(events, after, strict=True):
        out.append(_lost_to(stop) if trained else None)
        if cause == "training":
            stop, trained = None, True
        elif stop is None:
            stop = (event, cause)
    return out


def _lost_to(stop: tuple[EventView, str | None] | None) -> str | None:
    if stop is None or stop[1] not in FAULTS:
        return None
    reason = stop[0].reason.lower()
    return next((c for text, c in STOP_CAUSES if text in reason), "recovering")


def _move_window(segments: list[_Segment], start: float, end: float, to: str) -> None:
    """Training time within [start, end] becomes `to`."""
    i = max(0, bisect_right(segments, start, key=lambda seg: seg.start) - 1)
    j = i
    while j < len(segments) and segments[j].start < end:
        j += 1
    segments[i:j] = [p for seg in segments[i:j] for p in
                     _split(seg, max(seg.start, start), min(seg.end, end), to)]


def _move_amount(segments: list[_Segment], start: float, amount: float, to: str) -> None:
    """The first `amount` seconds of training from `start` on become `to`, up to the end of
    that training (the group that trained then stopped: what it did not redo, no later group
    redid for it)."""
    i = max(0, bisect_right(segments, start, key=lambda seg: seg.start) - 1)
    j, moved = i, []
    while j < len(segments) and amount > 0:
        seg = segments[j]
        if seg.cause != "training" and seg.end > start:
            break
        lo = max(seg.start, start)
        hi = min(seg.end, lo + amount) if seg.cause == "training" else lo
        amount -= max(0.0, hi - lo)
        moved += _split(seg, lo, hi, to)
        j += 1
    segments[i:j] = moved


def _split(seg: _Segment, lo: float, hi: float, to: str) -> list[_Segment]:
    """`seg` with its part [lo, hi] made `to`, if it is training time."""
    if seg.cause != "training" or lo >= hi:
        return [seg]
    return [p for p in (_Segment(seg.start, lo, seg.cause), _Segment(lo, hi, to),
                        _Segment(hi, seg.end, seg.cause)) if p.end > p.start]
