"""When a node whose lease lapsed counts as lost, after an outage of the control plane's own
(pure logic, fixed `now`), and how a replica learns of such an outage (`service.contact`,
on the in-memory store)."""

from __future__ import annotations

import asyncio

import pytest

from service.contact import Contact
from service.decide.liveness import HEARD_EVERY_S, MIN_MARGIN_S, NOTICE_S, Outage, graced, outage_since
from service.decide.scheduling import plan
from service.errors import StaleLeader
from service.scheduler import Leadership
from service.store.memory import MemoryStore
from tests.service.test_scheduler import CFG, NOW, job, nodes

S_RUNNING = "running"
TTL = 6.0
GRACE_S = TTL + MIN_MARGIN_S


@pytest.mark.parametrize("last_heard,outage", [
    (None, None),  # a fresh etcd: nobody's lease can have lapsed unheard
    (NOW - 1, None),  # heard a moment ago (another replica, or this one before a short gap)
    (NOW - TTL / 2 - HEARD_EVERY_S, None),  # too short for a heartbeating node's lease to lapse
    (NOW - 6, Outage(NOW - 6, NOW)),
    (NOW - 600, Outage(NOW - 600, NOW)),  # a 10-minute outage
])
def test_an_outage_is_a_time_in_which_no_control_plane_heard_the_nodes(last_heard, outage):
    assert outage_since(last_heard, NOW, TTL) == outage


OUT = Outage(started=NOW - 90, ended=NOW)


@pytest.mark.parametrize("missing_since,now,expected", [
    ({"a": NOW}, NOW, {"a"}),  # found gone when the outage ended: it lapsed in it
    ({"a": NOW + TTL}, NOW + TTL, {"a"}),  # lapsed a lease after the outage's end: never heard since
    ({"a": NOW}, NOW + GRACE_S - 0.1, {"a"}),  # still waited for, to the end of the grace
    ({"a": NOW}, NOW + GRACE_S, set()),  # the grace is over: lost
    # Heard after the outage, then silent for a lease (its agent SIGKILLed): lost at once.
    ({"a": NOW + TTL + NOTICE_S + 0.5}, NOW + TTL + NOTICE_S + 0.5, set()),
    ({"a": NOW, "b": NOW + 9}, NOW + 9, {"a"}),
])
def test_only_a_node_whose_lease_lapsed_in_the_outage_is_graced(missing_since, now, expected):
    assert graced(missing_since, OUT, TTL, now) == expected


def test_without_an_outage_no_node_is_graced():
    assert graced({"a": NOW}, None, TTL, NOW) == frozenset()


@pytest.mark.parametrize("mn,round_nodes", [(2, 2), (1, 2)])
def test_a_graced_member_whose_node_is_gone_is_waited_for(mn, round_nodes):
    j = job("RUNNING", {"a": S_RUNNING, "b": S_RUNNING}, mn=mn, mx=2, round_nodes=round_nodes)
    assert plan(j, nodes("a"), [], NOW, CFG, graced=frozenset({"b"})) is None  # neither lost nor restarted
    assert plan(j, nodes(), [], NOW, CFG, graced=frozenset({"a", "b"})) is None  # every node gone: same
    after = plan(j, nodes("a"), [], NOW, CFG)  # not graced (any more): lost as ever
    assert after is not None and "node b lost" in " ".join(e.reason for e in after.events)
    assert "b" not in after.job.members or not after.job.members["b"].is_live()
    other = plan(j, nodes(), [], NOW, CFG, graced=frozenset({"a"}))  # only a is graced: b is lost
    assert other is not None and "node b lost" in " ".join(e.reason for e in other.events)
    assert "node a lost" not in " ".join(e.reason for e in other.events)


def test_a_graced_member_does_not_stop_a_join_or_a_drain():
    j = job("RUNNING", {"a": S_RUNNING, "b": S_RUNNING}, mn=1, mx=3)
    p = plan(j, {**nodes("c"), **nodes("a", draining=("a",))}, ["c"], NOW, CFG, graced=frozenset({"b"}))
    assert p is not None and p.job.members["b"].is_live()  # b (gone) is not lost yet: carried along
    assert "a" not in p.job.members and "drained" in " ".join(e.reason for e in p.events)


LEAD = {"/ftrain/leader": 0}  # a fence that holds while no leader key exists


def test_a_replica_learns_of_an_outage_from_the_leaders_note_not_from_its_own_start():
    kv = MemoryStore()
    mono, wall = [100.0], [NOW]

    def replica() -> Contact:
        return Contact(kv, "/ftrain/contact", TTL, clock=lambda: mono[0], wall_clock=lambda: wall[0])

    def tick(s: float) -> None:
        mono[0] += s
        wall[0] += s

    async def scenario() -> None:
        first = replica()
        first.observe()
        await first.settle(LEAD)  # a fresh etcd: no note, no outage
        assert first.outage is None and first.recent_outage() is None
        assert first.graced({"a": wall[0]}, wall[0]) == frozenset()
        for _ in range(20):  # leading, in touch every 0.5 s: the note stays fresh
            tick(0.5)
            first.observe()
            await first.settle(LEAD)
        second = replica()  # another replica starts while the first leads: no outage either
        second.observe()
        await second.settle(None)
        assert second.outage is None
        stopped_at = wall[0]
        tick(90)  # the leader stopped (SIGSTOP), or etcd out of its reach, for 90 s
        first.observe()
        await first.settle(LEAD)
        assert first.outage == Outage(stopped_at, wall[0])
        assert (first.recent_outage().started, first.recent_outage().ended) == (stopped_at, wall[0])
        assert first.graced({"a": wall[0]}, wall[0]) == {"a"}
        third = replica()  # a replica started just after: it reads the same note
        third.observe()
        await third.settle(None)
        assert third.outage is None  # the leader renewed the note as it came back
        tick(2.5)  # a short gap: the note is fresh, nothing changes
        first.observe()
        await first.settle(LEAD)
        assert first.outage.ended == wall[0] - 2.5

    asyncio.run(scenario())


def test_a_replica_that_lost_the_lead_does_not_renew_the_note():
    async def scenario() -> None:
        kv = MemoryStore()
        lead = Leadership(kv, "/ftrain/leader", ttl_s=5)
        assert await lead.hold()
        stale = lead.fence()
        mono = [100.0]
        contact = Contact(kv, "/ftrain/contact", TTL, clock=lambda: mono[0])
        contact.observe()
        await contact.settle(stale)
        noted = await kv.get("/ftrain/contact")
        await kv.revoke_lease(lead.lease_id)  # its lease lapsed; another replica leads
        assert await Leadership(kv, "/ftrain/leader", ttl_s=5).hold()
        mono[0] += HEARD_EVERY_S  # due to note again
        with pytest.raises(StaleLeader):
            await contact.settle(stale)
        assert await kv.get("/ftrain/contact") == noted

    asyncio.run(scenario())


def test_broken_peer_suspects_are_the_reporters_fellow_members_of_the_current_attempt():
    from service.decide.liveness import broken_peer_suspects

    members = {"a": 1, "b": 1, "c": 1}
    assert broken_peer_suspects(members, "a", 2, 2, False) == ["b", "c"]
    assert broken_peer_suspects(members, "a", 1, 2, False) == []  # a stale attempt's group
    assert broken_peer_suspects(members, "a", 2, 2, True) == []  # a finished job
    assert broken_peer_suspects(members, "z", 2, 2, False) == []  # not a member
