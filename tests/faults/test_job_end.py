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
    state_letter,
    train_spec,
    wait_latest,
    workers,
)
from tests.helpers.processes import ControlPlane, NodeAgentProc, wait_for
from worker.procs import cmdline, descendants, is_fork_server, parent_of

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
    makes the commits, says that the node's workers finished the run (the worker's word, left
    with them) and reports the end. Before: the node was taken for stopped ("the node's agent
    restarted"), and the job ran again (attempt 2) from step 5; then, the commits made, it ran
    attempt 2 from step 30 (no step again)."""
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
        # workers' exit unseen; but the worker had left its word that the run finished with
        # the commits, which the restarted agent delivered first: the node finished, and no
        # attempt follows (before: one more, resuming from step 30 and running no step again;
        # before that: from step 5).
        assert (done["attempt"], done["restarts"]) == (attempt, 0), events_of(again, job_id)
        assert "after its workers finished the run" in done["reason"], done["reason"]
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


# ---------------------------------------------------------------------------- an agent lost in
# its group's last moments: its workers finished the run, its agent never reported the end

STEPS = 30


def _rank0_node(nodes, job_id: str, attempt: int):
    """The agent whose torchrun prints rank 0's steps (and the other), once one has."""
    def found():
        return next((a for a in nodes if local_steps(agent_stdout(a, job_id, attempt))), None)
    first = wait_for(found, 90, "rank 0's first step")
    return first, next(a for a in nodes if a is not first)


def _stop_near_the_end(api, nodes, job_id: str, stop) -> tuple:
    """SIGSTOP the agents `stop` picks (given rank 0's and the other) a few steps before the
    end: their workers and torchrun finish on their own, the agents see nothing of it."""
    attempt = wait_state(api, job_id, ("RUNNING",), timeout_s=90)["attempt"]
    rank0, other = _rank0_node(nodes, job_id, attempt)
    out = agent_stdout(rank0, job_id, attempt)
    wait_for(lambda: max(local_steps(out), default=0) >= STEPS - 4, 60, "rank 0 near its last step")
    stopped = stop(rank0, other)
    for a in stopped:
        a.proc.send_signal(signal.SIGSTOP)
    return attempt, rank0, other, stopped


def _torchrun_exited(agent: NodeAgentProc) -> bool:
    """The stopped agent's torchrun (its child that is not the job's fork server) has exited:
    a zombie its agent has not reaped."""
    kids = [p for p in descendants(agent.pid) if parent_of(p) == agent.pid and not is_fork_server(cmdline(p))]
    return all(state_letter(p) in (None, "Z") for p in kids)


def _lose_at_once(control_plane, job_id: str, attempt: int, lost: NodeAgentProc, reporter: NodeAgentProc,
                  api) -> None:
    """A survivor's broken-peer report, as its peer watch makes one, naming `lost`'s silent
    (killed) agent: lost at once (service/presence.py), not a lease later."""
    with control_plane.client(control_plane.job_token_of(job_id)) as as_job:
        resp = as_job.post(f"/v1/jobs/{job_id}/broken",
                           json={"attempt": attempt, "node": reporter.name, "detail": "test: peer gone"})
        assert resp.status_code == 200 and lost.name in resp.json()["nodes"], resp.text
    wait_for(lambda: lost.name not in {n["name"] for n in api.get("/v1/nodes").json()["items"]}
             and (job(api, job_id)["state"] != "RUNNING"
                  or any(f"node {lost.name} lost" in e["reason"] for e in events_of(api, job_id))),
             20, f"node {lost.name} to be lost, and the job to hear of it")


def _ended_at_its_first_attempt(api, job_id: str, attempt: int, nodes, timeout_s: float = 60) -> None:
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED", "PENDING", "CANCELLED"), timeout_s=timeout_s)
    told = [(e["state"], e["reason"]) for e in events_of(api, job_id)]
    assert done["state"] == "SUCCEEDED", told
    assert done["attempt"] == attempt and done["restarts"] == 0, told
    assert "after its workers finished the run" in done["reason"], told
    assert done["progress"]["step"] == STEPS
    assert latest_step(api, job_id) == STEPS
    rerun = [s for a in nodes for n in range(attempt + 1, done["attempt"] + 1)
             for s in local_steps(agent_stdout(a, job_id, n))]
    assert rerun == []


@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "60"}], indirect=True)
def test_a_node_whose_agent_is_killed_with_its_torchrun_after_its_workers_finished_does_not_fail_the_job(
        control_plane, api, agents):
    """`min == max == 2`: rank 0's node's agent SIGSTOPped a few steps before the end (it sees
    nothing of its group's end), its workers finish all their steps and exit, then the agent
    and its torchrun are SIGKILLed (torchrun before or in torch's exit barrier, which the
    other node's torchrun then waits in) and the node is lost. The other agent is alive
    throughout. The workers said, at their clean finish, that they had finished the run
    (`POST /v1/jobs/{id}/finished`): the lost node counts as finished, so does the other,
    whose torchrun waits for the lost one's in the exit barrier, and the job SUCCEEDED at its
    first attempt. Before: FAILED ("node lost ... after node(s) ... finished"), or PENDING
    when the loss came first, or 300 s in the exit barrier."""
    nodes = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("lastgasp", STEPS, every=5, mn=2, mx=2, delay_s=0.1))
    attempt, rank0, other, _ = _stop_near_the_end(api, nodes, job_id, lambda r0, o: [r0])
    wait_for(lambda: not workers(rank0), 90, "the stopped agent's workers to finish and exit")
    rank0.kill_tree()
    _lose_at_once(control_plane, job_id, attempt, rank0, other, api)
    _ended_at_its_first_attempt(api, job_id, attempt, nodes)


@pytest.mark.slow  # ~2 min: the lease (60 s here) is what finds the stopped, then killed, agent
@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "60"}], indirect=True)
def test_a_node_whose_agent_is_killed_after_its_torchrun_exited_does_not_fail_the_job(
        control_plane, api, agents):
    """The same with the node that is not rank 0's, its agent SIGKILLed alone once its
    torchrun has exited 0 (torch's exit barrier passed: the window between torchrun's exit and
    the agent's report), and no help: its lease lapses. The other node has reported its end
    first. Before: FAILED ("node lost (its lease lapsed) after node(s) ... finished")."""
    nodes = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("lastgasp1", STEPS, every=5, mn=2, mx=2, delay_s=0.1))
    attempt, rank0, other, _ = _stop_near_the_end(api, nodes, job_id, lambda r0, o: [o])
    wait_for(lambda: _torchrun_exited(other), 90, "the stopped agent's torchrun to exit")
    other.proc.kill()
    other.proc.wait()
    _ended_at_its_first_attempt(api, job_id, attempt, nodes, timeout_s=120)


@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "60"}], indirect=True)
def test_a_node_lost_after_its_workers_finished_and_before_the_others_ended_does_not_restart_the_job(
        control_plane, api, agents):
    """The other order: both agents SIGSTOPped before the end, both groups finish and both
    torchruns exit, rank 0's node's agent is SIGKILLed and lost, and only then does the other
    agent go on and report its end. Before: the job went back to PENDING with one of its two
    nodes left (and would have run again, resuming at its last step)."""
    nodes = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("lastgasp2", STEPS, every=5, mn=2, mx=2, delay_s=0.1))
    attempt, rank0, other, _ = _stop_near_the_end(api, nodes, job_id, lambda r0, o: [r0, o])
    try:
        wait_for(lambda: all(_torchrun_exited(a) for a in nodes), 90, "both nodes' torchrun to exit")
        rank0.kill_tree()
        _lose_at_once(control_plane, job_id, attempt, rank0, other, api)
    finally:
        other.proc.send_signal(signal.SIGCONT)
    _ended_at_its_first_attempt(api, job_id, attempt, nodes)
