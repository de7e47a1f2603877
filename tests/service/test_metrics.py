"""GET /metrics (Prometheus): the scheduler's pass times, and the jobs, restarts and recovery
times the job index sees."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

from service import scheduler
from service.context import Context
from service.models import JobSpec, JobState, RestartCounts
from service.routes.health import metrics
from service.settings import Settings
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait
from tests.service.records import make_job


def parse(response) -> dict[str, float]:
    text = response.body.decode()
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if line and not line.startswith("#"))}


def test_pass_times_keep_a_count_a_sum_and_quantiles_of_the_last_passes():
    p = scheduler.PassTimes()
    assert p.quantile(0.5) is None
    for ms in range(1, 101):
        p.record(ms / 1000)
    assert p.count == 100 and abs(p.sum_s - 5.05) < 1e-9
    assert p.quantile(0.5) == 0.051 and p.quantile(0.99) == 0.099
    for _ in range(scheduler.PASS_WINDOW):  # the window moves: old passes no longer count
        p.record(0.001)
    assert p.quantile(0.99) == 0.001 and p.count == 100 + scheduler.PASS_WINDOW


def test_the_leading_scheduler_records_its_passes_and_metrics_publishes_them():
    async def main():
        log_root = tempfile.mkdtemp(prefix="ftrain-test-logs-")
        ctx = Context.wire(Settings(log_root=log_root), MemoryStore())
        assert parse(await metrics(ctx))["ftrain_scheduler_pass_seconds_count"] == 0
        leadership = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=5)
        tasks = [asyncio.create_task(ctx.index.run()),
                 asyncio.create_task(scheduler.run(ctx.jobs, ctx.nodes, ctx.index, leadership, 0.05,
                                                   passes=ctx.scheduler_passes))]
        try:
            await ctx.jobs.create(JobSpec(name="j", command=["true"]))
            deadline = asyncio.get_running_loop().time() + 5
            while ctx.scheduler_passes.count < 3:
                assert asyncio.get_running_loop().time() < deadline, "no scheduler pass recorded"
                await asyncio.sleep(0.01)
            got = parse(await metrics(ctx))
        finally:
            await cancel_and_wait(*tasks)
            shutil.rmtree(log_root, ignore_errors=True)
        assert got["ftrain_scheduler_pass_seconds_count"] >= 3
        assert 0 < got['ftrain_scheduler_pass_seconds{quantile="0.5"}'] <= \
            got['ftrain_scheduler_pass_seconds{quantile="0.99"}'] < 5
        assert got["ftrain_scheduler_pass_seconds_sum"] > 0

    asyncio.run(main())


def test_the_index_feeds_jobs_by_state_restarts_and_recovery_time():
    async def main():
        log_root = tempfile.mkdtemp(prefix="ftrain-test-logs-")
        ctx = Context.wire(Settings(log_root=log_root), MemoryStore())
        index = asyncio.create_task(ctx.index.run())
        base = make_job(JobState.RUNNING).model_copy(update={"id": "job-1"})
        pending = make_job(JobState.PENDING).model_copy(update={"id": "job-2"})
        # a worker fault at t=100 (RECOVERING, one restart), training again at t=103.5
        versions = [base.model_copy(update={"updated_at": 90.0})] + [
            base.model_copy(update={"state": state, "restarts_by_cause": RestartCounts(failure=1),
                                    "updated_at": at})
            for state, at in ((JobState.RECOVERING, 100.0), (JobState.RUNNING, 103.5),
                              (JobState.SUCCEEDED, 110.0))]
        try:
            await ctx.index.wait_ready(5)
            await ctx.kv.put(ctx.keys.job("job-2"), pending.model_dump_json().encode())
            seen = []
            for v in versions:
                await ctx.kv.put(ctx.keys.job(v.id), v.model_dump_json().encode())
                assert await ctx.index.wait_until(lambda v=v: ctx.index.get(v.id) == v, 5)
                seen.append(parse(await metrics(ctx)))
        finally:
            await cancel_and_wait(index)
            shutil.rmtree(log_root, ignore_errors=True)
        running, recovering, again, done = seen
        assert (running['ftrain_jobs{state="RUNNING"}'], running['ftrain_jobs{state="PENDING"}']) == (1, 1)
        assert recovering['ftrain_jobs{state="RECOVERING"}'] == 1
        assert recovering["ftrain_job_restarts_total"] == 1
        assert recovering["ftrain_job_recovery_seconds_count"] == 0
        assert again["ftrain_job_recovery_seconds_count"] == 1
        assert again["ftrain_job_recovery_seconds_sum"] == 3.5
        assert again['ftrain_job_recovery_seconds_bucket{le="3.0"}'] == 0
        assert again['ftrain_job_recovery_seconds_bucket{le="5.0"}'] == 1
        assert done['ftrain_jobs{state="SUCCEEDED"}'] == 1 and done['ftrain_jobs{state="RUNNING"}'] == 0
        assert done["ftrain_job_restarts_total"] == 1

    asyncio.run(main())


def test_metrics_give_each_jobs_restarts_by_cause():
    async def main():
        log_root = tempfile.mkdtemp(prefix="ftrain-test-logs-")
        ctx = Context.wire(Settings(log_root=log_root), MemoryStore())
        index = asyncio.create_task(ctx.index.run())
        counts = RestartCounts(failure=1, lost_node=2, preemption=3)
        restarted = make_job(JobState.RUNNING).model_copy(update={"id": "job-1", "restarts_by_cause": counts})
        steady = make_job(JobState.RUNNING).model_copy(update={"id": "job-2"})
        try:
            await ctx.index.wait_ready(5)
            for j in (restarted, steady):
                await ctx.kv.put(ctx.keys.job(j.id), j.model_dump_json().encode())
            assert await ctx.index.wait_until(lambda: ctx.index.get("job-2") == steady, 5)
            got = parse(await metrics(ctx))
        finally:
            await cancel_and_wait(index)
            shutil.rmtree(log_root, ignore_errors=True)
        by_cause = {k: v for k, v in got.items() if k.startswith("ftrain_job_restarts_by_cause_total")}
        expected = (("failure", 1), ("lost_node", 2), ("preemption", 3), ("resize", 0))
        assert by_cause == {f'ftrain_job_restarts_by_cause_total{{cause="{cause}",job="job-1"}}': n
                            for cause, n in expected}

    asyncio.run(main())
