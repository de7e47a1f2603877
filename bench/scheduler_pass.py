"""One scheduler pass, timed, as the pending queue grows (no processes: the in-memory store).

    python bench/scheduler_pass.py                     # 1,000 nodes, 999 jobs running, 0..20,000 pending
    python bench/scheduler_pass.py --pending 0,5000,20000 --passes 20
    python bench/scheduler_pass.py --nodes 5000 --pending 2000 --users 10 --free 8 --passes 200
    python bench/scheduler_pass.py --nodes 5000 --pending 2000 --priorities 10 --passes 100

`--users N` spreads the jobs over N owners (fair share orders the queue by their shares);
`--free K` leaves K nodes free and makes each waiting job ask for K+1: no waiting job can
start, and each pass sees so without ordering the queue. With `--quota`, each waiting job
asks for one node but every user's quota is what it holds already: each pass reads, orders
and plans the whole queue (every job's quota checked) and starts nothing, the worst case of
fair share and quotas. With `--priorities K`, the waiting jobs' priorities go round 0..K-1
above the running jobs' 0, so the jobs at the head of the queue preempt (bench agents never
stop their workers: the victims stay marked, and later passes find the nodes already leaving
for them). The heap is frozen before the passes are timed (`gc.freeze`), as the control plane
does every second (service.gc_pauses); `--no-gc-freeze` times them with the collector going
through every record, as a process without that would.

What bench/api.py's submissions phase makes of the control plane: every node holds a job
(the first submissions took them all) and every later submission waits PENDING, while each
one wakes a scheduler pass. A pass runs on the event loop that answers the requests, so its
time is added to the latency of every request that arrives meanwhile. Prints the median and
the worst pass at each queue length, and the CPU one submission costs the control plane
(the job store's create, the index's apply and the pass that follows), in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service import scheduler  # noqa: E402
from service.context import Context  # noqa: E402
from service.decide.scheduling import SchedulerConfig  # noqa: E402
from service.models import JobSpec, JobState, NodesSpec, QuotaPatch  # noqa: E402
from service.settings import Settings  # noqa: E402
from service.store.memory import MemoryStore  # noqa: E402

try:  # what the scheduler loop keeps across passes (absent before it was written)
    from service.decide.scheduling import Settled
except ImportError:
    Settled = None

SPEC = JobSpec(name="load", command=["python", "-c", "pass"], nodes={"min": 1, "max": 1}, max_restarts=0)


async def main(args) -> None:
    ctx = Context.wire(Settings(), MemoryStore())
    wake = asyncio.Event()
    tasks = [asyncio.create_task(ctx.index.run()), asyncio.create_task(ctx.nodes.follow(wake))]
    await asyncio.wait_for(ctx.index.ready.wait(), 10)
    for i in range(args.nodes):
        await ctx.nodes.register(f"n{i:05d}", 1, None, ttl_s=600)
    owners = [f"user{u}" for u in range(args.users)]
    size = 1 if args.quota else args.free + 1
    base = SPEC.model_copy(update={"nodes": NodesSpec(min=size, max=size)})
    submitted = 0

    async def create(spec: JobSpec) -> None:
        nonlocal submitted
        await ctx.jobs.create(spec, owner=owners[submitted % len(owners)])
        submitted += 1

    for _ in range(args.nodes - args.free):
        await create(SPEC)
    await asyncio.sleep(0.1)  # the node view and the index take in the watch's events

    def waiting(i: int) -> JobSpec:
        """The i-th waiting job's spec: its priority goes round 0..K-1 (`--priorities`)."""
        return base if args.priorities <= 1 else base.model_copy(update={"priority": i % args.priorities})
    reasons: dict[str, str] = {}
    watches: dict = {}
    missing: dict[str, float] = {}
    kept = {} if Settled is None else {"settled": Settled()}

    async def one_pass() -> float:
        t = time.perf_counter()
        await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), reasons, watches,
                             missing_since=missing, **kept)
        return time.perf_counter() - t

    while await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), reasons, watches,
                               missing_since=missing, **kept):
        pass  # (a pass starts at most MAX_STARTS_PER_PASS jobs: until every one has started)
    running = sum(1 for j in ctx.index.jobs() if j.state in (JobState.STARTING, JobState.RUNNING))
    if args.quota:  # every user at its quota: each holds what it may
        tenants_task = asyncio.create_task(ctx.tenancy.run())
        tasks.append(tenants_task)
        for owner, held in ctx.index.held().items():
            await ctx.users.add(owner)
            await ctx.tenancy.set_user_quota(owner, QuotaPatch(max_nodes=held))
        kept["tenancy"] = ctx.tenancy
    if args.gc_freeze:  # what the control plane does every second (service.gc_pauses)
        gc.freeze()
    print(f"{args.nodes} nodes ({args.free} free), {running} jobs running, {args.users} users"
          f"{' at their quotas' if args.quota else ''}; {args.passes} passes per row"
          f"{'' if args.gc_freeze else '; the heap not frozen (--no-gc-freeze)'}")
    print(f"{'pending':>8}{'pass p50 ms':>13}{'pass p99 ms':>13}{'pass max ms':>13}{'submit+pass ms':>16}")
    pending = 0
    for target in args.pending:
        while pending < target:
            await create(waiting(pending))
            pending += 1
        await asyncio.sleep(0)
        if args.gc_freeze:
            gc.freeze()
        times = [await one_pass() for _ in range(args.passes)]
        # One submission followed by the pass it wakes, as under a stream of submissions.
        t = time.process_time()
        for _ in range(args.passes):
            await create(waiting(pending))
            await one_pass()
        per_submit = (time.process_time() - t) / args.passes
        pending += args.passes
        p99 = sorted(times)[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        print(f"{target:>8}{statistics.median(times) * 1e3:>13.2f}{p99 * 1e3:>13.2f}"
              f"{max(times) * 1e3:>13.2f}{per_submit * 1e3:>16.2f}", flush=True)
    for task in tasks:
        task.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pending", type=lambda s: [int(x) for x in s.split(",")],
                    default=[0, 1000, 5000, 10000, 20000])
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--users", type=int, default=1, help="Owners the jobs are spread over.")
    ap.add_argument("--free", type=int, default=0, help="Nodes left free (waiting jobs ask for one more).")
    ap.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                    help="Freeze the heap before timing, as the control plane does every second "
                         "(service.gc_pauses, FTRAIN_GC_FREEZE_S): its collections then skip the records.")
    ap.add_argument("--quota", action="store_true", help="Every user at its quota (waiting jobs ask for one node).")
    ap.add_argument("--priorities", type=int, default=1,
                    help="waiting jobs' priorities go round 0..K-1 (running ones: 0); 1: all 0")
    asyncio.run(main(ap.parse_args()))
