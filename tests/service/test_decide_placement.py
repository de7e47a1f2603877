"""Placement by GPUs: `placement.fits` as a table, and `plan` taking only nodes that fit (pure)."""

from __future__ import annotations

import pytest

from service.decide.placement import fits, unfit_reason
from service.decide.scheduling import SchedulerConfig, plan
from service.models import JobRecord, JobSpec, JobState, MemberStatus, NodeRecord

S = JobState
NOW = 1000.0


def spec(gpus_per_node=None, mn=1, mx=2) -> JobSpec:
    return JobSpec(name="j", command=["true"], nodes={"min": mn, "max": mx}, gpus_per_node=gpus_per_node)


def node(name: str, gpus: int) -> NodeRecord:
    return NodeRecord(name=name, registered_at=1.0, lease_id=1, gpus=gpus,
                      gpu_model="Fake GPU" if gpus else None)


@pytest.mark.parametrize("asked, has, ok", [
    (None, 0, True),   # asks for none: anywhere, a CPU node too
    (None, 8, True),
    (1, 0, False),     # a CPU node never takes a GPU job
    (1, 1, True),
    (2, 1, False),
    (2, 2, True),
    (2, 4, True),      # more than asked is fine
])
def test_fits(asked, has, ok):
    assert fits(spec(asked), node("a", has)) is ok
    assert (unfit_reason(spec(asked), node("a", has)) is None) is ok


def test_unfit_reason_names_the_node_and_both_counts():
    assert unfit_reason(spec(2), node("a", 1)) == "node a has 1 GPU(s), the job needs 2"


def job(state=S.PENDING, members=(), **spec_kw) -> JobRecord:
    return JobRecord(id="j1", spec=spec(**spec_kw), state=state, created_at=1.0, updated_at=1.0,
                     members={n: MemberStatus(state="running") for n in members},
                     attempt=1 if members else 0)


def test_pending_gpu_job_starts_only_on_nodes_with_the_gpus():
    ns = {"cpu": node("cpu", 0), "one": node("one", 1), "two": node("two", 2)}
    p = plan(job(gpus_per_node=1, mn=2, mx=3), ns, ["cpu", "one", "two"], NOW, SchedulerConfig())
    assert p.job.state is S.STARTING and sorted(p.job.members) == ["one", "two"]


def test_pending_gpu_job_waits_while_too_few_nodes_have_them():
    ns = {"cpu": node("cpu", 0), "one": node("one", 1), "two": node("two", 2)}
    assert plan(job(gpus_per_node=2, mn=2), ns, ["cpu", "one", "two"], NOW, SchedulerConfig()) is None


def test_a_job_without_gpus_per_node_takes_any_node():
    ns = {"cpu": node("cpu", 0), "two": node("two", 2)}
    p = plan(job(mn=2), ns, ["cpu", "two"], NOW, SchedulerConfig())
    assert sorted(p.job.members) == ["cpu", "two"]


def test_scale_up_takes_only_a_node_that_fits():
    ns = {"a": node("a", 2), "cpu": node("cpu", 0), "b": node("b", 2)}
    j = job(S.RUNNING, members=["a"], gpus_per_node=2, mn=1, mx=3).model_copy(update={"round_nodes": 1})
    p = plan(j, ns, ["cpu", "b"], NOW, SchedulerConfig())
    assert p is not None and "cpu" not in p.job.members and "b" in p.job.members
