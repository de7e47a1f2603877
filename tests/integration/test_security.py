"""docs/api.md's "Who can do what", row by row, against a real etcd and a real uvicorn.

Every user, node, rendezvous and job-runtime endpoint is called with each credential: no
token, a wrong one, the user token (the admin's), a named user's token, the node
(bootstrap) token, node a's credential (a is a member of job J), node b's credential (a
member of job K), J's job token and K's job token.
Only the principals of the table's row get through; a missing or wrong token is 401 and any
other principal's valid token is 403.
"""

from __future__ import annotations

import asyncio
import base64
import os
import signal
from pathlib import Path

import httpx
import pytest

from service.keys import Keys
from service.store.etcd import EtcdStore
from tests.helpers.processes import ControlPlane, NodeAgentProc, wait_for

ONE_NODE = {"name": "sec", "command": ["python", "train.py"], "nodes": {"min": 1, "max": 1}}
B64 = base64.b64encode(b"k").decode()
PRINCIPALS = ("none", "wrong", "user", "named", "bootstrap", "cred_a", "cred_b", "job_j", "job_k")


@pytest.fixture
def cluster(etcd, tmp_path):
    """Jobs J (on node a) and K (on node b), node c idle, job L pending, and every token."""
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", env={"FTRAIN_NODE_TTL_S": "60"}).start()
    try:
        with cp.client("user") as api:
            j = api.post("/v1/jobs", json=ONE_NODE).json()["id"]
            cred_a = cp.member_of(j, "a")
            k = api.post("/v1/jobs", json=ONE_NODE).json()["id"]
            cred_b = cp.member_of(k, "b")
            cred_c = cp.enrol("c")
            lone = api.post("/v1/jobs", json=ONE_NODE).json()["id"]
            wait_for(lambda: api.get(f"/v1/jobs/{lone}").json()["state"] == "STARTING", 20,
                     "job L to go to node c")  # it is c's now: cancelling it is harmless
            attempt = api.get(f"/v1/jobs/{j}").json()["attempt"]
            named = api.post("/v1/users", json={"name": "alice"}).json()["token"]
        tokens = {"none": None, "wrong": "not-a-token", "user": cp.user_token, "named": named,
                  "bootstrap": cp.node_token, "cred_a": cred_a, "cred_b": cred_b,
                  "job_j": cp.job_token_of(j), "job_k": cp.job_token_of(k)}
        yield cp, tokens, {"j": j, "k": k, "lone": lone, "attempt": attempt, "cred_c": cred_c}
    finally:
        cp.stop()


_clients: dict[tuple[str, str | None], httpx.Client] = {}


def call(cp: ControlPlane, token: str | None, method: str, path: str, body=None) -> httpx.Response:
    """One request with `token` as the bearer (a client per token, kept for the module)."""
    client = _clients.get((cp.url, token))
    if client is None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        client = _clients[(cp.url, token)] = httpx.Client(base_url=cp.url, headers=headers, timeout=10)
    return client.request(method, path, json=body)


@pytest.fixture(autouse=True)
def _close_clients():
    yield
    for client in _clients.values():
        client.close()
    _clients.clear()


def rows(j: str, attempt: int, lone: str,
         snapshot_root: Path) -> list[tuple[str, str, dict | None, set[str]]]:
    """(method, path, body, the principals that may call it): docs/api.md's "Who can do what".

    Rows that change something for good (drain, cancel, leaving) come last.
    """
    rdzv = f"/v1/rdzv/{j}-a{attempt}"
    line = {"rank": 0, "stream": "stdout", "line": "hello", "time": 1.0}
    commit = {"step": 5, "path": f"{snapshot_root}/{j}/5.pt", "size": 1, "checksum": "x", "attempt": attempt}
    return [
        # users
        ("POST", "/v1/jobs", {**ONE_NODE, "name": "more"}, {"user", "named"}),
        ("GET", "/v1/jobs", None, {"user", "named"}),
        ("GET", f"/v1/jobs/{j}", None, {"user", "named"}),
        ("GET", f"/v1/jobs/{j}/events", None, {"user", "named"}),
        ("GET", f"/v1/jobs/{j}/goodput", None, {"user", "named"}),
        ("GET", "/v1/goodput", None, {"user", "named"}),
        ("GET", f"/v1/jobs/{j}/logs", None, {"user", "named"}),
        ("GET", "/v1/nodes", None, {"user", "named"}),
        ("GET", "/v1/users", None, {"user"}),  # the admin only
        ("GET", "/v1/queue", None, {"user", "named"}),
        ("GET", "/v1/teams", None, {"user"}),  # the admin only
        ("PATCH", "/v1/teams/vision", {"max_nodes": 4}, {"user"}),  # the admin only
        ("PATCH", "/v1/users/alice", {"max_nodes": 4}, {"user"}),  # the admin only
        ("GET", f"/v1/jobs/{j}/snapshots", None, {"user", "named", "job_j"}),
        # nodes
        ("POST", "/v1/nodes/register", {"name": "newcomer"}, {"bootstrap"}),
        ("POST", "/v1/nodes/a/heartbeat", {}, {"cred_a"}),
        ("GET", "/v1/nodes/a/presence", None, {"cred_a"}),
        ("POST", "/v1/nodes/a/health", {"ok": True}, {"cred_a"}),
        ("POST", "/v1/nodes/a/report", {"job_id": j, "attempt": attempt, "state": "running"},
         {"cred_a"}),
        ("POST", f"/v1/jobs/{j}/logs", {"node": "a", "attempt": attempt, "lines": [line]}, {"cred_a"}),
        # the job's rendezvous: its workers (job token) and its member nodes
        ("GET", f"{rdzv}/state", None, {"cred_a", "job_j"}),
        ("PUT", f"{rdzv}/state", {"state": B64, "token": None}, {"cred_a", "job_j"}),
        ("POST", f"{rdzv}/store/set", {"items": [{"key": B64, "value": B64}]}, {"cred_a", "job_j"}),
        ("POST", f"{rdzv}/store/get", {"keys": [B64]}, {"cred_a", "job_j"}),
        ("POST", f"{rdzv}/store/add", {"key": "YQ==", "amount": 1}, {"cred_a", "job_j"}),
        ("GET", f"{rdzv}/store/num_keys", None, {"cred_a", "job_j"}),
        # the job's runtime: its token only
        ("POST", f"/v1/jobs/{j}/rounds",
         {"attempt": attempt, "node": "a", "phase": "joining", "call": 0}, {"job_j"}),
        ("POST", f"/v1/jobs/{j}/progress", {"step": 5, "attempt": attempt}, {"job_j"}),
        ("GET", f"/v1/jobs/{j}/control", None, {"job_j"}),
        ("PUT", f"/v1/jobs/{j}/memory/a", {"step": 5, "attempt": attempt}, {"job_j"}),
        ("POST", f"/v1/jobs/{j}/memory/a/corrupt", {"step": 5, "attempt": attempt}, {"job_j"}),
        ("POST", f"/v1/jobs/{j}/restore", {"attempt": attempt}, {"job_j"}),
        ("POST", f"/v1/jobs/{j}/snapshots", commit, {"job_j"}),
        ("POST", f"/v1/jobs/{j}/snapshots/5/corrupt", {"reason": "test"}, {"job_j"}),
        ("POST", f"/v1/jobs/{j}/finished", {"attempt": attempt, "node": "a"}, {"job_j"}),
        # for good
        ("POST", "/v1/nodes/c/drain", None, {"user"}),  # the admin only
        ("POST", "/v1/nodes/c/undrain", None, {"user"}),  # the admin only
        ("POST", f"/v1/jobs/{lone}/cancel", None, {"user"}),  # the admin's job: not alice's
        ("DELETE", "/v1/nodes/a", None, {"cred_a"}),
    ]


def test_every_endpoint_takes_exactly_the_credentials_of_its_row(cluster):
    cp, tokens, ids = cluster
    wrong: list[str] = []
    for method, path, body, allowed in rows(ids["j"], ids["attempt"], ids["lone"], cp.snapshot_root):
        # the refused first: a refusal must change nothing the allowed call then relies on
        for who in sorted(PRINCIPALS, key=lambda p: p in allowed):
            got = call(cp, tokens[who], method, path, body).status_code
            expected = ("ok" if who in allowed else 401 if who in ("none", "wrong") else 403)
            if (got in (401, 403)) if expected == "ok" else got != expected:
                wrong.append(f"{method} {path} with {who}: {got}, expected {expected}")
    assert not wrong, "\n".join(wrong)


def test_a_node_credential_cannot_act_for_another_node_or_another_job(cluster):
    cp, tokens, ids = cluster
    b = tokens["cred_b"]
    for method, path, body in [
        ("POST", "/v1/nodes/a/heartbeat", {}),
        ("POST", "/v1/nodes/a/health", {"ok": False, "checks": [{"name": "own", "ok": False}]}),
        ("POST", "/v1/nodes/a/report", {"job_id": ids["j"], "attempt": ids["attempt"], "state": "failed"}),
        ("DELETE", "/v1/nodes/a", None),
        ("GET", f"/v1/rdzv/{ids['j']}-a{ids['attempt']}/state", None),
        ("POST", f"/v1/jobs/{ids['j']}/logs",
         {"node": "b", "lines": [{"line": "x", "time": 1.0}]}),
    ]:
        resp = call(cp, b, method, path, body)
        assert resp.status_code == 403, f"{method} {path}: {resp.status_code} {resp.text}"
    # reporting as itself on a job it is not a member of changes nothing
    resp = call(cp, b, "POST", "/v1/nodes/b/report",
                {"job_id": ids["j"], "attempt": ids["attempt"], "state": "failed"})
    assert resp.status_code == 200 and resp.json()["accepted"] is False, resp.text
    # nor ship lines in another member's name into its own job
    resp = call(cp, b, "POST", f"/v1/jobs/{ids['k']}/logs",
                {"node": "a", "lines": [{"line": "x", "time": 1.0}]})
    assert resp.status_code == 403, resp.text
    # and node a is untouched: still alive, still on J
    with cp.client("user") as api:
        nodes = {n["name"]: n for n in api.get("/v1/nodes").json()["items"]}
        assert nodes["a"]["job"] == ids["j"]
        assert api.get(f"/v1/jobs/{ids['j']}").json()["state"] == "STARTING"  # given a (fake) node


def test_a_forged_snapshot_commit_is_refused_with_the_node_token_or_a_members_credential(cluster):
    cp, tokens, ids = cluster
    j, attempt = ids["j"], ids["attempt"]
    forged = {"step": 99, "path": "/tmp/evil.pt", "size": 1, "checksum": "x", "attempt": attempt}
    for who in ("bootstrap", "cred_a", "cred_b", "job_k", "user"):
        resp = call(cp, tokens[who], "POST", f"/v1/jobs/{j}/snapshots", forged)
        assert resp.status_code == 403, f"{who}: {resp.status_code} {resp.text}"
    with cp.client("user") as api:
        assert api.get(f"/v1/jobs/{j}/snapshots").json() == {"items": [], "latest": None, "memory": []}
        assert api.get(f"/v1/jobs/{j}").json()["latest_snapshot"] is None


def _snapshot_keys(etcd_endpoint: str, job_id: str) -> list[str]:
    async def read() -> list[str]:
        kv = EtcdStore(etcd_endpoint)
        try:
            return [e.key async for e in kv.scan_prefix(Keys().snapshots(job_id))]
        finally:
            await kv.close()

    return asyncio.run(read())


def test_a_commit_with_the_jobs_own_token_naming_a_file_outside_its_snapshot_directory_is_422(cluster):
    """Every rank of the job loads the committed file: a commit (a leaked job token is enough)
    may name only a file in `<snapshot root>/<job id>`; nothing is written to etcd otherwise."""
    cp, tokens, ids = cluster
    j, attempt = ids["j"], ids["attempt"]
    good = {"step": 5, "path": f"{cp.snapshot_root}/{j}/step-000000000005.pt", "size": 1, "checksum": "x",
            "attempt": attempt}
    assert call(cp, tokens["job_j"], "POST", f"/v1/jobs/{j}/snapshots", good).status_code == 200
    kept = _snapshot_keys(cp.etcd_endpoint, j)
    for path in ("/tmp/x", "/tmp/evil.pt", f"/tmp/{j}/evil.pt", f"{cp.snapshot_root}/{j}/../../evil.pt",
                 f"{cp.snapshot_root}/{ids['k']}/step-000000000009.pt", f"{j}/step-000000000009.pt"):
        resp = call(cp, tokens["job_j"], "POST", f"/v1/jobs/{j}/snapshots", {**good, "step": 9, "path": path})
        assert resp.status_code == 422, f"{path}: {resp.status_code} {resp.text}"
        body = resp.json()
        assert [e["field"] for e in body["errors"]] == ["path"], body
        assert "outside job" in body["detail"] and f"{cp.snapshot_root}/{j}" in body["detail"], body
    with cp.client("user") as api:
        listed = api.get(f"/v1/jobs/{j}/snapshots").json()
        assert listed["latest"] == 5 and [i["path"] for i in listed["items"]] == [good["path"]]
        assert api.get(f"/v1/jobs/{j}").json()["latest_snapshot"]["step"] == 5
    assert _snapshot_keys(cp.etcd_endpoint, j) == kept


def test_a_job_token_on_a_user_or_node_endpoint_is_403(cluster):
    cp, tokens, ids = cluster
    for method, path, body in [("GET", "/v1/jobs", None), ("GET", "/v1/nodes", None),
                               ("POST", "/v1/nodes/register", {"name": "x"}),
                               ("POST", "/v1/nodes/a/heartbeat", {})]:
        resp = call(cp, tokens["job_j"], method, path, body)
        assert resp.status_code == 403 and "job token" in resp.json()["detail"], resp.text


def test_a_live_nodes_name_is_refused_until_it_is_drained_and_its_old_credential_dies(cluster):
    cp, tokens, ids = cluster
    with cp.client("node") as node:
        again = node.post("/v1/nodes/register", json={"name": "a"})
        assert again.status_code == 409 and "already registered and alive" in again.json()["detail"]
    assert call(cp, tokens["cred_a"], "POST", "/v1/nodes/a/heartbeat", {}).status_code == 200
    with cp.client("user") as api:
        assert api.post("/v1/nodes/a/drain").status_code == 202
    new = cp.enrol("a")
    assert call(cp, new, "POST", "/v1/nodes/a/heartbeat", {}).status_code == 200
    old = call(cp, tokens["cred_a"], "POST", "/v1/nodes/a/heartbeat", {})
    assert old.status_code == 401 and "registered again" in old.json()["detail"]


def test_a_live_name_is_taken_back_only_with_its_own_current_credential(cluster):
    cp, tokens, ids = cluster
    with cp.client("node") as node:
        def register(previous: str | None) -> httpx.Response:
            return node.post("/v1/nodes/register", json={"name": "a", "previous_credential": previous})

        # the bootstrap token alone, another node's credential, a forged one: the name stays a's
        for previous in (None, tokens["cred_b"], ids["cred_c"], "ftrain-node.a.forged", cp.node_token):
            refused = register(previous)
            assert refused.status_code == 409 and "already registered and alive" in refused.text, previous
        assert call(cp, tokens["cred_a"], "POST", "/v1/nodes/a/heartbeat", {}).status_code == 200
        # a's own credential (its agent restarted) takes the name back at once, under a new one
        back = register(tokens["cred_a"])
        assert back.status_code == 200, back.text
        new = back.json()["credential"]
        assert new != tokens["cred_a"]
        assert call(cp, new, "POST", "/v1/nodes/a/heartbeat", {}).status_code == 200
        assert call(cp, tokens["cred_a"], "POST", "/v1/nodes/a/heartbeat", {}).status_code == 401
        # and the old credential, now outdated, takes nothing over
        assert register(tokens["cred_a"]).status_code == 409
        too_long = register("x" * 257)
        assert too_long.status_code == 422 and "previous_credential" in too_long.text


def test_an_out_of_range_lease_id_is_422_and_the_heartbeats_after_it_work(cluster):
    cp, tokens, ids = cluster
    for lease in (-1, 0):
        resp = call(cp, tokens["cred_a"], "POST", "/v1/nodes/a/heartbeat", {"lease_id": lease})
        assert resp.status_code == 422 and "lease_id" in resp.text, resp.text
    # One past int64 (no lease has it) is set aside: the node's lease is read instead.
    assert call(cp, tokens["cred_a"], "POST", "/v1/nodes/a/heartbeat", {"lease_id": 2**63}).status_code == 200
    assert call(cp, tokens["cred_a"], "POST", "/v1/nodes/a/heartbeat", {}).status_code == 200


def test_a_chunked_body_over_the_limit_is_413(control_plane):
    def chunks():
        for _ in range(100):
            yield b"x" * 1024  # 100 KiB, no Content-Length

    with control_plane.client("user") as api:
        resp = api.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        assert resp.status_code == 413, resp.text
        small = api.post("/v1/jobs", content=iter([b'{"name": "c", "command": ["true"]}']),
                         headers={"Content-Type": "application/json"})
        assert small.status_code == 201, small.text


def test_the_agent_drops_the_node_token_from_its_environment_and_enrols_again_after_a_lapse(
        etcd, tmp_path):
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", env={"FTRAIN_NODE_TTL_S": "2"}).start()
    agent = NodeAgentProc(cp, "n0", tmp_path / "nodes", env={"FTRAIN_NODE_TOKEN": cp.node_token})
    agent.start()  # the token in its environment, not a file
    try:
        with cp.client("user") as api:
            def registered() -> dict | None:
                return {n["name"]: n for n in api.get("/v1/nodes").json()["items"]}.get("n0")

            first = wait_for(registered, 20, "the agent to register")
            environ = open(f"/proc/{agent.pid}/environ", "rb").read()
            assert cp.node_token.encode() not in environ
            assert b"FTRAIN_NODE_TOKEN=\0" in environ or b"FTRAIN_NODE_TOKEN" not in environ
            # A real lapse: stopped past its lease, the node is forgotten ...
            os.kill(agent.pid, signal.SIGSTOP)
            try:
                wait_for(lambda: registered() is None, 20, "the node's lease to lapse")
            finally:
                os.kill(agent.pid, signal.SIGCONT)
            # ... and the agent enrols again with the bootstrap token it kept in memory.
            again = wait_for(registered, 20, "the agent to register again")
            assert again["registered_at"] > first["registered_at"]
    finally:
        agent.stop()
        cp.stop()
