"""Hangs, explained: before the workers of a job taken for hung are stopped, every rank's
Python stack and flight-recorder trace go into the job's log and events, and the ranks that
had not reached the collective the others wait in are named, across nodes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers.elastic import events, job_spec, submit, wait_nodes, wait_state
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "stops_stepping.py"
NAMED = re.compile(r" \(did not reach collective #(\d+) gloo:broadcast of group default_pg: rank 1\)$")


def test_a_hung_jobs_events_and_log_carry_every_ranks_stack_and_flight_recorder(api, agents):
    """Two nodes, a rank each; rank 1 sleeps in Python after step 3 while rank 0 goes on into
    the next step's collective. hang_timeout_s=3, max_restarts=1: a restart (a new attempt),
    then the end (FAILED); the stacks and traces of both attempts are collected before their
    workers stop, and the node that reports last names rank 1: in the first attempt by the
    collective's sequence number, which only the other node's rank entered. (The last
    attempt's workers are stopped by torchrun as the job fails, while the agent collects: its
    traces may not come, and the stacks name rank 1 then.)"""
    agents(2, nproc=1)
    wait_nodes(api, 2)
    job_id = submit(api, job_spec("hung", "--steps", "3", "--hang-rank", "1", script=SCRIPT,
                                  mn=2, mx=2, nproc_per_node=1, max_restarts=1, hang_timeout_s=3))
    done = wait_state(api, job_id, ("FAILED",), timeout_s=120)
    assert done["attempt"] == 2
    def stacks_events():  # the last attempt's come as its workers stop, after the job ended
        found = [e for e in events(api, job_id) if e["reason"].startswith("stacks of hung attempt")]
        return len(found) == 4 and found
    stacks = wait_for(stacks_events, 30, "the stacks of both attempts from both nodes")
    for attempt in (1, 2):
        of = [e["reason"] for e in stacks if e["reason"].startswith(f"stacks of hung attempt {attempt} on node ")]
        assert sorted(x.split(":")[0][-2:] for x in of) == ["n0", "n1"], of
        rank0 = next(x for x in of if "rank 0 " in x)
        rank1 = next(x for x in of if "rank 1 " in x)
        assert "rank 0 in a collective: broadcast (distributed_c10d.py:" in rank0, rank0
        assert "rank 1 not in a collective: main (stops_stepping.py:" in rank1, rank1
        if attempt == 2 and of[1].endswith(" (did not reach the collective: rank 1)"):
            continue  # by the stacks: the traces did not come (the docstring says why)
        entered = re.search(r"rank 0 .*, last entered #(\d+) gloo:broadcast of group default_pg", rank0)
        assert entered, of
        assert f", last entered #{int(entered[1]) - 1} " in rank1, of
        named = NAMED.search(of[1])  # the later event: both ranks known
        assert named and int(named[1]) == int(entered[1]), of
    for e in stacks:
        assert "Thread 0x" in e["detail"]
    lines = [(i["rank"], i["attempt"], i["line"])
             for i in api.get(f"/v1/jobs/{job_id}/logs", params={"limit": 5000}).json()["items"]]
    for rank in (0, 1):
        said = [x for r, _, x in lines if r == rank and x == f"ftrain: rank {rank}'s stacks (the job was taken for hung):"]
        assert len(said) == 2, lines[-40:]
        recorded = [a for r, a, x in lines if r == rank and x.startswith(
            f"ftrain: rank {rank}'s flight recorder (the job was taken for hung): group default_pg: last enqueued #")]
        assert 1 in recorded, lines[-40:]
    assert any(r == 1 and "stops_stepping.py" in x and "in main" in x for r, _, x in lines)
    assert any(r == 0 and "distributed_c10d.py" in x for r, _, x in lines)
