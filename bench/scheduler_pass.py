"""One scheduler pass, timed, as the pending queue grows (no processes: the in-memory store).

    python bench/scheduler_pass.py                     # 1,000 nodes, 999 jobs running, 0..20,000 pending
    python bench/scheduler_pass.py --pending 0,5000,20000 --passes 20
    python bench/scheduler_pass.py --nodes 5000 --pending 2000 --priorities 10 --passes 100

With `--priorities K`, the waiting jobs' priorities go round 0..K-1 above the running jobs' 0, so
the jobs at the head of the queue preempt (bench agents never stop their workers: the victims
stay marked, and later passes find the nodes already leaving for them).

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
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from service import scheduler  # noqa: E402
from service.context import Context  # noqa: E402
from service.decide.scheduling import SchedulerConfig  # noqa: E402
from service.models import JobSpec, JobState  # noqa: E402
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
    for _ in range(args.nodes):
        await ctx.jobs.create(SPEC)
    await asyncio.sleep(0.1)  # the node view and the index take in the watch's events

    def waiting(i: int) -> JobSpec:
        """The i-th waiting job's spec: its priority goes round 0..K-1 (`--priorities`)."""
        return SPEC if args.priorities <= 1 else SPEC.model_copy(update={"priority": i % args.priorities})
    reasons: dict[str, str] = {}
    watches: dict = {}
    missing: dict[str, float] = {}
    kept = {} if Settled is None else {"settled": Settled()}

    async def one_pass() -> float:
        t = time.perf_counter()
        await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), reasons, watches,
                             missing_since=missing, **kept)
        return time.perf_counter() - t

    for _ in range(args.nodes // scheduler.MAX_STARTS_PER_PASS + 2):  # a pass starts at most that many
        await one_pass()
    running = sum(1 for j in ctx.index.jobs() if j.state in (JobState.STARTING, JobState.RUNNING))
    print(f"{args.nodes} nodes, {running} jobs running; {args.passes} passes per row")
    print(f"{'pending':>8}{'pass p50 ms':>13}{'pass p99 ms':>13}{'pass max ms':>13}{'submit+pass ms':>16}")
    pending = 0
    for target in args.pending:
        while pending < target:
            await ctx.jobs.create(waiting(pending))
            pending += 1
        await asyncio.sleep(0)
        times = [await one_pass() for _ in range(args.passes)]
        # One submission followed by the pass it wakes, as under a stream of submissions.
        t = time.process_time()
        for _ in range(args.passes):
            await ctx.jobs.create(waiting(pending))
            await one_pass()
        per_submit = (time.process_time() - t) / args.passes
        pending += args.passes
        p99 = sorted(times)[min(len(times) - 1, round(0.99 * (len(times) - 1)))]
        print(f"{target:>8}{statistics.median(times) * 1e3:>13.2f}{p99 * 1e3:>13.2f}{max(times) * 1e3:>13.2f}"
              f"{per_submit * 1e3:>16.2f}", flush=True)
    for task in tasks:
        task.cancel()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=1000)
    ap.add_argument("--pending", type=lambda s: [int(x) for x in s.split(",")],
                    default=[0, 1000, 5000, 10000, 20000])
    ap.add_argument("--passes", type=int, default=20)
    ap.add_argument("--priorities", type=int, default=1,
                    help="waiting jobs' priorities go round 0..K-1 (running ones: 0); 1: all 0")
    asyncio.run(main(ap.parse_args()))
