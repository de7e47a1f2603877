"""Short garbage-collector pauses on the control plane's event loop.

CPython's cyclic collector stops the whole process while it goes through every object of
the generation it collects. The oldest generation holds the job index (a record is a few
dozen objects; tens of thousands of jobs wait under load), and a full collection comes each
time it has grown by a quarter: under bench/api.py's submissions such collections took
400-750 ms each, several a run, and every request that arrived meanwhile waited for them
(the submissions' p99). Young collections go through young objects only and stay short.

`run` moves what has lived through `freeze_s` into the permanent generation (`gc.freeze`,
which costs the same whatever the heap), so collections go through what is newer than that.
An object still frozen is never freed by the collector, only by reference counting: a
cycle that becomes garbage after it was frozen (rare: records and their parts form none)
waits for the next reclaim, every `reclaim_s`, when everything is unfrozen and collected
once (one full pause per `reclaim_s`, in place of one per quarter of growth).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger(__name__)


async def run(freeze_s: float, reclaim_s: float) -> None:
    """Freeze every `freeze_s`; unfreeze and collect every `reclaim_s`. Runs until cancelled
    (and leaves nothing frozen)."""
    reclaimed_at = time.monotonic()
    try:
        while True:
            await asyncio.sleep(freeze_s)
            if time.monotonic() - reclaimed_at >= reclaim_s:
                reclaim()
                reclaimed_at = time.monotonic()
            gc.freeze()
    finally:
        gc.unfreeze()


def reclaim() -> None:
    """Unfreeze everything and collect it once (a full pause, timed in the log)."""
    started = time.perf_counter()
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    found = gc.collect()
    log.debug("gc: %d objects unfrozen, %d unreachable collected in %.0f ms",
              frozen, found, (time.perf_counter() - started) * 1e3)
