"""Background asyncio tasks of a test (a job index, a scheduler loop, a watch pump): started
for a block and always ended with it, so no task outlives its test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any


async def cancel_and_wait(*tasks: asyncio.Task) -> None:
    """Cancel the tasks and wait until every one has ended; an error a task ended with (other
    than its cancellation) is raised here, so a background loop that broke fails its test.

    Python 3.11's `wait_for` may drop a cancellation that lands as the call it waits for
    completes (an index's watch set-up), so a task still running is cancelled again."""
    pending = set(tasks)
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=1)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()


@contextlib.asynccontextmanager
async def running(*coros: Coroutine[Any, Any, Any]) -> AsyncIterator[list[asyncio.Task]]:
    """Run the coroutines as tasks for the block; cancelled and awaited when it ends."""
    tasks = [asyncio.create_task(c) for c in coros]
    try:
        yield tasks
    finally:
        await cancel_and_wait(*tasks)


async def until(cond: Callable[[], object], what: str, within_s: float = 5.0) -> None:
    """Wait, yielding to the loop's tasks, until `cond()` holds; fail naming `what` if it
    does not within `within_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not cond():
        assert loop.time() < deadline, f"not within {within_s:g} s: {what}"
        await asyncio.sleep(0.01)
