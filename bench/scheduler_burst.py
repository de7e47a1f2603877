"""The scheduler passes that start a burst of jobs, against a real etcd (no HTTP, one process).

    python bench/scheduler_burst.py                 # 1,000 free nodes, 1,000 jobs pending
    python bench/scheduler_burst.py --jobs 500 --runs 3

What bench/api.py's submissions phase asks first: its first second submits about a
thousand jobs while 999 nodes are free, so the leader's passes start them all. A pass runs on
the event loop that answers the requests: the passes' wall time (etcd round trips and the
gaps between passes included), their CPU time, and the longest the loop went without a turn
meanwhile (a task that asks for a
turn every millisecond notes how late each came) are printed, with the etcd transactions
it made (watched from another client). The etcd store is a real one (service/embedded.py).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service import scheduler  # noqa: E402
from service.context import Context  # noqa: E402
from service.decide.scheduling import SchedulerConfig, Settled  # noqa: E402
from service.models import JobSpec, JobState  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.embedded import EtcdProcess  # noqa: E402

SPEC = JobSpec(name="load", command=["python", "-c", "pass"], nodes={"min": 1, "max": 1}, max_restarts=0)


async def one_run(endpoint: str, prefix: str, nodes: int, jobs: int) -> dict:
    ctx = Context.build(Settings(etcd_endpoints=endpoint, etcd_prefix=prefix))
    for i in range(nodes):
        await ctx.nodes.register(f"n{i:05d}", 1, None, ttl_s=600)
    ids = [(await ctx.jobs.create(SPEC))[0].id for _ in range(jobs)]
    index = asyncio.create_task(ctx.index.run())
    await asyncio.wait_for(ctx.index.ready.wait(), 30)
    lead = scheduler.Leadership(ctx.kv, ctx.keys.leader, ttl_s=60)
    assert await lead.hold()
    revision = await ctx.kv.revision()

    late: list[float] = []
    stop = asyncio.Event()

    async def turns() -> None:
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            asked = loop.time()
            await asyncio.sleep(0.001)
            late.append(loop.time() - asked - 0.001)

    ticker = asyncio.create_task(turns())
    await asyncio.sleep(0.01)
    wall, cpu = time.perf_counter(), time.process_time()
    passes = 0
    settled = Settled()  # kept across passes, as the scheduler loop keeps it
    while True:  # as the scheduler loop runs them: another pass, after the gap, while jobs are left
        passes += 1
        if not await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {},
                                    fence=lead.fence(), settled=settled):
            break
        await asyncio.sleep(getattr(scheduler, "MIN_PASS_GAP_S", 0.02))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stop.set()
    await ticker
    after = await ctx.kv.revision()
    started = sum(1 for j in await ctx.jobs.get_many(ids) if j.state is JobState.STARTING)
    index.cancel()
    await lead.release()
    await ctx.kv.close()
    return {"wall_s": wall, "cpu_s": cpu, "longest_turn_ms": max(late) * 1e3, "passes": passes,
            "revisions": after - revision, "started": started}


async def main(args) -> None:
    root = Path(tempfile.mkdtemp(prefix="ftrain-bench-burst-"))
    etcd = EtcdProcess(root / "etcd-data", log_path=root / "etcd.log").start()
    try:
        runs = [await one_run(etcd.endpoint, f"/burst{k}", args.nodes, args.jobs) for k in range(args.runs)]
    finally:
        etcd.kill()
        shutil.rmtree(root, ignore_errors=True)
    for k, r in enumerate(runs):
        print(f"run {k}: {r['started']} jobs started in {r['passes']} pass(es): "
              f"{r['wall_s'] * 1e3:.0f} ms wall, "
              f"{r['cpu_s'] * 1e3:.0f} ms CPU, longest wait for a turn of the loop "
              f"{r['longest_turn_ms']:.1f} ms, {r['revisions']} etcd revisions (transactions)")
    print(f"median: {statistics.median(r['wall_s'] for r in runs) * 1e3:.0f} ms wall, "
          f"{statistics.median(r['cpu_s'] for r in runs) * 1e3:.0f} ms CPU, longest turn "
          f"{statistics.median(r['longest_turn_ms'] for r in runs):.1f} ms, "
          f"{statistics.median(r['revisions'] for r in runs):.0f} transactions")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000, help="free nodes")
    ap.add_argument("--jobs", type=int, default=1000, help="jobs pending, one node each")
    ap.add_argument("--runs", type=int, default=3)
    asyncio.run(main(ap.parse_args()))
