"""Job records for the table tests of `service.decide` (pure logic, fixed `now`)."""

from __future__ import annotations

from service.models import JobRecord, JobSpec, JobState, MemberStatus

NOW = 1000.0


def make_job(state: JobState = JobState.RUNNING, members: dict[str, str] | None = None, *,
             mn: int = 1, mx: int = 2, max_restarts: int = 3, keep: int = 3,
             nproc: int | None = None, **fields) -> JobRecord:
    """A job at attempt 1 with `members` ({node: member state}), event_seq 5."""
    spec = JobSpec(name="j", command=["true"], nodes={"min": mn, "max": mx},
                   max_restarts=max_restarts, snapshot={"every_steps": 10, "keep": keep})
    members = {n: MemberStatus(state=s, nproc=nproc) for n, s in (members or {}).items()}
    fields.setdefault("attempt", 1)
    fields.setdefault("event_seq", 5)
    fields.setdefault("token_nonce", "n0")
    return JobRecord(id="j-abc123", spec=spec, state=state, created_at=1.0, updated_at=1.0,
                     members=members, **fields)
