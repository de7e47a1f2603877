"""The REST API against a real etcd and a real uvicorn: the module's one (each test works on
jobs of its own), or its own for a test that kills etcd or the control plane."""

from __future__ import annotations

import concurrent.futures
import signal

import httpx
import pytest

from tests.helpers.processes import wait_for

pytestmark = pytest.mark.shared_control_plane

SPEC = {"name": "mnist", "command": ["python", "train.py"], "nodes": {"min": 1, "max": 2}}


def submit(api: httpx.Client, spec: dict = SPEC, **kw) -> dict:
    resp = api.post("/v1/jobs", json=spec, **kw)
    assert resp.status_code == 201, resp.text
    return resp.json()


def test_submit_get_list_cancel_events(api):
    job = submit(api)
    assert job["state"] == "PENDING" and job["name"] == "mnist" and job["spec"]["nodes"]["max"] == 2

    got = api.get(f"/v1/jobs/{job['id']}").json()
    assert got["id"] == job["id"] and got["state"] == "PENDING"
    assert job["id"] in [j["id"] for j in api.get("/v1/jobs").json()["items"]]

    resp = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert resp.status_code == 202 and resp.json()["state"] == "CANCELLED"
    events = api.get(f"/v1/jobs/{job['id']}/events").json()["items"]
    assert [e["state"] for e in events] == ["PENDING", "CANCELLED"]
    assert all(e["time"] > 0 and e["reason"] for e in events)


def test_cancelling_twice_is_fine_and_answers_the_state(api):
    job = submit(api)
    assert api.post(f"/v1/jobs/{job['id']}/cancel").status_code == 202
    resp = api.post(f"/v1/jobs/{job['id']}/cancel")
    assert resp.status_code == 202 and resp.json()["state"] == "CANCELLED"
    events = api.get(f"/v1/jobs/{job['id']}/events").json()["items"]
    assert [e["state"] for e in events] == ["PENDING", "CANCELLED"]  # the second cancel wrote nothing


def test_unknown_job_is_404(api):
    assert api.get("/v1/jobs/nope-123456").status_code == 404
    assert api.post("/v1/jobs/nope-123456/cancel").status_code == 404
    assert api.get("/v1/jobs/nope-123456/events").status_code == 404
    assert api.get("/v1/jobs/nope-123456").json()["detail"] == \
        "job nope-123456 not found (finished jobs are deleted 7 days after they end)"


def test_list_filters_by_state_and_paginates(api):
    ids = [submit(api, {**SPEC, "name": f"job{i}"})["id"] for i in range(5)]
    api.post(f"/v1/jobs/{ids[0]}/cancel")
    pending = api.get("/v1/jobs", params={"state": "PENDING"}).json()["items"]
    assert all(j["state"] == "PENDING" for j in pending)
    assert {j["id"] for j in pending} & set(ids) == set(ids[1:])  # (the module's other jobs aside)
    seen, after = [], None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = api.get("/v1/jobs", params=params).json()
        assert len(page["items"]) <= 2
        seen += [j["id"] for j in page["items"]]
        after = page["next"]
        if after is None:
            break
    assert [i for i in seen if i in ids] == ids and len(seen) == len(set(seen))
    resp = api.get("/v1/jobs", params={"after": "nope-123456"})
    assert resp.status_code == 404 and "nope-123456" in resp.json()["detail"]
    resp = api.get("/v1/jobs", params={"after": ""})
    assert resp.status_code == 422 and resp.json()["errors"][0]["field"] == "query.after"


@pytest.mark.parametrize("spec,field", [
    ({**SPEC, "name": "Not_A_Label"}, "name"),
    ({**SPEC, "name": ""}, "name"),
    ({**SPEC, "command": []}, "command"),
    ({**SPEC, "command": "python train.py"}, "command"),
    ({**SPEC, "nodes": {"min": 3, "max": 2}}, "nodes"),
    ({**SPEC, "nodes": {"min": 0, "max": 2}}, "nodes.min"),
    ({**SPEC, "nproc_per_node": 0}, "nproc_per_node"),
    ({**SPEC, "nproc_per_node": "many"}, "nproc_per_node"),
    ({**SPEC, "max_restarts": -1}, "max_restarts"),
    ({**SPEC, "snapshot": {"every_steps": 0}}, "snapshot.every_steps"),
    ({**SPEC, "snapshot": {"keep": 0}}, "snapshot.keep"),
    ({**SPEC, "hang_timeout_s": 0}, "hang_timeout_s"),
    ({**SPEC, "max_duration_s": 0}, "max_duration_s"),
    ({**SPEC, "max_duration_s": "an hour"}, "max_duration_s"),
    ({**SPEC, "env": {"BAD-NAME": "x"}}, "env"),
    ({**SPEC, "env": {"RANK": "3"}}, "env"),
    ({**SPEC, "env": {f"V{i}": "x" for i in range(200)}}, "env"),
    ({**SPEC, "env": {f"V{i}": "x" * 4000 for i in range(9)}}, "env"),  # 36 KB: over 32 KiB
    ({**SPEC, "command": ["python", *["a" * 4000] * 5]}, "command"),  # 20 KB: over 16 KiB
    ({**SPEC, "working_dir": "relative/path"}, "working_dir"),
    ({**SPEC, "surprise": 1}, "surprise"),
    ({"command": ["python"]}, "name"),
])
def test_invalid_spec_is_422_naming_the_field(api, spec, field):
    before = [j["id"] for j in api.get("/v1/jobs").json()["items"]]
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code == 422, resp.text
    body = resp.json()
    assert field in [e["field"] for e in body["errors"]], body
    assert field in body["detail"]
    assert "Value error" not in body["detail"]  # the validator's words, not pydantic's wrapping
    assert [j["id"] for j in api.get("/v1/jobs").json()["items"]] == before  # nothing was stored


def test_malformed_json_and_huge_body_are_rejected_without_harm(api):
    resp = api.post("/v1/jobs", content=b"{not json", headers={"Content-Type": "application/json"})
    assert resp.status_code == 422
    resp = api.post("/v1/jobs", content=b"[" + b"1," * 100_000 + b"1]",
                    headers={"Content-Type": "application/json"})
    assert resp.status_code == 413
    assert api.get("/healthz").status_code == 200
    assert submit(api)["state"] == "PENDING"


def test_requests_without_a_valid_token_are_refused(control_plane):
    with control_plane.client(None) as anon:
        assert anon.post("/v1/jobs", json=SPEC).status_code == 401
        assert anon.get("/v1/jobs").status_code == 401
        assert anon.get("/healthz").status_code == 200
    with control_plane.client("wrong") as bad:
        assert bad.get("/v1/jobs").status_code == 401
    with control_plane.client("node") as node:
        assert node.get("/v1/jobs").status_code == 403
    with control_plane.client("user") as user:
        resp = user.get("/v1/jobs")
        assert resp.status_code == 200 and isinstance(resp.json()["items"], list)


def test_idempotency_key_returns_the_same_job(api):
    jobs = len(api.get("/v1/jobs").json()["items"])
    first = submit(api, headers={"Idempotency-Key": "abc-1"})
    again = api.post("/v1/jobs", json=SPEC, headers={"Idempotency-Key": "abc-1"})
    assert again.status_code == 200 and again.json()["id"] == first["id"]
    assert len(api.get("/v1/jobs").json()["items"]) == jobs + 1
    other = api.post("/v1/jobs", json={**SPEC, "name": "other"}, headers={"Idempotency-Key": "abc-1"})
    assert other.status_code == 409
    assert submit(api, headers={"Idempotency-Key": "abc-2"})["id"] != first["id"]


def test_concurrent_idempotent_submits_create_one_job(api):
    jobs = len(api.get("/v1/jobs").json()["items"])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        ids = set(pool.map(lambda _: api.post("/v1/jobs", json=SPEC,
                                             headers={"Idempotency-Key": "race"}).json()["id"],
                           range(16)))
    assert len(ids) == 1
    assert len(api.get("/v1/jobs").json()["items"]) == jobs + 1


@pytest.mark.own_control_plane
def test_control_plane_restart_keeps_every_job_and_event(control_plane, api):
    jobs = [submit(api, {**SPEC, "name": f"keep{i}"}) for i in range(3)]
    api.post(f"/v1/jobs/{jobs[1]['id']}/cancel")
    before = {j["id"]: api.get(f"/v1/jobs/{j['id']}/events").json() for j in jobs}

    control_plane.stop(signal.SIGKILL)
    control_plane.start()
    with control_plane.client() as again:
        listed = {j["id"]: j["state"] for j in again.get("/v1/jobs").json()["items"]}
        assert listed == {jobs[0]["id"]: "PENDING", jobs[1]["id"]: "CANCELLED", jobs[2]["id"]: "PENDING"}
        for job_id, events in before.items():
            assert again.get(f"/v1/jobs/{job_id}/events").json() == events


@pytest.mark.own_control_plane
def test_etcd_down_gives_503_with_reason_then_recovers(etcd, control_plane, api):
    job = submit(api)
    etcd.kill()
    # A status read answers from the watch-fed index until the index notices that its watch
    # broke (at once, when etcd's connection drops), then reads etcd: 503.
    wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").status_code == 503, 10,
             "status reads to answer 503 once the index lost its watch")
    resp = api.get(f"/v1/jobs/{job['id']}")
    assert "etcd" in resp.json()["detail"] and "did not answer" in resp.json()["detail"]
    assert api.post("/v1/jobs", json=SPEC).status_code == 503
    ready = api.get("/readyz")
    assert ready.status_code == 503 and "etcd" in ready.json()["reason"]
    assert api.get("/healthz").status_code == 200

    etcd.start()
    wait_for(lambda: api.get("/readyz").status_code == 200, 30, "readyz to recover")
    assert api.get(f"/v1/jobs/{job['id']}").json()["state"] == "PENDING"
    assert submit(api)["state"] == "PENDING"
