"""The grace lapsed nodes get after the control plane's own absence, and how the scheduler
plans with it (pure logic, fixed `now`)."""

from __future__ import annotations

import pytest

from service.decide.liveness import MIN_MARGIN_S, outage_grace
from service.decide.scheduling import plan
from tests.service.test_scheduler import CFG, NOW, job, nodes

S_RUNNING = "running"


@pytest.mark.parametrize("since_contact_s,ttl,grace_s", [
    (None, 6, 6 + MIN_MARGIN_S),  # just started: it cannot know who heard the nodes
    (0.5, 6, None),  # in touch all along: a lapsed lease is the node's own silence
    (2.9, 6, None),  # shorter than half a lease: no heartbeating node's lease lapsed for it
    (3.1, 6, 6 + MIN_MARGIN_S),
    (600, 6, 6 + MIN_MARGIN_S),  # a 10-minute outage
    (600, 30, 30 + 15),  # a long lease: half of it as margin
])
def test_outage_grace(since_contact_s, ttl, grace_s):
    grace = outage_grace(since_contact_s, ttl)
    assert (None if grace is None else grace.seconds) == grace_s
    if grace is not None:
        assert ("started" if since_contact_s is None else "no contact with etcd") in grace.reason


@pytest.mark.parametrize("mn,round_nodes", [(2, 2), (1, 2)])
def test_a_member_whose_node_is_gone_is_waited_for_during_the_grace(mn, round_nodes):
    j = job("RUNNING", {"a": S_RUNNING, "b": S_RUNNING}, mn=mn, mx=2, round_nodes=round_nodes)
    assert plan(j, nodes("a"), [], NOW, CFG, grace_until=NOW + 1) is None  # neither lost nor restarted
    assert plan(j, nodes(), [], NOW, CFG, grace_until=NOW + 1) is None  # every node gone: same
    after = plan(j, nodes("a"), [], NOW, CFG, grace_until=NOW)  # the grace is over: lost as ever
    assert after is not None and "node b lost" in " ".join(e.reason for e in after.events)
    assert "b" not in after.job.members or not after.job.members["b"].is_live()


def test_during_the_grace_a_free_node_still_joins_and_a_drain_still_drains():
    j = job("RUNNING", {"a": S_RUNNING, "b": S_RUNNING}, mn=1, mx=3)
    p = plan(j, {**nodes("c"), **nodes("a", draining=("a",))}, ["c"], NOW, CFG, grace_until=NOW + 5)
    assert p is not None and p.job.members["b"].is_live()  # b (gone) is not lost yet: carried along
    assert "a" not in p.job.members and "drained" in " ".join(e.reason for e in p.events)


def test_during_the_grace_a_pending_job_still_starts_on_free_nodes():
    p = plan(job(mn=1, mx=1), nodes("c"), ["c"], NOW, CFG, grace_until=NOW + 5)
    assert p.job.state.value == "RUNNING" and list(p.job.members) == ["c"]


def test_a_control_plane_notes_its_start_and_its_gaps_and_opens_a_grace_for_them():
    from service.contact import REPORT_S, Contact

    mono, wall = [100.0], [NOW]
    contact = Contact(node_ttl_s=6, clock=lambda: mono[0], wall_clock=lambda: wall[0])

    def tick(s: float) -> None:
        mono[0] += s
        wall[0] += s

    contact.observe()  # just started
    assert contact.grace_until == NOW + 6 + MIN_MARGIN_S
    assert contact.recent_outage().started == 0 and contact.recent_outage().ended == NOW  # 0: unknown
    contact.reached()
    for _ in range(200):  # in touch every 0.5 s for 100 s: the grace and the report run out
        tick(0.5)
        contact.observe()
        contact.reached()
    assert contact.grace_until == NOW + 6 + MIN_MARGIN_S and contact.recent_outage() is None
    assert REPORT_S < 100
    stopped_at = wall[0]
    tick(90)  # stopped, or etcd out of reach, for 90 s
    contact.observe()
    assert contact.grace_until == wall[0] + 6 + MIN_MARGIN_S
    assert (contact.recent_outage().started, contact.recent_outage().ended) == (stopped_at, wall[0])
    contact.reached()
    tick(2.5)  # a short gap: reported to the rendezvous, too short for a lease to lapse
    grace = contact.grace_until
    contact.observe()
    assert contact.grace_until == grace and contact.recent_outage().ended == wall[0]
