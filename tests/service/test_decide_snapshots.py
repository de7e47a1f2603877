"""Snapshot commits, corrupt reports, progress and control as tables (pure logic)."""

from __future__ import annotations

import pytest

from service.decide.snapshots import (
    control_for,
    decide_commit,
    decide_corrupt,
    decide_progress,
    newest_good,
    snapshot_path_error,
)
from service.errors import Conflict, InvalidField, SnapshotNotFound, StaleAttempt
from service.models import Control, JobState
from service.store.api import Delete, Put
from tests.service.records import NOW, make_job
from worker.protocol import (
    CommitRequest,
    ControlAction,
    ControlView,
    Progress,
    ProgressReport,
    SnapshotMeta,
    SnapshotRecord,
)

S = JobState
DIR = f"/snapshots/{make_job().id}"  # the job's snapshot directory (a node's, without a shared root)


def key(step: int) -> str:
    return f"/snap/{step}"


def rec(step: int, bad: bool = False) -> SnapshotRecord:
    return SnapshotRecord(step=step, path=f"{DIR}/{step}", size=1, checksum="c", attempt=1, bad=bad)


def records(*steps: int, bad: tuple[int, ...] = ()) -> dict[int, SnapshotRecord]:
    return {s: rec(s, s in bad) for s in steps}


def meta(step: int) -> SnapshotMeta:
    return rec(step).meta()


def commit(step: int, attempt: int = 1, control_id: int | None = None) -> CommitRequest:
    return CommitRequest(step=step, path=f"{DIR}/{step}", size=1, checksum="c", attempt=attempt,
                         control_id=control_id)


# ------------------------------------------------------------------ commit

@pytest.mark.parametrize("stored,latest,step,new_latest,pruned_steps", [
    ((), None, 10, 10, []),
    ((10, 20), 20, 30, 30, []),
    ((10, 20, 30), 30, 40, 40, [10]),  # keep 3
    ((10, 20, 30), 30, 30, 30, []),  # the same step again moves latest to the new record
    ((10, 20, 30), 30, 25, 30, [10]),  # an older step is kept if it is among the newest
])
def test_commit_moves_latest_only_forward_and_prunes_beyond_keep(stored, latest, step, new_latest,
                                                                 pruned_steps):
    job = make_job(latest_snapshot=meta(latest) if latest else None)
    decision = decide_commit(job, records(*stored), commit(step), NOW, key)
    change = decision.change
    assert change.job.latest_snapshot.step == new_latest
    written = SnapshotRecord.model_validate_json(change.ops[0].value)
    assert change.ops[0].key == key(step) and (written.step, written.time) == (step, NOW)
    assert change.ops[1:] == [Delete(key(s)) for s in pruned_steps]
    assert decision.prune == [f"{DIR}/{s}" for s in pruned_steps if s != new_latest]
    assert change.events == []


@pytest.mark.parametrize("stored,step", [((10, 20, 30), 5), ((10, 20, 30, 40), 10)])
def test_an_older_step_committed_beyond_keep_is_pruned_not_stored(stored, step):
    job = make_job(latest_snapshot=meta(max(stored)))
    decision = decide_commit(job, records(*stored), commit(step), NOW, key)
    ops = decision.change.ops
    assert not any(isinstance(op, Put) for op in ops)
    assert len({op.key for op in ops}) == len(ops)  # etcd refuses a key twice in one txn
    assert key(step) in [op.key for op in ops]
    assert f"{DIR}/{step}" in decision.prune
    assert decision.committed.step == step
    assert decision.change.job.latest_snapshot.step == max(stored)


def test_commit_never_lists_the_latest_path_to_delete():
    job = make_job(keep=1, latest_snapshot=meta(30))
    stored = records(30)
    stored[20] = SnapshotRecord(step=20, path=f"{DIR}/40", size=1, checksum="c", attempt=1)
    decision = decide_commit(job, stored, commit(40), NOW, key)
    assert [op.key for op in decision.change.ops if isinstance(op, Delete)] == [key(20), key(30)]
    assert decision.prune == [f"{DIR}/30"]  # step 20's file is now step 40's: kept


@pytest.mark.parametrize("acked,control_id,new_acked,acked_step", [
    (0, None, 0, None), (0, 2, 2, 50), (3, 2, 3, None), (2, 2, 2, 50),
])
def test_commit_acknowledges_a_control_request_only_forward(acked, control_id, new_acked, acked_step):
    job = make_job(control_acked=acked)
    change = decide_commit(job, {}, commit(50, control_id=control_id), NOW, key).change
    assert (change.job.control_acked, change.job.control_acked_step) == (new_acked, acked_step)


@pytest.mark.parametrize("since", [0.0, 0.3, 0.999])
def test_rank0s_final_report_is_stored_within_the_interval(since):
    # the step a run ended at: a finished job shows it, not the one a second before
    final = REPORT.model_copy(update={"step": 9, "final": True})
    d = decide_progress(make_job(reports_progress=True), progress(3, NOW - since), final, NOW, 1.0)
    assert d.write and (d.progress.step, d.progress.time, d.progress.loss) == (9, NOW, REPORT.loss)


@pytest.mark.parametrize("job,attempt,error", [
    (make_job(attempt=2), 1, StaleAttempt),
    (make_job(S.SUCCEEDED), 1, Conflict),
    (make_job(S.CANCELLED), 1, Conflict),
])
def test_commit_is_refused_from_a_stale_attempt_or_to_a_finished_job(job, attempt, error):
    with pytest.raises(error):
        decide_commit(job, {}, commit(10, attempt=attempt), NOW, key)


@pytest.mark.parametrize("path,root,refused", [
    (f"{DIR}/step-000000000010.pt", None, False),  # a node's <data dir>/snapshots/<job id>
    ("/shared/snap/j-abc123/step-000000000010.pt", "/shared/snap", False),
    ("/shared/snap/j-abc123/step-000000000010.pt", "/shared/snap/", False),  # as pathlib joins it
    ("/shared//snap/./j-abc123/step-000000000010.pt", "/shared/snap", False),
    ("/tmp/evil.pt", None, True),
    ("/tmp/evil.pt", "/shared/snap", True),
    ("/tmp/j-abc123/evil.pt", "/shared/snap", True),  # named after the job, not under the root
    ("/shared/snap/j-abc123/../../../tmp/evil.pt", "/shared/snap", True),
    ("/shared/snap/j-abc123/sub/step-000000000010.pt", "/shared/snap", True),
    ("/shared/snap/j-abc123/..", "/shared/snap", True),
    ("/shared/snap/j-other/step-000000000010.pt", "/shared/snap", True),  # another job's
    (f"{DIR}/../j-abc123/evil.pt", None, True),
    ("j-abc123/step-000000000010.pt", None, True),  # relative: to whose working directory?
    ("/j-abc123", None, True),
])
def test_a_commit_names_a_file_directly_in_the_jobs_snapshot_directory(path, root, refused):
    why = snapshot_path_error("j-abc123", path, root)
    assert (why is not None) == refused, why
    if refused:
        assert repr(path) in why and "outside job j-abc123's snapshot directory" in why


def test_a_commit_of_a_file_outside_the_jobs_snapshot_directory_changes_nothing():
    job = make_job(latest_snapshot=meta(10))
    forged = commit(20).model_copy(update={"path": "/tmp/evil.pt"})
    with pytest.raises(InvalidField) as refused:
        decide_commit(job, records(10), forged, NOW, key, "/shared/snap")
    assert refused.value.status_code == 422 and refused.value.field == "path"
    assert "/shared/snap/j-abc123" in refused.value.message


# ------------------------------------------------------------------ corrupt

@pytest.mark.parametrize("stored,bad,latest,step,new_latest,resume", [
    ((10, 20, 30), (), 30, 30, 20, "step 20"),
    ((10, 20, 30), (20,), 30, 30, 10, "step 10"),
    ((10, 20, 30), (), 30, 20, 30, "step 30"),  # not the latest: latest stays
    ((10,), (), 10, 10, None, "the start (no good snapshot left)"),
])
def test_a_corrupt_snapshot_is_marked_bad_and_latest_falls_back(stored, bad, latest, step,
                                                                new_latest, resume):
    job = make_job(latest_snapshot=meta(latest))
    change = decide_corrupt(job, records(*stored, bad=bad), step, "checksum mismatch", NOW, key).change
    assert (change.job.latest_snapshot.step if change.job.latest_snapshot else None) == new_latest
    assert [e.reason for e in change.events] == [
        f"snapshot at step {step} is corrupt; resuming from {resume} (checksum mismatch)"]
    (op,) = change.ops
    assert isinstance(op, Put) and op.key == key(step)
    assert SnapshotRecord.model_validate_json(op.value).bad


def test_a_snapshot_reported_corrupt_twice_changes_nothing_the_second_time():
    assert decide_corrupt(make_job(), records(10, bad=(10,)), 10, "x", NOW, key).change is None


def test_a_corrupt_report_of_an_unknown_step_is_not_found():
    with pytest.raises(SnapshotNotFound):
        decide_corrupt(make_job(), records(10), 20, "x", NOW, key)


def test_newest_good_skips_bad_ones():
    assert newest_good(records(10, 20, 30, bad=(30,))).step == 20
    assert newest_good(records(10, bad=(10,))) is None


# ------------------------------------------------------------------ progress and control

def progress(step: int, at: float) -> Progress:
    return Progress(step=step, loss=0.5, samples_per_s=9.0, time=at)


REPORT = ProgressReport(step=7, loss=0.5, samples_per_s=9.0)


@pytest.mark.parametrize("first,stored,now,written,job_written", [
    # the job's first report: stored, and the job record notes that rank 0 reports
    (True, None, NOW, progress(7, NOW), True),
    # the first report of a job whose progress key exists (written before a restart)
    (True, progress(3, NOW - 0.1), NOW, progress(7, NOW), True),
    # later reports: stored once the interval has passed, the job record left alone
    (False, None, NOW, progress(7, NOW), False),
    (False, progress(3, NOW - 1.0), NOW, progress(7, NOW), False),
    (False, progress(3, NOW - 5.0), NOW, progress(7, NOW), False),
    # a stored time ahead of this replica's clock (skew): not a reason to drop for ever
    (False, progress(3, NOW + 30.0), NOW, progress(7, NOW), False),
])
def test_progress_is_written_with_the_time_it_arrived(first, stored, now, written, job_written):
    d = decide_progress(make_job(reports_progress=not first), stored, REPORT, now, 1.0)
    reported = {"step", "loss", "samples_per_s", "time"}
    assert d.write and d.progress.model_dump(include=reported) == written.model_dump(include=reported)
    assert (d.job is not None) == job_written
    if job_written:
        assert d.job.reports_progress and d.job.model_copy(update={"reports_progress": False}) == \
            make_job(reports_progress=False)


@pytest.mark.parametrize("stored,report,speed,percent,eta", [
    # no earlier report: no speed yet, so no time left; percent from the script's total
    (None, ProgressReport(step=10, total_steps=100), None, 10.0, None),
    # 20 steps in 2 s after a first interval: 10 steps/s, 80 steps left
    (progress(0, NOW - 2).model_copy(update={"total_steps": 100}), ProgressReport(step=20), 10.0, 20.0, 8.0),
    # smoothed: 0.3 of the newest interval (10/s), 0.7 of the speed before (5/s)
    (progress(0, NOW - 2).model_copy(update={"steps_per_s": 5.0}),
     ProgressReport(step=20, total_steps=85), 6.5, 23.53, 10.0),
    # resumed from a snapshot (the step went back): the speed before is kept
    (progress(50, NOW - 1).model_copy(update={"steps_per_s": 4.0}),
     ProgressReport(step=40, total_steps=50), 4.0, 80.0, 2.5),
    # past the script's total (it trains on): 100 %, nothing left
    (progress(0, NOW - 1).model_copy(update={"total_steps": 10}), ProgressReport(step=12), 12.0, 100.0, 0.0),
    # no total said: no percent, no time left
    (progress(0, NOW - 1), ProgressReport(step=3), 3.0, None, None),
])
def test_progress_gives_speed_percent_and_time_left(stored, report, speed, percent, eta):
    p = decide_progress(make_job(reports_progress=True), stored, report, NOW, 1.0).progress
    assert (p.steps_per_s, p.percent, p.eta_s) == (speed, percent, eta)


def test_a_stored_report_adds_its_scalars_to_the_metric_history():
    report = ProgressReport(step=7, loss=0.5, samples_per_s=9.0, metrics={"lr": 0.001})
    d = decide_progress(make_job(reports_progress=True), None, report, NOW, 1.0)
    assert d.progress.metrics == {"lr": 0.001}
    assert d.body is None and d.tail.steps == [7]  # the first point: in the tail alone
    assert d.tail.series == {"loss": [0.5], "samples_per_s": [9.0], "lr": [0.001]}
    dropped = decide_progress(make_job(reports_progress=True), d.progress,
                              report.model_copy(update={"step": 8}), NOW + 0.1, 1.0, None, d.tail)
    assert not dropped.write and (dropped.body, dropped.tail) == (None, None)  # rate-limited: untouched


@pytest.mark.parametrize("since", [0.0, 0.3, 0.999])
def test_a_report_within_the_interval_is_dropped_and_answered_with_what_is_stored(since):
    stored = progress(3, NOW - since)
    d = decide_progress(make_job(reports_progress=True), stored, REPORT, NOW, 1.0)
    assert (d.write, d.progress, d.job) == (False, stored, None)


@pytest.mark.parametrize("job,attempt,error", [
    (make_job(attempt=2), 1, StaleAttempt),
    (make_job(S.FAILED), None, Conflict),
    (make_job(S.SUCCEEDED, reports_progress=True), 2, Conflict),
])
def test_progress_is_refused_from_a_stale_attempt_or_to_a_finished_job(job, attempt, error):
    with pytest.raises(error):
        decide_progress(job, None, ProgressReport(step=1, attempt=attempt), NOW, 1.0)


def pause(control_id: int) -> Control:
    return Control(id=control_id, action=ControlAction.CHECKPOINT_PAUSE, reason="join", requested_at=1)


@pytest.mark.parametrize("control,acked,view", [
    (None, 0, ControlView()),
    (pause(2), 1, ControlView(id=2, action=ControlAction.CHECKPOINT_PAUSE, reason="join")),
    (pause(2), 2, ControlView()),  # acknowledged by a commit
    (Control(id=3, action=ControlAction.NONE, reason="", requested_at=1), 0, ControlView()),
])
def test_control_for_shows_a_request_until_it_is_acknowledged(control, acked, view):
    assert control_for(make_job(control=control, control_acked=acked)) == view
