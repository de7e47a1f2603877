"""Bad-node attribution with real processes: a node whose torchrun is SIGKILLed in two
different jobs, while those jobs' other nodes run on, is QUARANTINED with a reason naming
both jobs, the second job's events say so, and the job goes on without it. Real etcd,
control plane, three agents, torchrun and a plain DDP script (gloo)."""

from __future__ import annotations

import os
import signal

import pytest

from tests.faults.test_drain_holds import node
from tests.helpers.elastic import events, job, submit, wait_nodes, wait_state
from tests.helpers.faults import forked_torchruns, plain_spec
from tests.helpers.processes import wait_for

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("FTRAIN_TEST_SLOW"),
                       reason="slow (about 2 min): set FTRAIN_TEST_SLOW=1 to run it"),
]


def kill_torchrun_on(agents: dict, name: str) -> None:
    """SIGKILL torch's elastic agent on node `name` (its member then fails: a crash)."""
    pid = wait_for(lambda: next(iter(forked_torchruns(agents[name])), None), 60, f"torchrun on {name}")
    os.kill(pid, signal.SIGKILL)


def test_a_node_whose_workers_die_in_two_jobs_while_their_peers_run_on_is_quarantined(api, agents):
    started = {a.name: a for a in agents(3)}
    wait_nodes(api, 3)
    first = submit(api, plain_spec("first", 2000, mn=2, mx=2, step_time_s=0.1, max_restarts=5))
    running = wait_state(api, first, "RUNNING", timeout_s=90)
    bad = sorted(running["nodes"])[0]
    kill_torchrun_on(started, bad)
    wait_for(lambda: job(api, first)["restarts"] >= 1, 60, "the first job to restart its workers")
    assert node(api, bad)["state"] == "READY"  # one job's failure proves nothing
    api.post(f"/v1/jobs/{first}/cancel").raise_for_status()
    wait_state(api, first, "CANCELLED", timeout_s=60)

    second = submit(api, plain_spec("second", 2000, mn=2, mx=3, step_time_s=0.1, max_restarts=5))
    wait_for(lambda: bad in job(api, second)["nodes"] and job(api, second)["state"] == "RUNNING", 90,
             f"the second job to run on {bad}")
    kill_torchrun_on(started, bad)
    quarantined = wait_for(lambda: (n := node(api, bad)) and n["state"] == "QUARANTINED" and n, 60,
                           f"{bad} to be quarantined")
    assert first in quarantined["reason"] and second in quarantined["reason"], quarantined
    wait_for(lambda: any(bad in e["reason"] and "quarantined" in e["reason"] for e in events(api, second)),
             30, "the second job's event that says its node was quarantined")
    # The job goes on without it, on the other two.
    wait_for(lambda: (j := job(api, second))["state"] == "RUNNING" and bad not in j["nodes"]
             and len(j["nodes"]) == 2, 90, f"the second job to run on without {bad}")
    api.post(f"/v1/jobs/{second}/cancel").raise_for_status()
    wait_state(api, second, "CANCELLED", timeout_s=60)
