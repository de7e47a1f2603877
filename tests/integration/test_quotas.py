"""Teams, quotas, fair share and the queue, on a real etcd and control plane: nodes registered
over HTTP where placement is all that is checked, real agents and workers where a job must
run and end for its quota to free."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.helpers.elastic import job_spec, submit, wait_nodes, wait_state
from tests.helpers.processes import wait_for

pytestmark = pytest.mark.integration


def add_user(admin: httpx.Client, name: str, team: str | None = None) -> str:
    body = {"name": name, **({"team": team} if team else {})}
    resp = admin.post("/v1/users", json=body)
    assert resp.status_code == 201, resp.text
    assert resp.json()["team"] == team
    return resp.json()["token"]


def patch(admin: httpx.Client, path: str, body: dict) -> dict:
    resp = admin.patch(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def small_job(client: httpx.Client, name: str) -> str:
    return submit(client, {"name": name, "command": ["true"], "nodes": {"min": 1, "max": 1}})


class Beats:
    """Registered nodes (no agents) that keep their leases by heartbeats, as the test polls."""

    def __init__(self, cp):
        self.cp = cp
        self.credentials: dict[str, str] = {}

    def enrol(self, *names: str) -> None:
        for name in names:
            self.credentials[name] = self.cp.enrol(name)
        self.beat()

    def beat(self) -> dict[str, str | None]:
        """Each node's assigned job (None: free)."""
        got = {}
        for name, credential in self.credentials.items():
            with self.cp.client(credential) as c:
                resp = c.post(f"/v1/nodes/{name}/heartbeat", json={})
                assert resp.status_code == 200, resp.text
                got[name] = (resp.json()["assignment"] or {}).get("job_id")
        return got


def waiting(api: httpx.Client, job_id: str) -> str:
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["state"] == "PENDING", view
    return view["waiting"] or ""


def test_setting_a_quota_is_the_admins_and_bad_input_is_a_422_naming_the_field(control_plane):
    cp = control_plane
    with cp.client() as admin:
        token = add_user(admin, "alice", team="ml")
        with cp.client(token) as alice:
            for path in ("/v1/users/alice", "/v1/teams/ml"):
                assert alice.patch(path, json={"max_nodes": 1}).status_code == 403
        with cp.client("not-a-token") as stranger:
            assert stranger.patch("/v1/users/alice", json={"max_nodes": 1}).status_code == 401
        for body, field in (({"max_nodes": -1}, "max_nodes"), ({"max_gpus": "8"}, "max_gpus"),
                            ({"max_nodes": 1.5}, "max_nodes"), ({"max_cpus": 2}, "max_cpus")):
            resp = admin.patch("/v1/users/alice", json=body)
            assert resp.status_code == 422, (body, resp.text)
            assert field in resp.text, resp.text
        empty = admin.patch("/v1/users/alice", json={})
        assert empty.status_code == 422 and "max_nodes" in empty.text
        assert admin.patch("/v1/teams/Not_A_Label", json={"max_nodes": 1}).status_code == 422
        missing = admin.patch("/v1/users/nobody", json={"max_nodes": 1})
        assert missing.status_code == 404 and "nobody" in missing.text

        assert patch(admin, "/v1/users/alice", {"max_nodes": 2})["max_nodes"] == 2
        both = patch(admin, "/v1/users/alice", {"max_gpus": 8})  # the other field is kept
        assert (both["max_nodes"], both["max_gpus"]) == (2, 8)
        cleared = patch(admin, "/v1/users/alice", {"max_nodes": None})
        assert (cleared["max_nodes"], cleared["max_gpus"]) == (None, 8)
        assert patch(admin, "/v1/teams/ml", {"max_nodes": 3})["max_nodes"] == 3

        users = {u["name"]: u for u in admin.get("/v1/users").json()["items"]}
        assert (users["alice"]["team"], users["alice"]["max_gpus"]) == ("ml", 8)
        teams = {t["name"]: t for t in admin.get("/v1/teams").json()["items"]}
        assert teams["ml"]["members"] == ["alice"] and teams["ml"]["max_nodes"] == 3

        env = {**os.environ, "FTRAIN_SERVER": cp.url, "FTRAIN_TOKEN": cp.user_token}
        cli = [sys.executable, "-m", "service.cli", "quota"]
        out = subprocess.run([*cli, "set", "--team", "ml", "--max-nodes", "4", "--max-gpus", "none"],
                             capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and "team ml: 4 nodes" in out.stdout, out.stdout + out.stderr
        shown = subprocess.run([*cli, "show"], capture_output=True, text=True, env=env, timeout=60)
        assert "alice" in shown.stdout and "4 nodes" in shown.stdout, shown.stdout + shown.stderr


def test_a_free_node_goes_to_the_user_holding_less_before_an_older_job(control_plane):
    cp = control_plane
    nodes = Beats(cp)
    with cp.client() as admin:
        ann, bob = (cp.client(add_user(admin, n)) for n in ("ann", "bob"))
        with ann, bob:
            running = small_job(ann, "running")
            nodes.enrol("w1")
            wait_for(lambda: nodes.beat()["w1"] == running, 20, "ann's first job to take w1")
            older, newer = small_job(ann, "older"), small_job(bob, "newer")
            queue = admin.get("/v1/queue").json()["items"]
            assert [q["id"] for q in queue] == [newer, older]  # bob holds no node, ann one
            assert [q["position"] for q in queue] == [1, 2] and queue[0]["owner"] == "bob"

            nodes.enrol("w2")
            taken = wait_for(lambda: (b := nodes.beat())["w2"] and b, 20, "w2 to be given a job")
            assert taken["w2"] == newer
            assert "held by" in waiting(admin, older)


def test_a_team_quota_holds_back_another_users_job_and_a_raised_one_lets_it_start(control_plane):
    cp = control_plane
    nodes = Beats(cp)
    with cp.client() as admin:
        patch(admin, "/v1/teams/ml", {"max_nodes": 1})
        ann, bob = (cp.client(add_user(admin, n, team="ml")) for n in ("ann", "bob"))
        with ann, bob:
            first = small_job(ann, "first")
            nodes.enrol("w1", "w2")
            wait_for(lambda: first in nodes.beat().values(), 20, "ann's job to start")
            held_back = small_job(bob, "held-back")
            reason = "team ml's quota: 1 of 1 nodes in use"
            wait_for(lambda: nodes.beat() and reason in waiting(admin, held_back), 20,
                     "bob's job to name the team's quota")
            assert list(nodes.beat().values()).count(None) == 1  # a node is free all the while
            queued = admin.get("/v1/queue").json()["items"]
            assert [(q["id"], q["team"]) for q in queued] == [(held_back, "ml")]
            assert reason in queued[0]["waiting"]
            metrics = admin.get("/metrics").text
            assert 'ftrain_team_nodes_in_use{team="ml"} 1.0' in metrics
            assert 'ftrain_user_jobs_waiting{user="bob"} 1.0' in metrics

            patch(admin, "/v1/teams/ml", {"max_nodes": 2})
            wait_for(lambda: held_back in nodes.beat().values(), 20, "bob's job to start once raised")


def test_a_user_quota_holds_a_job_back_until_the_users_running_job_ends(control_plane, agents):
    cp = control_plane
    with cp.client() as admin:
        alice = cp.client(add_user(admin, "alice"))
        patch(admin, "/v1/users/alice", {"max_nodes": 1})
        agents(2)
        wait_nodes(admin, 2)
        with alice:
            first = submit(alice, job_spec("first", "--steps", "40", mn=1, mx=1, max_restarts=0))
            second = submit(alice, job_spec("second", "--steps", "3", mn=1, mx=1, max_restarts=0))
            wait_state(alice, first, ("STARTING", "RUNNING"), 60)
            reason = waiting(alice, second)
            assert "user alice's quota: 1 of 1 nodes in use" in reason, reason
            env = {**os.environ, "FTRAIN_SERVER": cp.url, "FTRAIN_TOKEN": cp.user_token}
            out = subprocess.run([sys.executable, "-m", "service.cli", "queue"], capture_output=True,
                                 text=True, env=env, timeout=60)
            assert second in out.stdout and "alice's quota" in out.stdout, out.stdout + out.stderr

            assert wait_state(alice, first, ("SUCCEEDED", "FAILED"), 120)["state"] == "SUCCEEDED"
            assert wait_state(alice, second, ("SUCCEEDED", "FAILED"), 120)["state"] == "SUCCEEDED"


def test_the_queue_says_whom_a_waiting_job_preempts_and_how(control_plane):
    cp = control_plane
    nodes = Beats(cp)
    with cp.client() as admin:
        ann, bob = (cp.client(add_user(admin, n)) for n in ("ann", "bob"))
        with ann, bob:
            low = submit(ann, {"name": "low", "command": ["true"], "nodes": {"min": 1, "max": 2}})
            nodes.enrol("w1", "w2")
            wait_for(lambda: list(nodes.beat().values()) == [low, low], 20, "ann's job to take both nodes")
            high = submit(bob, {"name": "high", "command": ["true"], "nodes": {"min": 1, "max": 1},
                                "priority": 10})

            def shown() -> list[dict]:
                nodes.beat()
                item = next(q for q in admin.get("/v1/queue").json()["items"] if q["id"] == high)
                return item["would_preempt"]

            takes = wait_for(lambda: (t := shown()) and t[0]["under_way"] and t, 20,
                             "the queue to show the preemption under way")
            assert takes == [{"job_id": low, "priority": 0, "how": "shrink", "under_way": True,
                              "fair_share": False, "nodes": takes[0]["nodes"]}]
            assert takes[0]["nodes"] in (["w1"], ["w2"])

            env = {**os.environ, "FTRAIN_SERVER": cp.url, "FTRAIN_TOKEN": cp.user_token}
            out = subprocess.run([sys.executable, "-m", "service.cli", "queue"], capture_output=True,
                                 text=True, env=env, timeout=60)
            assert f"{low} shrink {takes[0]['nodes'][0]}" in out.stdout, out.stdout + out.stderr


def test_a_job_behind_one_waiting_for_more_nodes_borrows_the_node_kept_for_it(control_plane):
    cp = control_plane
    nodes = Beats(cp)
    with cp.client() as admin:
        def spec(name: str, n: int, **extra) -> dict:
            return {"name": name, "command": ["true"], "nodes": {"min": n, "max": n}, **extra}

        nodes.enrol("w1", "w2", "w3")
        holder = submit(admin, spec("holder", 1, max_duration_s=3600))
        wait_for(lambda: holder in nodes.beat().values(), 20, "the holder to take a node")
        big = submit(admin, spec("big", 3))  # waits for the holder's node: in about an hour, as it declares
        small, later = submit(admin, spec("small", 1)), submit(admin, spec("later", 1))
        # The two free nodes are kept for big; the jobs behind it, which have never run, borrow
        # them, to give them back once big could start with them.
        wait_for(lambda: {small, later} <= set(nodes.beat().values()), 20, "the jobs behind big to borrow")
        for jid in (small, later):
            said = [e["reason"] for e in admin.get(f"/v1/jobs/{jid}/events").json()["items"]]
            assert any(f"kept for job {big}" in m and "borrowed" in m for m in said), said
        queued = {q["id"]: q for q in admin.get("/v1/queue").json()["items"]}
        assert list(queued) == [big]
        assert "borrowed in front of this job" in queued[big]["waiting"]
        # the job's own view says the same as the queue
        assert "borrowed in front of this job" in admin.get(f"/v1/jobs/{big}").json()["waiting"]