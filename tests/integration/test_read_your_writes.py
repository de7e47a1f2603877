"""Read-your-writes across control-plane replicas, with real processes: two
`ftrain serve` on one etcd. A write through one replica answers `X-Ftrain-Revision`; a read
through the other that sends it back is never older than the write, though that replica's
job index (fed by its etcd watch) may not have the write yet when the read arrives.

To make the other replica's index lag behind, it is stopped (SIGSTOP) while the write goes
through the first one and continued just before the read: the read and the watch event
carrying the write then reach it together. Without the header, or with a replica that does
not wait for it, the read is answered from the index as it was (PENDING)."""

from __future__ import annotations

import signal

import httpx
import pytest

from tests.helpers.processes import ControlPlane

pytestmark = pytest.mark.integration

REVISION = "X-Ftrain-Revision"
SPEC = {"name": "ryw", "command": ["true"], "nodes": {"min": 1, "max": 1}}
ROUNDS = 10


def test_a_write_through_one_replica_is_read_through_the_other_with_its_revision(etcd, tmp_path):
    a = ControlPlane(etcd.endpoint, tmp_path / "a").start()
    b = ControlPlane(etcd.endpoint, tmp_path / "b", user_token=a.user_token, node_token=a.node_token)
    b.secret_dir, b.snapshot_root, b.log_root = a.secret_dir, a.snapshot_root, a.log_root
    b.start()
    try:
        with a.client() as api_a, a.client() as admin:
            # A named user's reads go through FastAPI's route; the admin's through the fast path.
            user = admin.post(f"{a.url}/v1/users", json={"name": "ann"}).json()["token"]
            for token in (a.user_token, user):
                for _ in range(ROUNDS):
                    headers = {"Authorization": f"Bearer {token}"}
                    submitted = api_a.post(f"{a.url}/v1/jobs", json=SPEC, headers=headers)
                    assert submitted.status_code == 201, submitted.text
                    job_id = submitted.json()["id"]
                    seen = int(submitted.headers[REVISION])
                    # b shows the new job (from its index once it has it, else from etcd).
                    with httpx.Client(base_url=b.url, headers=headers, timeout=10) as api_b:
                        got = api_b.get(f"/v1/jobs/{job_id}", headers={REVISION: str(seen)})
                        assert got.status_code == 200 and got.json()["state"] == "PENDING", got.text
                        assert int(got.headers[REVISION]) >= seen
                        assert b.proc is not None
                        b.proc.send_signal(signal.SIGSTOP)
                        try:
                            cancelled = api_a.post(f"{a.url}/v1/jobs/{job_id}/cancel", headers=headers)
                            assert cancelled.status_code == 202, cancelled.text
                            wrote = int(cancelled.headers[REVISION])
                            assert wrote > seen
                        finally:
                            b.proc.send_signal(signal.SIGCONT)
                        got = api_b.get(f"/v1/jobs/{job_id}", headers={REVISION: str(wrote)})
                    assert got.status_code == 200, got.text
                    assert got.json()["state"] in ("CANCELLING", "CANCELLED"), got.json()
                    assert int(got.headers[REVISION]) >= wrote
    finally:
        if b.proc is not None and b.proc.poll() is None:
            b.proc.send_signal(signal.SIGCONT)
        b.stop()
        a.stop()
