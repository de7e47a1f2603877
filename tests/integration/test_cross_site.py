"""What a web page in the user's browser cannot make a control plane do (service/cross_site.py),
against a real etcd and a real uvicorn: a body not sent as JSON is a 415 on any control plane,
and one without tokens refuses another site's Origin and a Host that is not loopback (DNS
rebinding)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers.processes import ControlPlane

SPEC = {"name": "xsite", "command": ["python", "train.py"], "nodes": {"min": 1, "max": 1}}
BODY = json.dumps(SPEC).encode()
EVIL = "http://evil.example"


@pytest.mark.shared_control_plane
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_not_sent_as_json_is_a_415_after_the_token(control_plane, content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    with control_plane.client("user") as api:
        resp = api.post("/v1/jobs", content=BODY, headers=headers)
        assert resp.status_code == 415 and "application/json" in resp.json()["detail"], resp.text
    with control_plane.client("node") as node:
        resp = node.post("/v1/nodes/register", content=b'{"name": "x1"}', headers=headers)
        assert resp.status_code == 415, resp.text
    with control_plane.client("not-a-token") as stranger:  # the token is judged first
        assert stranger.post("/v1/jobs", content=BODY, headers=headers).status_code == 401
    with control_plane.client("user") as api:  # JSON, with its parameters, is taken
        resp = api.post("/v1/jobs", content=BODY, headers={"Content-Type": "application/json; charset=utf-8"})
        assert resp.status_code == 201, resp.text
        api.post(f"/v1/jobs/{resp.json()['id']}/cancel")


@pytest.fixture
def open_cp(etcd, tmp_path):
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", open_=True).start()
    yield cp
    cp.stop()


def test_an_open_control_plane_refuses_another_sites_requests(open_cp):
    own = f"http://127.0.0.1:{open_cp.port}"
    with httpx.Client(base_url=open_cp.url, timeout=10) as anyone:
        # A page's simple request: a Blob body (no Content-Type) or text/plain, from its origin.
        for headers in ({"Origin": EVIL}, {"Origin": EVIL, "Content-Type": "text/plain"},
                        {"Origin": "null"}, {"Origin": EVIL, "Content-Type": "application/json"}):
            resp = anyone.post("/v1/jobs", content=BODY, headers=headers)
            assert resp.status_code == 403 and "another site" in resp.json()["detail"], resp.text
        # DNS rebinding: the page's own name, pointed at 127.0.0.1; it could read the answers.
        for method, path in (("GET", "/v1/jobs"), ("POST", "/v1/jobs")):
            resp = anyone.request(method, path, content=BODY, headers={
                "Host": "evil.example", "Origin": EVIL, "Content-Type": "application/json"})
            assert resp.status_code == 403 and "loopback" in resp.json()["detail"], resp.text
        assert anyone.get("/v1/jobs").json()["items"] == []  # nothing was submitted
        # Without an Origin (curl, the CLI) or from its own (the dashboard): served.
        mine = anyone.post("/v1/jobs", json=SPEC)
        assert mine.status_code == 201, mine.text
        resp = anyone.post(f"/v1/jobs/{mine.json()['id']}/cancel", headers={"Origin": EVIL})
        assert resp.status_code == 403, resp.text
        resp = anyone.post(f"/v1/jobs/{mine.json()['id']}/cancel", headers={"Origin": own})
        assert resp.status_code == 202, resp.text
        # A body without its Content-Type is refused there too.
        assert anyone.post("/v1/jobs", content=BODY).status_code == 415
        # The dashboard's page itself is the same for anyone: not refused.
        assert anyone.get("/ui/", headers={"Host": "evil.example"}).status_code == 200
