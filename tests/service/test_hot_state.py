"""Hot state apart from the job record, and history compaction, on the in-memory KeyValue.

Progress goes to a key of its own at a bounded rate, fenced on the job record, which it
writes once (the first report); the leader compacts history to the revision it saw one
interval earlier; a watch that starts before a compaction re-reads instead of missing
what was compacted away.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from service.compaction import Compactor
from service.context import Context
from service.decide.change import Change
from service.errors import Conflict, HistoryCompacted, StaleAttempt, StaleLeader
from service.keys import Keys
from service.models import JobRecord, JobSpec, JobState, MemberStatus
from service.rendezvous import Rendezvous, state_token
from service.scheduler import Leadership
from service.settings import Settings
from service.store.api import Put
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait
from worker.protocol import MemoryReport, Progress, ProgressReport, Timeouts

SPEC = JobSpec(name="t", command=["true"])
LONG_POLL_S = Timeouts().long_poll_s  # the control plane's default hold of a long poll
LEADER_TTL_S = 5


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def running_job(ctx: Context) -> JobRecord:
    """A job RUNNING its attempt 1."""
    job, _ = await ctx.jobs.create(SPEC)
    await ctx.jobs.move(job.id, JobState.STARTING, "test")
    await ctx.jobs.move(job.id, JobState.RUNNING, "test")
    return await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={"attempt": 1})))


def context(clock: ManualClock, kv: MemoryStore | None = None, **settings) -> Context:
    ctx = Context.wire(Settings(**settings), kv or MemoryStore(clock))
    ctx.jobs.clock = clock
    return ctx


async def writes_of(kv: MemoryStore, key: str, since: int) -> int:
    """How many times `key` was written after revision `since` (its watch events)."""
    events = kv.watch_prefix(key, since + 1)
    count = 0
    try:
        while True:  # the history is replayed at once; then nothing more comes
            event = await asyncio.wait_for(anext(events), 0.05)
            count += event.key == key
    except TimeoutError:
        return count
    finally:
        await events.aclose()


# ------------------------------------------------------------------ progress

def test_twenty_reports_write_the_job_record_once_and_progress_at_the_bounded_rate():
    async def main():
        clock = ManualClock()
        ctx = context(clock, progress_min_interval_s=1.0)
        job = await running_job(ctx)
        before = await ctx.kv.revision()
        answers = []
        for step in range(20):  # 20 reports, 1/8 s apart: 2.5 s
            answers.append(await ctx.progress.report(job.id, ProgressReport(step=step, attempt=1)))
            clock.now += 0.125
        assert await writes_of(ctx.kv, ctx.keys.job(job.id), before) == 1  # the first report
        assert await writes_of(ctx.kv, ctx.keys.progress(job.id), before) == 3  # t = 0, 1, 2 s
        assert (await ctx.jobs.get(job.id)).reports_progress
        # Reports in between are answered with what is stored: the last write, not the report.
        assert [a.step for a in answers] == [0] * 8 + [8] * 8 + [16] * 4
        assert (await ctx.jobs.view(job.id)).progress == Progress(step=16, time=1002.0, steps_per_s=8.0)

    asyncio.run(main())


def test_the_metric_history_is_written_with_the_progress_and_at_its_rate():
    async def main():
        clock = ManualClock()
        ctx = context(clock, progress_min_interval_s=1.0)
        job = await running_job(ctx)
        before = await ctx.kv.revision()
        for step in range(20):  # 20 reports, 1/8 s apart: stored at t = 0, 1, 2 s
            await ctx.progress.report(job.id, ProgressReport(step=step, loss=1.0 / (step + 1), attempt=1,
                                                             metrics={"lr": 0.1}))
            clock.now += 0.125
        assert await writes_of(ctx.kv, ctx.keys.metrics_tail(job.id), before) == 3
        assert await writes_of(ctx.kv, ctx.keys.metrics_body(job.id), before) == 0  # the tail holds 3
        history = await ctx.jobs.metrics(job.id)
        assert (history.steps, history.times) == ([0, 8, 16], [1000.0, 1001.0, 1002.0])
        assert history.series == {"loss": [1.0, 0.111111, 0.0588235], "lr": [0.1] * 3}

    asyncio.run(main())


def test_progress_from_a_stale_attempt_or_to_a_finished_job_is_refused_and_writes_nothing():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        job = await running_job(ctx)
        await ctx.progress.report(job.id, ProgressReport(step=1, attempt=1))
        clock.now += 5
        before = await ctx.kv.revision()
        with pytest.raises(StaleAttempt):
            await ctx.progress.report(job.id, ProgressReport(step=2, attempt=0))
        await ctx.jobs.move(job.id, JobState.FAILED, "test")
        after_fail = await ctx.kv.revision()
        with pytest.raises(Conflict):
            await ctx.progress.report(job.id, ProgressReport(step=3))
        assert await writes_of(ctx.kv, ctx.keys.progress(job.id), before) == 0
        assert await ctx.kv.revision() == after_fail
        assert (await ctx.jobs.view(job.id)).progress.step == 1  # still shown once finished

    asyncio.run(main())


class RestartsTheJobAfterTheNextRead(MemoryStore):
    """A job restart (a new attempt) lands between a progress report's read and its write."""

    def __init__(self, clock, job_key: str):
        super().__init__(clock)
        self.job_key = job_key
        self.armed = False

    async def get_many(self, keys):
        entries = await super().get_many(keys)
        if self.armed and self.job_key in keys:
            self.armed = False
            job = JobRecord.model_validate_json((await self.get(self.job_key)).value)
            await self.put(self.job_key, job.model_copy(update={"attempt": 2}).model_dump_json().encode())
        return entries


def test_a_report_racing_a_restart_is_refused_because_the_write_is_fenced_on_the_job():
    async def main():
        clock = ManualClock()
        kv = RestartsTheJobAfterTheNextRead(clock, "")
        ctx = context(clock, kv)
        job = await running_job(ctx)
        await ctx.progress.report(job.id, ProgressReport(step=1, attempt=1))
        clock.now += 5
        kv.job_key, kv.armed = ctx.keys.job(job.id), True
        with pytest.raises(StaleAttempt):
            await ctx.progress.report(job.id, ProgressReport(step=2, attempt=1))
        assert (await ctx.jobs.view(job.id)).progress.step == 1

    asyncio.run(main())


def test_a_record_written_with_progress_on_it_counts_as_reporting():
    job = JobRecord(id="t-abc123", spec=SPEC, created_at=1, updated_at=1)
    old = {**job.model_dump(mode="json"), "progress": {"step": 5, "time": 1.0}}
    assert JobRecord.model_validate(old).reports_progress
    assert not JobRecord.model_validate(job.model_dump(mode="json")).reports_progress


# ------------------------------------------------------------------ compaction

def test_the_compactor_compacts_to_the_revision_it_saw_one_step_earlier_while_leading():
    async def main():
        kv = MemoryStore()
        lead = Leadership(kv, "/leader", LEADER_TTL_S)
        assert await lead.hold()
        compactor = Compactor(kv, "/compacted")
        await kv.put("/k", b"0")
        assert await compactor.step(lead.fence()) is None  # first step: only observes
        seen = await kv.revision()
        await kv.put("/k", b"1")
        await kv.put("/k", b"2")
        assert await compactor.step(lead.fence()) == seen
        assert (await kv.get("/compacted")).value == str(seen).encode()  # noted, fenced
        with pytest.raises(HistoryCompacted):  # older history is gone
            await anext(kv.watch_prefix("/k", seen - 1))
        events = kv.watch_prefix("/k", seen + 1)  # a watch one interval behind survives
        assert (await anext(events)).value == b"1"
        await events.aclose()
        await kv.put("/k", b"3")
        assert await compactor.step(None) is None  # not leading: nothing, and forget
        assert await compactor.step(lead.fence()) is None
        assert await compactor.step(lead.fence()) == await kv.revision() - 1  # less its note

    asyncio.run(main())


def test_a_replica_that_lost_the_lead_compacts_nothing():
    async def main():
        kv = MemoryStore()
        lead = Leadership(kv, "/leader", LEADER_TTL_S)
        assert await lead.hold()
        compactor = Compactor(kv, "/compacted")
        await kv.put("/k", b"0")
        assert await compactor.step(lead.fence()) is None
        first = await kv.revision()
        stale = lead.fence()
        await kv.revoke_lease(lead.lease_id)  # its lease lapsed; another replica leads
        assert await Leadership(kv, "/leader", LEADER_TTL_S).hold()
        await kv.put("/k", b"1")
        with pytest.raises(StaleLeader):
            await compactor.step(stale)  # it has not noticed yet: its fence is refused
        assert await kv.get("/compacted") is None
        events = kv.watch_prefix("/k", first)  # the history is all there
        assert (await anext(events)).value == b"0"
        await events.aclose()

    asyncio.run(main())


class CompactsBeforeTheNextWatch(MemoryStore):
    """A leader's compaction lands between a reader's read and the start of its watch,
    after a write that only the watch would have seen."""

    def __init__(self) -> None:
        super().__init__()
        self.race: Put | None = None

    async def watch_prefix(self, prefix, start_revision, max_session_s=60.0):
        if self.race is not None and self.race.key.startswith(prefix):
            race, self.race = self.race, None
            await self.put(race.key, race.value)
            await self.put("/elsewhere", b"")  # so that the compaction passes the write
            await self.compact(await self.revision())
        async for event in super().watch_prefix(prefix, start_revision, max_session_s):
            yield event


def test_the_job_index_re_reads_what_a_compaction_took_from_its_watch():
    async def main():
        kv = CompactsBeforeTheNextWatch()
        ctx = context(ManualClock(), kv)
        job = JobRecord(id="t-abc123", spec=SPEC, created_at=1, updated_at=1)
        kv.race = Put(ctx.keys.job(job.id), job.model_dump_json().encode())
        index = asyncio.create_task(ctx.index.run())
        try:
            assert await ctx.index.wait_until(lambda: ctx.index.get(job.id) is not None, 5)
        finally:
            await cancel_and_wait(index)

    asyncio.run(main())


def test_a_rendezvous_wait_re_reads_when_its_watch_starts_before_a_compaction():
    async def main():
        kv = CompactsBeforeTheNextWatch()
        keys = Keys()
        rdzv = Rendezvous(kv, keys, "t-abc123-a1", long_poll_s=LONG_POLL_S)
        first, _ = await rdzv.set_state(b"s1", None)
        # The next state is written (by another node) just before the waiter's watch starts,
        # and that history is compacted away.
        kv.race = Put(keys.rdzv_state("t-abc123-a1"), b"s2")
        began = time.monotonic()
        entry, changed = await rdzv.wait_for_state_change(state_token(first), 5)
        assert changed and entry.value == b"s2"
        assert time.monotonic() - began < 2.5  # seen on the re-read, not at the timeout

    asyncio.run(main())


# ------------------------------------------------------------------ the memory tier's reports

def test_memory_tier_reports_are_listed_per_member_node_and_fenced_by_attempt():
    async def main():
        clock = ManualClock()
        ctx = context(clock)
        job = await running_job(ctx)
        job = await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(
            update={"members": {"n0": MemberStatus(state="running"), "n1": MemberStatus(state="running")}})))
        await ctx.snapshots.report_memory(job.id, "n0", MemoryReport(step=7, attempt=1))
        await ctx.snapshots.report_memory(job.id, "n1", MemoryReport(step=6, attempt=1))
        await ctx.snapshots.report_memory(job.id, "n1", MemoryReport(step=8, attempt=1))
        listed = await ctx.snapshots.list(job.id)
        assert [(m.tier, m.node, m.step, m.attempt) for m in listed.memory] == \
            [("memory", "n0", 7, 1), ("memory", "n1", 8, 1)]
        before = await ctx.kv.revision()
        with pytest.raises(StaleAttempt):  # a worker of an attempt that is over
            await ctx.snapshots.report_memory(job.id, "n0", MemoryReport(step=9, attempt=0))
        with pytest.raises(Conflict, match="not a member"):
            await ctx.snapshots.report_memory(job.id, "n9", MemoryReport(step=9, attempt=1))
        assert await ctx.kv.revision() == before
        # n0 leaves (as the scheduler does it: a new attempt of the others): the reports go in
        # that write, and the members of the new attempt report again; n0 is refused.
        await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(
            update={"members": {"n1": MemberStatus(state="running")}, "attempt": 2})))
        assert (await ctx.snapshots.list(job.id)).memory == []
        assert [e.key async for e in ctx.kv.scan_prefix(ctx.keys.memory_copies(job.id))] == []
        await ctx.snapshots.report_memory(job.id, "n1", MemoryReport(step=8, attempt=2))
        with pytest.raises(Conflict, match="not a member"):
            await ctx.snapshots.report_memory(job.id, "n0", MemoryReport(step=8, attempt=2))
        assert [m.node for m in (await ctx.snapshots.list(job.id)).memory] == ["n1"]
        # And the records go with the job.
        assert any(op.key == ctx.keys.memory_copies(job.id) and op.prefix
                   for op in ctx.jobs.deletion(job))

    asyncio.run(main())
