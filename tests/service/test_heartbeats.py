"""Node heartbeats answered from memory, keep-alives in batches (service.heartbeats), on the
in-memory KeyValue with a clock the test moves: a beating node's lease never lapses, one
that stops is lost, and a lapsed or revoked lease answers 404 (False) again."""

from __future__ import annotations

import asyncio

import pytest

from service.errors import NodeNotFound
from service.heartbeats import FLUSH_S, LeaseKeeper
from service.keys import Keys
from service.nodes import NodeStore
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait

TTL = 6


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _store() -> tuple[ManualClock, MemoryStore, NodeStore]:
    clock = ManualClock()
    kv = MemoryStore(clock)
    return clock, kv, NodeStore(kv, Keys("/t"), clock, ttl_s=TTL)


def test_nodes_beating_at_a_quarter_ttl_never_lapse_and_no_beat_waits_on_etcd():
    async def main():
        clock, kv, nodes = _store()
        names = [f"n{i}" for i in range(50)]
        for name in names:
            await nodes.register(name, 1, None, ttl_s=TTL, credential_sha256=name * 32)
        refreshes = 0
        real = kv.refresh_lease

        async def counted(lease_id: int) -> bool:
            nonlocal refreshes
            refreshes += 1
            return await real(lease_id)

        kv.refresh_lease = counted
        interval, beats, t = TTL / 4, 0, 0.0
        next_beat = [i * interval / len(names) for i in range(len(names))]
        while t < 10 * TTL:  # every node beats every TTL/4 (phase-shifted); a flush every FLUSH_S
            t = round(t + FLUSH_S / 5, 6)
            clock.now = 1000.0 + t
            for i, name in enumerate(names):
                if t >= next_beat[i]:
                    next_beat[i] += interval
                    beats += 1
                    before = refreshes
                    await nodes.heartbeat_with(name, name * 32)
                    assert refreshes == before  # answered from memory
            if round(t / FLUSH_S, 6).is_integer():
                await nodes.leases.flush()
        assert sorted(await nodes.list()) == sorted(names)  # none lapsed
        assert beats > 1000
        # about one keep-alive every TTL/3 (+ up to a flush) per node, not one per beat
        assert 0.5 * beats < refreshes < 0.85 * beats, (refreshes, beats)

    asyncio.run(main())


def test_a_node_that_stops_beating_is_lost_within_a_ttl_and_a_flush():
    async def main():
        clock, _, nodes = _store()
        await nodes.register("n0", 1, None, ttl_s=TTL, credential_sha256="a" * 64)
        last_beat = clock.now
        for _ in range(8):  # beats, flushed
            clock.now += TTL / 4
            await nodes.heartbeat_with("n0", "a" * 64)
            last_beat = clock.now
            clock.now += FLUSH_S
            await nodes.leases.flush()
        while "n0" in await nodes.list():  # silent from here; flushes go on
            clock.now += 0.1
            await nodes.leases.flush()
            assert clock.now <= last_beat + TTL + FLUSH_S + 0.1
        with pytest.raises(NodeNotFound):  # its agent registers again
            await nodes.heartbeat_with("n0", "a" * 64)

    asyncio.run(main())


def test_a_beat_on_a_lease_not_confirmed_lately_asks_etcd_and_a_lapsed_one_is_refused():
    async def main():
        clock, kv, nodes = _store()
        keeper = nodes.leases
        lease = await kv.grant_lease(TTL)  # granted by another replica: unknown here
        assert await keeper.beat(lease) and keeper.keepalives == 1  # asked etcd
        assert await keeper.beat(lease) and keeper.keepalives == 1  # from memory
        clock.now += TTL + 1  # paused past its lease (no flush ran: nobody beat)
        assert not await keeper.beat(lease)
        assert keeper.keepalives == 2
        assert not await keeper.beat(lease)  # remembered: no second question
        assert keeper.keepalives == 2

    asyncio.run(main())


def test_a_lease_revoked_elsewhere_is_refused_after_the_next_flush_that_refreshes_it():
    async def main():
        clock, kv, nodes = _store()
        other = LeaseKeeper(kv, TTL, clock)  # another replica's view
        lease = await kv.grant_lease(TTL)
        other.granted(lease, clock.now)
        assert await other.beat(lease)
        await kv.revoke_lease(lease)
        assert await other.beat(lease)  # still answered from memory
        clock.now += TTL / 3
        assert await other.flush() == 1
        assert not await other.beat(lease)

    asyncio.run(main())


def test_keeper_with_flush_loop_keeps_a_lease_on_real_time():
    async def main():
        kv = MemoryStore()
        keeper = LeaseKeeper(kv, 2)
        lease = await kv.grant_lease(2)
        keeper.granted(lease, keeper._clock())
        loop = asyncio.create_task(keeper.run(0.05))
        try:
            for _ in range(14):  # 3.5 s, past the 2 s lease
                assert await keeper.beat(lease)
                await asyncio.sleep(0.25)
        finally:
            await cancel_and_wait(loop)
        assert await kv.refresh_lease(lease)

    asyncio.run(main())
