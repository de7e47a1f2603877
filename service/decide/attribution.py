"""Bad-node attribution: failures that follow a node across jobs quarantine it.

One failed member proves little: the job's own code may have failed there. But a node whose
workers fail in two different jobs within `window_s` (an hour), each time while the same
job's other members did not fail (they ran on, elsewhere), is the common factor: it is
quarantined (`service.nodes.NodeStore.quarantine`, by "failures"), the job whose failure
made the second one gets an event that says so, and only the admin's `ftrain undrain`
clears it (a node that passes its own health checks may still break jobs).

What counts is a *lone* failure: a member recorded failed while at least one other member of
the same attempt is not. A job on one node, or one whose every member failed, says nothing
about any node. Each (job, attempt, node) counts once, however many passes see it.

`Ledger` is the leader's memory of lone failures, bounded: only those within the window, at
most MAX_PER_NODE per node and MAX_NODES nodes (the oldest go first). It lives in the
leading scheduler's process; a new leader starts with an empty one (a failure before the
change then counts for nothing, which errs towards keeping nodes in service). The functions
here do no I/O and read no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from service.models import JobRecord

WINDOW_S = 3600.0
MAX_PER_NODE = 8
MAX_NODES = 10_000
JOBS_TO_BLAME = 2  # different jobs whose workers failed on the node alone


@dataclass(frozen=True)
class Failure:
    """A lone failure of a job's workers on a node."""

    job_id: str
    attempt: int
    at: float
    reason: str


@dataclass(frozen=True)
class Blame:
    """A node to quarantine, the reason, and the job whose failure made it (for its event)."""

    node: str
    reason: str
    job_id: str


def lone_failures(job: JobRecord) -> list[tuple[str, str]]:
    """(node, its failure's first line) of each failed member of `job` while some other
    member of the attempt did not fail; [] for a job on one node or one whose members all
    failed."""
    failed = [(n, m) for n, m in sorted(job.members.items()) if m.state == "failed"]
    if not failed or len(failed) == len(job.members):
        return []
    return [(n, (m.reason or f"exit code {m.exit_code}").partition("\n")[0]) for n, m in failed]


@dataclass
class Ledger:
    """Recent lone failures by node (bounded), and the nodes already blamed."""

    window_s: float = WINDOW_S
    by_node: dict[str, list[Failure]] = field(default_factory=dict)
    blamed: set[str] = field(default_factory=set)

    def note(self, jobs: Iterable[JobRecord], now: float) -> list[Blame]:
        """Take in the lone failures of `jobs` seen at `now`; returns the nodes that are to be
        quarantined for them (each once, until `forget`)."""
        if self.window_s <= 0:
            return []
        touched: list[tuple[str, str]] = []
        for job in jobs:
            for node, reason in lone_failures(job):
                seen = self.by_node.setdefault(node, [])
                if any(f.job_id == job.id and f.attempt == job.attempt for f in seen):
                    continue
                seen.append(Failure(job.id, job.attempt, now, reason))
                touched.append((node, job.id))
        self._trim(now)
        return [b for node, job_id in touched if (b := self._blame(node, job_id)) is not None]

    def forget(self, node: str) -> None:
        """The node is back in service (undrained): its failures so far are forgiven."""
        self.by_node.pop(node, None)
        self.blamed.discard(node)

    def _blame(self, node: str, job_id: str) -> Blame | None:
        if node in self.blamed:
            return None
        failures = self.by_node.get(node, [])
        jobs: dict[str, Failure] = {}
        for f in failures:
            jobs.setdefault(f.job_id, f)
        if len(jobs) < JOBS_TO_BLAME:
            return None
        self.blamed.add(node)
        minutes = round(self.window_s / 60)
        told = "; ".join(f"job {f.job_id}: {f.reason}" for f in jobs.values())
        return Blame(node, f"its workers failed in {len(jobs)} different jobs within {minutes} min while "
                           f"those jobs' other nodes did not ({told})", job_id)

    def _trim(self, now: float) -> None:
        for node in list(self.by_node):
            kept = [f for f in self.by_node[node] if now - f.at <= self.window_s][-MAX_PER_NODE:]
            if kept:
                self.by_node[node] = kept
            else:
                del self.by_node[node]
        while len(self.by_node) > MAX_NODES:  # the node whose latest failure is oldest goes
            del self.by_node[min(self.by_node, key=lambda n: self.by_node[n][-1].at)]
        if len(self.blamed) > MAX_NODES:  # (each is forgotten when its node is undrained)
            self.blamed = set(sorted(self.blamed)[:MAX_NODES])
