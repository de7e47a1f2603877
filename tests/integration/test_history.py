"""A long history in etcd: more job records than one gRPC reply holds.

Before reads were bounded, about 4 MiB of job records made `GET /v1/jobs` answer 503 and
the scheduler pause for good (its index could not load): a new job stayed PENDING with a
free node. Here 1,000 finished jobs with ~5 KiB of env each (over 5 MiB) are written
straight into etcd, then a control plane starts on them: it must list every one of them,
page by page, and still schedule a new job.
"""

from __future__ import annotations

import asyncio
import time

from service.keys import Keys
from service.models import JobRecord, JobSpec, JobState
from service.store.api import Put
from service.store.etcd import EtcdStore
from tests.helpers.processes import ControlPlane, NodeAgentProc, wait_for

HISTORY = 1000
GRPC_MAX_REPLY_BYTES = 4 * 1024 * 1024


def write_history(endpoint: str) -> tuple[list[str], int]:
    """HISTORY finished job records, oldest first; returns their ids and their bytes in all."""
    env = {"PAYLOAD_A": "a" * 2600, "PAYLOAD_B": "b" * 2600}
    base = time.time() - 3600  # an hour ago: well within the default retention (7 days)
    # Ids in the reverse of creation order: a listing in key order would come out backwards.
    records = [JobRecord(id=f"hist-{HISTORY - i:06d}", created_at=base + i, updated_at=base + i,
                         finished_at=base + i, state=JobState.SUCCEEDED,
                         spec=JobSpec(name="hist", command=["python", "train.py"], env=env))
               for i in range(HISTORY)]
    values = [(Keys().job(r.id), r.model_dump_json().encode()) for r in records]

    async def write() -> None:
        store = EtcdStore(endpoint)
        try:
            for start in range(0, len(values), 100):
                assert await store.commit({}, [Put(k, v) for k, v in values[start:start + 100]])
        finally:
            await store.close()

    asyncio.run(write())
    return [r.id for r in records], sum(len(k) + len(v) for k, v in values)


def test_a_history_larger_than_one_grpc_reply_is_listed_and_scheduling_goes_on(etcd, tmp_path):
    ids, size = write_history(etcd.endpoint)
    assert size > GRPC_MAX_REPLY_BYTES, size
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp").start()
    agent = None
    try:
        with cp.client("user") as api:
            seen, after, pages = [], None, 0
            start = time.monotonic()
            while True:
                resp = api.get("/v1/jobs", params={"limit": 100, **({"after": after} if after else {})})
                assert resp.status_code == 200, resp.text
                page = resp.json()
                seen += [j["id"] for j in page["items"]]
                pages += 1
                after = page["next"]
                if not after:
                    break
            elapsed = time.monotonic() - start
            assert seen == ids  # every job, once, oldest first (not in key order)
            print(f"\nGET /v1/jobs over {len(ids)} jobs ({size / 2**20:.1f} MiB in etcd): "
                  f"{pages} pages of 100 in {elapsed:.2f} s")
            start = time.monotonic()
            whole = api.get("/v1/jobs", params={"limit": 1000})
            assert whole.status_code == 200 and len(whole.json()["items"]) == 1000
            print(f"GET /v1/jobs?limit=1000: {time.monotonic() - start:.2f} s")

            # The scheduler did not stop: a new job gets the free node.
            agent = NodeAgentProc(cp, "n0", tmp_path / "nodes").start()
            job = api.post("/v1/jobs", json={"name": "new", "command": ["python", "-c", "pass"]}).json()
            wait_for(lambda: api.get(f"/v1/jobs/{job['id']}").json()["state"] != "PENDING", 30,
                     "the new job to be scheduled")
            assert api.get(f"/v1/jobs/{job['id']}").json()["state"] in ("STARTING", "RUNNING", "SUCCEEDED")
            assert job["id"] == api.get("/v1/jobs", params={"after": ids[-1]}).json()["items"][0]["id"]
    finally:
        if agent is not None:
            agent.stop()
        cp.stop()
