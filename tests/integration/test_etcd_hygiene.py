"""etcd hygiene with a real etcd and a real control plane: the leader compacts history by
itself, and a full etcd (its NOSPACE alarm) is named, with what to do, by every 503 and by
/readyz."""

from __future__ import annotations

import asyncio
import shutil

import aetcd
import pytest

from service.errors import HistoryCompacted, StoreFull
from service.store.etcd import EtcdStore
from tests.helpers.processes import ControlPlane, EtcdProcess, wait_for

SPEC = {"name": "hygiene", "command": ["python", "train.py"]}


def history_from(endpoint: str, revision: int) -> str:
    """'kept' if etcd still has its history from `revision`, 'compacted' if not."""

    async def run() -> str:
        kv = EtcdStore(endpoint)
        try:
            events = kv.watch_prefix("/", revision, max_session_s=1)
            try:
                await anext(events)
            except HistoryCompacted:
                return "compacted"
            finally:
                await events.aclose()
            return "kept"
        finally:
            await kv.close()

    return asyncio.run(run())


def test_the_leading_control_plane_compacts_etcd_and_goes_on_scheduling(etcd, tmp_path):
    # The etcd fixture's own auto-compaction keeps 10,000 revisions: any compaction here is ours.
    cp = ControlPlane(etcd.endpoint, tmp_path / "cp", env={"FTRAIN_COMPACTION_INTERVAL_S": "0.5"}).start()
    try:
        with cp.client("user") as api, cp.client("node") as node:
            first = api.post("/v1/jobs", json=SPEC)
            assert first.status_code == 201
            wait_for(lambda: history_from(etcd.endpoint, 2) == "compacted", 20,
                     "the leader to compact etcd's history")
            # After compactions, the watch-fed index and the scheduler still follow etcd: a node
            # that registers now gets the job.
            assert node.post("/v1/nodes/register", json={"name": "n0"}).status_code == 200
            wait_for(lambda: api.get(f"/v1/jobs/{first.json()['id']}").json()["state"] == "STARTING",
                     20, "the job to start on the new node")
    finally:
        cp.stop()


@pytest.fixture
def small_etcd(tmp_path):
    """An etcd whose quota is 1 MiB, so that it fills in a second."""
    server = EtcdProcess(tmp_path / "etcd-small", log_path=tmp_path / "etcd-small.log",
                         quota_backend_bytes=1024 * 1024).start()
    yield server
    server.kill()
    shutil.rmtree(server.data_dir, ignore_errors=True)


async def fill(endpoint: str) -> StoreFull:
    """Write 100 KB values until etcd refuses; returns what the store raised."""
    kv = EtcdStore(endpoint)
    try:
        for i in range(1000):
            try:
                await kv.put(f"/filler/{i:04d}", b"x" * 100_000)
            except StoreFull as exc:
                return exc
        raise AssertionError("etcd took 100 MB under a 1 MiB quota")
    finally:
        await kv.close()


async def free_space(endpoint: str) -> None:
    """What the message says to do: free space, compact, defragment, disarm the alarm."""
    kv = EtcdStore(endpoint)
    await kv.delete_prefix("/filler/")
    await kv.compact(await kv.revision())
    await kv.close()
    host, port = endpoint.removeprefix("http://").split(":")
    client = aetcd.Client(host=host, port=int(port), timeout=10)
    await client.connect()
    try:
        await client.defragment()
        # As `etcdctl alarm disarm` does: each raised alarm by its member (0 matches none).
        for alarm in [a async for a in client.list_alarms()]:
            await client.disarm_alarm(alarm.member_id)
    finally:
        await client.close()


def test_a_full_etcd_is_named_with_what_to_do_by_every_503_and_by_readyz(small_etcd, tmp_path):
    cp = ControlPlane(small_etcd.endpoint, tmp_path / "cp").start()
    try:
        with cp.client("user") as api:
            assert api.get("/readyz").status_code == 200
            raised = asyncio.run(fill(small_etcd.endpoint))
            assert "NOSPACE" in raised.message

            submit = api.post("/v1/jobs", json=SPEC)
            assert submit.status_code == 503
            detail = submit.json()["detail"]
            assert "NOSPACE alarm" in detail and "is it running" not in detail
            for advice in ("compact", "defrag", "alarm disarm", small_etcd.endpoint):
                assert advice in detail, advice
            ready = api.get("/readyz")
            assert ready.status_code == 503 and ready.json()["reason"] == detail
            assert api.get("/v1/jobs").status_code == 200  # reads still work

            asyncio.run(free_space(small_etcd.endpoint))
            assert api.get("/readyz").status_code == 200
            assert api.post("/v1/jobs", json=SPEC).status_code == 201
    finally:
        cp.stop()
