"""Fast loss detection (service/presence.py) on the in-memory KeyValue: a presence request
whose connection drops revokes the node's lease after the grace when a survivor reported a
broken peer, or after the blip bound without one, unless the node asks again, registered
again, or another replica holds its presence now."""

from __future__ import annotations

import asyncio

from service.keys import Keys
from service.nodes import NodeStore
from service.presence import Presence
from service.store.memory import MemoryStore

KEYS = Keys("/t")
GRACE_S = 0.05
BLIP_S = 0.6


async def receive_held():
    await asyncio.sleep(3600)  # the connection stays open
    return {"type": "http.disconnect"}


async def receive_dropped():
    return {"type": "http.disconnect"}


async def setup(replicas: int = 1):
    kv = MemoryStore()
    nodes = NodeStore(kv, KEYS)
    lease = await nodes.register("n1", 1, None, ttl_s=60)
    return kv, nodes, lease, [Presence(kv, KEYS, grace_s=GRACE_S, blip_s=BLIP_S) for _ in range(replicas)]


async def settle(p: Presence) -> None:
    await asyncio.gather(*p._checks)


def test_a_dropped_connection_with_a_broken_peer_report_revokes_the_lease_after_the_grace():
    async def main():
        kv, nodes, lease, (p,) = await setup()
        assert await p.hold("n1", lease, receive_held, hold_s=0.01)  # held, answered
        assert not await p.hold("n1", lease, receive_dropped)
        p.suspect(["n1"])  # a survivor's process group broke
        assert await kv.get(KEYS.node("n1")) is not None  # not before the grace
        t0 = p.clock()
        await settle(p)
        assert p.clock() - t0 < BLIP_S / 2
        assert await kv.get(KEYS.node("n1")) is None and p.revoked == ["n1"]

    asyncio.run(main())


def test_a_drop_alone_is_a_blip_until_it_outlasts_the_bound_then_the_node_is_lost():
    async def main():
        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped)
        await asyncio.sleep(GRACE_S * 4)  # past the grace: no second signal, still a member
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []
        await settle(p)  # the blip outlasted BLIP_S
        assert await kv.get(KEYS.node("n1")) is None and p.revoked == ["n1"]

        # A blip that is back within the bound costs nothing.
        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped)
        await asyncio.sleep(GRACE_S * 4)
        await p.hold("n1", lease, receive_held, hold_s=0.01)  # the agent reconnected
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []

    asyncio.run(main())


def test_a_broken_peer_report_alone_revokes_nothing():
    async def main():
        kv, nodes, lease, (p,) = await setup()
        assert await p.hold("n1", lease, receive_held, hold_s=0.01)
        p.suspect(["n1"])  # its worker died, its agent is fine and asks again at once
        assert await p.hold("n1", lease, receive_held, hold_s=0.01)
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []

    asyncio.run(main())


def test_a_suspect_that_died_between_two_presence_requests_is_lost_after_the_grace():
    async def main():
        kv, nodes, lease, (p,) = await setup()
        assert await p.hold("n1", lease, receive_held, hold_s=0.01)  # answered; no next request
        p.suspect(["n1"])
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is None and p.revoked == ["n1"]

    asyncio.run(main())


def test_a_node_that_asks_again_within_the_grace_is_kept():
    async def main():
        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped)
        await p.hold("n1", lease, receive_held, hold_s=0.01)  # the agent reconnected
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []

    asyncio.run(main())


def test_a_node_registered_again_or_held_by_another_replica_is_kept():
    async def main():
        kv, nodes, lease, (p, q) = await setup(replicas=2)
        assert not await p.hold("n1", lease, receive_dropped)
        await q.hold("n1", lease, receive_held, hold_s=0.01)  # it reconnected to the other replica
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is not None

        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped)
        await kv.revoke_lease(lease)  # the agent deregistered and registered again
        new = await nodes.register("n1", 1, None, ttl_s=60)
        await settle(p)
        assert (await kv.get(KEYS.node("n1"))).lease == new and p.revoked == []

    asyncio.run(main())


def test_a_report_to_one_replica_confirms_a_drop_on_another_in_either_order():
    """Suspicions are shared through etcd: replica A holds n1's presence, a survivor's report
    goes to replica B. Either order is lost after the grace, not after the blip bound."""
    async def main(report_first: bool):
        kv, nodes, lease, (a, b) = await setup(replicas=2)
        assert await a.hold("n1", lease, receive_held, hold_s=0.01)
        t0 = a.clock()
        if report_first:
            b.suspect(["n1"])
            await settle(b)  # written to etcd
        assert not await a.hold("n1", lease, receive_dropped)
        if not report_first:
            await asyncio.sleep(GRACE_S * 2)  # the drop waits for a second signal
            b.suspect(["n1"])
        await settle(b)
        await settle(a)
        assert a.clock() - t0 < BLIP_S / 2, "lost only at the blip bound: the report was not shared"
        assert await kv.get(KEYS.node("n1")) is None and a.revoked == ["n1"] and b.revoked == []

    asyncio.run(main(report_first=True))
    asyncio.run(main(report_first=False))


def test_a_shared_report_older_than_the_window_confirms_nothing():
    async def main():
        kv, nodes, lease, (a, b) = await setup(replicas=2)
        b.wall = lambda: a.wall() - 10  # a report made long before the drop
        b.suspect(["n1"])
        await settle(b)
        assert await kv.get(KEYS.suspect("n1")) is not None
        assert not await a.hold("n1", lease, receive_dropped)
        await asyncio.sleep(GRACE_S * 4)
        assert await kv.get(KEYS.node("n1")) is not None and a.revoked == []  # a blip still
        await settle(a)  # lost at the blip bound
        assert a.revoked == ["n1"]

    asyncio.run(main())
