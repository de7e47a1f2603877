"""The job index's waits (heartbeat long polls, a new leader's catch-up) against cancellation.

A heartbeat's long poll is `JobIndex.wait_until` with a timeout, cancelled when the node's
connection drops. After a control-plane outage (SIGSTOP) both came in the same loop step, and
the asyncio.Condition it waited on was left locked for good: every later long poll and the
index's own notifications waited on that lock, agents' heartbeats timed out and every node's
lease lapsed, again and again (`test_a_long_control_plane_outage...` found it).
"""

import asyncio
import random

from service.job_index import JobIndex


async def _cancelled_waits_then_a_wait():
    index = JobIndex(None, None)  # type: ignore[arg-type]  (waiting and notifying touch no store)
    rng = random.Random(7)

    async def notify_often():
        while True:
            await index._notify()
            await asyncio.sleep(0)

    notifier = asyncio.create_task(notify_often())
    try:
        for _ in range(400):
            waits = [asyncio.create_task(index.wait_until(lambda: False, 0.001)) for _ in range(4)]
            await asyncio.sleep(rng.uniform(0.0005, 0.002))
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
    finally:
        notifier.cancel()
        await asyncio.gather(notifier, return_exceptions=True)
    await asyncio.wait_for(index._notify(), 1)
    seen = []
    waiter = asyncio.create_task(index.wait_until(lambda: bool(seen), 5))
    await asyncio.sleep(0.01)
    seen.append(1)
    await asyncio.wait_for(index._notify(), 1)
    assert await asyncio.wait_for(waiter, 1) is True


def test_waits_cancelled_as_their_timeout_ends_leave_notifications_and_later_waits_working():
    asyncio.run(asyncio.wait_for(_cancelled_waits_then_a_wait(), 30))
