"""Real agents run real torchrun workers; faults are real signals."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.helpers.elastic import (
    events,
    forked,
    job,
    job_spec,
    log_items,
    rdzv_keys,
    steps,
    submit,
    torchrun_launchers,
    wait_nodes,
    wait_state,
    wait_step,
    worker_pids,
)
from tests.helpers.processes import pid_alive, wait_for

pytestmark = pytest.mark.integration




def test_job_on_two_agents_runs_at_world_size_two_and_succeeds(etcd, api, agents):
    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, job_spec("two", "--steps", "15", "--step-time", "0.02"))
    wait_for(lambda: rdzv_keys(etcd.endpoint, job_id), 60, "the job's rendezvous keys")
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"))
    assert done["state"] == "SUCCEEDED", events(api, job_id)
    assert done["world_size"] == 2 and sorted(done["nodes"]) == ["n0", "n1"]
    assert {w for _, w in steps(api, job_id)} == {2}
    assert [s for s, _ in steps(api, job_id)] == list(range(1, 16))
    wait_for(lambda: not rdzv_keys(etcd.endpoint, job_id), 10, "the rendezvous keys to be removed")


def test_worker_sigkill_recovers_and_counts_one_restart(api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, job_spec("kill", "--steps", "400", "--step-time", "0.05"))
    wait_step(api, job_id, 10)
    victims = worker_pids(b)
    assert len(victims) == 1 and forked(victims[0])  # a forked worker (worker/fork_server.py)
    killed_at = max(s for s, _ in steps(api, job_id))
    os.kill(victims[0], signal.SIGKILL)
    wait_for(lambda: not pid_alive(victims[0]), 10, "the worker to die")

    wait_for(lambda: job(api, job_id)["restarts"] == 1, 60, "the restart to be counted")
    death = f"ftrain: the worker (pid {victims[0]}) died of SIGKILL"
    wait_for(lambda: any(death in i["line"] for i in log_items(api, job_id)),
             10, "the worker's death in the job's log")
    before = len(steps(api, job_id))
    wait_step(api, job_id, killed_at + 5, world=2, after=before)
    assert all(forked(p) for p in worker_pids(a) + worker_pids(b))  # the restarted ones too
    states = [e["state"] for e in events(api, job_id)]
    assert "RECOVERING" in states
    assert states[states.index("RECOVERING"):].count("RUNNING") >= 1
    final = job(api, job_id)
    assert final["state"] == "RUNNING" and final["restarts"] == 1 and final["world_size"] == 2


def test_job_can_opt_out_of_the_fork_server(api, agents):
    (a,) = agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, job_spec("cold", "--steps", "400", "--step-time", "0.05", mx=1,
                                  env={"FTRAIN_FORK_SERVER": "0"}))
    wait_step(api, job_id, 3)
    pids = worker_pids(a)
    assert len(pids) == 1 and not forked(pids[0]) and torchrun_launchers(a) == []  # torchrun too
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    wait_state(api, job_id, "CANCELLED")


# A 60 s node lease: a restarted agent that had to wait for its old lease to lapse would
# miss every deadline below; it takes its name back with its credential file instead.
@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "60"}], indirect=True)
def test_agent_sigkill_takes_its_workers_and_its_restart_takes_the_name_back_at_once(
        control_plane, api, agents):
    (a,) = agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, job_spec("orphans", "--steps", "400", "--step-time", "0.05",
                                  nproc_per_node=2))
    wait_step(api, job_id, 3)
    first = node_record(api, "n0")
    attempt = job(api, job_id)["attempt"]
    tree = a.tree()
    workers = worker_pids(a)
    assert len(workers) == 2
    os.kill(a.pid, signal.SIGKILL)
    a.proc.wait()
    wait_for(lambda: not any(pid_alive(p) for p in tree), 10, "no orphan of the SIGKILLed agent")

    a.start()  # the same name and data directory; the old lease has ~60 s to live
    again = wait_for(lambda: (n := node_record(api, "n0")) and n["registered_at"] > first["registered_at"]
                     and n, 20, "the restarted agent to take its live name back")
    assert again["registered_at"] - first["registered_at"] < 60
    # The control plane heard at once that the old workers are gone: a new attempt on n0. (The
    # restarted agent also ships the old attempt's last lines from its data directory: only a
    # step of the new attempt counts, and the job is RUNNING once rank 0 reports it.)
    wait_step(api, job_id, 1, timeout_s=60, attempt=attempt + 1)
    j = wait_for(lambda: (j := job(api, job_id))["state"] == "RUNNING" and j, 30,
                 "the new attempt's first step to make the job RUNNING")
    assert j["nodes"] == ["n0"] and j["attempt"] > attempt
    reasons = [e["reason"] for e in events(api, job_id)]
    assert reasons.count("started on 1 node(s): n0") == 2, reasons
    assert len(worker_pids(a)) == 2 and not set(worker_pids(a)) & set(workers)


def node_record(api, name: str) -> dict | None:
    return {n["name"]: n for n in api.get("/v1/nodes").json()["items"]}.get(name)


def test_third_agent_joining_scales_the_job_up(api, agents):
    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, job_spec("grow", "--steps", "400", "--step-time", "0.05", mx=3))
    wait_step(api, job_id, 5, world=2)
    agents(1)
    before = len(steps(api, job_id))
    wait_step(api, job_id, 1, world=3, after=before, timeout_s=60)
    j = job(api, job_id)
    assert j["world_size"] == 3 and sorted(j["nodes"]) == ["n0", "n1", "n2"] and j["restarts"] == 0
    # a planned change is no fault: RUNNING throughout, its end recorded at the new group's output
    wait_for(lambda: any(e["reason"] == "training again: world size 3 on 3 node(s), its workers' first "
                         "output" for e in events(api, job_id)), 10, "training again at world size 3")
    evs = events(api, job_id)
    assert "RECOVERING" not in [e["state"] for e in evs], evs
    assert any(e["reason"] == "node(s) n2 joined; scaling up" for e in evs), evs


def test_control_plane_restart_does_not_disturb_training(control_plane, api, agents):
    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, job_spec("cprestart", "--steps", "120", "--step-time", "0.05"))
    wait_step(api, job_id, 5, world=2)
    control_plane.stop(signal.SIGKILL)
    control_plane.start()
    with control_plane.client() as again:
        done = wait_state(again, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
        assert done["state"] == "SUCCEEDED", events(again, job_id)
        assert done["restarts"] == 0 and done["world_size"] == 2
        evs = events(again, job_id)
        assert "RECOVERING" not in [e["state"] for e in evs], evs
        logged = [s for s, _ in steps(again, job_id)]
        assert logged[-1] == 120 and logged == sorted(logged)


def test_cancel_stops_every_worker_within_10s(api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, job_spec("cancel", "--steps", "1000", "--step-time", "0.05"))
    wait_step(api, job_id, 3, world=2)
    workers = worker_pids(a) + worker_pids(b)
    assert len(workers) == 2
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    wait_for(lambda: not any(pid_alive(p) for p in workers), 10, "every worker to stop")
    wait_state(api, job_id, "CANCELLED", timeout_s=20)


def test_script_that_always_fails_ends_failed_after_max_restarts(etcd, api, agents):
    agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, job_spec("fails", "--fail", max_restarts=2))
    done = wait_state(api, job_id, ("FAILED", "SUCCEEDED"), timeout_s=120)
    assert done["state"] == "FAILED"
    assert done["restarts"] == 2
    assert "max_restarts=2" in done["reason"] and "failing on purpose" in done["reason"]
    wait_for(lambda: not rdzv_keys(etcd.endpoint, job_id), 10, "the rendezvous keys to be removed")


@pytest.mark.parametrize("fork_server", ["1", "0"])
def test_a_crash_in_teardown_after_the_script_finished_does_not_fail_the_job(api, agents, fork_server):
    """torch's backend threads can abort the interpreter's teardown after a script ended
    well (gloo on Python 3.11, see worker/fork_server.py). With the fork server the job
    still succeeds with no restart; without it (FTRAIN_FORK_SERVER=0) the same crash,
    really injected, fails it."""
    agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, job_spec("teardown", "--steps", "6", "--step-time", "0.02", "--crash-on-exit",
                                  max_restarts=0, env={"FTRAIN_FORK_SERVER": fork_server}))
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"))
    if fork_server == "1":  # each node reports its end once its lines are shipped: all there now
        assert [s for s, _ in steps(api, job_id)] == list(range(1, 7))
    else:  # the first node's failure ends the job; the other's group is stopped, not waited
        # for, and its last lines come with its stop (CI read [1, 2, 3, 4] at once)
        wait_for(lambda: [s for s, _ in steps(api, job_id)] == list(range(1, 7)), 15,
                 "rank 0's six steps in the job's log")
    notes = [i for i in log_items(api, job_id)
             if "the script finished, then the interpreter died of SIGABRT" in i["line"]]
    if fork_server == "1":
        assert done["state"] == "SUCCEEDED" and done["restarts"] == 0, events(api, job_id)
        assert len(notes) == 2  # one per worker
    else:
        assert done["state"] == "FAILED" and not notes
        assert "workers failed 1 times" in done["reason"], done["reason"]


@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "60"}], indirect=True)
def test_an_idle_agent_then_its_control_plane_stop_at_once_not_after_its_long_poll(
        control_plane, api, agents):
    """Under a 60 s lease an idle agent's heartbeat is a long poll of 15 s (a quarter of the
    lease). SIGTERM cuts it short (the agent still deregisters on its way out), and the
    control plane's end of the poll ends with the connection, so it does not hold the
    control plane's own stop (uvicorn waits for the requests in flight)."""
    (agent,) = agents(1)
    wait_nodes(api, 1)
    asked = time.monotonic()
    agent.proc.send_signal(signal.SIGTERM)
    agent.proc.wait(30)
    took_s = time.monotonic() - asked
    assert agent.proc.returncode == 0 and took_s < 5, took_s
    assert api.get("/v1/nodes").json()["items"] == []  # deregistered
    asked = time.monotonic()
    control_plane.stop()
    assert time.monotonic() - asked < 5
