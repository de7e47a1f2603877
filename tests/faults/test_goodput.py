"""The goodput ledger of a real job through real faults: a worker SIGKILLed, then a node lost
(its agent SIGKILLed), under examples/train.py (the ftrain runtime, DDP over gloo) on two
real agents. Where its wall time went must add up, and its recovering and replayed parts
must be what its events and its rank 0's own output show.

About a minute and a half on two loaded cores: marked `slow` (FTRAIN_TEST_SLOW=1 runs it)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.helpers.elastic import job, submit, wait_nodes, wait_state
from tests.helpers.faults import SnapshotWatch, check_steps, events_of, train_spec, wait_workers
from tests.helpers.processes import pid_alive, wait_for

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("FTRAIN_TEST_SLOW"),
                       reason="slow (minutes): set FTRAIN_TEST_SLOW=1 to run it"),
]

STEP_S = 0.05
EVERY = 80  # steps between snapshots: 4 s, so that a fault redoes steps
# Restores from the disk's snapshots only (no memory tier, no last words): the steps since the
# last snapshot are trained again, which the memory tier would have saved.
DISK_ONLY = {"FTRAIN_MEMORY_EVERY": "0", "FTRAIN_LAST_WORDS": "0"}


def step_of(api, job_id: str) -> int:
    return (job(api, job_id).get("progress") or {}).get("step", 0)


def trained_again(api, job_id: str) -> list[dict]:
    """The job's events of a new group's first step after a stopped one."""
    return [e for e in events_of(api, job_id) if e.get("replay") is not None]


def fault_before(events: list[dict], first: dict) -> dict:
    """The event of the fault that stopped the group whose replacement made step `first`: the
    first RECOVERING event since the job last trained."""
    before = [e for e in events if e["seq"] < first["seq"]]
    trained = max(e["seq"] for e in before if e["state"] == "RUNNING")
    return next(e for e in before if e["seq"] > trained and e["state"] == "RECOVERING")


def test_goodput_of_a_job_through_a_worker_sigkill_and_a_lost_node_adds_up(control_plane, api, agents):
    a, b = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("goodput", 250, every=EVERY, mn=1, mx=2, delay_s=STEP_S, env=DISK_ONLY))
    with SnapshotWatch(control_plane, job_id) as watch:
        # a worker on n1 is SIGKILLed, 30 steps or more past the last snapshot (as reported):
        # the group restarts on both nodes, from that snapshot
        wait_for(lambda: job(api, job_id)["world_size"] == 2 and 30 <= step_of(api, job_id) % EVERY < 60,
                 120, "the job to train at world size 2, 30 steps past a snapshot")
        (worker,) = wait_workers(b, 1)
        os.kill(worker, signal.SIGKILL)
        wait_for(lambda: len(trained_again(api, job_id)) == 1, 90, "training again after the worker's kill")
        wait_for(lambda: step_of(api, job_id) >= trained_again(api, job_id)[0]["replay"]["from_step"] + 40,
                 90, "40 more steps")
        # then node n1 is lost (its agent SIGKILLed, its workers with it): n0 goes on alone
        os.kill(b.pid, signal.SIGKILL)
        b.proc.wait()
        wait_for(lambda: len(trained_again(api, job_id)) == 2, 90, "training again after n1 was lost")
        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=180)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        trace = check_steps(api, job_id, watch=watch)
    assert pid_alive(a.pid)

    g = api.get(f"/v1/jobs/{job_id}/goodput").json()
    seconds, wall = g["seconds"], g["wall_s"]
    assert wall == pytest.approx(done["finished_at"] - done["created_at"], abs=0.01)
    assert all(s >= 0 for s in seconds.values()), seconds
    assert sum(seconds.values()) == pytest.approx(wall, rel=0.02), seconds
    assert seconds["training"] > 0 and seconds["starting"] > 0

    # recovering: each fault's RECOVERING up to the new group's first step, as the events show,
    # plus the time from the stopped group's last report to the fault (its detection)
    events = events_of(api, job_id)
    again = trained_again(api, job_id)
    assert len(again) == 2, events
    restarts, detections = 0.0, 0.0
    for first in again:
        fault = fault_before(events, first)
        restarts += first["time"] - fault["time"]
        detections += max(0.0, fault["time"] - first["replay"]["reached_at"])
    assert restarts > 0
    assert seconds["recovering"] == pytest.approx(restarts + detections, abs=0.05), (seconds, events)

    # replayed: the steps each new group redid, from where rank 0 says it resumed to the step
    # its stopped group had reported, at that group's step time; never more than the new group
    # trained before its own stop (its last report, or the fault if that came first)
    assert [r["replay"]["from_step"] for r in again] == [resumed for _, resumed, _ in trace.resumes], \
        (again, trace.resumes)
    # The worker's kill left both agents shipping rank 0's lines: its stopped group reported no
    # step past the last it printed (rank 0 reports a step just before it prints it). (Rank 0's
    # last lines on the lost node may be lost with its agent.)
    assert again[0]["replay"]["reached_step"] <= trace.resumes[0][2] + 1, (again, trace.resumes)
    lives = [min(after["replay"]["reached_at"], fault_before(events, after)["time"]) - r["time"]
             for r, after in zip(again, again[1:])] + [float("inf")]
    redone = sum(min(life, max(0, r["replay"]["reached_step"] - r["replay"]["from_step"]) * r["replay"]["step_s"])
                 for r, life in zip(again, lives, strict=True))
    assert again[0]["replay"]["reached_step"] - again[0]["replay"]["from_step"] >= 30, again
    assert seconds["replayed"] == pytest.approx(redone, abs=0.05) and redone > 0, (seconds, again)
    print(f"\ngoodput | wall {wall:.1f} s | " + " | ".join(f"{c} {s:.2f}" for c, s in seconds.items() if s))
