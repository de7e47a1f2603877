"""Faults of the training processes: a worker killed or hung, an agent killed, a cancel
that lands while the job is recovering."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.elastic import SCRIPT, job, job_spec, log_items, submit, wait_nodes, wait_state, wait_step
from tests.helpers.faults import (
    SnapshotWatch,
    check_steps,
    events_of,
    plain_spec,
    rank0_lines,
    state_letter,
    states_of,
    train_spec,
    wait_latest,
    wait_workers,
    workers,
)
from tests.helpers.processes import pid_alive, wait_for

pytestmark = pytest.mark.integration


def test_worker_sigkill_restarts_the_group_from_the_latest_snapshot(control_plane, api, agents):
    (a,) = agents(1, nproc=2)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("wkill", 60, nproc=2))
    with SnapshotWatch(control_plane, job_id) as watch:
        latest = wait_latest(api, job_id, 10)
        victim = wait_workers(a, 2)[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not pid_alive(victim), 10, "the SIGKILLed worker to die")

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=90)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        assert done["restarts"] == 1 and done["world_size"] == 2
        trace = check_steps(api, job_id, watch=watch)
        assert trace.steps[-1] == 60
        assert len(trace.resumes) == 1 and trace.resumes[0][1] >= latest, trace.resumes
        assert watch.check(api)["latest"] == 60


def test_worker_hung_with_sigstop_is_killed_and_the_group_restarts_within_seconds(api, agents):
    (a,) = agents(1, nproc=2)
    wait_nodes(api, 1)
    job_id = submit(api, plain_spec("wstop", 80, nproc=2))
    wait_step(api, job_id, 10)
    victim = wait_workers(a, 2, script=SCRIPT)[1]
    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.time()
    wait_for(lambda: state_letter(victim) in ("T", "t"), 5, "the worker to be stopped (state T)")

    # The agent kills a worker stopped for more than 3 s; torch restarts the group.
    wait_for(lambda: not pid_alive(victim), 15, "the agent to kill the stopped worker")
    assert time.time() - stopped_at < 15
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=90)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert done["restarts"] == 1
    trace = check_steps(api, job_id, every=5)
    assert trace.steps[-1] == 80 and len(trace.resumes) == 1
    # Training again well before any collective's timeout (30 s in the script, 30 min by default).
    assert trace.resumes[0][0] - stopped_at < 20, trace.resumes
    lines = [i["line"] for i in log_items(api, job_id)]
    assert any(f"worker pid {victim} was stopped" in line for line in lines)


def test_agent_sigkill_the_job_goes_on_with_the_other_node(control_plane, api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("akill", 100, mn=1, mx=2))
    with SnapshotWatch(control_plane, job_id) as watch:
        wait_for(lambda: job(api, job_id)["world_size"] == 2, 60, "world size 2")
        latest = wait_latest(api, job_id, 10)
        assert workers(b)
        killed = b.kill_tree()
        wait_for(lambda: not any(pid_alive(p) for p in killed), 10, "every process of agent n1 to die")

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=90)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        assert done["nodes"] == ["n0"] and done["world_size"] == 1 and done["restarts"] == 0
        trace = check_steps(api, job_id, watch=watch)
        assert trace.steps[-1] == 100
        assert len(trace.resumes) == 1 and trace.resumes[0][1] >= latest, trace.resumes
        assert any("node n1 lost" in e["reason"] for e in events_of(api, job_id))
        assert watch.check(api)["latest"] == 100


def test_cancel_during_recovery_ends_cancelled_with_no_worker_left(control_plane, api, agents):
    (a,) = agents(1, nproc=2)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("cancelrec", 2000, nproc=2))
    with SnapshotWatch(control_plane, job_id) as watch:
        wait_latest(api, job_id, 5)
        tree = a.tree()
        victim = wait_workers(a, 2)[0]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: not pid_alive(victim), 10, "the SIGKILLed worker to die")
        wait_for(lambda: job(api, job_id)["state"] == "RECOVERING", 20, "the job to be RECOVERING",
                 interval_s=0.01)
        resp = api.post(f"/v1/jobs/{job_id}/cancel")
        assert resp.status_code == 202, resp.text

        done = wait_state(api, job_id, ("CANCELLED", "FAILED", "SUCCEEDED"), timeout_s=30)
        assert done["state"] == "CANCELLED", events_of(api, job_id)
        states = states_of(api, job_id)
        # The cancel landed while recovering: no RUNNING between RECOVERING and CANCELLING.
        assert states[-3:] == ["RECOVERING", "CANCELLING", "CANCELLED"], states
        wait_for(lambda: not any(pid_alive(p) for p in tree[1:]) and not workers(a), 15,
                 "every worker and torchrun of the job to stop")
        check_steps(api, job_id, watch=watch)
        watch.check(api)
        assert rank0_lines(api, job_id)


@pytest.mark.slow  # 10-20 s, most of it torchrun's start: left out of the default run (make test-slow)
@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "2", "FTRAIN_CANCEL_GRACE_S": "5"}],
                         indirect=True)
def test_a_group_stop_longer_than_the_node_lease_keeps_the_node_alive(api, agents):
    """The agent's stop of a group whose worker ignores SIGTERM takes the whole cancel grace
    (5 s), past the node lease (2 s). Its heartbeat goes on meanwhile (worker/agent.py,
    `_beating_meanwhile`): the node is never lost (listed throughout, never registered again)
    and the job ends CANCELLED, its worker killed at the grace's end."""
    (a,) = agents(1)
    wait_nodes(api, 1)
    script = SCRIPT.with_name("ignores_sigterm.py")
    job_id = submit(api, job_spec("ignores-term", script=script, mx=1, env={"FTRAIN_FORK_SERVER": "0"}))
    wait_for(lambda: any("ignoring SIGTERM" in i["line"] for i in log_items(api, job_id)), 60,
             "the worker to ignore SIGTERM")
    (registered,) = [n["registered_at"] for n in api.get("/v1/nodes").json()["items"]]
    (worker,) = wait_workers(a, 1, script, timeout_s=10)
    cancelled = time.monotonic()
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    while pid_alive(worker):  # the stop is under way: the node must stay, under the same lease
        nodes = api.get("/v1/nodes").json()["items"]
        assert [(n["name"], n["registered_at"]) for n in nodes] == [("n0", registered)], \
            f"node lost {time.monotonic() - cancelled:.1f} s into the group's stop: {nodes}"
        assert time.monotonic() - cancelled < 30, "the worker was never killed"
        time.sleep(0.1)
    assert time.monotonic() - cancelled > 2 * 1.5, "the stop did not outlast the lease: no test"
    wait_state(api, job_id, "CANCELLED", timeout_s=20)
    nodes = api.get("/v1/nodes").json()["items"]
    assert [(n["name"], n["registered_at"]) for n in nodes] == [("n0", registered)]
    assert not [e for e in events_of(api, job_id) if "lost" in e["reason"]]
