"""A new node view keeps the settled jobs that none of its changes touch (`Settled.advance`):
a pass after a node joins or goes re-plans the jobs on that node, not every running job, and
plans as a pass that re-plans every job does."""

from __future__ import annotations

import asyncio

from service.context import Context
from service.decide.scheduling import Settled, schedule_queue
from service.models import JobState, NodeState
from service.settings import Settings
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait, until
from tests.service.test_scheduler import CFG, NOW, job, node, nodes

S = JobState


def plans_of(plans) -> list[tuple[str, str, list[str]]]:
    return [(p.job.id, p.job.state.value, sorted(p.job.members)) for p in plans]


def test_a_settled_job_stays_known_while_only_other_nodes_change():
    settled = Settled()
    on_a = job(S.RUNNING, {"a": "running"}, mn=1, mx=1, jid="on-a")
    on_b = job(S.RUNNING, {"b": "running"}, mn=1, mx=1, jid="on-b")
    settled.advance(1, None)
    assert schedule_queue([], [on_a, on_b], nodes("a", "b"), NOW, CFG, settled=settled) == []
    settled.advance(2, {"c"})  # c joined
    assert settled.unknown([on_a, on_b], frozenset()) == []
    settled.advance(3, {"a"})  # a drained
    assert settled.unknown([on_a, on_b], frozenset()) == [on_a]
    settled.advance(4, None)  # not known what changed (the view loaded again)
    assert settled.unknown([on_a, on_b], frozenset()) == [on_a, on_b]


def test_a_job_that_replaces_stragglers_is_planned_again_at_any_node_change():
    settled = Settled()
    swapper = job(S.RUNNING, {"a": "running"}, mn=1, mx=1, jid="swapper")
    swapper = swapper.model_copy(update={"spec": swapper.spec.model_copy(update={"straggler_action": "replace"})})
    settled.advance(1, None)
    assert schedule_queue([], [swapper], nodes("a"), NOW, CFG, settled=settled) == []
    assert settled.unknown([swapper], frozenset()) == []
    settled.advance(2, {"c"})  # c may take a straggler's place
    assert settled.unknown([swapper], frozenset()) == [swapper]


def test_passes_over_changing_views_plan_as_passes_that_replan_every_job():
    full = job(S.RUNNING, {"a": "running"}, mn=1, mx=1, jid="full")
    grows = job(S.RUNNING, {"b": "running"}, mn=1, mx=2, jid="grows", created=2.0)
    ending = job(S.RUNNING, {"d": "running"}, mn=1, mx=1, jid="ending", created=3.0)
    views = [  # (the node view, the names that changed since the one before)
        (nodes("a", "b", "d"), None),
        (nodes("a", "b", "d", "e") | {"e": node("e", NodeState.DRAINING)}, {"e"}),  # joins, takes no work
        (nodes("a", "b", "d"), {"e"}),  # e went
        ({**nodes("b", "d"), "a": node("a", NodeState.DRAINING)}, {"a"}),  # full's node drains
        (nodes("b"), {"a", "d"}),  # a and d went
        (nodes("b", "c"), {"c"}),  # c joins: grows may take it
    ]
    settled, jobs = Settled(), [full, grows, ending]
    for version, (view, changed) in enumerate(views, 1):
        settled.advance(version, changed)
        kept = schedule_queue([], jobs, view, NOW, CFG, settled=settled)
        assert plans_of(kept) == plans_of(schedule_queue([], jobs, view, NOW, CFG)), version
        planned = {p.job.id: p.job for p in kept}
        jobs = [planned.get(j.id, j) for j in jobs if planned.get(j.id, j).state is not S.PENDING]
    assert [(j.id, sorted(j.members)) for j in jobs] == [("grows", ["b", "c"])]


def test_the_node_view_names_the_nodes_that_changed_between_two_versions():
    async def main():
        ctx = Context.wire(Settings(), MemoryStore())
        wake = asyncio.Event()
        follow = asyncio.create_task(ctx.nodes.follow(wake))
        try:
            await until(lambda: ctx.nodes.view_changes >= 1, "the node view loaded")
            for name in ("a", "b", "c"):
                await ctx.nodes.register(name, 1, None, 30)
            await until(lambda: ctx.nodes.view_changes >= 4, "three registrations in the view")
            await ctx.nodes.live()
            first = ctx.nodes.version
            assert ctx.nodes.changed_since(first) == set()
            await ctx.nodes.drain("b")
            await ctx.nodes.register("d", 1, None, 30)
            await until(lambda: ctx.nodes.view_changes > first + 1, "the drain and the registration in the view")
            await ctx.nodes.live()
            assert ctx.nodes.changed_since(first) == {"b", "d"}
            assert ctx.nodes.changed_since(None) is None
            assert ctx.nodes.changed_since(0) is None  # before the view was loaded
        finally:
            await cancel_and_wait(follow)
    asyncio.run(main())
