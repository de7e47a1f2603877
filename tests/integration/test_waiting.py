"""A PENDING job says what it waits for, through the API and the CLI: a real etcd and uvicorn,
nodes registered over HTTP (the scheduler places jobs on them; no workers are needed to wait)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.helpers.processes import wait_for


def _beat(cp, credentials: dict[str, str]) -> None:
    for name, credential in credentials.items():
        with cp.client(credential) as c:
            assert c.post(f"/v1/nodes/{name}/heartbeat", json={}).status_code == 200


def test_a_job_larger_than_the_cluster_says_how_many_nodes_are_missing(control_plane):
    cp = control_plane
    credentials = {n: cp.enrol(n) for n in ("w1", "w2")}
    with cp.client() as api:
        job = api.post("/v1/jobs", json={"name": "big", "command": ["true"],
                                          "nodes": {"min": 3, "max": 3}}).json()
        _beat(cp, credentials)
        got = api.get(f"/v1/jobs/{job['id']}").json()
        assert got["state"] == "PENDING"
        assert got["waiting"] == "needs 3 node(s); the cluster has 2 registered: it starts when 1 more join"
        listed = {j["id"]: j for j in api.get("/v1/jobs").json()["items"]}
        assert listed[job["id"]]["waiting"] == got["waiting"]


def test_a_job_behind_a_running_one_names_the_job_holding_its_nodes(control_plane):
    cp = control_plane
    with cp.client() as api:
        first = api.post("/v1/jobs", json={"name": "first", "command": ["true"],
                                            "nodes": {"min": 1, "max": 2}}).json()
        credentials = cp.members_of(first["id"], ["w1", "w2"])
        second = api.post("/v1/jobs", json={"name": "second", "command": ["true"],
                                             "nodes": {"min": 2, "max": 2}}).json()

        def says() -> str | None:
            _beat(cp, credentials)
            return api.get(f"/v1/jobs/{second['id']}").json().get("waiting")

        wait_for(lambda: "held by" in (says() or ""), 20, "the second job to name its nodes' holder")
        assert says() == (f"needs 2 node(s); 0 of the 2 that fit are free, the others are held by "
                          f"job {first['id']} (STARTING: w1, w2)")
        env = {**os.environ, "FTRAIN_SERVER": cp.url, "FTRAIN_TOKEN": cp.user_token}
        out = subprocess.run([sys.executable, "-m", "service.cli", "status", second["id"]],
                             capture_output=True, text=True, env=env, timeout=60)
        assert f"held by job {first['id']}" in out.stdout, out.stdout + out.stderr
