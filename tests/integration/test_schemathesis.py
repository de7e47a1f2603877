"""Schemathesis, every check, against a real control plane (real etcd, uvicorn) and its own
/openapi.json: the description matches what the server sends. Slow: marked `slow`.

Every kind of token is real: the user's and the node token (the server's settings), a
registered node's credential and a submitted job's token (the job is assigned to that node, whose
heartbeats this test keeps up while Schemathesis runs), so the node's and the job's endpoints
are exercised past their authentication (schemathesis.toml names the node, the job and its
rendezvous for them)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from tests.helpers.processes import wait_for

pytestmark = pytest.mark.slow
CONFIG = Path(__file__).with_name("schemathesis.toml")  # 413 as a rejection (it says why)
# A job spec's rules between fields, which JSON Schema cannot state (the module says which).
HOOKS = "schemathesis_hooks"
NODE, SPARE = "st-node", "st-spare"  # the job's node; one for the deregistration to delete


def register(cp, name: str) -> str:
    got = httpx.post(f"{cp.url}/v1/nodes/register", json={"name": name},
                     headers={"Authorization": f"Bearer {cp.node_token}"}, timeout=10)
    got.raise_for_status()
    return got.json()["credential"]


def failures_first(report: str, limit: int = 30000) -> str:
    """Schemathesis's report for an assertion message: its failures (each with the request
    that reproduces it) first, then the summary; a long report is cut in its middle."""
    start = report.find("= FAILURES =")
    failures = report[start:start + limit // 2] if start >= 0 else ""
    return failures + "\n[...]\n" + report[-(limit - len(failures)):]


def keep_alive(cp, credentials: dict[str, str], stop: threading.Event) -> None:
    """Heartbeat the nodes (their leases are the credentials' life) until `stop`."""
    with httpx.Client(base_url=cp.url, timeout=5) as http:
        while not stop.wait(1.0):
            for name, credential in credentials.items():
                try:
                    http.post(f"/v1/nodes/{name}/heartbeat",
                              headers={"Authorization": f"Bearer {credential}"})
                except httpx.HTTPError:
                    pass  # a slow answer under Schemathesis's load: the next beat is a second away


@pytest.mark.timeout(1200)  # 4-6 minutes on a quiet machine; more under load
# a node lease of 60 s: an etcd stalled for seconds by a loaded machine must not lose the node
# whose credential Schemathesis holds
@pytest.mark.parametrize("control_plane", [{"FTRAIN_NODE_TTL_S": "60"}], indirect=True)
def test_schemathesis_all_checks_find_nothing(control_plane, tmp_path):
    cp = control_plane
    credentials = {NODE: register(cp, NODE), SPARE: register(cp, SPARE)}
    with cp.client("user") as api:
        # The highest priority: Schemathesis submits jobs of every priority, and a preemption
        # would move this job to a new attempt, whose old rendezvous is then rightly 410 Gone.
        job = api.post("/v1/jobs", json={"name": "st-job", "command": ["python", "-c", "pass"],
                                         "max_restarts": 1000, "priority": 1000}).json()

    def assignment():
        got = httpx.post(f"{cp.url}/v1/nodes/{NODE}/heartbeat", timeout=5,
                         headers={"Authorization": f"Bearer {credentials[NODE]}"}).json()
        return got["assignment"]
    a = wait_for(assignment, 30, f"job {job['id']} assigned to {NODE}", interval_s=0.2)
    assert a["job_id"] == job["id"]
    stop = threading.Event()
    beats = threading.Thread(target=keep_alive, args=(cp, credentials, stop), daemon=True)
    beats.start()
    argv = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run",
            f"{cp.url}/openapi.json",
            "--checks", "all", "--max-examples", os.environ.get("FTRAIN_SCHEMATHESIS_EXAMPLES", "20"),
            # a follow stream is held up to its `wait_s` (30 s at most) while the job is PENDING
            "--request-timeout", "40",
            # Hypothesis's check that generating a case is fast: on 2 cores shared with other
            # runs (load 40-100) a pattern-heavy body (a heartbeat's) failed it, no finding of ours
            "--suppress-health-check", "too_slow",
            # a failure names its seed; FTRAIN_SCHEMATHESIS_SEED replays that run's cases
            *(["--seed", seed] if (seed := os.environ.get("FTRAIN_SCHEMATHESIS_SEED")) else []),
            ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": HOOKS,  # the tokens of its security schemes:
           "FTRAIN_ST_USER_TOKEN": cp.user_token, "FTRAIN_ST_NODE_TOKEN": cp.node_token,
           "FTRAIN_ST_NODE_CREDENTIAL": credentials[NODE], "FTRAIN_ST_JOB_TOKEN": a["job_token"],
           "FTRAIN_ST_SPARE_CREDENTIAL": credentials[SPARE],
           "FTRAIN_ST_NODE": NODE, "FTRAIN_ST_SPARE": SPARE, "FTRAIN_ST_JOB": job["id"],
           "FTRAIN_ST_RDZV": a["rdzv_id"],
           # a snapshot commit names a file in the job's own snapshot directory (schemathesis_hooks)
           "FTRAIN_ST_SNAPSHOT_DIR": str(cp.snapshot_root / job["id"]),
           "PYTHONPATH": os.pathsep.join([str(CONFIG.parent), str(CONFIG.parents[2]),
                                          os.environ.get("PYTHONPATH", "")])}
    report = tmp_path / "schemathesis.txt"  # written as it runs: kept if the run is cut short
    try:
        with report.open("w") as out:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=1100, cwd=tmp_path,
                                  env=env)
    finally:
        stop.set()
        beats.join()
    text = report.read_text()
    assert done.returncode == 0, failures_first(text)
    # every operation got past its authentication (Schemathesis warns of those that did not)
    assert "returned only 401/403" not in text, failures_first(text)
