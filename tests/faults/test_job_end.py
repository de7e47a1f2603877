"""A job's end with the control plane away over its last seconds: the job ends with its
final snapshot committed and listed as latest, never SUCCEEDED on an older one
(worker/handoff.py: rank 0 leaves the commits the control plane did not take to its agent)."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.helpers.elastic import job, submit, wait_nodes, wait_state
from tests.helpers.faults import (
    SnapshotWatch,
    agent_stdout,
    events_of,
    latest_step,
    local_steps,
    train_spec,
    wait_latest,
    workers,
)
from tests.helpers.processes import ControlPlane, NodeAgentProc, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "2"}], indirect=True)
def test_a_job_whose_last_commits_meet_an_outage_ends_with_its_final_snapshot(control_plane, api, agents):
    """Rank 0 writes its last snapshots while the control plane is down and exits after its
    commit wait (0.5 s here, 10 s by default); its agent makes the commits (and sends its
    final progress report) once a control plane is back, and only then reports the end.
    Before: SUCCEEDED with latest 5 of 40, progress at step 6.
    The node's 2 s lease lapses in the outage: it registers again as still running the group."""
    (a,) = agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("endaway", 40, every=5, env={"FTRAIN_COMMIT_WAIT_S": "0.5"}))
    with SnapshotWatch(control_plane, job_id) as watch:
        wait_for(lambda: watch.latest and (watch.latest[-1][1] or 0) >= 5, 60, "a first commit")
        attempt = job(api, job_id)["attempt"]
        control_plane.stop(signal.SIGKILL)
        killed = time.monotonic()
        out = agent_stdout(a, job_id, attempt)
        # The worker trains to its end and leaves; its last commits are not made.
        wait_for(lambda: not workers(a) and max(local_steps(out), default=0) == 40, 60,
                 "the worker to finish its 40 steps and exit while the control plane is away")
        time.sleep(max(0.0, 3 - (time.monotonic() - killed)))  # the fault itself: past the node's lease
        control_plane.start()
        with control_plane.client() as again:
            done = wait_state(again, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
            assert done["state"] == "SUCCEEDED", events_of(again, job_id)
            assert done["attempt"] == attempt and done["restarts"] == 0
            assert done["progress"]["step"] == 40  # rank 0's final report, which the agent sent
            final = watch.check(again)
            assert final["latest"] == 40, (final["latest"], events_of(again, job_id))
            assert set(range(5, 41, 5)) <= {i["step"] for i in final["items"]}
            assert events_of(again, job_id)[-1]["reason"] == "every worker exited 0"
    assert not list(control_plane.snapshot_root.glob(f"{job_id}/.handoff-*"))  # the agent's, done


@pytest.mark.slow  # ~45 s under load: the control plane and the agent restarted, then a second attempt
@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "2"}], indirect=True)
def test_an_agent_killed_while_it_holds_the_last_commits_leaves_them_to_its_restart(
        control_plane, api, agents):
    """The control plane SIGKILLed over the job's last steps, then rank 0's node agent SIGKILLed
    while it holds what its worker left (its taken file), and restarted (same name, same data
    directory) before the control plane is back: the restarted agent finds the end its
    predecessor owed (worker/end_record.py), registers naming the attempt as still its own,
    makes the commits and reports the end. Before: the node was taken for stopped ("the node's
    agent restarted"), and the job ran again (attempt 2) from step 5."""
    (a,) = agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("endkill", 30, every=5, env={"FTRAIN_COMMIT_WAIT_S": "0.5"}))
    wait_latest(api, job_id, 5)
    attempt = job(api, job_id)["attempt"]
    control_plane.stop(signal.SIGKILL)
    folder = control_plane.snapshot_root / job_id
    wait_for(lambda: not workers(a) and list(folder.glob(".handoff-n0-a*.json.taken-*")), 60,
             "the worker to exit and its agent to take what it left")
    record = a.workdir / "end.n0.json"
    assert json.loads(record.read_text())["attempt"] == attempt
    a.kill_tree()
    a.start()  # the same name and data directory
    control_plane.start()
    with control_plane.client() as again:
        done = wait_state(again, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
        assert done["state"] == "SUCCEEDED", events_of(again, job_id)
        assert done["progress"]["step"] == 30
        assert latest_step(again, job_id) == 30, events_of(again, job_id)
        # torchrun waited in its exit barrier on the control plane and died with the agent, its
        # workers' exit unseen: the node's end is `stopped`, and the attempt after it resumes
        # from step 30, the last commit, and runs no step again (before: from step 5).
        rerun = [s for n in range(attempt + 1, done["attempt"] + 1)
                 for s in local_steps(agent_stdout(a, job_id, n))]
        assert rerun == [], (rerun, events_of(again, job_id))
    assert not list(folder.glob(".handoff-*"))
    wait_for(lambda: not record.exists(), 10, "the record of the end owed to go")


@pytest.mark.slow  # ~25 s: torchrun waits for the stopped control plane to leave its rendezvous
def test_a_two_node_job_that_ends_while_the_control_plane_is_stopped_ends_with_its_final_snapshot(
        control_plane, api, agents):
    """`min == max == 2`, the control plane SIGSTOPped (requests hang, nothing refused) from
    the job's first commit past both nodes' exits: the node that is not rank 0's finishes
    first, rank 0's node reports its end only after the commits its worker left it."""
    nodes = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("endstop", 40, every=5, mn=2, mx=2, env={"FTRAIN_COMMIT_WAIT_S": "0.5"}))
    with SnapshotWatch(control_plane, job_id) as watch:
        wait_for(lambda: watch.latest and (watch.latest[-1][1] or 0) >= 5, 60, "a first commit")
        control_plane.proc.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: not any(workers(a) for a in nodes), 60,
                     "both nodes' workers to exit while the control plane is stopped")
        finally:
            control_plane.proc.send_signal(signal.SIGCONT)
        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        assert done["restarts"] == 0 and done["progress"]["step"] == 40
        final = watch.check(api)
        assert final["latest"] == 40, (final["latest"], events_of(api, job_id))


@pytest.mark.slow  # ~18 s: two control planes started, one of them twice
def test_the_last_commits_go_to_whichever_control_plane_comes_back(etcd, tmp_path):
    """Two replicas, both SIGKILLed over the job's last steps, only the second restarted: the
    agent's commits of what rank 0 left go to it (`worker/http.py` `Servers`)."""
    a = ControlPlane(etcd.endpoint, tmp_path / "a").start()
    b = ControlPlane(etcd.endpoint, tmp_path / "b", user_token=a.user_token, node_token=a.node_token)
    b.secret_dir, b.snapshot_root, b.log_root = a.secret_dir, a.snapshot_root, a.log_root
    b.start()
    agent = NodeAgentProc(a, "n0", tmp_path / "node").start(server=f"{a.url},{b.url}")
    try:
        with a.client() as api:
            wait_nodes(api, 1)
            job_id = submit(api, train_spec("endtwo", 30, every=5, env={"FTRAIN_COMMIT_WAIT_S": "0.5"}))
            wait_latest(api, job_id, 5)
        a.stop(signal.SIGKILL)
        b.stop(signal.SIGKILL)
        wait_for(lambda: not workers(agent), 60, "the worker to exit while no control plane is up")
        b.start()
        with b.client() as again:
            done = wait_state(again, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
            assert done["state"] == "SUCCEEDED", events_of(again, job_id)
            assert done["restarts"] == 0 and done["progress"]["step"] == 30
            assert latest_step(again, job_id) == 30, events_of(again, job_id)
    finally:
        agent.stop()
        a.stop()
        b.stop()


@pytest.mark.slow  # ~10 s, the first test's run with one file taken away
def test_a_final_snapshot_that_cannot_be_committed_is_named_in_the_end(control_plane, api, agents):
    """The file of the last snapshot is gone before the agent can commit it (deleted by hand
    in the outage): the job still SUCCEEDED (every worker exited 0), its latest is the one
    before, and its end says which step was not committed and why: never a silent success."""
    (a,) = agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("endgone", 40, every=5, env={"FTRAIN_COMMIT_WAIT_S": "0.5"}))
    wait_latest(api, job_id, 5)
    control_plane.stop(signal.SIGKILL)
    wait_for(lambda: not workers(a), 60, "the worker to exit while the control plane is away")
    last = control_plane.snapshot_root / job_id / "step-000000000040.pt"
    last.unlink()
    control_plane.start()
    with control_plane.client() as again:
        done = wait_state(again, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
        end = events_of(again, job_id)[-1]
        assert done["state"] == "SUCCEEDED" and latest_step(again, job_id) == 35, end
        assert end["reason"].startswith("every worker exited 0; node n0: snapshot(s) written and not "
                                        "committed"), end
        assert "step 40: its file cannot be read" in end["reason"] + (end.get("detail") or ""), end
