"""Several control planes, any of them serving: two real `ftrain serve` replicas
on one etcd, a real agent and torchrun job given both URLs. SIGKILL the replica the agent
talks to mid-job: heartbeats, rendezvous keep-alives and snapshot commits move to the other
one, the job trains on with 0 restarts, and the CLI given both URLs still answers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from service.client import FtrainClient
from tests.helpers.elastic import job, submit, wait_nodes, wait_state
from tests.helpers.faults import events_of, latest_step, train_spec, wait_latest
from tests.helpers.processes import REPO, ControlPlane, NodeAgentProc, wait_for

pytestmark = pytest.mark.integration


def test_the_replica_the_agent_talks_to_is_killed_and_the_job_trains_on(etcd, tmp_path):
    a = ControlPlane(etcd.endpoint, tmp_path / "a").start()
    # The second replica shares the first one's secret (job tokens), tokens and folders.
    b = ControlPlane(etcd.endpoint, tmp_path / "b", user_token=a.user_token, node_token=a.node_token)
    b.secret_dir, b.snapshot_root, b.log_root = a.secret_dir, a.snapshot_root, a.log_root
    b.start()
    both = f"{a.url},{b.url}"
    agent = NodeAgentProc(a, "n0", tmp_path / "node").start(server=both)
    try:
        with a.client() as api_a, b.client() as api_b:
            wait_nodes(api_b, 1)
            # 100 steps of 0.1 s: the job outlives the node's 6 s lease after the kill.
            job_id = submit(api_b, train_spec("failover", 100, every=5, delay_s=0.1))
            before = wait_latest(api_a, job_id, 10)
            attempt = job(api_b, job_id)["attempt"]
            a.stop(signal.SIGKILL)
            assert a.proc.returncode == -signal.SIGKILL

            # Snapshot commits go on, through the other replica.
            wait_latest(api_b, job_id, before + 20, timeout_s=30)
            # The CLI given both URLs answers (the first is dead), as FtrainClient does.
            out = subprocess.run(
                [sys.executable, "-m", "service.cli", "status", job_id, "--json"], cwd=REPO,
                env={**os.environ, "FTRAIN_SERVER": both, "FTRAIN_TOKEN": a.user_token},
                capture_output=True, text=True, timeout=30)
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["id"] == job_id
            with FtrainClient(both, a.user_token) as client:
                assert [n["name"] for n in client.nodes()] == ["n0"]
                assert client.server == b.url  # stuck to the one that answered

            done = wait_state(api_b, job_id, ("SUCCEEDED", "FAILED"), timeout_s=60)
            assert done["state"] == "SUCCEEDED", events_of(api_b, job_id)
            assert done["restarts"] == 0 and done["attempt"] == attempt, events_of(api_b, job_id)
            reasons = " ".join(e["reason"] for e in events_of(api_b, job_id))
            assert "lost" not in reasons and "new rendezvous" not in reasons, reasons
            assert latest_step(api_b, job_id) == 100
            # the node's heartbeats moved too: it is alive on b, past its lease
            wait_for(lambda: [n["name"] for n in api_b.get("/v1/nodes").json()["items"]] == ["n0"],
                     5, "node n0 alive on the second replica")
            # ... without a lapse: the agent registered once (with a), never again
            log = (agent.workdir / "agent-n0.log").read_text()
            assert log.count("registered node n0 with") == 1, log[-3000:]
            assert f"registered node n0 with {a.url}" in log
    finally:
        agent.stop()
        a.stop()
        b.stop()
