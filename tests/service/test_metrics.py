"""GET /metrics: the scheduler records each pass's duration, and the route publishes them."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile

from service import scheduler
from service.context import Context
from service.models import JobSpec
from service.routes.health import metrics
from service.settings import Settings
from service.store.memory import MemoryStore


def parse(text: str) -> dict[str, float]:
    return {name: float(value) for name, _, value in
            (line.rpartition(" ") for line in text.splitlines() if not line.startswith("#"))}


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
        leadership = scheduler.Leadership(ctx.kv, ctx.keys.leader)
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
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            shutil.rmtree(log_root, ignore_errors=True)
        assert got["ftrain_scheduler_pass_seconds_count"] >= 3
        assert 0 < got['ftrain_scheduler_pass_seconds{quantile="0.5"}'] <= \
            got['ftrain_scheduler_pass_seconds{quantile="0.99"}'] < 5
        assert got["ftrain_scheduler_pass_seconds_sum"] > 0

    asyncio.run(main())
