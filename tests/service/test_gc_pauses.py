"""The control plane's garbage-collector pauses (service.gc_pauses): what lives through a
freeze interval is left out of collections, and a reclaim collects it once."""

from __future__ import annotations

import asyncio
import gc
import weakref

from service import gc_pauses
from tests.helpers.tasks import cancel_and_wait


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_long_lived_objects_are_frozen_and_a_reclaim_collects_a_frozen_cycle_that_became_garbage():
    async def main():
        gc.unfreeze()
        loop = asyncio.create_task(gc_pauses.run(0.01, reclaim_s=3600))
        try:
            cycle = Cycle()
            alive = weakref.ref(cycle)
            await asyncio.sleep(0.05)
            assert gc.get_freeze_count() > 0  # frozen (the test's objects with the rest)
            del cycle
            gc.collect()
            assert alive() is not None  # a dead cycle frozen is left alone by collections...
            gc_pauses.reclaim()
            assert alive() is None  # ...until a reclaim
            assert gc.get_freeze_count() == 0
        finally:
            await cancel_and_wait(loop)
        assert gc.get_freeze_count() == 0  # the loop leaves nothing frozen

    asyncio.run(main())
