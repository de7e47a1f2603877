"""A drain holds: through an etcd pause long enough for the node's lease to lapse (the agent
registers again), and through a control-plane restart; `ftrain undrain` ends it. Real etcd
(SIGSTOPped), control plane, agent, torchrun, and the `ftrain` CLI as a process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.elastic import submit, wait_state
from tests.helpers.processes import REPO, wait_for

SCRIPT = REPO / "tests" / "scripts" / "exit_with.py"
NODE_TTL_S = 2  # the shortest lease the control plane takes (FTRAIN_NODE_TTL_S)
ETCD_PAUSE_S = 5  # past the node's lease: it lapses and the node's record with it


def ftrain(control_plane, command: str, *rest: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FTRAIN_")}
    return subprocess.run([sys.executable, "-m", "service.cli", command, "--server", control_plane.url,
                           "--token", control_plane.user_token, *rest],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)


def node(api, name: str) -> dict | None:
    resp = api.get("/v1/nodes")
    if resp.status_code != 200:
        return None
    return next((n for n in resp.json()["items"] if n["name"] == name), None)


@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": str(NODE_TTL_S)}], indirect=True)
def test_a_drain_survives_an_etcd_pause_and_a_control_plane_restart_until_undrain(
        etcd, control_plane, api, agents):
    agents(1)
    wait_for(lambda: node(api, "n0"), 30, "node n0 to register")
    done = ftrain(control_plane, "drain", "n0")
    assert done.returncode == 0 and done.stdout.strip() == "n0: DRAINED", done
    first = node(api, "n0")

    etcd.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(ETCD_PAUSE_S)  # the fault itself, held on purpose
    finally:
        etcd.proc.send_signal(signal.SIGCONT)

    def registered_again():
        n = node(api, "n0")
        return n is not None and n["registered_at"] != first["registered_at"] and n
    again = wait_for(registered_again, 60, "n0 to register again after its lease lapsed")
    assert again["state"] == "DRAINED"

    control_plane.stop()
    control_plane.start()
    listed = wait_for(lambda: node(api, "n0"), 30, "n0 listed by the restarted control plane")
    assert listed["state"] == "DRAINED"

    # A job does not start on the drained node; it does once the node is undrained.
    job_id = submit(api, {"name": "after", "command": ["python", str(SCRIPT), "0"], "max_restarts": 0})
    # A job that could start starts within a scheduler pass (well under a second here): one
    # that is still PENDING after 3 s was not given the drained node.
    held_until = time.monotonic() + 3
    while time.monotonic() < held_until:
        assert api.get(f"/v1/jobs/{job_id}").json()["state"] == "PENDING"
        time.sleep(0.2)
    assert ftrain(control_plane, "list").stdout.count("PENDING") == 1
    done = ftrain(control_plane, "undrain", "n0")
    assert done.returncode == 0 and done.stdout.strip() == "n0: READY", done
    wait_state(api, job_id, "SUCCEEDED", timeout_s=90)
