"""Bad-node attribution (`service.decide.attribution`): pure logic, a fixed clock."""

from __future__ import annotations

import pytest

from service.decide import attribution
from service.decide.attribution import Ledger, lone_failures
from service.models import MemberStatus
from tests.service.records import NOW, make_job


def job(job_id: str, members: dict[str, str], attempt: int = 1):
    j = make_job(members=members, attempt=attempt)
    failed = {n: m.model_copy(update={"exit_code": 1, "reason": f"worker on {n} exited 1\nTraceback"})
              for n, m in j.members.items() if m.state == "failed"}
    return j.model_copy(update={"id": job_id, "members": {**j.members, **failed}})


@pytest.mark.parametrize("members, lone", [
    ({"a": "failed", "b": "running"}, ["a"]),
    ({"a": "failed", "b": "stopped", "c": "running"}, ["a"]),
    ({"a": "failed", "b": "failed"}, []),  # every member failed: the job's fault, or nobody's
    ({"a": "failed"}, []),  # one node: says nothing about it
    ({"a": "running", "b": "running"}, []),
])
def test_lone_failures_are_those_of_a_member_whose_peers_did_not_fail(members, lone):
    assert [n for n, _ in lone_failures(job("j1", members))] == lone


def test_lone_failures_keep_the_reasons_first_line():
    assert lone_failures(job("j1", {"a": "failed", "b": "running"})) == [("a", "worker on a exited 1")]


def test_a_node_failing_alone_in_two_different_jobs_within_the_window_is_blamed():
    ledger = Ledger()
    assert ledger.note([job("j1", {"a": "failed", "b": "running"})], NOW) == []
    blamed = ledger.note([job("j2", {"a": "failed", "c": "running"})], NOW + 600)
    assert [(b.node, b.job_id) for b in blamed] == [("a", "j2")]
    assert "2 different jobs within 60 min" in blamed[0].reason
    assert "job j1: worker on a exited 1" in blamed[0].reason and "job j2" in blamed[0].reason


def test_the_same_failure_seen_by_many_passes_counts_once_and_a_blame_is_made_once():
    ledger = Ledger()
    first = job("j1", {"a": "failed", "b": "running"})
    for t in range(5):
        assert ledger.note([first], NOW + t) == []
    assert len(ledger.by_node["a"]) == 1
    assert len(ledger.note([job("j2", {"a": "failed", "b": "running"})], NOW + 10)) == 1
    assert ledger.note([job("j3", {"a": "failed", "b": "running"})], NOW + 20) == []  # blamed already


def test_two_attempts_of_one_job_are_not_two_jobs():
    ledger = Ledger()
    ledger.note([job("j1", {"a": "failed", "b": "running"}, attempt=1)], NOW)
    assert ledger.note([job("j1", {"a": "failed", "b": "running"}, attempt=2)], NOW + 5) == []
    assert len(ledger.by_node["a"]) == 2


def test_failures_further_apart_than_the_window_blame_nobody():
    ledger = Ledger(window_s=3600)
    ledger.note([job("j1", {"a": "failed", "b": "running"})], NOW)
    assert ledger.note([job("j2", {"a": "failed", "b": "running"})], NOW + 3601) == []
    assert [f.job_id for f in ledger.by_node["a"]] == ["j2"]  # the old one is gone


def test_failures_where_every_member_failed_blame_nobody():
    ledger = Ledger()
    ledger.note([job("j1", {"a": "failed", "b": "failed"})], NOW)
    assert ledger.note([job("j2", {"a": "failed", "b": "failed"})], NOW + 1) == []
    assert ledger.by_node == {}


def test_a_forgotten_node_starts_afresh():
    ledger = Ledger()
    ledger.note([job("j1", {"a": "failed", "b": "running"})], NOW)
    assert ledger.note([job("j2", {"a": "failed", "b": "running"})], NOW + 1)
    ledger.forget("a")
    assert ledger.note([job("j3", {"a": "failed", "b": "running"})], NOW + 2) == []
    assert ledger.note([job("j4", {"a": "failed", "b": "running"})], NOW + 3)[0].node == "a"


def test_a_window_of_zero_turns_attribution_off():
    ledger = Ledger(window_s=0)
    ledger.note([job("j1", {"a": "failed", "b": "running"})], NOW)
    assert ledger.note([job("j2", {"a": "failed", "b": "running"})], NOW + 1) == []


def test_the_ledger_stays_bounded(monkeypatch):
    monkeypatch.setattr(attribution, "MAX_NODES", 3)
    monkeypatch.setattr(attribution, "MAX_PER_NODE", 2)
    ledger = Ledger()
    for i in range(10):
        ledger.note([job(f"j{i}", {f"n{i}": "failed", "ok": "running"})], NOW + i)
    assert sorted(ledger.by_node) == ["n7", "n8", "n9"]  # the latest three
    for i in range(5):
        ledger.note([job("k", {"n9": "failed", "ok": "running"}, attempt=i + 2)], NOW + 20 + i)
    assert len(ledger.by_node["n9"]) == 2


def test_a_member_status_without_an_exit_code_is_named_by_its_reason():
    j = make_job(members={"a": "running", "b": "running"})
    j = j.model_copy(update={"members": {**j.members, "a": MemberStatus(state="failed", reason="lost")}})
    assert lone_failures(j) == [("a", "lost")]
