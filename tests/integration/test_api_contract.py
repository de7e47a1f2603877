"""The API's contract against a real server: authentication before the body, and an OpenAPI
description that lists the error answers as the server sends them. One control plane for
the module: no test stores anything."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.shared_control_plane


def test_a_missing_or_wrong_token_and_a_bad_body_is_401_or_403_not_413_or_422(control_plane):
    with httpx.Client(base_url=control_plane.url, timeout=10) as anon:
        for body in (b"{not json", b'{"name": "Bad Name"}', b"x" * 200_000):
            resp = anon.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
            assert resp.status_code == 401, (body[:20], resp.status_code, resp.text)
            assert resp.headers["www-authenticate"] == "Bearer"
        resp = anon.post("/v1/nodes/register", content=b"[", headers={"Content-Type": "application/json"})
        assert resp.status_code == 401
        # A wrong token, or another principal's, is judged before the body too: 401 / 403.
        bad_bodies = (b"{not json", b"x" * 200_000)
        for token, code in (("not-a-token", 401), (control_plane.node_token, 403)):
            for body in bad_bodies:
                resp = anon.post("/v1/jobs", content=body, headers={
                    "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
                assert resp.status_code == code, (token, body[:20], resp.status_code, resp.text)
        resp = anon.post("/v1/nodes/register", content=b"[", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {control_plane.user_token}"})
        assert resp.status_code == 403, resp.text
    with control_plane.client("user") as api:  # with the token, the body is judged
        resp = api.post("/v1/jobs", json={"name": "Bad Name", "command": ["true"]})
        assert resp.status_code == 422
        body = resp.json()
        assert isinstance(body["detail"], str) and body["errors"][0]["field"] == "name"
        for body, code in zip(bad_bodies, (422, 413)):
            resp = api.post("/v1/jobs", content=body, headers={"Content-Type": "application/json"})
            assert resp.status_code == code, (body[:20], resp.status_code, resp.text)


def test_openapi_documents_the_answers_as_sent(control_plane):
    with httpx.Client(base_url=control_plane.url, timeout=10) as anon:
        doc = anon.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert schemas["ValidationErrorBody"]["properties"]["detail"]["type"] == "string"
    assert "errors" in schemas["ValidationErrorBody"]["properties"]
    submit = doc["paths"]["/v1/jobs"]["post"]["responses"]
    assert {"201", "401", "403", "409", "413", "422", "503"} <= set(submit)
    assert submit["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ValidationErrorBody")
    assert submit["401"]["headers"]["WWW-Authenticate"]
    assert "404" in doc["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]
    logs = doc["paths"]["/v1/jobs/{job_id}/logs"]["get"]["responses"]["200"]["content"]
    assert "application/x-ndjson" in logs
    assert "HTTPValidationError" not in schemas


def test_openapi_names_the_token_each_endpoint_takes(control_plane):
    with httpx.Client(base_url=control_plane.url, timeout=10) as anon:
        doc = anon.get("/openapi.json").json()
    assert set(doc["components"]["securitySchemes"]) == {
        "userToken", "adminToken", "nodeToken", "nodeCredential", "jobToken"}

    def schemes(path: str, method: str) -> set[str]:
        return {name for req in doc["paths"][path][method]["security"] for name in req}

    assert schemes("/v1/jobs", "post") == {"userToken"}
    assert schemes("/v1/nodes/{name}/drain", "post") == {"adminToken"}
    assert schemes("/v1/nodes/register", "post") == {"nodeToken"}
    assert schemes("/v1/nodes/{name}/heartbeat", "post") == {"nodeCredential"}
    assert schemes("/v1/jobs/{job_id}/progress", "post") == {"jobToken"}
    assert schemes("/v1/rdzv/{rdzv_id}/state", "get") == {"jobToken", "nodeCredential"}
    assert schemes("/v1/jobs/{job_id}/snapshots", "get") == {"userToken", "jobToken"}
