"""Hangs, explained: before the workers of a job taken for hung are stopped, every rank's
Python stack goes into the job's log and events, and the ranks that had not reached the
collective the others wait in are named."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.elastic import events, job_spec, submit, wait_nodes, wait_state
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stops_stepping.py"


def test_a_hung_jobs_events_and_log_carry_every_ranks_stack(api, agents):
    """Two ranks on one node; rank 1 stops stepping after step 3 while rank 0 goes on into the
    next step's collective. hang_timeout_s=3, max_restarts=1: a restart (a new attempt), then
    the end (FAILED); the stacks of both attempts are collected before their workers stop."""
    agents(1, nproc=2)
    wait_nodes(api, 1)
    job_id = submit(api, job_spec("hung", "--steps", "3", "--hang-rank", "1", script=SCRIPT,
                                  mn=1, mx=1, nproc_per_node=2, max_restarts=1, hang_timeout_s=3))
    done = wait_state(api, job_id, ("FAILED",), timeout_s=120)
    assert done["attempt"] == 2
    def stacks_events():  # the last attempt's come as its workers stop, after the job ended
        found = [e for e in events(api, job_id) if e["reason"].startswith("stacks of hung attempt")]
        return len(found) == 2 and found
    stacks = wait_for(stacks_events, 30, "the stacks of both attempts")
    assert [e["reason"].split(":")[0] for e in stacks] == [
        "stacks of hung attempt 1 on node n0", "stacks of hung attempt 2 on node n0"]
    for e in stacks:
        line = e["reason"]
        assert "rank 0 in a collective: broadcast (distributed_c10d.py:" in line, line
        assert "rank 1 not in a collective: main (stops_stepping.py:" in line, line
        assert line.endswith("(did not reach the collective: rank 1)"), line
        assert "rank 0:\n" in e["detail"] and "rank 1:\n" in e["detail"]
        assert "Thread 0x" in e["detail"]
    lines = [(i["rank"], i["line"]) for i in api.get(f"/v1/jobs/{job_id}/logs", params={"limit": 5000}).json()["items"]]
    for rank in (0, 1):
        said = [x for r, x in lines if r == rank and x == f"ftrain: rank {rank}'s stacks (the job was taken for hung):"]
        assert len(said) == 2, lines[-40:]
    assert any(r == 1 and "stops_stepping.py" in x and "in main" in x for r, x in lines)
    assert any(r == 0 and "distributed_c10d.py" in x for r, x in lines)
