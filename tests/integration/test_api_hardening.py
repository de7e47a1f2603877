"""Bodies and reads that once got a 500 (or took what the README refuses), against a real etcd
and a real uvicorn: each is now a clean answer that names the field, and no answer names a
path of the server's."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.shared_control_plane

SPEC = {"name": "hard", "command": ["python", "train.py"], "nodes": {"min": 1, "max": 1}}
JSON = {"Content-Type": "application/json"}


def fields(api, resp) -> list[str]:
    """The fields a 422 names (a job the body made is cancelled: it would hold the queue)."""
    if resp.status_code == 201:
        api.post(f"/v1/jobs/{resp.json()['id']}/cancel")
    assert resp.status_code == 422, resp.text
    return [e["field"] for e in resp.json()["errors"]]


def test_a_lone_surrogate_in_env_is_a_422_naming_the_field(api):
    # "\ud800" as JSON text: valid JSON, no valid Unicode (it cannot be stored nor passed on).
    body = json.dumps({**SPEC, "env": {"A": "\ud800"}})
    assert '\\ud800' in body
    resp = api.post("/v1/jobs", content=body.encode(), headers=JSON)
    assert fields(api, resp) == ["env"] and "'A'" in resp.json()["detail"]
    resp = api.post("/v1/jobs", content=json.dumps({**SPEC, "secret_env": {"S": "x\udfff"}}).encode(),
                    headers=JSON)
    assert fields(api, resp) == ["secret_env"]


@pytest.mark.parametrize("key", ["CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "MASTER_ADDR",
                                 "FTRAIN_JOB_TOKEN", "TORCHELASTIC_RUN_ID"])
def test_env_may_not_set_what_the_node_or_ftrain_sets_for_every_worker(api, key):
    resp = api.post("/v1/jobs", json={**SPEC, "env": {key: "0"}})
    assert fields(api, resp) == ["env"] and key in resp.json()["detail"]


@pytest.mark.parametrize(("field", "value"), [
    (("max_restarts",), "3"), (("nodes", "min"), "1"), (("snapshot", "every_steps"), "10"),
    (("hang_timeout_s",), "60"), (("gpus_per_node",), "1"), (("global_batch_size",), "8"),
    (("nproc_per_node",), "2")])
def test_a_number_sent_as_a_string_is_a_422_naming_the_field(api, field, value):
    spec = json.loads(json.dumps(SPEC))
    at = spec
    for part in field[:-1]:
        at = at.setdefault(part, {})
    at[field[-1]] = value
    assert fields(api, api.post("/v1/jobs", json=spec)) == [".".join(field)]
    at[field[-1]] = float(value)  # 3.0 is an integer (JSON Schema's), as a number it is taken
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code == 201, resp.text
    api.post(f"/v1/jobs/{resp.json()['id']}/cancel")


@pytest.fixture
def job_with_lines(control_plane, api):
    """A job on node a, with two lines in its log; its id and the log's end."""
    job = api.post("/v1/jobs", json={**SPEC, "name": "logs"}).json()["id"]
    credential = control_plane.member_of(job, "logs-a")
    lines = [{"rank": 0, "line": f"line {i}", "time": 1.0} for i in range(2)]
    with control_plane.client(credential) as node:
        resp = node.post(f"/v1/jobs/{job}/logs", json={"node": "logs-a", "attempt": 0, "lines": lines})
        assert resp.status_code == 204, resp.text
    end = api.get(f"/v1/jobs/{job}/logs").json()["end_seq"]
    assert end > 0
    yield job, end
    api.post(f"/v1/jobs/{job}/cancel")


def test_a_log_read_past_its_end_is_an_empty_page(control_plane, api, job_with_lines):
    job, end = job_with_lines
    for past in (2**63, 10**30, 0, 1, 10**6):
        resp = api.get(f"/v1/jobs/{job}/logs", params={"since": end + past})
        assert resp.status_code == 200, (past, resp.text)
        page = resp.json()
        assert page["items"] == [] and page["end_seq"] == end and page["next_seq"] == end + past
        assert str(control_plane.workdir) not in resp.text


def test_a_user_added_again_under_a_removed_name_does_not_own_the_old_users_jobs(control_plane, api):
    first = api.post("/v1/users", json={"name": "again"}).json()["token"]
    with control_plane.client(first) as old:
        job = old.post("/v1/jobs", json={**SPEC, "name": "olds"},
                       headers={"Idempotency-Key": "k1"}).json()["id"]
    assert api.delete("/v1/users/again").status_code == 204
    second = api.post("/v1/users", json={"name": "again"}).json()["token"]
    with control_plane.client(second) as new:
        resp = new.post(f"/v1/jobs/{job}/cancel")
        assert resp.status_code == 403 and "removed since" in resp.json()["detail"], resp.text
        # The old user's Idempotency-Key is not the new one's: a new job, not a replay.
        mine = new.post("/v1/jobs", json={**SPEC, "name": "olds"}, headers={"Idempotency-Key": "k1"})
        assert mine.status_code == 201 and mine.json()["id"] != job, mine.text
        assert new.post(f"/v1/jobs/{mine.json()['id']}/cancel").status_code == 202
    assert api.get(f"/v1/jobs/{job}").json()["state"] == "PENDING"
    assert api.post(f"/v1/jobs/{job}/cancel").status_code == 202  # the admin still may
