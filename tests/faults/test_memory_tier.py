"""The memory tier under real faults: a worker SIGKILLed, a node's agent SIGKILLed with
its whole tree, a node's copy damaged in /dev/shm. Disk snapshots are taken every 1000
steps, so everything a restart does not retrain comes from the memory tier
(worker/memory.py), which copies every step
(FTRAIN_MEMORY_EVERY=1, so that a loaded machine does not space the copies out); each fault
may cost one step."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.elastic import job, log_items, submit, wait_nodes, wait_state
from tests.helpers.faults import (
    agent_stdout,
    events_of,
    local_steps,
    runs,
    steps_lost,
    state_letter,
    train_spec,
    wait_workers,
    workers,
)
from tests.helpers.processes import pid_alive, wait_for
from worker import memory as mem

pytestmark = pytest.mark.integration

EVERY_STEP = {"FTRAIN_MEMORY_EVERY": "1"}


def wait_logged_step(api, job_id: str, step: int) -> None:
    wait_for(lambda: (r := runs(api, job_id)) and r[-1][1] and r[-1][1][-1] >= step, 60,
             f"step {step} logged")


def local_step(agents, job_id: str) -> int:
    """Rank 0's latest step as it wrote it on its node (no shipping delay)."""
    return max((s for agent in agents for s in local_steps(agent_stdout(agent, job_id, None))), default=0)


def is_memory_writer(pid: int) -> bool:
    """The node's first worker, which writes its memory tier: it maps the tier's slots."""
    return "/slot0.bin" in Path(f"/proc/{pid}/maps").read_text()


# One node of two workers: 8-10 s more, and the stop that waits for the writer and a sibling
# that speaks for a dead writer are tested alone in tests/worker/test_last_words.py; an agent
# SIGKILLed with its tree: as long as the worker's case (26 s each on 2 cores at load 9), which
# covers the same last words; all three left out of the default run (make test-slow).
@pytest.mark.parametrize("nodes,kill", [(2, "worker"), pytest.param(2, "agent", marks=pytest.mark.slow),
                                        pytest.param(1, "sibling", marks=pytest.mark.slow),
                                        pytest.param(1, "writer", marks=pytest.mark.slow)])
def test_a_worker_sigkill_loses_at_most_one_step_with_a_copy_every_10_steps(api, agents, nodes, kill):
    """The tier copies every 10 steps; a worker (or a node's agent with its whole tree) is
    SIGKILLed 2-6 steps past a copy. A survivor (the other node's first worker; with one node,
    the writer's sibling, or the writer if the sibling was killed), whose state is still that of
    its last step, copies it into its node's tier before it exits (its last words,
    worker/last_words.py), and the job resumes from it (after an agent's loss, on n0 alone)."""
    started = agents(2) if nodes == 2 else agents(1, nproc=2)
    wait_nodes(api, nodes)
    job_id = submit(api, train_spec("lastwords", 24, mn=1 if kill == "agent" else nodes, mx=nodes,
                                    nproc=3 - nodes, every=1000, delay_s=0.05,
                                    env={"FTRAIN_MEMORY_EVERY": "10"}))
    wait_for(lambda: 12 <= local_step(started, job_id) <= 16, 60,
             "rank 0 at step 12-16, 2-6 steps past the tier's copy of step 10")
    if kill == "agent":
        assert job(api, job_id)["world_size"] == 2
        killed = started[-1].kill_tree()
        wait_for(lambda: not any(pid_alive(p) for p in killed), 10, "every process of agent n1 to die")
    else:
        victim = next(p for p in wait_workers(started[-1], 3 - nodes)
                      if nodes == 2 or is_memory_writer(p) == (kill == "writer"))
        os.kill(victim, signal.SIGKILL)

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert done["restarts"] == (0 if kill == "agent" else 1)  # a lost node is no restart
    (_, before), (start, _) = runs(api, job_id)
    assert start % 10 != 0, f"resumed from step {start}, the tier's periodic copy, after step {before[-1]}"
    assert steps_lost(api, job_id, 24) <= 1, runs(api, job_id)
    lines = [i["line"] for i in log_items(api, job_id) if i["node"] == "n0"]
    assert any(f"last words: copied the state into the node's memory tier (step {start})" in line
               for line in lines), lines[-20:]


def test_worker_sigkill_loses_at_most_one_step(api, agents):
    (a,) = agents(1, nproc=2)
    wait_nodes(api, 1)
    job_id = submit(api, train_spec("memwkill", 60, nproc=2, every=1000, env=EVERY_STEP))
    wait_logged_step(api, job_id, 20)
    # The API lists the node's memory tier next to the disk tier.
    wait_for(lambda: any(m["tier"] == "memory" and m["node"] == "n0" and m["step"] >= 20
                         for m in api.get(f"/v1/jobs/{job_id}/snapshots").json()["memory"]),
             10, "the memory tier of n0 listed at step >= 20")
    victim = wait_workers(a, 2)[1]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not pid_alive(victim), 10, "the SIGKILLed worker to die")

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=90)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert done["restarts"] == 1
    assert steps_lost(api, job_id, 60) <= 1, runs(api, job_id)


# A 60 s node lease and a 30 s bound on a dropped connection alone: only the dropped
# connection confirmed by the survivor's broken-peer report can tell the control plane in seconds.
@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "60", "FTRAIN_PRESENCE_BLIP_S": "30"}],
                         indirect=True)
def test_agent_sigkill_is_noticed_at_once_loses_at_most_one_step_and_the_node_rejoins(
        control_plane, api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("memakill", 200, mn=1, mx=2, every=1000, env=EVERY_STEP))
    wait_for(lambda: job(api, job_id)["world_size"] == 2, 60, "world size 2")
    wait_logged_step(api, job_id, 20)
    assert workers(b)
    killed_at = time.time()
    killed = b.kill_tree()
    wait_for(lambda: not any(pid_alive(p) for p in killed), 10, "every process of agent n1 to die")
    lost = wait_for(lambda: next((e for e in events_of(api, job_id) if "node n1 lost" in e["reason"]), None),
                    15, "the job to lose n1 (its lease has 60 s to live, its dropped connection 30 s)")
    assert lost["time"] - killed_at < 5, lost
    wait_for(lambda: len(r := runs(api, job_id)) == 2 and r[1][1], 60, "training again on n0 alone")

    # n1 comes back with an empty memory tier: the job grows to it (a planned change), and
    # n0 sends it the state of the step they restart from.
    b.start()
    wait_for(lambda: job(api, job_id)["world_size"] == 2 and len(runs(api, job_id)) == 3, 60,
             "the job to grow back to n1")
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=90)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert steps_lost(api, job_id, 200, restarts=2) <= 1, runs(api, job_id)
    lines = [i["line"] for i in log_items(api, job_id)
             if i["node"] == "n1" and i["attempt"] == done["attempt"]]
    assert any("resumed from memory" in line and "sent by rank" in line for line in lines), lines[-20:]


@pytest.mark.slow  # 20-40 s on 2 cores, most of it two torchrun starts: left out of the default run (make test-slow)
def test_a_min_max_two_job_that_loses_a_node_resumes_from_the_survivors_copy(api, agents):
    """min == max == 2: a node's agent is SIGKILLed, the job goes back to PENDING and lets the
    survivor go; when the node is back, the group restarts from the survivor's memory copy (sent
    to the other node), losing at most a step. The survivor deleted its copy as soon as it had
    no assignment, so the job went back to the disk tier (here: step 0). Found by the hour soak
    (bench/soak.py --minutes), where that cost the long job up to `every_steps` steps.

    Meanwhile another job waits for a node: the survivor, which holds the first job's copy, is
    held for that job (service/decide/keep.py), not given to the other one, which would delete
    the copy (the hour soak's SIGSTOP cases); the other job runs once the pair has ended."""
    (a, b) = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("memmm", 120, mn=2, mx=2, every=1000, env=EVERY_STEP))
    wait_logged_step(api, job_id, 20)
    killed = b.kill_tree()
    wait_for(lambda: not any(pid_alive(p) for p in killed), 10, "every process of agent n1 to die")
    wait_for(lambda: job(api, job_id)["state"] == "PENDING", 30, "the job back to PENDING")
    assert "its memory copy is on n0" in job(api, job_id)["reason"], job(api, job_id)["reason"]
    wait_for(lambda: not workers(a), 30, "the survivor's workers stopped (it is let go)")
    other = submit(api, {"name": "other", "command": ["python", "-c", "import time; time.sleep(1)"],
                         "nodes": {"min": 1, "max": 1}})
    wait_for(lambda: any(n["name"] == "n0" and n["held_for"] == job_id
                         for n in api.get("/v1/nodes").json()["items"]),
             10, "n0 listed as held for the waiting job")
    deadline = time.monotonic() + 2  # several scheduler passes (0.5 s apart, and at each change)
    while time.monotonic() < deadline:
        assert job(api, other)["state"] == "PENDING", "the survivor went to the other job"
        time.sleep(0.1)
    b.start()
    (_, before), (start, _) = wait_for(lambda: len(r := runs(api, job_id)) == 2 and r[1][1] and r, 90,
                                       "training again on both nodes")
    assert start >= before[-1] - 1, (f"resumed from step {start} after step {before[-1]}",
                                     [e["reason"] for e in events_of(api, job_id)])
    assert any("in the memory of n0" in e["reason"] for e in events_of(api, job_id)), events_of(api, job_id)
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    assert steps_lost(api, job_id, 120) <= 1, runs(api, job_id)
    assert wait_state(api, other, ("SUCCEEDED", "FAILED"), timeout_s=60)["state"] == "SUCCEEDED"


def _memory_dir(agent, job_id: str) -> Path:
    """The agent's memory-tier directory of `job_id` (worker/memory.py's naming)."""
    prefix = mem.node_root(agent.workdir, agent.name)
    found = [p for base in (mem.SHM_ROOT, agent.workdir / "memory") if base.is_dir()
             for p in base.glob(f"{prefix}{job_id}.*")]
    assert len(found) == 1, found
    return found[0]


def test_a_corrupt_memory_copy_falls_back_to_the_peers_copy_and_says_so(api, agents):
    (a, b) = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, train_spec("memcorrupt", 60, mn=2, mx=2, every=1000, env=EVERY_STEP))
    wait_for(lambda: job(api, job_id)["world_size"] == 2, 60, "world size 2")
    wait_logged_step(api, job_id, 15)
    # Freeze the group (no copy in flight can rewrite a slot), damage n1's newest copy in
    # /dev/shm, then SIGKILL n1's worker: the restart must notice and take n0's copy.
    frozen = [wait_workers(a, 1)[0], wait_workers(b, 1)[0]]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: all(state_letter(p) == "T" for p in frozen), 10, "both workers stopped")
    directory = _memory_dir(b, job_id)
    slot = json.loads((directory / mem.LATEST).read_text())["slot"]
    with open(directory / f"slot{slot}.bin", "r+b") as f:
        f.seek(64)
        byte = f.read(1)[0]
        f.seek(64)
        f.write(bytes([byte ^ 0xFF]))
    os.kill(frozen[1], signal.SIGKILL)
    os.kill(frozen[0], signal.SIGCONT)

    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=90)
    assert done["state"] == "SUCCEEDED", events_of(api, job_id)
    reasons = [e["reason"] for e in events_of(api, job_id)]
    assert any("on node n1 is corrupt; falling back" in r for r in reasons), reasons
    assert any("in the memory of n0" in r for r in reasons), reasons
    assert steps_lost(api, job_id, 60) <= 1, runs(api, job_id)
    lines = [i["line"] for i in log_items(api, job_id)
             if i["node"] == "n1" and i["attempt"] == done["attempt"]]
    assert any("resumed from memory" in line and "sent by rank" in line for line in lines), lines[-20:]
