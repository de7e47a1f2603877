"""The restore point of a (re)started group as a table (pure logic: service.decide.restore)."""

from __future__ import annotations

import pytest

from service.decide.restore import choose_restore, decide_memory_corrupt, decide_restore
from service.errors import Conflict, StaleAttempt
from service.models import JobState
from tests.service.records import NOW, make_job
from worker.protocol import MemorySnapshot, SnapshotMeta

TWO = {"n0": "running", "n1": "running"}


def copy(node: str, step: int, attempt: int = 1) -> MemorySnapshot:
    return MemorySnapshot(node=node, step=step, attempt=attempt)


def disk(step: int) -> SnapshotMeta:
    return SnapshotMeta(step=step, path=f"/s/{step}", size=1, checksum="c")


@pytest.mark.parametrize("members, copies, latest, want", [
    # the newest copy a member reported under this attempt, with every node that holds it
    (TWO, [copy("n0", 57), copy("n1", 56)], disk(50), ("memory", 57, ["n0"])),
    (TWO, [copy("n0", 57), copy("n1", 57)], None, ("memory", 57, ["n0", "n1"])),
    # equal to the disk's latest: memory (faster), never older than disk
    (TWO, [copy("n0", 50)], disk(50), ("memory", 50, ["n0"])),
    (TWO, [copy("n0", 49)], disk(50), ("disk", 50, [])),
    # a report of an earlier attempt may have been overwritten since: not counted
    (TWO, [copy("n0", 90, attempt=0), copy("n1", 57)], disk(50), ("memory", 57, ["n1"])),
    # a node that is not a member (lost, left) is not a survivor
    ({"n0": "running"}, [copy("n1", 90), copy("n0", 57)], None, ("memory", 57, ["n0"])),
    ({"n0": "running"}, [copy("n1", 90)], disk(50), ("disk", 50, [])),
    (TWO, [], None, ("none", None, [])),
])
def test_choose_restore(members, copies, latest, want):
    point = choose_restore(make_job(members=members, latest_snapshot=latest), copies, attempt=1)
    assert (point.tier, point.step, point.nodes) == want, point.reason


def test_each_ask_decides_from_the_reports_of_now_records_it_and_says_so():
    job = make_job(members=TWO)
    point, change = decide_restore(job, [copy("n0", 57)], 1, NOW)
    assert change.job.restore == point
    assert [e.reason for e in change.events] == [point.reason] and "step 57" in point.reason
    # a scale-up restarts the group within the attempt: the members hold newer copies by then
    again, _ = decide_restore(change.job, [copy("n0", 70), copy("n1", 3, attempt=0)], 1, NOW)
    assert (again.tier, again.step, again.nodes) == ("memory", 70, ["n0"])


def test_a_stale_attempt_or_a_finished_job_gets_no_restore_point():
    with pytest.raises(StaleAttempt):
        decide_restore(make_job(members=TWO, attempt=2), [], 1, NOW)
    with pytest.raises(Conflict):
        decide_restore(make_job(JobState.SUCCEEDED, members=TWO), [], 1, NOW)


def test_a_corrupt_memory_copy_is_an_event_that_says_so():
    change = decide_memory_corrupt(make_job(members=TWO), "n1", 57, "sha mismatch", 1, NOW)
    (event,) = change.events
    assert "memory copy at step 57 on node n1 is corrupt" in event.reason
    assert change.job.event_seq == 6
    with pytest.raises(StaleAttempt):
        decide_memory_corrupt(make_job(members=TWO, attempt=2), "n1", 57, "x", 1, NOW)
