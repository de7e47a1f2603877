"""Which finished jobs to delete, and how the retention rule reads (pure; no I/O).

A finished job (SUCCEEDED, FAILED, CANCELLED) is kept for `retention_s` after it ended
(`finished_at`); with `keep_jobs` set, only the newest `keep_jobs` finished jobs are kept
whatever their age, the oldest finished going first. Unfinished jobs are never candidates:
the caller passes finished ones only, and the loop in `service.retention` re-reads each
record before it deletes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

DAY_S = 86400.0
_UNITS_S = {"d": DAY_S, "h": 3600.0, "m": 60.0, "s": 1.0}
_DURATION = re.compile(r"^\s*(?P<n>[0-9]+(\.[0-9]+)?)\s*(?P<unit>[dhms]?)\s*$")


@dataclass(frozen=True)
class RetentionPolicy:
    retention_s: float = 7 * DAY_S  # how long a finished job is kept after it ended
    keep_jobs: int | None = None  # at most this many finished jobs are kept (None: no cap)


@dataclass(frozen=True)
class Expired:
    job_id: str
    reason: str


def expired(finished: Iterable[tuple[str, float]], now: float,
            policy: RetentionPolicy) -> list[Expired]:
    """The finished jobs to delete, oldest finished first, each with the rule that took it.

    `finished` is (job id, finished_at) of every finished job.
    """
    ordered = sorted(finished, key=lambda f: (f[1], f[0]))
    beyond_count = len(ordered) - policy.keep_jobs if policy.keep_jobs is not None else 0
    out = []
    for i, (job_id, finished_at) in enumerate(ordered):
        age_s = now - finished_at
        if age_s >= policy.retention_s:
            out.append(Expired(job_id, f"finished {format_duration(age_s)} ago; finished jobs are "
                                       f"kept {format_duration(policy.retention_s)}"))
        elif i < beyond_count:
            out.append(Expired(job_id, f"beyond the newest {policy.keep_jobs} finished jobs"))
    return out


def describe(policy: RetentionPolicy) -> str:
    """The rule in words, for a 404: why a job that once existed may be gone."""
    text = f"finished jobs are deleted {format_duration(policy.retention_s)} after they end"
    if policy.keep_jobs is not None:
        text += f", and only the newest {policy.keep_jobs} finished jobs are kept"
    return text


def pass_interval_s(policy: RetentionPolicy) -> float:
    """How often the leader looks for expired jobs: a tenth of the retention, between
    half a second and a minute (a job outlives its retention by at most that much)."""
    return min(60.0, max(0.5, policy.retention_s / 10))


def parse_duration(text: str) -> float:
    """'7d', '12h', '30m', '90s' or a number of seconds -> seconds (positive)."""
    match = _DURATION.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration; write e.g. 7d, 12h, 30m, 90s "
                         "(days, hours, minutes, seconds) or a number of seconds")
    seconds = float(match["n"]) * _UNITS_S[match["unit"] or "s"]
    if seconds <= 0:
        raise ValueError(f"{text!r}: a retention must be longer than 0 s")
    return seconds


def format_duration(seconds: float) -> str:
    """In the largest unit it reaches: 604800 -> '7 days', 5400 -> '1.5 hours', 90 -> '1.5 minutes'."""
    for unit_s, name in ((DAY_S, "day"), (3600.0, "hour"), (60.0, "minute"), (1.0, "second")):
        if seconds >= unit_s or unit_s == 1.0:
            n = seconds / unit_s
            if n == int(n):
                return f"{int(n)} {name}{'' if n == 1 else 's'}"
            return f"{n:.1f} {name}s"
    raise AssertionError("unreachable")
