"""Every process ftrain starts on a node, SIGKILLed in turn under a running elastic job.

A 1:2 job (min 1, max 2 nodes) trains on two nodes; one process of node n1's tree is
SIGKILLed: a worker, a worker's launcher (worker/launch.py), torchrun as a user finds it
(`ps | grep train.py` lists first the launcher that stands in for it, whose argv names the
script), torch's elastic agent itself (forked by the fork server), the job's fork server, a
standby, or the node agent. Each for a plain torchrun-style script and for one that uses
ftrain's runtime. Whatever was killed, the job ends SUCCEEDED, the fault costs at most one
restart, the steps go on from a committed snapshot (or the memory tier), and nothing of the
killed process's tree is left running. Each case prints how long it took from the kill to
the next step rank 0 logged (`kill-to-step`).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from tests.helpers.elastic import SCRIPT, job, submit, wait_nodes, wait_state
from tests.helpers.faults import (
    TRAIN,
    SnapshotWatch,
    check_steps,
    events_of,
    forked_torchruns,
    fork_servers,
    found_by_grep,
    plain_spec,
    standbys,
    train_spec,
    worker_launchers,
    workers,
)
from tests.helpers.processes import NodeAgentProc, descendants, pid_alive, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.shared_control_plane]

STEPS = 240
STEP_S = 0.05


def _one(found: list[int]) -> int | None:
    return found[0] if found else None


# What to kill on the node, by name: a function from (agent, script) to a pid, or None while
# there is none yet.
FINDERS: dict[str, Callable[[NodeAgentProc, object], int | None]] = {
    "worker": lambda a, script: _one(workers(a, script)),
    "launcher": lambda a, script: _one(worker_launchers(a)),
    "torchrun": found_by_grep,
    "torch agent": lambda a, script: _one(forked_torchruns(a)),
    "fork server": lambda a, script: _one(fork_servers(a)),
    "standby": lambda a, script: _one(standbys(a)),
    "node agent": lambda a, script: a.pid if a.proc.poll() is None else None,
}


def spec_for(kind: str, script: str, name: str) -> dict:
    env = {"FTRAIN_WORKER_STANDBY": "1"} if kind == "standby" else {}  # (CPU: none by default)
    if script == "runtime":
        return train_spec(name, STEPS, every=5, mn=1, mx=2, delay_s=STEP_S, env=env)
    return plain_spec(name, STEPS, every=5, mn=1, mx=2, step_time_s=STEP_S, env=env)


@pytest.mark.parametrize("script", ["plain", "runtime"])
@pytest.mark.parametrize("kind", list(FINDERS))
def test_sigkill_of_any_node_process_costs_at_most_one_restart(control_plane, api, agents, kind, script):
    a, b = agents(2)
    wait_nodes(api, 2)
    path = TRAIN if script == "runtime" else SCRIPT
    job_id = submit(api, spec_for(kind, script, f"kill-{kind.replace(' ', '-')}-{script}"))
    with SnapshotWatch(control_plane, job_id) as watch:
        wait_for(lambda: job(api, job_id)["world_size"] == 2 and job(api, job_id)["state"] == "RUNNING",
                 90, "the job to train at world size 2")
        victim = wait_for(lambda: FINDERS[kind](b, path), 30, f"a {kind} under node n1")
        tree = [victim, *descendants(victim)]
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()
        if kind == "node agent":
            b.proc.wait()
        wait_for(lambda: not any(pid_alive(p) for p in tree), 20, f"the killed {kind}'s tree to be gone")

        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), timeout_s=120)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        assert done["restarts"] <= 1, events_of(api, job_id)
        trace = check_steps(api, job_id, watch=watch) if script == "runtime" else check_steps(api, job_id, every=5)
        assert trace.steps[-1] == STEPS
        if script == "runtime":
            assert watch.check(api)["latest"] == STEPS
    after = [t for t, _, _ in trace.resumes if t > killed_at]
    again = after[0] - killed_at if after else None
    print(f"\nkill-to-step {kind} {script}: {done['state']} restarts={done['restarts']} "
          f"kill-to-step={'%.2f s' % again if again is not None else 'no pause'}")
