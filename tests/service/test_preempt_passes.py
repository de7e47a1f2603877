"""Preemption through the scheduler's passes on the in-memory store: the victim's mark is
written with the pass's other plans, or, where its record changed after the pass read it,
made again on the stored record (`scheduler._schedule`); the node it gives up goes to the job
of higher priority in the pass after it let it go."""

from __future__ import annotations

import asyncio

from service import scheduler
from service.decide.change import Change
from service.decide.scheduling import SchedulerConfig
from service.models import JobSpec, JobState, MemberStatus
from tests.service.test_stores import context, following


def spec(name: str, priority: int, mn: int, mx: int) -> JobSpec:
    return JobSpec(name=name, command=["true"], nodes={"min": mn, "max": mx}, priority=priority)


def test_a_victim_marked_on_a_record_that_changed_meanwhile_is_marked_again_on_the_stored_one():
    async def main():
        ctx = context()
        async with following(ctx):
            low, _ = await ctx.jobs.create(spec("low", 0, 1, 2))
            for name in ("n0", "n1"):
                await ctx.nodes.register(name, 1, None, ttl_s=60)
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            read = await ctx.jobs.get(low.id)
            assert sorted(read.members) == ["n0", "n1"]
            high, _ = await ctx.jobs.create(spec("high", 10, 1, 1))
            # a node's report lands after the pass read the job: the pass's write loses its race
            await ctx.jobs.update(low.id, lambda j: Change(
                j.model_copy(update={"members": {**j.members, "n0": MemberStatus(state="running")}})))
            await scheduler._schedule(ctx.jobs, await ctx.nodes.live(), [high], {low.id: read},
                                      SchedulerConfig(), {}, frozenset())  # (no revisions: each re-decided)
            marked = await ctx.jobs.get(low.id)
            assert marked.preempt is not None and marked.preempt.by == high.id and marked.stopping
            assert marked.members["n0"].state == "running"  # the report kept
            reasons = [e.reason for e in await ctx.jobs.events(low.id)]
            assert f"preempted by job {high.id} (priority 10): giving up node(s) n0" in reasons
            # its workers stop (a plain script: SIGTERM and its grace); then n0 goes to "high"
            await ctx.jobs.update(low.id, lambda j: Change(
                j.model_copy(update={"members": {n: MemberStatus(state="stopped") for n in j.members}})))
            for _ in range(2):
                await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            shrunk, started = await ctx.jobs.get(low.id), await ctx.jobs.get(high.id)
            assert (sorted(shrunk.members), shrunk.restarts_by_cause.preemption) == (["n1"], 1)
            assert (started.state, sorted(started.members)) == (JobState.STARTING, ["n0"])

    asyncio.run(main())
