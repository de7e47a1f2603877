"""Preemption with real processes: a job of higher priority takes nodes from a running one of
lower priority, which shrinks at a step boundary (the ftrain runtime: 0 steps lost), then is
suspended at its `min` and resumed; a plain script gets SIGTERM and its spec's grace. Real
etcd, control plane, agents, torchrun and gloo DDP (examples/train.py)."""

from __future__ import annotations

import re

import pytest

from tests.helpers.elastic import events, job, log_items, submit, wait_nodes, wait_state
from tests.helpers.faults import SnapshotWatch, check_steps, train_spec
from tests.helpers.processes import REPO, wait_for

pytestmark = pytest.mark.integration
SAVES = REPO / "tests" / "scripts" / "saves_on_sigterm.py"
SAVING = re.compile(r"^saving ([\d.]+) s after SIGTERM")


def reasons(api, job_id: str) -> list[str]:
    return [e["reason"] for e in events(api, job_id)]


def test_a_higher_priority_job_shrinks_then_suspends_a_runtime_job_losing_no_step(control_plane, api, agents):
    agents(2)
    wait_nodes(api, 2)
    # Snapshots only at the preemptions' step boundaries: a resume from anywhere else would lose steps.
    low = submit(api, train_spec("low", 200, every=100_000, mn=1, mx=2, delay_s=0.03))
    with SnapshotWatch(control_plane, low) as watch:
        wait_for(lambda: (j := job(api, low))["world_size"] == 2
                 and (j["progress"] or {}).get("step", 0) >= 5,
                 120, "the low-priority job to train on both nodes")
        # (long enough to still run when the next one comes: then "low" is at its min)
        high_a = submit(api, train_spec("high-a", 150, mn=1, mx=1, priority=10, delay_s=0.03))
        wait_for(lambda: job(api, high_a)["state"] == "RUNNING" and len(job(api, low)["nodes"]) == 1, 120,
                 "the high-priority job to run on the node the other gave up")
        high_b = submit(api, train_spec("high-b", 30, mn=1, mx=1, priority=10, delay_s=0.03))
        wait_for(lambda: "suspended" in job(api, low)["reason"] or job(api, low)["state"] == "PENDING", 120,
                 "the low-priority job, at its min, to be suspended")
        for high in (high_a, high_b):
            assert wait_state(api, high, ("SUCCEEDED", "FAILED"), timeout_s=180)["state"] == "SUCCEEDED"
        done = wait_state(api, low, ("SUCCEEDED", "FAILED"), timeout_s=240)
        assert done["state"] == "SUCCEEDED", reasons(api, low)
        trace = check_steps(api, low, watch=watch)
    # 0 steps lost: every resume starts from the last step made before it (rank 0 snapshotted there).
    assert len(trace.resumes) >= 2, trace.resumes
    assert all(resumed >= last for _, resumed, last in trace.resumes), trace.resumes
    assert trace.steps[-1] == 200
    said = reasons(api, low)
    assert any(r.startswith(f"preempted by job {high_a} (priority 10): giving up node(s)")
               for r in said), said
    assert any(r.startswith(f"preempted by job {high_b} (priority 10): suspended") for r in said), said
    assert any(r.startswith(f"preempting job {low} (priority 0): taking node(s)")
               for r in reasons(api, high_a))
    assert f"preempting job {low} (priority 0): suspending it" in reasons(api, high_b)
    by_cause = done["restarts_by_cause"]
    assert (by_cause["preemption"], by_cause["failure"], by_cause["lost_node"]) == (2, 0, 0), by_cause
    assert done["restarts"] == 0  # (failures only: what max_restarts bounds)


def test_a_preempted_plain_script_gets_sigterm_and_its_grace_then_runs_again(api, agents):
    agents(1)
    wait_nodes(api, 1)
    grace_s = 6.0  # more than the cancel grace (5 s): the spec's is the one given
    low = submit(api, {"name": "plain", "command": ["python", str(SAVES), "--steps", "60"],
                       "preempt_grace_s": grace_s, "max_restarts": 0})
    wait_for(lambda: any(i["line"] == "step 3" for i in log_items(api, low)), 60, "the plain script to step")
    quick = ["python", str(REPO / "tests" / "scripts" / "exit_with.py"), "0"]
    high = submit(api, {"name": "urgent", "command": quick, "priority": 5})
    assert wait_state(api, high, ("SUCCEEDED", "FAILED"), timeout_s=90)["state"] == "SUCCEEDED"
    lines = [i["line"] for i in log_items(api, low) if i["attempt"] == 1]
    assert any(x.startswith("SIGTERM at step") for x in lines), lines[-5:]
    saved_for = max(float(m.group(1)) for x in lines if (m := SAVING.match(x)))
    assert saved_for >= grace_s - 1.0, f"stopped {saved_for} s after SIGTERM; its grace is {grace_s} s"
    assert f"preempted by job {high} (priority 5): suspended" in " ".join(reasons(api, low))
    done = wait_state(api, low, ("SUCCEEDED", "FAILED"), timeout_s=120)
    assert done["state"] == "SUCCEEDED", reasons(api, low)
    assert done["restarts_by_cause"] == {"failure": 0, "lost_node": 0, "preemption": 1, "resize": 0}


@pytest.mark.parametrize("control_plane", [{"FTRAIN_FAIR_SHARE_SETTLE_S": "2"}], indirect=True)
def test_fair_share_gives_a_starved_user_a_node_from_a_runtime_job_losing_no_step(control_plane, api, agents):
    tokens = {}
    for name in ("ann", "bob"):
        resp = api.post("/v1/users", json={"name": name})
        assert resp.status_code == 201, resp.text
        tokens[name] = resp.json()["token"]
    agents(2)
    wait_nodes(api, 2)
    with control_plane.client(tokens["ann"]) as ann, control_plane.client(tokens["bob"]) as bob:
        # Snapshots only at the give-back's step boundary: a resume from anywhere else would lose steps.
        sweep = submit(ann, train_spec("sweep", 150, every=100_000, mn=1, mx=2, delay_s=0.03))
        with SnapshotWatch(control_plane, sweep) as watch:
            wait_for(lambda: (j := job(api, sweep))["world_size"] == 2
                     and (j["progress"] or {}).get("step", 0) >= 5,
                     120, "ann's job to train on both nodes")
            mine = submit(bob, train_spec("bobs", 20, mn=1, mx=1, delay_s=0.03))  # priority 0, as ann's
            wait_for(lambda: job(api, mine)["state"] in ("RUNNING", "SUCCEEDED"), 120,
                     "bob's job to run on the node ann's job gives back")
            assert wait_state(api, mine, ("SUCCEEDED", "FAILED"), timeout_s=180)["state"] == "SUCCEEDED"
            done = wait_state(api, sweep, ("SUCCEEDED", "FAILED"), timeout_s=240)
            assert done["state"] == "SUCCEEDED", reasons(api, sweep)
            trace = check_steps(api, sweep, watch=watch)
    # 0 steps lost: the shrink resumed from the step where rank 0 snapshotted at the boundary.
    assert trace.resumes and all(resumed >= last for _, resumed, last in trace.resumes), trace.resumes
    assert trace.steps[-1] == 150
    said = reasons(api, sweep)
    assert any(r.startswith("giving node(s) ") and "back to user bob (fair share" in r for r in said), said
    assert any(r.startswith(f"by fair share (its user holds no node), from job {sweep} (priority 0)")
               for r in reasons(api, mine))
    by_cause = done["restarts_by_cause"]
    assert (by_cause["preemption"], by_cause["failure"], by_cause["lost_node"]) == (0, 0, 0), by_cause
    assert by_cause["resize"] >= 1


def test_a_preemption_whose_job_is_cancelled_in_the_victims_grace_leaves_it_all_its_nodes(api, agents):
    agents(2)
    wait_nodes(api, 2)
    low = submit(api, {"name": "plain", "command": ["python", str(SAVES), "--steps", "60"],
                       "nodes": {"min": 1, "max": 2}, "preempt_grace_s": 4.0, "max_restarts": 0})
    wait_for(lambda: len(job(api, low)["nodes"]) == 2 and any(i["line"] == "step 3" for i in log_items(api, low)),
             60, "the plain script to step on both nodes")
    quick = ["python", str(REPO / "tests" / "scripts" / "exit_with.py"), "0"]
    high = submit(api, {"name": "urgent", "command": quick, "priority": 5})
    wait_for(lambda: any(i["line"].startswith("SIGTERM at step") for i in log_items(api, low)), 60,
             "the victim's SIGTERM (its grace begins)")
    assert api.post(f"/v1/jobs/{high}/cancel").status_code == 202
    assert wait_state(api, high, ("CANCELLED",), timeout_s=30)["state"] == "CANCELLED"
    done = wait_state(api, low, ("SUCCEEDED", "FAILED"), timeout_s=120)
    assert done["state"] == "SUCCEEDED", reasons(api, low)
    said = reasons(api, low)
    assert f"job {high} (priority 5) no longer waits for them: its workers, already told to stop, start " \
           "again on all its nodes" in said, said
    # one restart, on both nodes: not a shrink and then a scale-up
    assert done["restarts_by_cause"] == {"failure": 0, "lost_node": 0, "preemption": 1, "resize": 0}, said


def test_a_borrower_gives_the_kept_node_back_at_a_step_boundary_losing_no_step(control_plane, api, agents):
    """A 2-node job waits behind a job holding one node; the free node is kept for it, and a
    1-node runtime job of its priority submitted after it borrows that node. Once the holder
    is cancelled the waiting job could start with both: the borrower gives its node back at
    a step boundary (0 steps lost), the waiting job runs, and the borrower resumes after."""
    agents(2)
    wait_nodes(api, 2)
    holder = submit(api, train_spec("holder", 100_000, every=100_000, delay_s=0.05))
    wait_for(lambda: job(api, holder)["state"] == "RUNNING", 120, "the holder to run")
    head = submit(api, train_spec("head", 20, every=100_000, mn=2, mx=2, delay_s=0.03))
    borrower = submit(api, train_spec("borrower", 150, every=100_000, delay_s=0.03))
    with SnapshotWatch(control_plane, borrower) as watch:
        wait_for(lambda: (job(api, borrower)["progress"] or {}).get("step", 0) >= 5, 120,
                 "the job behind the waiting one to train on the node kept for it")
        assert job(api, head)["state"] == "PENDING"
        assert any(f"kept for job {head}" in r and "borrowed" in r for r in reasons(api, borrower))
        assert api.post(f"/v1/jobs/{holder}/cancel").status_code == 202
        assert wait_state(api, head, ("SUCCEEDED", "FAILED"), timeout_s=180)["state"] == "SUCCEEDED"
        done = wait_state(api, borrower, ("SUCCEEDED", "FAILED"), timeout_s=240)
        assert done["state"] == "SUCCEEDED", reasons(api, borrower)
        trace = check_steps(api, borrower, watch=watch)
    assert len(trace.resumes) >= 1, trace.resumes
    assert all(resumed >= last for _, resumed, last in trace.resumes), trace.resumes  # 0 steps lost
    assert trace.steps[-1] == 150
    said = reasons(api, borrower)
    assert any(r.startswith("giving back the node(s) it borrowed") and f"job {head}" in r for r in said), said
    assert done["restarts_by_cause"]["preemption"] == 1 and done["restarts"] == 0, done["restarts_by_cause"]
