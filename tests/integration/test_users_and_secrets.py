"""Named users own their jobs; secrets are kept out of etcd, the API and the logs.

Real etcd, control plane, agent and torchrun workers. The etcd checks read every key of the
keyspace as it is after the job ran.
"""

from __future__ import annotations

import asyncio
import secrets
import stat
from pathlib import Path

import pytest

from service.jobs import JobStore
from service.keys import Keys
from service.store.etcd import EtcdStore
from service.users import token_digest
from tests.helpers.elastic import job_spec, log_items, submit, wait_nodes, wait_state

pytestmark = pytest.mark.integration
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "secret_env.py"
PRINTS = Path(__file__).resolve().parents[1] / "scripts" / "prints_secrets.py"


def etcd_dump(endpoint: str) -> bytes:
    """Every key and value in etcd now, as one blob."""
    async def read() -> bytes:
        kv = EtcdStore(endpoint)
        try:
            return b"\n".join([e.key.encode() + b"=" + e.value async for e in kv.scan_prefix("/")])
        finally:
            await kv.close()

    return asyncio.run(read())


def stored_job(endpoint: str, job_id: str):
    async def read():
        kv = EtcdStore(endpoint)
        try:
            return await JobStore(kv, Keys()).get(job_id)
        finally:
            await kv.close()

    return asyncio.run(read())


def test_a_secret_env_value_reaches_the_worker_and_no_store_response_or_log(
        api, agents, etcd, control_plane, tmp_path):
    secret = f"s3cr3t-{secrets.token_hex(12)}"
    expected = tmp_path / "expected"
    expected.write_text(secret)
    agents(1)
    wait_nodes(api, 1)
    spec = job_spec("secret", "API_KEY", str(expected), script=SCRIPT, mn=1, mx=1, max_restarts=0,
                    env={"FTRAIN_FORK_SERVER": "0"}, secret_env={"API_KEY": secret})
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code == 201, resp.text
    job_id = resp.json()["id"]
    # The worker exits 0 only if it found the value in its environment.
    wait_state(api, job_id, ("SUCCEEDED", "FAILED"), 90)
    answers = [resp.text, api.get(f"/v1/jobs/{job_id}").text, api.get("/v1/jobs").text,
               api.get(f"/v1/jobs/{job_id}/events").text, api.get(f"/v1/jobs/{job_id}/logs").text]
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["state"] == "SUCCEEDED", (view, log_items(api, job_id))
    assert view["secret_env_names"] == ["API_KEY"] and view["spec"]["secret_env"] == {}

    # The worker printed it; the log the control plane keeps has it masked.
    lines = [i["line"] for i in log_items(api, job_id)]
    assert "the secret is *** (rank 0)" in lines, lines
    for text in answers:
        assert secret not in text

    dump = etcd_dump(etcd.endpoint)
    assert f"/ftrain/jobs/{job_id}".encode() in dump  # the scan did see the job
    assert secret.encode() not in dump
    job_token = control_plane.job_token(stored_job(etcd.endpoint, job_id))
    assert job_token.encode() not in dump  # derived, never stored

    for log in [*control_plane.workdir.glob("*.log"), *(tmp_path / "nodes").glob("agent-*.log")]:
        assert secret not in log.read_text(errors="replace"), log
    # Kept where etcd is not: in the secret dir, readable by the control plane's user only.
    kept = [p for p in (control_plane.secret_dir / "env").iterdir()]
    assert len(kept) == 1 and secret in kept[0].read_text()
    assert stat.S_IMODE(kept[0].stat().st_mode) == 0o600
    assert stat.S_IMODE(control_plane.secret_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((control_plane.secret_dir / "key").stat().st_mode) == 0o600


def test_the_job_token_and_each_line_of_a_multi_line_secret_are_masked_in_the_log(
        api, agents, control_plane):
    """Whoever reads a job's log must not get its token (it commits the job's snapshots) nor a
    PEM key given as secret_env: lines are shipped one by one, so each line is masked."""
    body = [secrets.token_urlsafe(48) for _ in range(3)]
    pem = "\n".join(["-----BEGIN PRIVATE KEY-----", *body, "-----END PRIVATE KEY-----"]) + "\n"
    agents(1)
    wait_nodes(api, 1)
    job_id = submit(api, job_spec("prints", script=PRINTS, mn=1, mx=1, max_restarts=0,
                                  env={"FTRAIN_FORK_SERVER": "0"}, secret_env={"KEY": pem}))
    token = control_plane.job_token_of(job_id)
    view = wait_state(api, job_id, ("SUCCEEDED", "FAILED"), 90)
    lines = [i["line"] for i in log_items(api, job_id)]
    assert view["state"] == "SUCCEEDED", (view, lines)
    assert "my token is *** (rank 0)" in lines, lines
    assert lines.count("***") >= 5, lines  # the key's five lines, each masked
    text = api.get(f"/v1/jobs/{job_id}/logs").text
    for shown in (token, *body):
        assert shown not in text


def test_users_own_their_jobs_only_owners_and_the_admin_cancel(api, control_plane, etcd):
    tokens = {}
    for name in ("alice", "bob"):
        resp = api.post("/v1/users", json={"name": name})
        assert resp.status_code == 201, resp.text
        tokens[name] = resp.json()["token"]
    assert api.post("/v1/users", json={"name": "alice"}).status_code == 409
    assert api.post("/v1/users", json={"name": "admin"}).status_code == 422
    alice, bob = (control_plane.client(tokens[n]) for n in ("alice", "bob"))
    with alice, bob:
        assert alice.get("/v1/users/me").json() == {"name": "alice", "created_at": None, "admin": False}
        assert api.get("/v1/users/me").json()["admin"] is True  # the server's token: the admin's

        job_id = submit(alice, job_spec("mine", mn=1, mx=1))
        assert alice.get(f"/v1/jobs/{job_id}").json()["owner"] == "alice"
        # An Idempotency-Key is its user's own: the same key from another user is a new job.
        same = {"json": job_spec("keyed", mn=1, mx=1), "headers": {"Idempotency-Key": "k1"}}
        first, again, others = alice.post("/v1/jobs", **same), alice.post("/v1/jobs", **same), \
            bob.post("/v1/jobs", **same)
        assert (first.status_code, again.status_code, others.status_code) == (201, 200, 201)
        assert again.json()["id"] == first.json()["id"] != others.json()["id"]
        assert others.json()["owner"] == "bob"
        # Everyone reads every job (a shared queue) ...
        assert bob.get(f"/v1/jobs/{job_id}").status_code == 200
        assert job_id in [j["id"] for j in bob.get("/v1/jobs").json()["items"]]
        # ... but only its owner or the admin cancels it.
        refused = bob.post(f"/v1/jobs/{job_id}/cancel")
        assert refused.status_code == 403, refused.text
        assert "belongs to 'alice'" in refused.json()["detail"]
        assert alice.get(f"/v1/jobs/{job_id}").json()["state"] == "PENDING"
        assert alice.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
        by = [(e["state"], e["by"]) for e in alice.get(f"/v1/jobs/{job_id}/events").json()["items"]]
        assert by == [("PENDING", "alice"), ("CANCELLED", "alice")]

        other = submit(bob, job_spec("theirs", mn=1, mx=1))
        assert api.post(f"/v1/jobs/{other}/cancel").status_code == 202
        assert [e["by"] for e in bob.get(f"/v1/jobs/{other}/events").json()["items"]] == ["bob", "admin"]

        # Users and nodes are the admin's to manage.
        assert bob.post("/v1/users", json={"name": "eve"}).status_code == 403
        assert bob.get("/v1/users").status_code == 403
        assert bob.delete("/v1/users/alice").status_code == 403
        assert bob.post("/v1/nodes/n0/drain").status_code == 403

        # Tokens are stored hashed only; a removed user's token stops working at once.
        dump = etcd_dump(etcd.endpoint)
        assert tokens["alice"].encode() not in dump and token_digest(tokens["alice"]).encode() in dump
        # (bob's submits and status reads above were answered by the fast path, from the
        # watch-fed cache of tokens: the removal must reach it at once too)
        assert bob.get(f"/v1/jobs/{other}").status_code == 200
        assert api.delete("/v1/users/bob").status_code == 204
        assert bob.get("/v1/jobs").status_code == 401
        assert bob.get(f"/v1/jobs/{other}").status_code == 401
        assert bob.post("/v1/jobs", json=job_spec("late", mn=1, mx=1)).status_code == 401
        assert api.delete("/v1/users/bob").status_code == 404
        assert [u["name"] for u in api.get("/v1/users").json()["items"]] == ["admin", "alice"]
