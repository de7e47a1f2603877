"""Fast loss detection (service/presence.py) on the in-memory KeyValue: a presence request
whose connection drops revokes the node's lease at once when a survivor reported a broken
peer (before or after the drop), or after the blip bound without one, unless the node asks
again, registered again, or another replica holds its presence now."""

from __future__ import annotations

import asyncio

from service.keys import Keys
from service.nodes import NodeStore
from service.settings import Settings
from service.presence import REASK_S, RECONNECT_S, Presence
from service.store.memory import MemoryStore

KEYS = Keys("/t")
BLIP_S = 0.6
HOLD_S = 1.0  # a presence request's hold, as the control plane's default
AT_ONCE_S = 0.1  # well under the blip bound and the re-ask window: no waiting of any kind


async def receive_held():
    await asyncio.sleep(3600)  # the connection stays open
    return {"type": "http.disconnect"}


async def receive_dropped():
    return {"type": "http.disconnect"}


async def setup(replicas: int = 1, grace_s: float | None = None):
    kv = MemoryStore()
    nodes = NodeStore(kv, KEYS, ttl_s=Settings().node_ttl_s)
    lease = await nodes.register("n1", 1, None, ttl_s=60)
    extra = {} if grace_s is None else {"grace_s": grace_s}
    return kv, nodes, lease, [Presence(kv, KEYS, blip_s=BLIP_S, **extra) for _ in range(replicas)]


async def settle(p: Presence) -> None:
    await asyncio.gather(*p._checks)


def test_a_dropped_connection_and_a_broken_peer_report_revoke_the_lease_at_once_in_either_order():
    async def main(report_first: bool):
        kv, nodes, lease, (p,) = await setup()
        assert await p.hold("n1", lease, receive_held, hold_s=0.01)  # held, answered
        dropped = asyncio.Event()

        async def receive_until_dropped():
            await dropped.wait()
            return {"type": "http.disconnect"}

        held = asyncio.create_task(p.hold("n1", lease, receive_until_dropped, HOLD_S))
        await asyncio.sleep(0.01)  # the next request is held
        t0 = p.clock()
        if report_first:  # the peer watch's closed connection can come before the drop is seen
            p.suspect(["n1"])
        dropped.set()
        assert not await held
        if not report_first:
            await asyncio.sleep(AT_ONCE_S / 2)  # the drop waits for a second signal
            assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []
            p.suspect(["n1"])  # a survivor's process group broke
        await settle(p)
        assert p.clock() - t0 < AT_ONCE_S, "the two signals agreed, yet the node was not lost at once"
        assert await kv.get(KEYS.node("n1")) is None and p.revoked == ["n1"]

    asyncio.run(main(report_first=True))
    asyncio.run(main(report_first=False))


def test_a_grace_after_the_two_signals_keeps_a_node_that_asks_again_within_it():
    async def main():
        kv, nodes, lease, (p,) = await setup(grace_s=0.3)
        assert not await p.hold("n1", lease, receive_dropped, HOLD_S)
        p.suspect(["n1"])
        await asyncio.sleep(0.05)
        assert await kv.get(KEYS.node("n1")) is not None  # not before the grace
        await p.hold("n1", lease, receive_held, hold_s=0.01)  # the agent reconnected
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []

    asyncio.run(main())


def test_a_drop_alone_is_a_blip_until_it_outlasts_the_bound_then_the_node_is_lost():
    async def main():
        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped, HOLD_S)
        await asyncio.sleep(BLIP_S / 3)  # no second signal: still a member
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []
        await settle(p)  # the blip outlasted BLIP_S
        assert await kv.get(KEYS.node("n1")) is None and p.revoked == ["n1"]

        # A blip that is back within the bound costs nothing.
        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped, HOLD_S)
        await asyncio.sleep(BLIP_S / 3)
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


def test_a_suspect_that_died_between_two_presence_requests_is_lost_unless_it_asks_again():
    async def main(asks_again: bool):
        kv, nodes, lease, (p,) = await setup()
        assert await p.hold("n1", lease, receive_held, hold_s=0.01)  # answered; no next request yet
        t0 = p.clock()
        p.suspect(["n1"])
        if asks_again:  # a live agent asks again within milliseconds: its worker died, not it
            await asyncio.sleep(REASK_S / 3)
            assert await p.hold("n1", lease, receive_held, hold_s=0.01)
        await settle(p)
        if asks_again:
            assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []
        else:
            assert await kv.get(KEYS.node("n1")) is None and p.revoked == ["n1"]
            assert p.clock() - t0 < REASK_S + AT_ONCE_S

    asyncio.run(main(asks_again=True))
    asyncio.run(main(asks_again=False))


def test_a_node_that_asks_again_before_a_second_signal_is_kept():
    async def main():
        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped, HOLD_S)
        await p.hold("n1", lease, receive_held, hold_s=0.01)  # the agent reconnected
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []

    asyncio.run(main())


def test_a_node_registered_again_or_held_by_another_replica_is_kept():
    async def main():
        kv, nodes, lease, (p, q) = await setup(replicas=2)
        assert not await p.hold("n1", lease, receive_dropped, HOLD_S)
        await q.hold("n1", lease, receive_held, hold_s=0.01)  # it reconnected to the other replica
        await settle(p)
        assert await kv.get(KEYS.node("n1")) is not None

        kv, nodes, lease, (p,) = await setup()
        assert not await p.hold("n1", lease, receive_dropped, HOLD_S)
        await kv.revoke_lease(lease)  # the agent deregistered and registered again
        new = await nodes.register("n1", 1, None, ttl_s=60)
        await settle(p)
        assert (await kv.get(KEYS.node("n1"))).lease == new and p.revoked == []

    asyncio.run(main())


def test_a_report_to_one_replica_confirms_a_drop_on_another_in_either_order():
    """Suspicions are shared through etcd: replica A holds n1's presence, a survivor's report
    goes to replica B. Either order is lost within a poll of the shared reports, not after
    the blip bound."""
    async def main(report_first: bool):
        kv, nodes, lease, (a, b) = await setup(replicas=2)
        assert await a.hold("n1", lease, receive_held, hold_s=0.01)
        t0 = a.clock()
        if report_first:
            b.suspect(["n1"])
            await settle(b)  # written to etcd
        assert not await a.hold("n1", lease, receive_dropped, HOLD_S)
        if not report_first:
            await asyncio.sleep(0.05)  # the drop waits for a second signal
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
        assert not await a.hold("n1", lease, receive_dropped, HOLD_S)
        await asyncio.sleep(BLIP_S / 3)
        assert await kv.get(KEYS.node("n1")) is not None and a.revoked == []  # a blip still
        await settle(a)  # lost at the blip bound
        assert a.revoked == ["n1"]

    asyncio.run(main())


def _held_until(event: asyncio.Event):
    async def receive():
        await event.wait()
        return {"type": "http.disconnect"}
    return receive


async def _two_held(p: Presence, lease: int, dead: asyncio.Event, blip: asyncio.Event):
    """The agent's two presence connections held (`a` dropping at `blip`, `b` at `dead`)."""
    a = asyncio.create_task(p.hold("n1", lease, _held_until(blip), HOLD_S, conn="10.0.0.2:5001"))
    b = asyncio.create_task(p.hold("n1", lease, _held_until(dead), HOLD_S, conn="10.0.0.2:5002"))
    await asyncio.sleep(0.01)
    return a, b


def test_every_connection_of_an_agent_closing_is_a_dead_process_lost_without_a_report():
    async def main():
        kv, nodes, lease, _ = await setup()
        p = Presence(kv, KEYS, blip_s=30.0)  # the bound is far: only the closes can tell
        died = asyncio.Event()
        held = await _two_held(p, lease, died, died)
        t0 = p.clock()
        died.set()  # the process died: the kernel closed both
        assert [await h for h in held] == [False, False]
        await asyncio.sleep(RECONNECT_S / 2)
        assert await kv.get(KEYS.node("n1")) is not None  # a live agent may still ask again
        await settle(p)
        assert p.clock() - t0 < 5 * RECONNECT_S, "lost only at the blip bound"
        assert await kv.get(KEYS.node("n1")) is None and p.revoked == ["n1"]

    asyncio.run(main())


def test_one_of_two_connections_closing_is_a_blip_while_the_other_is_held():
    async def main():
        kv, nodes, lease, _ = await setup()
        p = Presence(kv, KEYS, blip_s=4 * RECONNECT_S)
        blip, never = asyncio.Event(), asyncio.Event()
        a, b = await _two_held(p, lease, never, blip)
        blip.set()  # the agent's own timeout, or a proxy's cut, on one connection
        assert not await a
        await asyncio.sleep(2 * RECONNECT_S)
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []
        b.cancel()
        await settle(p)  # no report, not back: the blip bound, as before
        assert p.revoked == ["n1"]

    asyncio.run(main())


def test_a_single_connection_closing_waits_for_the_blip_bound():
    """An agent seen on one connection here (its other one on another replica, or none) may
    be alive: its drop alone is a blip until the bound."""
    async def main():
        kv, nodes, lease, _ = await setup()
        p = Presence(kv, KEYS, blip_s=4 * RECONNECT_S)
        assert not await p.hold("n1", lease, receive_dropped, HOLD_S, conn="10.0.0.2:5001")
        await asyncio.sleep(2 * RECONNECT_S)
        assert await kv.get(KEYS.node("n1")) is not None and p.revoked == []
        await settle(p)
        assert p.revoked == ["n1"]

    asyncio.run(main())
