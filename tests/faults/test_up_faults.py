"""The fault matrix under `ftrain up --replicas 2 --etcd-members 3` with two local nodes: while a
`min 1, max 2` job trains (a runtime script, then a plain one), a node agent, a control-plane
replica and an etcd member are SIGKILLed in turn. `up` starts each again (one line each), the
job ends SUCCEEDED with at most one restart per fault, and rank 0's steps never go back past
a committed snapshot. The time from each kill to training again is printed (`-s`).

Slow (a few minutes): `FTRAIN_TEST_SLOW=1 .venv/bin/python -m pytest -s -m slow tests/faults/test_up_faults.py`.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from service.up import agent_available
from tests.helpers.elastic import submit, wait_state
from tests.helpers.faults import check_steps, events_of, plain_spec, rank0_lines, train_spec
from tests.helpers.processes import wait_for
from tests.integration.test_up import Up
from tests.integration.test_up_ha import two_free_ports
from tests.integration.test_up_supervise import api_of, parts
from worker.procs import cmdline

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.skipif(not agent_available(), reason="the node agent is not in this build")]

# (part of `up` to kill, a word of its command line, the name up's line gives it): the agent of
# local-1, replica 0 (the one the agents list first), etcd member 0.
FAULTS = [("node", "local-1", "node local-1"), ("serve", None, "control plane 0"),
          ("etcd", "ftrain-0", "etcd member ftrain-0")]


def _victim(up: Up, part: str, word: str | None) -> int:
    word = word or str(up.port)  # replica 0 listens on --port
    return next(p for p in parts(up)[part] if word.encode() in cmdline(p))


def _step_times(api, job_id: str) -> list[float]:
    return [i["time"] for i in rank0_lines(api, job_id) if i["line"].startswith("step=")]


PAUSE_S = 1.5  # a gap between two of rank 0's steps longer than this is a pause (a step: 0.05 s)


def _training_again(api, job_id: str, killed_at: float) -> tuple[float, float]:
    """Seconds from the kill to rank 0's first step after the first pause that follows it
    (training again; the first step after the kill if it never paused), and to the end of
    the longest pause (a killed agent's node back in the group). The steps' times are the
    agents' wall-clock read times."""
    def settled() -> list[float] | None:
        times = [t for t in _step_times(api, job_id) if t > killed_at]
        return times if len(times) >= 40 else None

    wait_for(settled, 120, "training again after the fault")
    times = [killed_at] + [t for t in _step_times(api, job_id) if t > killed_at]
    gaps = [(b - a, b) for a, b in zip(times, times[1:], strict=False)]
    first = next((b for gap, b in gaps if gap > PAUSE_S), times[1])
    _, longest = max(gaps)
    return first - killed_at, max(first, longest) - killed_at


@pytest.mark.parametrize("kind", ["runtime", "plain"])
def test_up_restarts_each_killed_part_while_a_job_trains(tmp_path, kind):
    up = Up(tmp_path / "data", two_free_ports(), 2, ("--replicas", "2", "--etcd-members", "3"))
    try:
        up.start(timeout_s=120)
        api = api_of(up, up.port + 1)  # replica 1: replica 0 is killed
        wait_for(lambda: len(api.get("/v1/nodes").json()["items"]) == 2, 60, "both nodes")
        spec = (train_spec("matrix", 900, every=20, mn=1, mx=2, delay_s=0.05) if kind == "runtime"
                else plain_spec("matrix", 900, every=20, mn=1, mx=2, step_time_s=0.05))
        job_id = submit(api, spec)
        wait_for(lambda: len(_step_times(api, job_id)) >= 20, 120, "20 steps")
        rows = []
        for part, word, name in FAULTS:
            restarts_before = api.get(f"/v1/jobs/{job_id}").json()["restarts"]
            victim = _victim(up, part, word)
            killed_at = time.time()
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda name=name: f"{name} exited (SIGKILL); restarting it in" in up.output(), 30,
                     f"`up` to restart the {name}")
            again, whole = _training_again(api, job_id, killed_at)
            restarts = api.get(f"/v1/jobs/{job_id}").json()["restarts"] - restarts_before
            rows.append((name, again, whole, restarts))
            assert restarts <= 1, (name, events_of(api, job_id))
        done = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), 300)
        assert done["state"] == "SUCCEEDED", events_of(api, job_id)
        if kind == "plain":  # (the runtime's snapshots would need a watch for the same check)
            check_steps(api, job_id, every=20)
        for name, again, whole, restarts in rows:
            print(f"[up fault matrix] {kind}: SIGKILL {name}: SUCCEEDED, {restarts} restart(s), "
                  f"training again {again:.2f} s after the kill, at full size again {whole:.2f} s")
        assert up.interrupt(timeout_s=90) == 0
    finally:
        up.kill()
