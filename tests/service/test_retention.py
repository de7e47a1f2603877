"""Retention passes and the job listing's order, on the in-memory KeyValue with a manual clock.

(What is deleted is decided in tests/service/test_decide_retention.py; here: that a pass
deletes everything of those jobs and nothing else, in transactions etcd accepts, only while
this replica leads; and that the index lists jobs in a stable order across deletions.)
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pytest

from service import retention, scheduler
from service.context import Context
from service.decide.retention import RetentionPolicy
from service.errors import JobNotFound, StaleLeader
from service.keyring import new_nonce
from service.models import JobSpec, JobState
from service.routes.logs import get_logs
from service.scheduler import Leadership
from service.settings import Settings
from service.store.api import MAX_TXN_OPS, Put
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait
from worker.protocol import CommitRequest, LogLineIn, LogShipment, ProgressReport

RETENTION_S = 100.0
POLICY = RetentionPolicy(retention_s=RETENTION_S)


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Cluster:
    """A context on a MemoryStore whose stores and leases all run on one manual clock."""

    def __init__(self) -> None:
        self.clock = ManualClock()
        self.kv = MemoryStore(self.clock)
        self.log_root = Path(tempfile.mkdtemp(prefix="ftrain-test-logs-"))
        self.ctx = Context.wire(Settings(log_root=str(self.log_root)), self.kv)
        self.ctx.jobs.clock = self.clock
        self.leadership = Leadership(self.kv, self.ctx.keys.leader, ttl_s=5)

    async def job(self, name: str, *, finish: bool, key: str | None = None) -> str:
        """A job with events, progress, a log chunk, a snapshot record and rendezvous keys."""
        ctx = self.ctx
        job, _ = await ctx.jobs.create(JobSpec(name=name, command=["true"]), key)
        await ctx.logs.ship(job.id, LogShipment(node="n0", attempt=0,
                                                lines=[LogLineIn(rank=0, stream="stdout", line="hi",
                                                                 time=self.clock.now)]))
        await ctx.snapshots.commit(job.id, CommitRequest(step=10, path=f"/s/{job.id}/10", size=1,
                                                         checksum="c",
                                                         attempt=0))
        await ctx.progress.report(job.id, ProgressReport(step=10, attempt=0))
        await self.kv.put(ctx.keys.rdzv_state(f"{job.id}-a0"), b"state")
        await self.kv.put(ctx.keys.rdzv_store(f"{job.id}-a0") + "k", b"v")
        if finish:
            await ctx.jobs.move(job.id, JobState.CANCELLED, "cancelled by the test")
        return job.id

    async def keys_of(self, job_id: str) -> list[str]:
        """The job's etcd keys, and its log folder (logs are files under the log root)."""
        keys = [e.key async for e in self.kv.scan_prefix("/ftrain/", keys_only=True) if job_id in e.key]
        return keys + ([f"log folder {job_id}"] if (self.log_root / job_id).exists() else [])

    async def prune(self, policy: RetentionPolicy = POLICY, snapshot_root: Path | None = None) -> list[str]:
        assert await self.leadership.hold()
        await self.index_caught_up()
        return await retention.prune(self.ctx.jobs, self.ctx.logs, self.ctx.index,
                                     self.leadership.fence(), policy, snapshot_root,
                                     self.ctx.keyring)

    async def index_caught_up(self) -> None:
        count = await self.kv.count_prefix(self.ctx.keys.jobs)
        states = {j.id: j.state async for j in self.ctx.jobs.scan()}
        assert await self.ctx.index.wait_until(
            lambda: len(self.ctx.index) == count
            and all(self.ctx.index.get(i) is not None and self.ctx.index.get(i).state is s
                    for i, s in states.items()), 5)


def run(test) -> None:
    async def main():
        cluster = Cluster()
        index = asyncio.create_task(cluster.ctx.index.run())
        try:
            await asyncio.wait_for(cluster.ctx.index.ready.wait(), 5)
            await test(cluster)
        finally:
            await cancel_and_wait(index)
            shutil.rmtree(cluster.log_root, ignore_errors=True)

    asyncio.run(main())


def test_a_pass_deletes_the_secret_env_of_an_expired_job_and_keeps_the_others():
    async def test(c: Cluster):
        ring, ids = c.ctx.keyring, {}
        for name in ("old", "recent"):
            nonce = new_nonce()
            ring.put_env(nonce, {"API_KEY": f"{name}-secret"})
            job, _ = await c.ctx.jobs.create(JobSpec(name=name, command=["true"],
                                                     secret_env={"API_KEY": "x"}), nonce=nonce)
            await c.ctx.jobs.move(job.id, JobState.CANCELLED, "cancelled by the test")
            ids[name] = (job.id, nonce)
            c.clock.now += 50
        c.clock.now += RETENTION_S - 60
        assert await c.prune() == [ids["old"][0]]
        assert ring.get_env(ids["old"][1]) == {}
        assert ring.get_env(ids["recent"][1]) == {"API_KEY": "recent-secret"}

    run(test)


def test_a_pass_deletes_everything_of_an_expired_job_and_nothing_of_the_others():
    async def test(c: Cluster):
        old = await c.job("old", finish=True, key="retried-submit")
        c.clock.now += RETENTION_S - 10
        recent = await c.job("recent", finish=True)
        running = await c.job("running", finish=False)
        # record, 2 events, progress, snapshot, 2 rendezvous keys; the log folder
        assert len(await c.keys_of(old)) == 8
        assert await c.kv.count_prefix(c.ctx.keys.prefix + "/idempotency/") == 1
        assert await c.prune() == []  # nothing is old enough yet
        c.clock.now += 10
        assert await c.prune() == [old]
        assert await c.keys_of(old) == []
        with pytest.raises(JobNotFound):
            await c.ctx.jobs.get(old)
        assert await c.kv.count_prefix(c.ctx.keys.prefix + "/idempotency/") == 0
        assert len(await c.keys_of(recent)) == 8
        assert len(await c.keys_of(running)) == 7  # one event: submitted
        # The key it was submitted with went with it: the same key makes a new job now.
        again, created = await c.ctx.jobs.create(JobSpec(name="old", command=["true"]), "retried-submit")
        assert created and again.id != old
        # An unfinished job is never deleted, however old.
        c.clock.now += 100 * RETENTION_S
        assert sorted(await c.prune()) == sorted([recent])
        assert len(await c.keys_of(running)) == 7

    run(test)


def test_a_count_keeps_the_newest_finished_jobs():
    async def test(c: Cluster):
        ids = []
        for i in range(4):
            ids.append(await c.job(f"j{i}", finish=True))
            c.clock.now += 1
        assert await c.prune(RetentionPolicy(retention_s=RETENTION_S, keep_jobs=1)) == ids[:3]
        assert [j.id async for j in c.ctx.jobs.scan()] == [ids[3]]

    run(test)


def test_many_expired_jobs_go_in_passes_of_transactions_etcd_accepts():
    """MemoryStore refuses a transaction of more than MAX_TXN_OPS operations, as etcd does."""
    async def test(c: Cluster):
        n = retention.MAX_DELETIONS_PER_PASS + 44
        for start in range(0, n, 50):  # plain records (the pass's reads are what is tested)
            for i in range(start, min(n, start + 50)):
                job, _ = await c.ctx.jobs.create(JobSpec(name=f"j{i}", command=["true"]))
                await c.ctx.jobs.move(job.id, JobState.CANCELLED, "done")
        commits = []
        commit = c.kv.commit

        async def counting(expect, ops):
            commits.append((len(expect), len(ops)))
            return await commit(expect, ops)

        c.kv.commit = counting  # type: ignore[method-assign]
        c.clock.now += RETENTION_S
        first = await c.prune()
        assert len(first) == retention.MAX_DELETIONS_PER_PASS
        second = await c.prune()
        assert len(second) == 44 and not set(first) & set(second)
        assert await c.kv.count_prefix(c.ctx.keys.jobs) == 0
        assert await c.kv.count_prefix(c.ctx.keys.prefix + "/events/") == 0
        assert all(compares <= MAX_TXN_OPS and ops <= MAX_TXN_OPS for compares, ops in commits)
        assert len([1 for compares, _ in commits if compares > 1]) >= n // MAX_TXN_OPS

    run(test)


def test_a_replica_that_lost_the_lead_deletes_no_job():
    async def test(c: Cluster):
        job_id = await c.job("old", finish=True)
        before = await c.keys_of(job_id)
        assert await c.leadership.hold()
        fence = c.leadership.fence()
        # Another replica leads now (this one's lease lapsed and the other took the key).
        await c.kv.revoke_lease(c.leadership.lease_id)
        await c.kv.put(c.ctx.keys.leader, b"other replica")
        c.clock.now += RETENTION_S
        await c.index_caught_up()
        with pytest.raises(StaleLeader):
            await retention.prune(c.ctx.jobs, c.ctx.logs, c.ctx.index, fence, POLICY)
        assert (await c.ctx.jobs.get(job_id)).state is JobState.CANCELLED
        assert (c.log_root / job_id).is_dir()  # its log too: files go only after the record
        assert await c.keys_of(job_id) == before  # its rendezvous keys too (fenced as well)
        assert c.leadership.fence() == fence  # it has not noticed yet; its next hold() will
        assert not await c.leadership.hold() and c.leadership.fence() is None

    run(test)


def test_a_scheduler_that_lost_the_lead_leaves_a_finished_jobs_rendezvous_keys():
    async def test(c: Cluster):
        job_id = await c.job("done", finish=True)
        before = await c.keys_of(job_id)
        assert any("/rdzv/" in k for k in before)
        assert await c.leadership.hold()
        stale = c.leadership.fence()
        await c.kv.revoke_lease(c.leadership.lease_id)
        assert await Leadership(c.kv, c.ctx.keys.leader, ttl_s=5).hold()  # another replica leads now
        with pytest.raises(StaleLeader):
            await scheduler._cleanup(c.ctx.jobs, job_id, stale)
        assert await c.keys_of(job_id) == before
        fresh = Leadership(c.kv, c.ctx.keys.leader, ttl_s=5)
        await c.kv.delete(c.ctx.keys.leader)  # the other one gave up; a third one leads
        assert await fresh.hold()
        await scheduler._cleanup(c.ctx.jobs, job_id, fresh.fence())  # the leader's goes through
        assert not any("/rdzv/" in k for k in await c.keys_of(job_id))

    run(test)


def test_a_job_changed_after_it_was_read_is_left_for_the_next_pass():
    async def test(c: Cluster):
        job_id = await c.job("old", finish=True)
        c.clock.now += RETENTION_S
        assert await c.leadership.hold()
        (job, revision), = await c.ctx.jobs.get_many_with_revisions([job_id])
        await c.kv.put(c.ctx.keys.job(job_id), job.model_dump_json().encode())  # a late write
        assert await c.ctx.jobs.delete_finished([(job, revision)], c.leadership.fence()) == []
        assert await c.prune() == [job_id]

    run(test)


def test_a_job_is_deleted_before_its_log_so_no_reader_sees_a_job_with_an_empty_log():
    """The soak's "empty logs": retention deleted the files first, and a reader between that and
    the record's deletion got a page of 0 lines (and cut_bytes 0) for a job that still existed."""
    async def test(c: Cluster):
        job_id = await c.job("old", finish=True)
        exists_when_files_went: list[bool] = []
        delete = c.ctx.logs.delete

        async def watching(jid: str) -> None:
            try:
                await c.ctx.jobs.get(jid)
                exists_when_files_went.append(True)
            except JobNotFound:
                exists_when_files_went.append(False)
            await delete(jid)

        c.ctx.logs.delete = watching  # type: ignore[method-assign]
        c.clock.now += RETENTION_S
        assert await c.prune() == [job_id]
        assert exists_when_files_went == [False]
        assert not (c.log_root / job_id).exists()

    run(test)


def test_a_log_read_that_races_the_deletion_answers_not_found_instead_of_an_empty_page():
    async def test(c: Cluster):
        job_id = await c.job("old", finish=True)
        c.clock.now += RETENTION_S
        read_page = c.ctx.logs.read_page

        async def racing(*args, **kw):  # retention runs between the route's check and its read
            assert await c.prune() == [job_id]
            return await read_page(*args, **kw)

        c.ctx.logs.read_page = racing  # type: ignore[method-assign]
        with pytest.raises(JobNotFound):
            await get_logs(job_id, c.ctx, rank=None, since=0, limit=100, follow=False)

    run(test)


def test_snapshot_folders_go_with_their_job_and_orphaned_folders_are_swept(tmp_path):
    async def test(c: Cluster):
        snapshots = tmp_path / "snapshots"
        old = await c.job("old", finish=True)
        kept = await c.job("kept", finish=False)
        for job_id in (old, kept, "gone-abc123"):  # the last: a job deleted before its files
            (snapshots / job_id).mkdir(parents=True)
            (snapshots / job_id / "step-10.pt").write_bytes(b"x")
        (c.log_root / "gone-abc123").mkdir()  # a late shipment's folder, say
        (snapshots / "models").mkdir()  # not named like a job id: never touched
        c.clock.now += RETENTION_S
        assert await c.prune(snapshot_root=snapshots) == [old]
        assert sorted(p.name for p in snapshots.iterdir()) == sorted([kept, "gone-abc123", "models"])
        assert await retention.sweep_orphans(c.ctx.jobs, c.ctx.logs, snapshots) == ["gone-abc123"]
        assert sorted(p.name for p in snapshots.iterdir()) == sorted([kept, "models"])
        assert sorted(p.name for p in c.log_root.iterdir()) == [kept]

    run(test)


# ------------------------------------------------------------------ the listing's order

def test_the_index_lists_oldest_first_and_resumes_after_a_deleted_cursor():
    async def test(c: Cluster):
        ids = []
        for i in range(5):
            job, _ = await c.ctx.jobs.create(JobSpec(name=f"z{4 - i}", command=["true"]))
            ids.append(job.id)
            c.clock.now += 1
        await c.index_caught_up()
        index = c.ctx.index
        assert list(index.ids_after(None)) == ids  # by created_at, not by id (z4 < z0 reversed)
        cursor = index.place_of(ids[1])
        for job_id in ids[:2]:
            await c.ctx.jobs.move(job_id, JobState.CANCELLED, "done")
        c.clock.now += RETENTION_S
        assert sorted(await c.prune()) == sorted(ids[:2])
        assert await index.wait_until(lambda: index.get(ids[1]) is None, 5)
        assert index.place_of(ids[1]) == cursor  # remembered: a listing past it goes on
        assert list(index.ids_after(index.place_of(ids[1]))) == ids[2:]
        await c.ctx.jobs.move(ids[3], JobState.CANCELLED, "done")
        await c.index_caught_up()
        assert list(index.ids_after(None, [JobState.PENDING])) == [ids[2], ids[4]]

    run(test)


def test_listing_is_not_disturbed_by_jobs_added_and_deleted_while_it_reads():
    async def test(c: Cluster):
        ids = []
        for i in range(6):
            job, _ = await c.ctx.jobs.create(JobSpec(name=f"j{i}", command=["true"]))
            ids.append(job.id)
            c.clock.now += 1
        await c.index_caught_up()
        listing = c.ctx.index.ids_after(None)
        assert [next(listing), next(listing)] == ids[:2]
        await c.ctx.jobs.move(ids[2], JobState.CANCELLED, "done")
        c.clock.now += RETENTION_S
        await c.prune()  # ids[2] goes
        new, _ = await c.ctx.jobs.create(JobSpec(name="late", command=["true"]))
        await c.index_caught_up()
        assert list(listing) == [*ids[3:], new.id]

    run(test)


def test_a_job_created_here_is_listed_before_its_watch_event_comes():
    async def test(c: Cluster):
        c.ctx.index.ready.set()
        job, _ = await c.ctx.jobs.create(JobSpec(name="mine", command=["true"]))
        await c.kv.put("/unrelated", b"")  # nothing has run the index's watch since the write
        c.ctx.index.note_created(job)
        assert list(c.ctx.index.ids_after(None)) == [job.id]
        # A newer version the watch brought first is not overwritten by the older one.
        await c.ctx.jobs.move(job.id, JobState.CANCELLED, "done")
        await c.index_caught_up()
        c.ctx.index.note_created(job)
        assert c.ctx.index.get(job.id).state is JobState.CANCELLED

    run(test)


def test_leadership_fence_is_the_leader_key_at_the_revision_this_replica_wrote():
    async def main():
        kv = MemoryStore(ManualClock())
        one, two = Leadership(kv, "/l", ttl_s=5), Leadership(kv, "/l", ttl_s=5)
        assert await one.hold() and not await two.hold()
        assert one.fence() == {"/l": (await kv.get("/l")).mod_revision} and two.fence() is None
        assert await kv.commit(one.fence(), [Put("/x", b"1")])
        await one.release()
        assert one.fence() is None and await two.hold()
        assert two.fence() != {"/l": 0}

    asyncio.run(main())


def test_idempotency_keys_whose_job_is_gone_are_swept():
    """Keys of jobs deleted before records named their key (an older control plane)."""
    async def test(c: Cluster):
        kept, _ = await c.ctx.jobs.create(JobSpec(name="kept", command=["true"]), "k-kept")
        for i in range(150):  # more than one page of keys
            await c.kv.put(c.ctx.keys.idempotency(f"{i:064d}"),
                           json.dumps({"job_id": f"gone-{i:06d}", "spec": "x"}).encode())
        assert await c.leadership.hold()
        assert await c.ctx.jobs.delete_orphaned_keys(c.leadership.fence()) == 150
        assert [e.value async for e in c.kv.scan_prefix(c.ctx.keys.idempotency(""))] == \
            [(await c.kv.get(c.ctx.keys.idempotency(kept.idempotency_digest))).value]

    run(test)


def test_the_drain_of_a_node_gone_for_good_is_swept_after_the_keep_a_returning_node_keeps_its_own():
    async def test(c: Cluster):
        nodes, keep = c.ctx.nodes, 100.0
        nodes.clock = c.clock
        for name in ("gone", "back"):
            await nodes.register(name, 1, None, ttl_s=60)
            await nodes.drain(name)
            await nodes.deregister(name)
        assert await c.leadership.hold()
        fence = c.leadership.fence()
        assert await nodes.sweep_drains(fence, keep) == []  # both noted absent, none deleted
        await nodes.register("back", 1, None, ttl_s=100_000)  # back within the keep: still drained
        assert (await nodes.list())["back"].state.value == "DRAINING"
        c.clock.now += keep - 1
        assert await nodes.sweep_drains(fence, keep) == []  # "back"'s note cleared
        c.clock.now += 2
        stale = c.leadership.fence()
        await c.kv.revoke_lease(c.leadership.lease_id)  # a replica that lost the lead
        assert await nodes.sweep_drains(stale, keep) == []
        assert await c.kv.get(c.ctx.keys.drain("gone")) is not None
        assert await c.leadership.hold()
        assert await nodes.sweep_drains(c.leadership.fence(), keep) == ["gone"]
        assert await c.kv.get(c.ctx.keys.drain("gone")) is None
        assert await c.kv.get(c.ctx.keys.drain("back")) is not None  # present: kept
        c.clock.now += 10 * keep
        assert await nodes.sweep_drains(c.leadership.fence(), keep) == []

    run(test)


def test_the_retention_loop_sweeps_stale_drains(monkeypatch):
    monkeypatch.setattr(retention, "DRAIN_SWEEP_S", 0.0)

    async def test(c: Cluster):
        nodes = c.ctx.nodes
        await nodes.register("gone", 1, None, ttl_s=60)
        await nodes.drain("gone")
        await nodes.deregister("gone")
        loop = asyncio.create_task(retention.run(
            c.ctx.jobs, c.ctx.logs, c.ctx.index, c.leadership, RetentionPolicy(retention_s=1.0),
            drains=(nodes, 0.001)))
        try:
            assert await c.leadership.hold()
            for _ in range(100):  # noted on one pass, deleted on a later one
                if await c.kv.get(c.ctx.keys.drain("gone")) is None:
                    break
                await asyncio.sleep(0.05)
            assert await c.kv.get(c.ctx.keys.drain("gone")) is None
        finally:
            await cancel_and_wait(loop)

    run(test)
