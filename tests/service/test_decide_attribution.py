"""Bad-node attribution (service/decide/attribution.py), a table of cases at a fixed `now`."""

from __future__ import annotations

import pytest

from service.decide.attribution import WINDOW_S, Failure, blame, failed_alone

NOW = 10_000.0


def f(job: str, ago_s: float, alone: bool = True, node: str = "n1") -> Failure:
    return Failure(node=node, job=job, at=NOW - ago_s, alone=alone)


@pytest.mark.parametrize(("failures", "blamed"), [
    ([], False),
    ([f("a", 10)], False),  # one job's word alone: never
    ([f("a", 10), f("a", 20)], False),  # the same job twice: still one job
    ([f("a", 10), f("b", 20)], True),  # two jobs, each ran on elsewhere
    ([f("a", 10), f("b", 20, alone=False)], False),  # b's other members failed too: not the node's
    ([f("a", 10), f("b", WINDOW_S + 1)], False),  # more than an hour apart from now
    ([f("a", 10), f("b", 20, node="n2")], False),  # another node's failure
])
def test_a_node_is_blamed_only_for_failures_alone_in_two_jobs_within_the_window(failures, blamed):
    why = blame(failures, "n1", NOW)
    assert (why is not None) is blamed
    if blamed:
        assert "2 different jobs (a, b)" in why and "other members did not" in why


@pytest.mark.parametrize(("members", "alone"), [
    ({"n1": "failed"}, False),  # no other member: the job ran nowhere else
    ({"n1": "failed", "n0": "running"}, True),
    ({"n1": "failed", "n0": "succeeded"}, True),
    ({"n1": "failed", "n0": "failed"}, False),  # the others failed with it: the job, not the node
])
def test_a_failure_is_the_nodes_own_only_when_the_job_runs_on_elsewhere(members, alone):
    assert failed_alone(members, "n1") is alone
