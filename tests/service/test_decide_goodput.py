"""The goodput ledger as tables (`decide.goodput`): a job's wall time split by cause, from its
events, with a fixed `now`. Every ledger here adds up to the wall time and has no negative
part (`check`); each case says what the events were and where the time must go."""

from __future__ import annotations

import pytest

from service.decide.goodput import CAUSES, causes, ledger
from service.decide.snapshots import decide_commit, decide_progress
from service.models import EventView, JobState, Replay
from tests.service.records import make_job
from worker.protocol import CommitRequest, Progress, ProgressReport, RestorePoint

S = JobState
T0 = 100.0  # the job's submission


def ev(seq: int, t: float, state: JobState, reason: str, replay: Replay | None = None) -> EventView:
    return EventView(seq=seq, time=T0 + t, state=state, reason=reason, replay=replay)


def job_at(state=S.RUNNING, finished: float | None = None, **kw):
    job = make_job(state, finished_at=None if finished is None else T0 + finished, **kw)
    return job.model_copy(update={"created_at": T0})


def check(job, events, now) -> dict[str, float]:
    """The ledger's seconds, after checking what holds for every ledger."""
    g = ledger(job, events, now)
    assert set(g.seconds) == set(CAUSES)
    assert all(s >= 0 for s in g.seconds.values()), g.seconds
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s, abs=1e-6)
    return {c: round(s, 6) for c, s in g.seconds.items() if s}


START = [ev(1, 0, S.PENDING, "submitted"), ev(2, 5, S.STARTING, "given nodes a, b"),
         ev(3, 8, S.RUNNING, "training: world size 2 on 2 node(s), step 1")]


def test_a_finished_job_is_waiting_starting_then_training_to_its_end():
    events = START + [ev(4, 50, S.SUCCEEDED, "every node finished")]
    assert check(job_at(S.SUCCEEDED, finished=50), events, now=T0 + 999) == \
        {"waiting": 5, "starting": 3, "training": 42}


def test_a_running_job_counts_its_wall_time_up_to_now():
    assert check(job_at(), START, now=T0 + 20) == {"waiting": 5, "starting": 3, "training": 12}
    assert ledger(job_at(), START, now=T0 + 20).wall_s == 20


def test_a_pending_job_is_all_waiting_and_a_fresh_one_has_no_wall_time():
    assert check(job_at(S.PENDING), START[:1], now=T0 + 7) == {"waiting": 7}
    g = ledger(job_at(S.PENDING), START[:1], now=T0)
    assert g.wall_s == 0 and g.share("training") == 0


def test_a_worker_fault_counts_detection_restart_and_replayed_steps():
    # Last report at t=19 (step 90, 0.1 s a step); a worker dies, the fault is seen at t=20; the
    # new group resumes from the snapshot at step 80 and makes its first step at t=23: steps
    # 81..90 are redone, 10 x 0.1 s = 1 s of the training after t=23.
    replay = Replay(from_step=80, reached_step=90, reached_at=T0 + 19, step_s=0.1)
    events = START + [ev(4, 20, S.RECOVERING, "node b is restarting its workers"),
                      ev(5, 21, S.RECOVERING, "attempt 1 resumes from the disk snapshot at step 80"),
                      ev(6, 23, S.RUNNING, "training again: world size 2 on 2 node(s), step 81", replay)]
    assert check(job_at(), events, now=T0 + 30) == \
        {"waiting": 5, "starting": 3, "training": 11 + 6, "recovering": 1 + 3, "replayed": 1}


def test_a_lost_node_below_min_waits_for_nodes_then_replays():
    replay = Replay(from_step=40, reached_step=60, reached_at=T0 + 15, step_s=0.5)
    events = START + [ev(4, 16, S.RECOVERING, "node(s) b lost: restarting the 1 remaining node(s)"),
                      ev(5, 18, S.PENDING, "below min nodes: waiting for 1 more"),
                      ev(6, 30, S.STARTING, "given nodes a, c"),
                      ev(7, 34, S.RUNNING, "training: world size 2 on 2 node(s), step 41", replay)]
    assert check(job_at(), events, now=T0 + 60) == \
        {"waiting": 5 + 12, "starting": 3 + 4, "training": 7 + 16, "recovering": 1 + 2, "replayed": 10}


def test_a_hang_is_hung_from_the_last_report_to_its_detection():
    replay = Replay(from_step=10, reached_step=10, reached_at=T0 + 10, step_s=0.2)
    events = START + [ev(4, 40, S.RECOVERING, "no progress for 30 s (hang_timeout_s=30); restarting "
                                               "the workers (1 of 3)"),
                      ev(5, 42, S.RUNNING, "training again: world size 2 on 2 node(s), step 11", replay)]
    assert check(job_at(), events, now=T0 + 50) == \
        {"waiting": 5, "starting": 3, "training": 2 + 8, "hung": 30, "recovering": 2}


def test_a_planned_change_is_resizing_and_loses_no_training_before_it():
    replay = Replay(from_step=50, reached_step=50, reached_at=T0 + 10, step_s=0.1)
    events = START + [ev(4, 20, S.RUNNING, "node(s) c joined; scaling up"),
                      ev(5, 24, S.RUNNING, "training again: world size 3 on 3 node(s), step 51", replay)]
    assert check(job_at(), events, now=T0 + 30) == \
        {"waiting": 5, "starting": 3, "training": 12 + 6, "resizing": 4}


def test_a_preempted_job_back_in_pending_is_preempted_not_waiting():
    replay = Replay(from_step=30, reached_step=30, reached_at=T0 + 19, step_s=0.1)
    events = START + [ev(4, 20, S.PENDING, "preempted by job hi-1 (priority 5)"),
                      ev(5, 21, S.PENDING, "node a holds its memory copy"),  # keeps the cause
                      ev(6, 40, S.STARTING, "given nodes a, b"),
                      ev(7, 42, S.RUNNING, "training: world size 2 on 2 node(s), step 31", replay)]
    assert check(job_at(), events, now=T0 + 50) == \
        {"waiting": 5, "starting": 3 + 2, "training": 12 + 8, "preempted": 20}


def test_snapshot_stalls_come_out_of_training():
    assert check(job_at(snapshot_stall_s=2.5), START, now=T0 + 20) == \
        {"waiting": 5, "starting": 3, "training": 9.5, "snapshot": 2.5}


def test_a_cancel_is_stopping_until_the_job_ends():
    events = START + [ev(4, 20, S.CANCELLING, "cancelled by admin"), ev(5, 22, S.CANCELLED, "cancelled")]
    assert check(job_at(S.CANCELLED, finished=22), events, now=T0 + 99) == \
        {"waiting": 5, "starting": 3, "training": 12, "stopping": 2}


def test_replayed_time_never_exceeds_the_training_of_the_group_that_redid_it():
    # 100 steps of 1 s to redo, but the new group trained 3 s, then failed again: the 4 s
    # after that are the next group's own training.
    replay = Replay(from_step=0, reached_step=100, reached_at=T0 + 19, step_s=1.0)
    events = START + [ev(4, 20, S.RECOVERING, "node b is restarting its workers"),
                      ev(5, 22, S.RUNNING, "training again: world size 2 on 2 node(s), step 1", replay),
                      ev(6, 25, S.RECOVERING, "node b is restarting its workers"),
                      ev(7, 27, S.RUNNING, "training again: world size 2 on 2 node(s), step 1")]
    assert check(job_at(), events, now=T0 + 31) == \
        {"waiting": 5, "starting": 3, "training": 11 + 4, "recovering": 1 + 2 + 2, "replayed": 3}


def test_a_replay_estimate_longer_than_its_group_leaves_the_next_fault_its_detection():
    # The new group redoes 41 steps at the stopped group's 0.1 s (4.1 s from t=23), but runs
    # faster: it reports its last step at t=26.5 and a node is lost at t=27. The 0.5 s from
    # that report to the loss is the loss's detection (recovering), not replayed.
    first = Replay(from_step=0, reached_step=41, reached_at=T0 + 19, step_s=0.1)
    second = Replay(from_step=0, reached_step=43, reached_at=T0 + 26.5, step_s=0.08)
    events = START + [ev(4, 20, S.RECOVERING, "node b is restarting its workers"),
                      ev(5, 23, S.RUNNING, "training again: world size 2 on 2 node(s), step 1", first),
                      ev(6, 27, S.RUNNING, "node b lost (its agent's connection closed)"),
                      ev(7, 27, S.RECOVERING, "node(s) b lost: restarting the 1 remaining node(s)"),
                      ev(8, 28, S.RUNNING, "training again: world size 1 on 1 node(s), step 1", second)]
    seconds = check(job_at(), events, now=T0 + 40)
    assert seconds["recovering"] == pytest.approx((23 - 19) + (28 - 26.5))
    assert seconds["replayed"] == pytest.approx(3.5 + 43 * 0.08)


def test_clock_skew_between_replicas_never_makes_a_part_negative():
    events = START + [ev(4, 7, S.RECOVERING, "node b is restarting its workers"),  # before event 3
                      ev(5, 60, S.RUNNING, "training again: world size 2 on 2 node(s), step 5")]
    assert check(job_at(), events, now=T0 + 40) == {"waiting": 5, "starting": 3, "recovering": 32}


def test_pruned_events_are_unrecorded_time():
    events = [START[0], ev(900, 50, S.RUNNING, "training again: world size 2 on 2 node(s), step 9")]
    assert check(job_at(), events, now=T0 + 60) == {"unrecorded": 50, "training": 10}


def test_an_event_that_names_no_cause_keeps_the_one_before():
    events = START + [ev(4, 9, S.RUNNING, "snapshot at step 10 is corrupt; resuming from step 0"),
                      ev(5, 10, S.RECOVERING, "node b is restarting its workers"),
                      ev(6, 11, S.RECOVERING, "attempt 2 resumes from step 0 (no snapshot)")]
    assert causes(events) == ["waiting", "starting", "training", "training", "recovering", "recovering"]


# --- where the figures come from: the commit adds its stall, the first step carries its replay


def test_each_commit_adds_its_stall_to_the_job():
    job = job_at(event_seq=3)
    req = CommitRequest(step=10, path="/s/j-abc123/10.pt", size=1, checksum="c", attempt=1, stall_s=0.25)
    once = decide_commit(job, {}, req, T0 + 1, lambda s: f"k/{s}").change.job
    twice = decide_commit(once, {}, req.model_copy(update={"step": 20, "path": "/s/j-abc123/20.pt"}),
                          T0 + 2, lambda s: f"k/{s}").change.job
    assert (once.snapshot_stall_s, twice.snapshot_stall_s) == (0.25, 0.5)


def test_the_first_step_of_a_new_group_carries_the_steps_it_redoes():
    job = make_job(S.RECOVERING, {"a": "running"}, group="a/2", regrouping=True, stopped_group="a/1",
                   restore=RestorePoint(attempt=1, tier="disk", step=80))
    stored = Progress(step=90, time=T0 + 19, steps_per_s=10.0)
    d = decide_progress(job, stored, ProgressReport(step=81, attempt=1, group="a/2"), T0 + 23, 1.0)
    (event,) = d.events
    assert event.state is S.RUNNING
    assert event.replay == Replay(from_step=80, reached_step=90, reached_at=T0 + 19, step_s=0.1)
    assert event.replay.steps == 10


def test_a_first_start_carries_no_replay():
    job = make_job(S.STARTING, {"a": "running"}, group="a/1")
    d = decide_progress(job, None, ProgressReport(step=1, attempt=1, group="a/1"), T0 + 5, 1.0)
    assert [e.replay for e in d.events] == [None]
