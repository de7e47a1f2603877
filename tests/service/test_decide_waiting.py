"""Why a PENDING job waits (`decide.waiting.why_waiting`), as a table (pure)."""

from __future__ import annotations

import pytest

from service.decide.waiting import why_waiting
from service.models import JobSpec, JobState, NodeRecord, NodeState
from tests.service.records import make_job

S = JobState


def node(name: str, gpus: int = 0, state: NodeState = NodeState.READY) -> NodeRecord:
    return NodeRecord(name=name, registered_at=1.0, lease_id=1, gpus=gpus, state=state)


def pending(mn: int, mx: int, gpus: int | None = None):
    job = make_job(S.PENDING, mn=mn, mx=mx)
    spec = JobSpec(**{**job.spec.model_dump(), "gpus_per_node": gpus})
    return job.model_copy(update={"spec": spec})


def test_a_job_not_pending_waits_for_nothing():
    assert why_waiting(make_job(S.RUNNING, {"a": "running"}), {"a": node("a")}, {}) is None


@pytest.mark.parametrize("job, nodes, holders, says", [
    # more nodes asked than the cluster has
    (pending(3, 3), ["a", "b"], {}, "needs 3 node(s); the cluster has 2 registered: it starts when 1 more join"),
    # no node at all
    (pending(1, 2), [], {}, "needs 1 node(s); the cluster has 0 registered: it starts when 1 more join"),
    # nodes enough, free enough: it is about to start
    (pending(2, 2), ["a", "b"], {}, "needs 2 node(s); 2 are free: it starts at the scheduler's next pass"),
])
def test_counts_against_the_cluster(job, nodes, holders, says):
    assert why_waiting(job, {n: node(n) for n in nodes}, holders) == says


def test_names_the_jobs_that_hold_the_nodes_it_needs():
    running = make_job(S.RUNNING, {"a": "running", "b": "running"}).model_copy(update={"id": "j-run1"})
    says = why_waiting(pending(2, 2), {"a": node("a"), "b": node("b"), "c": node("c")},
                       {"a": running, "b": running})
    assert says == "needs 2 node(s); 1 of the 3 that fit are free, the others are held by job j-run1 " \
                   "(RUNNING: a, b)"


def test_names_at_most_three_holders_and_counts_the_rest():
    holders = {n: make_job(S.RUNNING, {n: "running"}).model_copy(update={"id": f"j-{n}"}) for n in "abcde"}
    says = why_waiting(pending(1, 1), {n: node(n) for n in "abcde"}, holders)
    assert says.endswith("held by job j-a (RUNNING: a), job j-b (RUNNING: b), job j-c (RUNNING: c) "
                         "and 2 more job(s)")


def test_counts_only_the_nodes_with_the_gpus_it_asks_for():
    nodes = {"cpu": node("cpu"), "g1": node("g1", gpus=1), "g8": node("g8", gpus=8)}
    assert why_waiting(pending(2, 2, gpus=4), nodes, {}) == (
        "needs 2 node(s) with 4 GPU(s) each; 1 of the 3 registered have that many GPUs: "
        "it starts when 1 more such node(s) join")


def test_a_draining_node_is_not_counted_as_free():
    nodes = {"a": node("a"), "b": node("b", state=NodeState.DRAINING)}
    assert why_waiting(pending(2, 2), nodes, {}) == (
        "needs 2 node(s); 1 of the 2 that fit are draining: it starts when enough are undrained or join")


def test_a_node_held_for_the_waiting_job_itself_is_free_to_it():
    # A job list reads the nodes' holders once for every waiting job on its page; a node kept
    # for one of them (its memory copy) is held from the others but free to that job.
    from service.decide.lineup import HeldFrom

    job = pending(2, 2).model_copy(update={"id": "kept-for"})
    other = make_job(S.PENDING, mn=1, mx=1).model_copy(update={"id": "other"})
    holders = {"a": job, "b": other}
    nodes = {n: node(n) for n in ("a", "b", "c")}
    assert dict(HeldFrom(holders, job.id)) == {"b": other}
    assert why_waiting(job, nodes, HeldFrom(holders, job.id)) == \
        "needs 2 node(s); 2 are free: it starts at the scheduler's next pass"
    assert why_waiting(other, nodes, HeldFrom(holders, other.id)).startswith(
        "needs 1 node(s); 2 are free")
