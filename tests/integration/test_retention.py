"""Retention against a real etcd and a real control plane: finished jobs are deleted, with
everything kept for them, once their retention has passed, and answer a 404 that says so."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx

from service.keys import Keys
from service.store.etcd import EtcdStore
from tests.helpers.processes import ControlPlane, wait_for
from worker.protocol import seal_state

RETENTION_S = 2.0
SPEC = {"name": "kept", "command": ["python", "train.py"]}


def etcd_keys(endpoint: str, prefix: str = "/ftrain/") -> list[str]:
    async def read() -> list[str]:
        store = EtcdStore(endpoint)
        try:
            return [e.key async for e in store.scan_prefix(prefix, keys_only=True)]
        finally:
            await store.close()

    return asyncio.run(read())


_NODES: dict[str, tuple[str, str]] = {}  # job id -> (its node, that node's credential)


def give_it_state(cp: ControlPlane, job_id: str) -> None:
    """Logs, progress (and a metric history), a committed snapshot and rendezvous keys, as a
    job's nodes leave them (a node of its own, which then runs it, and its workers)."""
    node_name = f"n{len(_NODES)}"
    credential = cp.member_of(job_id, node_name)
    line = {"rank": 0, "stream": "stdout", "line": "step 1", "time": time.time()}
    with cp.client(credential) as node:
        assert node.post(f"/v1/jobs/{job_id}/logs",
                         json={"node": node_name, "lines": [line]}).status_code == 204
    with cp.client(cp.job_token_of(job_id)) as worker, cp.client("user") as api:
        attempt = api.get(f"/v1/jobs/{job_id}").json()["attempt"]
        commit = {"step": 5, "path": f"{cp.snapshot_root}/{job_id}/5", "size": 1, "checksum": "x",
                  "attempt": attempt}
        assert worker.post(f"/v1/jobs/{job_id}/snapshots", json=commit).status_code == 200
        assert worker.post(f"/v1/jobs/{job_id}/progress",
                           json={"step": 5, "loss": 0.5, "attempt": attempt}).status_code == 200
        rdzv = f"/v1/rdzv/{job_id}-a{attempt}"
        state = base64.b64encode(seal_state(b"state")).decode()
        assert worker.put(f"{rdzv}/state", json={"state": state, "token": None}).status_code == 200
        assert worker.post(f"{rdzv}/store/set",
                           json={"items": [{"key": "k", "value": state}]}).status_code == 204
        assert worker.get(f"{rdzv}/store/num_keys").json() == {"count": 1}
    _NODES[job_id] = (node_name, credential)


def finished_at(api: httpx.Client, job_id: str, cp: ControlPlane | None = None) -> float:
    """Cancel the job; with a node (give_it_state), that node reports its workers stopped."""
    assert api.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
    if cp is not None and job_id in _NODES:
        name, credential = _NODES[job_id]
        attempt = api.get(f"/v1/jobs/{job_id}").json()["attempt"]
        with cp.client(credential) as node:
            assert node.post(f"/v1/nodes/{name}/report", json={
                "job_id": job_id, "attempt": attempt, "state": "stopped"}).status_code == 200
    job = wait_for(lambda: (j := api.get(f"/v1/jobs/{job_id}").json())["state"] == "CANCELLED" and j,
                   10, f"job {job_id} to be cancelled")
    return job["finished_at"]


def gone_at(api: httpx.Client, job_id: str, timeout_s: float) -> float:
    """When GET /v1/jobs/<id> first answered 404."""
    wait_for(lambda: api.get(f"/v1/jobs/{job_id}").status_code == 404, timeout_s,
             f"job {job_id} to be deleted", interval_s=0.02)
    return time.time()


def test_finished_jobs_and_all_they_kept_are_deleted_after_the_retention(etcd, tmp_path):
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", env={"FTRAIN_RETENTION_S": f"{RETENTION_S:g}"})
    cp.start()
    try:
        with cp.client("user") as api:
            old = api.post("/v1/jobs", json={**SPEC, "name": "old"},
                           headers={"Idempotency-Key": "submit-old"}).json()["id"]
            unfinished = api.post("/v1/jobs", json={**SPEC, "name": "unfinished"}).json()["id"]
            for job_id in (old, unfinished):
                give_it_state(cp, job_id)
            keys = etcd_keys(etcd.endpoint)
            for job_id in (old, unfinished):
                assert {k.split("/")[2] for k in keys if job_id in k} == \
                    {"jobs", "events", "progress", "metrics", "snapshots", "rdzv"}, keys
                assert (cp.log_root / job_id).is_dir()  # worker logs are files, not etcd keys
            assert len(etcd_keys(etcd.endpoint, "/ftrain/idempotency/")) == 1

            old_end = finished_at(api, old, cp)
            # A second job that ends 1.5 s later: still within its retention when the first goes.
            wait_for(lambda: time.time() > old_end + 1.5, 5, "1.5 s after the first job ended")
            recent = api.post("/v1/jobs", json={**SPEC, "name": "recent"}).json()["id"]
            recent_end = finished_at(api, recent, cp)

            old_gone = gone_at(api, old, RETENTION_S + 10)
            assert old_gone >= old_end + RETENTION_S
            assert api.get(f"/v1/jobs/{recent}").status_code == 200  # younger than its retention
            resp = api.get(f"/v1/jobs/{old}")
            assert resp.json()["detail"] == (f"job {old} not found (finished jobs are deleted "
                                             "2 seconds after they end)")
            for path in ("events", "logs", "snapshots"):
                assert api.get(f"/v1/jobs/{old}/{path}").status_code == 404
            keys = etcd_keys(etcd.endpoint)
            assert [k for k in keys if old in k] == []  # record, events, progress, metrics, snapshots, rdzv
            assert not (cp.log_root / old).exists()  # and its log folder
            assert etcd_keys(etcd.endpoint, "/ftrain/idempotency/") == []
            # An unfinished job is kept with all it has, whatever its age.
            assert {k.split("/")[2] for k in keys if unfinished in k} == \
                {"jobs", "events", "progress", "metrics", "snapshots", "rdzv"}
            assert (cp.log_root / unfinished).is_dir()
            assert api.get(f"/v1/jobs/{unfinished}").json()["state"] in {"PENDING", "STARTING", "RUNNING"}
            # The key of the deleted job is free: the same key submits a new job.
            again = api.post("/v1/jobs", json={**SPEC, "name": "old"},
                             headers={"Idempotency-Key": "submit-old"})
            assert again.status_code == 201 and again.json()["id"] != old

            assert gone_at(api, recent, RETENTION_S + 10) >= recent_end + RETENTION_S
            listed = [j["id"] for j in api.get("/v1/jobs").json()["items"]]
            assert old not in listed and recent not in listed and unfinished in listed
            assert Keys().job(unfinished) in etcd_keys(etcd.endpoint)
    finally:
        cp.stop()
