"""Health checks and quarantine, with real agents, torchrun and gloo workers.

A node whose own check (`--health-check`) fails registers QUARANTINED with the check's output
as the reason and is given no job while a healthy node trains; an admin's undrain puts it back
in service and the running job grows onto it. The built-in checks pass on this CPU machine,
and fail for real where a node claims GPUs that torch cannot see (a `nvidia-smi` that lists
two, on a host without them).
"""

from __future__ import annotations

import os

import pytest

from bench.harness import NodeAgentProc
from tests.helpers.elastic import steps, submit, wait_nodes
from tests.helpers.faults import plain_spec
from tests.helpers.processes import wait_for
from tests.integration.test_gpus import fake_nvidia_smi
from worker.health import builtin_checks

pytestmark = pytest.mark.integration

SICK = "echo 'ECC errors on GPU 3: 17'; exit 1"


def node(api, name: str) -> dict:
    return next(n for n in api.get("/v1/nodes").json()["items"] if n["name"] == name)


def test_a_node_whose_check_fails_is_quarantined_never_gets_a_job_and_undrain_clears_it(
        control_plane, api, tmp_path):
    agents = [NodeAgentProc(control_plane, "n0", tmp_path / "nodes", args=["--health-check", "true"]),
              NodeAgentProc(control_plane, "n1", tmp_path / "nodes", args=["--health-check", SICK])]
    try:
        for a in agents:
            a.start()
        wait_nodes(api, 2)
        sick = node(api, "n1")
        assert sick["state"] == "QUARANTINED", sick
        assert sick["reason"] == f"health check failed: own: `{SICK}` exited 1: ECC errors on GPU 3: 17"
        assert node(api, "n0")["state"] == "READY"
        job_id = submit(api, plain_spec("healthy", 1000, every=1000, mn=1, mx=2, step_time_s=0.2))
        wait_for(lambda: len(steps(api, job_id)) >= 5, 90, "five steps")
        assert {w for _, w in steps(api, job_id)} == {1}  # on n0 alone
        assert node(api, "n1")["job"] is None and node(api, "n1")["state"] == "QUARANTINED"

        back = api.post("/v1/nodes/n1/undrain")
        assert back.status_code == 200 and back.json()["state"] == "READY" and back.json()["reason"] is None
        # Back in service: the job (below its max) grows onto it.
        wait_for(lambda: any(w == 2 for _, w in steps(api, job_id)), 90, "a step at world size 2")
        assert node(api, "n1")["job"] == job_id
        assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    finally:
        for a in agents:
            a.stop()


def test_the_builtin_checks_pass_on_this_machine():
    checks = builtin_checks(timeout_s=120)
    assert [(c.name, c.ok) for c in checks] == [("devices", True), ("matmul", True), ("memory", True),
                                                ("collective", True)], checks


def test_a_node_that_claims_gpus_torch_cannot_see_is_quarantined(control_plane, api, tmp_path):
    env = {"PATH": fake_nvidia_smi(tmp_path / "bin")}  # two "GPUs" listed; torch sees none
    agent = NodeAgentProc(control_plane, "g0", tmp_path / "nodes", env=env, args=["--builtin-checks"])
    try:
        agent.start()
        wait_nodes(api, 1, timeout_s=120)
        got = node(api, "g0")
        assert got["state"] == "QUARANTINED", got
        assert got["reason"] == "health check failed: devices: the node was given 2 GPU(s) but torch sees 0"
    finally:
        agent.stop()
