"""Every process ftrain starts on a node, SIGKILLed in turn under a running elastic job.

A 1:2 job (min 1, max 2 nodes) trains on two nodes; one process of node n1's tree is
SIGKILLed: a worker, a worker's launcher (worker/launch.py), torchrun as a user finds it
(`ps | grep train.py` lists first the launcher that stands in for it, whose argv names the
script), torch's elastic agent itself (forked by the fork server), the job's fork server, a
standby, or the node agent. Each for a plain torchrun-style script and for one that uses
ftrain's runtime. Whatever was killed, the job ends SUCCEEDED, the fault costs at most one
restart, the steps go on from a committed snapshot (or the memory tier), and nothing of the
killed process's tree is left running. Each case prints how long it took from the kill to
the next step rank 0 logged (`kill-to-step`; "no pause" where training never stopped).

Most cases are `slow` (about a minute each on two loaded cores); the default run keeps the
fault users meet first (torchrun, found by name, for a plain script; for the runtime in the
test of its reason) and the fork server's.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.elastic import SCRIPT, job, submit, torchrun_launchers, wait_nodes, wait_state
from tests.helpers.faults import (
    STEP_LINE,
    TRAIN,
    SnapshotWatch,
    check_steps,
    events_of,
    forked_torchruns,
    fork_servers,
    found_by_grep,
    plain_spec,
    rank0_lines,
    standbys,
    train_spec,
    worker_launchers,
    workers,
)
from tests.helpers.processes import NodeAgentProc, descendants, pid_alive, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.shared_control_plane]

STEPS = 100
STEP_S = 0.05


def _one(found: list[int]) -> int | None:
    return found[0] if found else None


# What to kill on the node, by name: a function from (agent, script) to a pid, or None while
# there is none yet.
FINDERS: dict[str, Callable[[NodeAgentProc, Path], int | None]] = {
    "worker": lambda a, script: _one(workers(a, script)),
    "launcher": lambda a, script: _one(worker_launchers(a)),
    "torchrun": found_by_grep,
    "torch agent": lambda a, script: _one(forked_torchruns(a)),
    "fork server": lambda a, script: _one(fork_servers(a)),
    "standby": lambda a, script: _one(standbys(a)),
    "node agent": lambda a, script: a.pid if a.proc.poll() is None else None,
}
DEFAULT = {("torchrun", "plain"), ("fork server", "plain")}  # with the test below: about 2.5 min
CASES = [pytest.param(kind, script, id=f"{kind}-{script}",
                      marks=() if (kind, script) in DEFAULT else pytest.mark.slow)
         for kind in FINDERS for script in ("plain", "runtime")]


def spec_for(kind: str, script: str, name: str, max_restarts: int = 3) -> dict:
    env = {"FTRAIN_WORKER_STANDBY": "1"} if kind == "standby" else {}  # (CPU: none by default)
    if script == "runtime":
        return train_spec(name, STEPS, every=5, mn=1, mx=2, delay_s=STEP_S, env=env, max_restarts=max_restarts)
    return plain_spec(name, STEPS, every=5, mn=1, mx=2, step_time_s=STEP_S, env=env, max_restarts=max_restarts)


def rank0_steps(api, job_id: str) -> list[tuple[float, int]]:
    """(read time, step) of each step rank 0 logged, in the order written."""
    return [(i["time"], int(m.group(1))) for i in rank0_lines(api, job_id) if (m := STEP_LINE.match(i["line"]))]


def start_training_on_two_nodes(api, agents, spec: dict) -> tuple[NodeAgentProc, str]:
    """Two agents, the job submitted, trained a few steps at world size 2: (node n1, job id)."""
    _, b = agents(2)
    wait_nodes(api, 2)
    job_id = submit(api, spec)
    wait_for(lambda: job(api, job_id)["world_size"] == 2 and job(api, job_id)["state"] == "RUNNING",
             90, "the job to train at world size 2")
    wait_for(lambda: any(n >= 3 for _, n in rank0_steps(api, job_id)), 30, "rank 0's step 3")
    return b, job_id


def kill(agent: NodeAgentProc, pid: int, what: str) -> float:
    """SIGKILL `pid`; wait until it and everything under it is gone; when it was killed."""
    tree = [pid, *descendants(pid)]
    os.kill(pid, signal.SIGKILL)
    killed_at = time.time()
    if pid == agent.pid:
        agent.proc.wait()
    wait_for(lambda: not any(pid_alive(p) for p in tree), 20, f"the killed {what}'s tree to be gone")
    return killed_at


def kill_to_step(resumes: list[tuple[float, int, int]], steps: list[tuple[float, int]],
                 killed_at: float) -> str:
    """From the kill to rank 0's first step of the group that replaced the killed one; "no
    pause" where none did (the next step after the kill, then)."""
    after = [t for t, _, _ in resumes if t > killed_at]
    if after:
        return f"{after[0] - killed_at:.2f} s"
    nxt = [t for t, _ in steps if t > killed_at]
    return "no pause" + (f" (next step {nxt[0] - killed_at:.2f} s)" if nxt else "")


@pytest.mark.parametrize("kind,script", CASES)
def test_sigkill_of_any_node_process_costs_at_most_one_restart(control_plane, api, agents, kind, script):
    path = TRAIN if script == "runtime" else SCRIPT
    b, job_id = start_training_on_two_nodes(api, agents, spec_for(kind, script, f"kill-{kind.replace(' ', '-')}-{script}"))
    with SnapshotWatch(control_plane, job_id) as watch:
        victim = wait_for(lambda: FINDERS[kind](b, path), 30, f"a {kind} under node n1")
        if kind == "torchrun":  # what a user who greps for the script finds: torchrun's stand-in
            assert victim in torchrun_launchers(b)
        killed_at = kill(b, victim, kind)

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        assert done["restarts"] <= 1, events_of(api, job_id)
        trace = check_steps(api, job_id, watch=watch) if script == "runtime" else check_steps(api, job_id, every=5)
        assert trace.steps[-1] == STEPS
        if script == "runtime":
            assert watch.check(api)["latest"] == STEPS
    print(f"\nfault-matrix | {kind} | {script} | {done['state']} | {done['restarts']} | "
          f"{kill_to_step(trace.resumes, rank0_steps(api, job_id), killed_at)} |")


def test_a_killed_torchrun_with_no_restart_left_fails_the_job_naming_the_kill(api, agents):
    """max_restarts=0: the kill ends the job, and its reason is the kill, not the last line a
    worker happened to log (the runtime's INFO lines were taken for the cause)."""
    b, job_id = start_training_on_two_nodes(api, agents, spec_for("torchrun", "runtime", "kill-no-restart",
                                                                  max_restarts=0))
    victim = found_by_grep(b, TRAIN)
    kill(b, victim, "torchrun")
    done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
    assert done["state"] == "FAILED" and done["restarts"] == 0
    assert done["reason"] == f"node n1: torchrun (pid {victim}) was killed by SIGKILL; " \
                             "workers failed 1 times (max_restarts=0)", events_of(api, job_id)
