"""Preemption and backfill through the scheduler's passes on the in-memory store: the victim's
mark is written with the pass's other plans, or, where its record changed after the pass read
it, made again on the stored record (`scheduler._schedule`), as is a scale-up, with the limits
the pass put on it; the node a victim gives up goes to the job of higher priority in the pass
after it let it go; a preemption whose job no longer waits is withdrawn."""

from __future__ import annotations

import asyncio

from service import scheduler
from service.decide.cancel import decide_cancel
from service.decide.change import Change
from service.decide.scheduling import SchedulerConfig
from service.models import JobRecord, JobSpec, JobState, MemberStatus
from tests.service.test_stores import context, following


def spec(name: str, priority: int, mn: int, mx: int) -> JobSpec:
    return JobSpec(name=name, command=["true"], nodes={"min": mn, "max": mx}, priority=priority)


async def running_on_two_nodes(ctx) -> JobRecord:
    """A plain script of priority 0 (`min` 1, `max` 2), started by a pass on nodes n0 and n1."""
    low, _ = await ctx.jobs.create(spec("low", 0, 1, 2))
    for name in ("n0", "n1"):
        await ctx.nodes.register(name, 1, None, ttl_s=60)
    await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
    return low


def test_a_victim_marked_on_a_record_that_changed_meanwhile_is_marked_again_on_the_stored_one():
    async def main():
        ctx = context()
        async with following(ctx):
            low = await running_on_two_nodes(ctx)
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


def test_a_scale_up_made_again_on_a_changed_record_keeps_off_the_nodes_backfill_holds_for_the_head():
    # The head needs 3 GPU nodes: a and b are free, c is held by a job of its own priority that
    # may end at any moment. A running job of that priority (no bound) may grow onto "cpu" only:
    # growing onto a or b could delay the head. Its record changes after the pass read it, so its
    # plan is made again on the stored one: with the same limit.
    async def main():
        ctx = context()
        async with following(ctx):
            for name, gpus in (("a", 1), ("b", 1), ("c", 1), ("cpu", 0), ("d", 0)):
                await ctx.nodes.register(name, 1, None, ttl_s=60, gpus=gpus)

            async def running_on(name: str, node: str, mx: int):
                job, _ = await ctx.jobs.create(spec(name, 0, 1, mx))
                return await ctx.jobs.update(job.id, lambda j: Change(j.model_copy(update={
                    "state": JobState.RUNNING, "attempt": 1, "started_at": 1.0,
                    "members": {node: MemberStatus(state="running")}})))

            holder, grower = await running_on("holder", "c", 1), await running_on("grower", "d", 3)
            head, _ = await ctx.jobs.create(JobSpec(name="head", command=["true"], nodes={"min": 3, "max": 3},
                                                    gpus_per_node=1))
            # a report lands after the pass read the grower: its write loses its race
            await ctx.jobs.update(grower.id, lambda j: Change(
                j.model_copy(update={"members": {"d": MemberStatus(state="running", nproc=1)}})))
            await scheduler._schedule(ctx.jobs, await ctx.nodes.live(), [head], {holder.id: holder,
                                      grower.id: grower}, SchedulerConfig(), {}, frozenset())
            grown = await ctx.jobs.get(grower.id)
            assert sorted(grown.members) == ["cpu", "d"]
            assert (await ctx.jobs.get(head.id)).state is JobState.PENDING

    asyncio.run(main())


def test_a_victim_whose_preemptor_is_cancelled_meanwhile_starts_again_on_all_its_nodes():
    async def main():
        ctx = context()
        async with following(ctx):
            low = await running_on_two_nodes(ctx)
            high, _ = await ctx.jobs.create(spec("high", 10, 1, 1))
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            marked = await ctx.jobs.get(low.id)
            assert marked.preempt is not None and marked.stopping  # a plain script: SIGTERM, its grace
            await ctx.jobs.update(high.id, lambda j: decide_cancel(j, ctx.jobs.clock()))
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            withdrawn = await ctx.jobs.get(low.id)
            assert withdrawn.preempt is not None and withdrawn.preempt.leave == []
            await ctx.jobs.update(low.id, lambda j: Change(
                j.model_copy(update={"members": {n: MemberStatus(state="stopped") for n in j.members}})))
            await scheduler.tick(ctx.jobs, ctx.nodes, ctx.index, SchedulerConfig(), {})
            again = await ctx.jobs.get(low.id)
            assert (again.preempt, again.stopping, sorted(again.members)) == (None, False, ["n0", "n1"])
            reasons = [e.reason for e in await ctx.jobs.events(low.id)]
            assert f"job {high.id} (priority 10) no longer waits for them: its workers, already told to " \
                   "stop, start again on all its nodes" in reasons

    asyncio.run(main())
