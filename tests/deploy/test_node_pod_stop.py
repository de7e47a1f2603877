"""A node agent's pod ends (a node upgrade, a spot reclaim, a rolling update): the kubelet
sends its agent SIGTERM and SIGKILLs the pod after its terminationGracePeriodSeconds. The
agent's part, with real processes: SIGTERM drains the node (its job stops at a step boundary
with that step saved and goes on without it), and the agent exits 0 well within the grace
that deploy/kubernetes/node-agent.yaml gives it."""

from __future__ import annotations

import signal
import time

import pytest
import yaml

from tests.helpers.elastic import log_items, submit, wait_nodes, wait_state
from tests.helpers.faults import SnapshotWatch, check_steps, events_of, train_spec
from tests.helpers.processes import wait_for

from .test_kubernetes_manifests import DEPLOY

pytestmark = pytest.mark.integration
STEPS = 300


def pod_grace_s() -> int:
    docs = yaml.safe_load_all((DEPLOY / "node-agent.yaml").read_text())
    (agent,) = [d for d in docs if d and d["kind"] == "DaemonSet"]
    return agent["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]


def rank0_node(api, job_id: str, world: int) -> str | None:
    """The node of rank 0 in the job's latest start at world size `world`."""
    starts = [x for x in log_items(api, job_id, rank=0) if x["line"].startswith("start step=")]
    return starts[-1]["node"] if starts and f"world={world}" in starts[-1]["line"] else None


def test_sigterm_drains_the_agent_at_a_step_boundary_and_it_exits_0_within_its_pods_grace(
        control_plane, api, agents):
    by_name = {a.name: a for a in agents(2)}
    wait_nodes(api, 2)
    # No periodic snapshot in the run: every step kept across the drain is the drain's own.
    job_id = submit(api, train_spec("pod-stop", STEPS, every=100000, mn=1, mx=2, delay_s=0.03))
    with SnapshotWatch(control_plane, job_id) as watch:
        leaving = wait_for(lambda: rank0_node(api, job_id, 2), 120, "the job to train at world size 2")
        wait_for(lambda: ((api.get(f"/v1/jobs/{job_id}").json().get("progress") or {}).get("step") or 0) >= 20,
                 120, "the job to make 20 steps")
        # The harder node to lose: rank 0's, which saves the step where the group stops.
        agent = by_name[leaving]
        asked = time.monotonic()
        agent.proc.send_signal(signal.SIGTERM)
        code = agent.proc.wait(pod_grace_s())  # past it, the kubelet would have SIGKILLed the pod
        took_s = time.monotonic() - asked

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), 240)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        trace = check_steps(api, job_id, watch=watch)
    assert code == 0, (agent.workdir / f"agent-{leaving}.log").read_text()[-3000:]
    reasons = " | ".join(e["reason"] for e in events_of(api, job_id))
    # Taken out as a drained node is (at a step boundary, with that step saved), not lost.
    assert f"{leaving} drained" in reasons, reasons
    assert done["restarts"] == 0 and "lost" not in reasons and "lease lapsed" not in reasons, reasons
    # 0 steps lost: the group went on from the step it stopped at, saved by the drain (rank 0's
    # line of that last step may not have been shipped: then it resumes one past the last seen).
    assert trace.resumes and all(resumed >= last > 0 for _, resumed, last in trace.resumes), trace.resumes
    assert trace.steps[-1] == STEPS
    assert leaving not in {n["name"] for n in api.get("/v1/nodes").json()["items"]}  # it deregistered
    print(f"agent of rank 0 exited 0 {took_s:.1f} s after SIGTERM (grace {pod_grace_s()} s); "
          f"resumed at step {trace.resumes[0][1]}")
