"""What a node agent owes the control plane for its group's end, kept for an agent restarted
in its place.

A group's end is the agent's to deliver: the commits rank 0 left it (worker/handoff.py), then
the end report. Both live in the agent's memory (a thread, a queued report); an agent
SIGKILLed before they land took them with it, and the agent restarted under the same name
registered as one that runs nothing: the control plane took the node for stopped
("the node's agent restarted"), so a one-node job ran again from an older snapshot and a
job whose other nodes had finished FAILED.

So the agent keeps, in its data directory, a record of the group it owes an end for:

    <data dir>/end.<node>.json   (0600, replaced whole; the agent's alone)

written when it starts a group (job, attempt, the job's snapshot folder, the job token: the
commits are the job's), again with the group's outcome once torchrun has exited, and
removed once the end report has landed (or the control plane stopped the group: nothing is
owed). The job token is no more than the node credential beside it already gives (a
heartbeat's assignment carries it).

An agent that starts and finds a record (`recover`) finishes that end when something of it
is left: the commits a hand-over still holds (`handoff.gather`), or an outcome whose report
did not land. It registers naming the attempt as still running (the control plane keeps the
node a member, as it does for an agent whose lease lapsed in an outage, and only for the
attempt the job is on: a newer one fences the commits, 409), makes the commits, and reports
the outcome recorded (`succeeded` after a clean exit), or `stopped` if torchrun's exit was
never seen (the group died with the agent). The hand-over also carries the node's word that
its workers finished the run, when the worker could not say it itself (`Progress.say_finished`),
and it is said before the report: the control plane then takes that `stopped` for a finished
node (service/decide/outcome.py `vanished`), so the job ends without another attempt. A record
with neither (the agent was killed mid-training) is dropped: the workers died with it, and
registering as usual says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

from . import handoff
from .links import ServiceLink
from .node_link import write_private

log = logging.getLogger("ftrain.agent")

# The reason of an end whose group died with the agent, its exit never seen.
DIED_WITH_THE_AGENT = ("the node's agent was killed after rank 0's end and restarted; the workers' exit "
                       "was not seen")


@dataclass(frozen=True)
class EndRecord:
    job_id: str
    attempt: int
    snapshot_dir: str
    job_token: str
    stop_requested: bool = False
    # (state, exit code, reason) as the node reports it, once torchrun's exit was seen
    outcome: tuple[str, int | None, str | None] | None = None

    @property
    def key(self) -> tuple[str, int]:
        return (self.job_id, self.attempt)

    def owed(self, node: str) -> bool:
        """Whether an agent restarted in place of the one that wrote it has an end to deliver:
        something a hand-over still holds, or an outcome (whose report may not have landed)."""
        if self.stop_requested:
            return False
        return self.outcome is not None or self.handed_over(node) is not None

    def handed_over(self, node: str) -> Path | None:
        """What rank 0 left for the agent and it did not make (worker/handoff.py), gathered in
        one file; None if nothing."""
        return handoff.gather(self.snapshot_dir, node, self.attempt)


class EndRecords:
    """The record file of one agent name in its data directory."""

    def __init__(self, data_dir: Path, node: str):
        self.node = node
        self.path = Path(data_dir) / f"end.{node}.json"
        self.kept: EndRecord | None = None

    def keep(self, record: EndRecord) -> None:
        """Write `record` (only when it changed)."""
        if record == self.kept:
            return
        try:
            write_private(self.path, json.dumps(asdict(record)))
        except OSError as exc:  # the group runs on; only a restart of this agent would miss it
            log.warning("could not keep the record of job %s attempt %d's end in %s (%s)",
                        record.job_id, record.attempt, self.path, exc)
        self.kept = record

    def drop(self) -> None:
        if self.kept is not None or self.path.exists():
            self.path.unlink(missing_ok=True)
        self.kept = None

    def load(self) -> EndRecord | None:
        """The record a killed agent of this name left, if readable."""
        try:
            got = json.loads(self.path.read_text())
            outcome = got.get("outcome")
            record = EndRecord(job_id=str(got["job_id"]), attempt=int(got["attempt"]),
                               snapshot_dir=str(got["snapshot_dir"]), job_token=str(got["job_token"]),
                               stop_requested=bool(got.get("stop_requested", False)),
                               outcome=None if outcome is None else (str(outcome[0]), outcome[1], outcome[2]))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
            log.warning("the record of a group's end in %s cannot be read (%s): ignored", self.path, exc)
            self.path.unlink(missing_ok=True)
            return None
        self.kept = record
        return record


class Recovery:
    """A restarted agent's finish of the end its killed predecessor owed (`EndRecord.owed`):
    the commits left, in a thread (`handoff.AgentHandoff`), then the report (`outcome`)."""

    def __init__(self, record: EndRecord, node: str, server: str):
        self.record = record
        path = record.handed_over(node)
        self.handoff = None
        if path is not None:
            link = ServiceLink(server, record.job_id, record.job_token, record.attempt, timeout_s=5.0)
            self.handoff = handoff.AgentHandoff(path, link).start()
        log.warning("node %s's agent restarted owing the end of job %s attempt %d (%s): delivering it",
                    node, record.job_id, record.attempt,
                    "the snapshot commits its worker left, then its end report" if self.handoff is not None
                    else "its end report")

    @property
    def key(self) -> tuple[str, int]:
        return self.record.key

    def done(self) -> bool:
        return self.handoff is None or self.handoff.done()

    def outcome(self) -> tuple[str, int | None, str | None]:
        """(state, exit code, reason) to report, once `done`: the one recorded, or `stopped` if
        torchrun's exit was never seen; with what the commits left say of the steps not made."""
        state, code, reason = self.record.outcome or ("stopped", None, DIED_WITH_THE_AGENT)
        note = None if self.handoff is None else self.handoff.note()
        if note:
            reason = note if not reason else f"{reason}\n{note}"
        return state, code, reason


def recover(records: EndRecords, server: str) -> Recovery | None:
    """At an agent's start: the end its predecessor of the same name owed, being delivered, or
    None (a record of nothing owed is dropped)."""
    record = records.load()
    if record is None:
        return None
    if not record.job_token or not record.owed(records.node):
        records.drop()
        return None
    return Recovery(record, records.node, server)
