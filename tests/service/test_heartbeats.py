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


def test_a_replica_cut_off_from_etcd_answers_a_heartbeat_503_at_once_and_never_waits_long():
    """Cut off (a request to etcd unanswered for a second: `check_contact` raises), a beat is
    refused at once even on a lease confirmed a moment ago, so the node takes its beats to
    another replica in time; a beat that must ask etcd waits at most BEAT_WAIT of a TTL."""
    from service.errors import StoreUnavailable
    from service.heartbeats import BEAT_WAIT

    async def main():
        clock, kv, _nodes = _store()
        ttl = 2  # (the shortest: the test waits its BEAT_WAIT)
        keeper = LeaseKeeper(kv, ttl_s=ttl, clock=clock)
        lease = await kv.grant_lease(ttl)
        keeper.granted(lease, clock.now)
        assert await keeper.beat(lease)  # from memory

        def cut_off() -> None:
            raise StoreUnavailable("no answer from etcd for 1.2 s")
        kv.check_contact = cut_off
        clock.now += ttl * 0.4  # due for a keep-alive at the next flush
        with pytest.raises(StoreUnavailable):
            await keeper.beat(lease)
        del kv.check_contact
        # Still kept alive by the flush (etcd may only have been slow): the refusal noted it.
        assert await keeper.flush() == 1

        async def hangs(lease_id: int) -> bool:
            await asyncio.sleep(3600)
            return True
        kv.refresh_lease = hangs
        clock.now += ttl * 0.6  # past FAST_WITHIN: the beat asks etcd
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(StoreUnavailable):
            await keeper.beat(lease)
        assert loop.time() - started == pytest.approx(ttl * BEAT_WAIT, abs=0.2)

    asyncio.run(main())


def test_etcd_store_is_cut_off_only_while_no_answer_came_past_the_bound():
    import time

    from service.errors import StoreUnavailable
    from service.store.api import CUT_OFF_AFTER_S
    from service.store.etcd import EtcdStore

    store = EtcdStore("http://127.0.0.1:1")
    store.check_contact()  # nothing asked
    store.calls.unanswered_since = time.monotonic() - CUT_OFF_AFTER_S / 2
    store.check_contact()  # waiting (or failing), not yet for long
    store.calls.unanswered_since = time.monotonic() - CUT_OFF_AFTER_S - 0.5
    with pytest.raises(StoreUnavailable, match="no answer from etcd"):
        store.check_contact()
    store.calls.answered()  # an answer came
    store.check_contact()

    async def refused():  # a member that refuses connections: no answer either
        async def call(client):
            raise OSError("connection refused")
        store.calls.connected = lambda: asyncio.sleep(0)
        with pytest.raises(StoreUnavailable):
            await store.calls.call_once("GET /k", call)
    asyncio.run(refused())
    assert store.calls.unanswered_since is not None


def test_a_flush_tells_how_long_etcd_took_to_answer_its_keep_alives():
    """(service.admission sheds user load when node work runs late.)"""
    async def main():
        clock, kv, nodes = _store()
        await nodes.register("n0", 1, None, ttl_s=TTL, credential_sha256="a" * 64)
        waits: list[float] = []
        nodes.leases.on_flush = waits.append
        real = kv.refresh_lease

        async def slow(lease_id: int) -> bool:
            clock.now += 0.75  # etcd answers late
            return await real(lease_id)

        kv.refresh_lease = slow
        await nodes.heartbeat_with("n0", "a" * 64)
        assert await nodes.leases.flush() == 0 and waits == []  # nothing due: nothing to tell
        clock.now += TTL / 2 - 0.1  # due for a keep-alive, still answered from memory
        await nodes.heartbeat_with("n0", "a" * 64)
        assert await nodes.leases.flush() == 1
        return waits

    assert asyncio.run(main()) == [0.75]
