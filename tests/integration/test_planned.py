"""Planned membership changes (a join, a drain, a cancel) lose no step.

The job runs the runtime example on real agents. Before the change, the scheduler asks
rank 0 (through the job's control endpoint) to snapshot at a step boundary; the group
then restarts (or stops) from exactly that step.
"""

from __future__ import annotations

import re

import pytest

from tests.helpers.elastic import job, log_items, submit, torchrun_launchers, wait_nodes, wait_state
from tests.helpers.processes import REPO, wait_for

pytestmark = pytest.mark.integration
STEP = re.compile(r"^step=(\d+) loss=")
START = re.compile(r"^start step=(\d+) world=(\d+)")
PAUSED = re.compile(r"rank 0: (checkpoint_pause|checkpoint_stop) at step (\d+)")


def spec(name: str, steps: int = 3000, mx: int = 2) -> dict:
    return {"name": name, "working_dir": str(REPO),
            "command": ["python", "examples/train.py", "--steps", str(steps), "--step-delay", "0.03",
                        "--width", "32"],
            "nodes": {"min": 1, "max": mx}, "snapshot": {"every_steps": 100000, "keep": 3}}


def rank0(api, job_id: str) -> list[tuple[str, int, int | None]]:
    """('step', n, None), ('start', step, world) and ('stop', step, None) lines of rank 0.

    'step' lines are printed after a step; 'stop' is rank 0 saying at which step it obeyed
    a planned change (it snapshots there, so that step is done even if it was not printed).
    """
    out = []
    for item in log_items(api, job_id, rank=0):
        if m := STEP.match(item["line"]):
            out.append(("step", int(m.group(1)), None))
        elif m := START.match(item["line"]):
            out.append(("start", int(m.group(1)), int(m.group(2))))
        elif m := PAUSED.search(item["line"]):
            out.append(("stop", int(m.group(2)), None))
    return out


def starts(api, job_id: str) -> list[tuple[int, int, int]]:
    """(index in the rank-0 lines, resumed step, world size) of every (re)start."""
    return [(i, s, w) for i, (kind, s, w) in enumerate(rank0(api, job_id)) if kind == "start"]


def stop_before(lines, index: int) -> int:
    """The step at which rank 0 stopped for the planned change before line `index`."""
    stops = [n for kind, n, _ in lines[:index] if kind == "stop"]
    assert stops, "rank 0 never obeyed a planned change"
    # No step ran past the stop: every printed step before the restart is at most it.
    assert max(n for kind, n, _ in lines[:index] if kind == "step") <= stops[-1]
    return stops[-1]




def wait_running_with_progress(api, job_id: str, step: int) -> None:
    wait_for(lambda: (j := job(api, job_id))["progress"] and j["progress"]["step"] >= step, 120,
             f"job {job_id} to report progress past step {step}")


def test_a_node_joining_loses_no_step(api, agents):
    agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, spec("join"))
    wait_running_with_progress(api, job_id, 10)
    agents(1)
    wait_for(lambda: any(w == 2 for _, _, w in starts(api, job_id)), 90, "the job to restart at world size 2")
    lines = rank0(api, job_id)
    index, resumed, world = next((i, s, w) for i, s, w in starts(api, job_id) if w == 2)
    assert resumed == stop_before(lines, index) > 0
    snaps = api.get(f"/v1/jobs/{job_id}/snapshots").json()
    assert resumed in [s["step"] for s in snaps["items"]]
    assert job(api, job_id)["restarts"] == 0


def test_a_drained_node_loses_no_step(api, agents):
    by_name = {a.name: a for a in agents(2)}
    wait_nodes(api, 2)
    job_id = submit(api, spec("drain"))
    wait_for(lambda: any(w == 2 for _, _, w in starts(api, job_id)), 90, "world size 2")
    wait_running_with_progress(api, job_id, 10)
    # Drain the node of rank 0: its note of the step where it stopped reaches the control
    # plane after the drain took the node out of the job's members (it must still be taken).
    drained = [x["node"] for x in log_items(api, job_id, rank=0) if START.match(x["line"])][-1]
    (kept,) = by_name.keys() - {drained}
    # Attempt 1's torchrun came from the job's fork server too (forked once torchrun's modules were in).
    (first,) = torchrun_launchers(by_name[kept])
    assert api.post(f"/v1/nodes/{drained}/drain").status_code == 202
    wait_for(lambda: any(w == 1 for _, _, w in starts(api, job_id)[1:]), 90,
             "the job to go on at world size 1")
    lines = rank0(api, job_id)
    index, resumed, _ = next((i, s, w) for i, s, w in starts(api, job_id)[1:] if w == 1)
    assert resumed == stop_before(lines, index) > 0
    j = job(api, job_id)
    assert j["nodes"] == [kept] and j["restarts"] == 0
    # The drain moved the other node to a new attempt: its new torchrun came from the job's fork server.
    assert j["attempt"] == 2 and len(again := torchrun_launchers(by_name[kept])) == 1 and again != [first]
    nodes = {n["name"]: n for n in api.get("/v1/nodes").json()["items"]}
    assert nodes[drained]["state"] == "DRAINED" and nodes[drained]["job"] is None  # drained and idle


def test_cancel_snapshots_at_the_step_where_it_stops(api, agents):
    agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, spec("cancel"))
    wait_running_with_progress(api, job_id, 10)
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    wait_state(api, job_id, "CANCELLED", timeout_s=30)
    lines = rank0(api, job_id)
    last = stop_before(lines, len(lines))
    final = job(api, job_id)
    assert final["latest_snapshot"] is not None and final["latest_snapshot"]["step"] == last
