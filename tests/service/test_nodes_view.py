"""GET /v1/nodes: which job holds each node, a node that finished its part included."""

from __future__ import annotations

import asyncio
import shutil
import tempfile

from service.context import Context
from service.models import JobSpec, JobState, MemberStatus, NodesSpec
from service.routes.nodes import list_nodes
from service.settings import Settings
from service.store.memory import MemoryStore
from tests.helpers.tasks import cancel_and_wait


def test_a_node_that_finished_its_part_still_shows_the_job_that_holds_it():
    async def main():
        log_root = tempfile.mkdtemp(prefix="ftrain-test-logs-")
        ctx = Context.wire(Settings(log_root=log_root), MemoryStore())
        index = asyncio.create_task(ctx.index.run())
        try:
            await asyncio.wait_for(ctx.index.ready.wait(), 5)
            for name in ("n0", "n1", "n2"):
                await ctx.nodes.register(name, 1, None, 30)
            job, _ = await ctx.jobs.create(JobSpec(name="j", command=["true"], nodes=NodesSpec(min=2, max=2)))
            # n0's workers exited 0 first; n1's still run: the job is RUNNING and holds both.
            running = job.model_copy(update={"state": JobState.RUNNING, "members": {
                "n0": MemberStatus(state="succeeded", exit_code=0), "n1": MemberStatus(state="running")}})
            await ctx.kv.put(ctx.keys.job(job.id), running.model_dump_json().encode())
            assert await ctx.index.wait_until(
                lambda: (j := ctx.index.get(job.id)) is not None and j.state is JobState.RUNNING, 5)
            views = {n.name: n for n in (await list_nodes(ctx)).items}
        finally:
            await cancel_and_wait(index)
            shutil.rmtree(log_root, ignore_errors=True)
        assert (views["n0"].job, views["n0"].member_state) == (job.id, "succeeded")
        assert (views["n1"].job, views["n1"].member_state) == (job.id, "running")
        assert (views["n2"].job, views["n2"].member_state) == (None, None)

    asyncio.run(main())
