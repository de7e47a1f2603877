"""A node whose group has exited and whose end report has not landed registers (after its
lease lapsed in an outage) as still running that attempt: the control plane keeps it a member
until the report lands, instead of taking it for a restarted agent."""

from __future__ import annotations

from service.decide.members import decide_registered, decide_report
from service.models import JobState
from tests.service.records import NOW, make_job
from worker.node_link import NodeLink


def test_a_queued_end_report_is_named_at_registration_and_keeps_the_member(tmp_path):
    link = NodeLink("http://127.0.0.1:9", "bootstrap", "a")
    try:
        link.report("j-abc123", 1, "running")
        assert link.ending() is None  # a start is not an end: the group itself says what runs
        link.report("j-abc123", 1, "succeeded", 0)
        running = link.ending()
        assert running == ("j-abc123", 1)
    finally:
        link.close()
    job = make_job(JobState.RUNNING, {"a": "running", "b": "succeeded"})
    assert decide_registered(job, "a", 1, NOW, running) is None  # kept; then its report lands:
    ended = decide_report(job, "a", 1, "succeeded", 0, None, NOW).job
    assert ended.members["a"].state == "succeeded"
    # Before, it registered as running nothing: taken for a restarted agent after b finished,
    # which fails the job.
    assert decide_registered(job, "a", 1, NOW, None).job.members["a"].state == "failed"
