"""What one scheduler pass pays to read the jobs, with a history of finished jobs.

    .venv/bin/python bench/scheduler.py [--finished 5000] [--active 20] [--passes 50]

Starts a private etcd, stores `--finished` finished jobs and `--active` pending ones, then
times the two ways a pass can read them: every job (the whole history, a page at a time;
before reads were paged, one range read, which fails past 4 MiB) and the unfinished ones
only (ids from the watch-fed job index, the records a page per transaction: what
`service.scheduler.active_jobs` does). Prints the median and p90 per pass and their ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from service import scheduler  # noqa: E402
from service.context import Context  # noqa: E402
from service.embedded import EtcdProcess  # noqa: E402
from service.models import JobSpec, JobState  # noqa: E402
from service.settings import Settings  # noqa: E402


async def measure(endpoint: str, finished: int, active: int, passes: int) -> dict:
    ctx = Context.build(Settings(etcd_endpoints=endpoint, etcd_prefix="/bench"))
    spec = JobSpec(name="bench", command=["python", "train.py", "--steps", "1000"],
                   nodes={"min": 1, "max": 4})
    for i in range(finished):
        job, _ = await ctx.jobs.create(spec)
        await ctx.jobs.move(job.id, JobState.CANCELLED, "cancelled")
        if (i + 1) % 1000 == 0:
            print(f"  stored {i + 1} finished jobs", flush=True)
    for _ in range(active):
        await ctx.jobs.create(spec)
    index = asyncio.create_task(ctx.index.run())
    await asyncio.wait_for(ctx.index.ready.wait(), 60)

    async def every_job():
        return [j async for j in ctx.jobs.scan() if not j.state.is_terminal()]

    out = {}
    def unfinished_only():
        return scheduler.active_jobs(ctx.jobs, ctx.index)

    for name, read in (("every job", every_job), ("unfinished only", unfinished_only)):
        times = []
        for _ in range(passes):
            t = time.perf_counter()
            got = await read()
            times.append(time.perf_counter() - t)
        assert len(got) == active, (name, len(got))
        times.sort()
        out[name] = {"median_ms": statistics.median(times) * 1e3,
                     "p90_ms": times[int(0.9 * (len(times) - 1))] * 1e3}
    index.cancel()
    await ctx.kv.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--finished", type=int, default=5000)
    ap.add_argument("--active", type=int, default=20)
    ap.add_argument("--passes", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ftrain-bench-scheduler-") as tmp:
        etcd = EtcdProcess(Path(tmp))
        etcd.start()
        try:
            print(f"scheduler read per pass: {args.finished} finished jobs, {args.active} unfinished, "
                  f"{args.passes} passes", flush=True)
            res = asyncio.run(measure(etcd.endpoint, args.finished, args.active, args.passes))
        finally:
            etcd.stop()
    for name, r in res.items():
        print(f"  {name:16s} median {r['median_ms']:8.2f} ms   p90 {r['p90_ms']:8.2f} ms")
    ratio = res["every job"]["median_ms"] / res["unfinished only"]["median_ms"]
    print(f"  every job / unfinished only (medians): {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
