"""Hangs as a table: a job whose step stops advancing for `hang_timeout_s` is restarted as
after a worker failure, then fails once its restarts are spent (fixed `now`, no I/O)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.decide.hangs import (
    Watch,
    decide_hang,
    decide_stacks,
    is_watched,
    main_frames,
    not_in_collective,
    observe,
    unheard,
    where,
)
from service.models import Control, ControlAction, HungRank, JobSpec, JobState, MemberStatus
from worker.protocol import GroupCollectives, RankStacks, StacksReport
from tests.service.records import NOW, make_job

S = JobState
WHAT = "no progress for 3 s (hang_timeout_s=3)"


def hung(state=S.RUNNING, members=None, *, timeout: float | None = 3, restarts=0, max_restarts=1,
         **fields):
    job = make_job(state, members or {"a": "running", "b": "running"}, max_restarts=max_restarts,
                   rounds=fields.pop("rounds", 1), round_nodes=2, world_size=2, restarts=restarts,
                   **fields)
    return job.model_copy(update={"spec": job.spec.model_copy(update={"hang_timeout_s": timeout})})


@pytest.mark.parametrize("job,step,advanced_at", [
    (hung(timeout=None), 7, NOW - 1e6),  # no hang timeout in the spec: never watched
    (hung(), None, NOW - 1e6),  # rank 0 never reported progress (no runtime)
    (hung(), 7, NOW - 2.9),  # not yet
    (hung(S.RECOVERING), 7, NOW - 1e6),  # torchrun is re-forming the group
    (hung(regrouping=True), 7, NOW - 1e6),  # a planned change re-forms it (no group yet)
    (hung(S.CANCELLING), 7, NOW - 1e6),
    (hung(S.PENDING, {}), 7, NOW - 1e6),
    (hung(S.SUCCEEDED), 7, NOW - 1e6),
    (hung(rounds=0), 7, NOW - 1e6),  # the new attempt's group has not formed yet
    (hung(control=Control(id=1, action=ControlAction.CHECKPOINT_PAUSE, reason="join",
                          requested_at=NOW - 100)), 7, NOW - 1e6),  # paused for a planned change
])
def test_no_hang(job, step, advanced_at):
    assert decide_hang(job, step, advanced_at, NOW) is None


@pytest.mark.parametrize("since", [3.0, 3.1, 1e6])
def test_a_hang_restarts_the_workers_under_a_new_attempt_and_counts_as_a_failure(since):
    job = hung(max_restarts=2, restarts=1)
    change = decide_hang(job, 7, NOW - since, NOW)
    new = change.job
    assert (new.state, new.attempt, new.restarts) == (S.RECOVERING, 2, 2)
    assert new.reason == f"{WHAT}; restarting the workers (2 of 2)"
    assert [(e.state, e.reason) for e in change.events] == [(S.RECOVERING, new.reason)]
    assert new.members == {"a": MemberStatus(), "b": MemberStatus()}  # assigned afresh
    assert (new.rounds, new.round_nodes, new.world_size, new.stopping) == (0, 0, 0, False)
    assert not is_watched(new)  # until the new group forms
    assert new.hung_attempt == 1  # its nodes collect their workers' stacks before they stop them


@pytest.mark.parametrize("restarts,max_restarts", [(1, 1), (0, 0), (5, 3)])
def test_a_hang_once_the_restarts_are_spent_fails_the_job(restarts, max_restarts):
    change = decide_hang(hung(restarts=restarts, max_restarts=max_restarts), 7, NOW - 3, NOW)
    new = change.job
    assert new.state is S.FAILED and new.stopping and new.attempt == 1
    assert new.reason == (f"{WHAT}; workers failed {restarts + 1} times "
                          f"(max_restarts={max_restarts})")
    assert [e.state for e in change.events] == [S.FAILED]
    assert new.hung_attempt == 1


def test_a_hang_after_a_node_finished_fails_the_job_it_cannot_restart():
    change = decide_hang(hung(members={"a": "succeeded", "b": "running"}), 7, NOW - 3, NOW)
    new = change.job
    assert new.state is S.FAILED and new.stopping and new.restarts == 0
    assert new.reason.startswith(f"{WHAT} after node(s) a finished; finished nodes are not run again")


def test_a_hang_ignores_members_that_left_before_it():
    change = decide_hang(hung(members={"a": "running", "b": "stopped"}), 7, NOW - 3, NOW)
    assert list(change.job.members) == ["a"]


# ------------------------------------------------------------------ the clock

JOB = hung()
SEEN = Watch(attempt=1, rounds=1, watched=True, step=7, since=NOW - 10)


@pytest.mark.parametrize("job,step,restarts_clock", [
    (JOB, 7, False),  # nothing changed: the clock goes on
    (JOB.model_copy(update={"updated_at": NOW}), 7, False),  # a write that is no progress
    (JOB, 8, True),  # the step advanced
    (JOB, 6, True),  # or went back (resumed from a snapshot)
    (JOB.model_copy(update={"attempt": 2}), 7, True),  # a new attempt
    (JOB.model_copy(update={"rounds": 2}), 7, True),  # the group re-formed
    (JOB.model_copy(update={"state": S.RECOVERING}), 7, True),  # no longer watched
])
def test_observe_restarts_the_clock_on_progress_and_on_a_new_group(job, step, restarts_clock):
    got = observe(SEEN, job, step, NOW)
    assert got.since == (NOW if restarts_clock else SEEN.since)
    assert (got.attempt, got.rounds, got.watched, got.step) == (job.attempt, job.rounds,
                                                                  is_watched(job), step)


def test_observe_starts_a_clock_for_a_job_it_has_not_seen():
    assert observe(None, JOB, 7, NOW) == Watch(1, 1, True, 7, NOW)


def test_a_new_group_gets_the_whole_timeout_before_its_first_step():
    restarted = decide_hang(JOB, 7, NOW - 3, NOW).job
    # the new group formed: still RECOVERING (until its first step), and watched
    formed = restarted.model_copy(update={"rounds": 1, "group": "a/0"})
    watch = observe(observe(None, restarted, 7, NOW), formed, 7, NOW + 5)
    assert watch.since == NOW + 5
    assert decide_hang(formed, watch.step, watch.since, NOW + 7.9) is None
    assert decide_hang(formed, watch.step, watch.since, NOW + 8).job.state is S.FAILED


# ------------------------------------------------------------------ the spec

@pytest.mark.parametrize("value", [2, 3.5, 600, 7 * 24 * 3600])
def test_hang_timeout_s_in_the_spec(value):
    assert JobSpec(name="j", command=["x"], hang_timeout_s=value).hang_timeout_s == value
    assert JobSpec(name="j", command=["x"]).hang_timeout_s is None


@pytest.mark.parametrize("value", [0, 1, 1.9, -3, 7 * 24 * 3600 + 1, "soon", float("nan"), True])
def test_hang_timeout_s_out_of_range_is_refused(value):
    with pytest.raises(ValidationError) as err:
        JobSpec(name="j", command=["x"], hang_timeout_s=value)
    assert err.value.errors()[0]["loc"] == ("hang_timeout_s",)


@pytest.mark.parametrize("last_look,now,stall_after_s,expected", [
    (None, NOW, 1.5, 0.0),  # never looked: a fresh clock anyway
    (NOW - 10, NOW, None, 0.0),  # no pass interval known: nothing discounted
    (NOW - 1.5, NOW, 1.5, 0.0),  # passes as they come round
    (NOW - 10, NOW, 1.5, 8.5),  # stopped 10 s: the part beyond a pass's gap was not heard
])
def test_unheard_is_the_part_of_a_gap_in_the_passes_beyond_their_interval(last_look, now, stall_after_s,
                                                                           expected):
    assert unheard(last_look, now, stall_after_s) == expected


def test_a_stall_of_the_control_plane_is_not_counted_by_the_hang_clock():
    """The leader SIGSTOPped for 10 s (its last look at NOW - 10, step 7 seen since NOW - 11):
    after it, the clock stands at 1 s + the 1.5 s a pass may take, not 11 s; it runs on from
    there. Before: a hang at its first pass, before any progress report could land."""
    seen = Watch(attempt=1, rounds=1, watched=True, step=7, since=NOW - 11, seen_at=NOW - 10)
    assert decide_hang(JOB, 7, observe(seen, JOB, 7, NOW).since, NOW) is not None  # counted: hung
    watch = observe(seen, JOB, 7, NOW, stall_after_s=1.5)
    assert (watch.since, watch.seen_at) == (NOW - 2.5, NOW)
    assert decide_hang(JOB, 7, watch.since, NOW) is None
    later = observe(watch, JOB, 7, NOW + 0.5, stall_after_s=1.5)  # passes come round: it counts
    assert later.since == NOW - 2.5 and decide_hang(JOB, 7, later.since, NOW + 0.5) is not None


# ------------------------------------------------------------------ the stacks of a hung attempt

WAITING = """Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/torch/distributed/distributed_c10d.py", line 2730 in broadcast
  File "/venv/torch/distributed/c10d_logger.py", line 81 in wrapper
  File "/job/worker/control.py", line 118 in agree
  File "/job/train.py", line 30 in main
  File "/job/train.py", line 40 in <module>
"""
BEHIND = """Current thread 0x00007f0000000003 (most recent call first):
  File "/job/train.py", line 33 in main
  File "/job/train.py", line 40 in <module>
"""


@pytest.mark.parametrize("dump,expected", [
    (WAITING, (True, "in a collective: broadcast (distributed_c10d.py:2730)")),
    (BEHIND, (False, "not in a collective: main (train.py:33)")),
    ("", (None, "no stacks (the worker did not answer)")),
])
def test_where_says_whether_the_main_thread_waits_in_a_collective(dump, expected):
    assert where(main_frames(dump)) == expected


def test_main_frames_are_the_last_threads_innermost_first():
    assert main_frames(BEHIND) == [("/job/train.py", 33, "main"), ("/job/train.py", 40, "<module>")]


def stacks_of(attempt=1, **texts):
    return StacksReport(job_id="j-abc123", attempt=attempt,
                        ranks=[RankStacks(rank=int(k[1:]), text=v) for k, v in texts.items()])


def test_the_stacks_of_a_hung_attempt_are_an_event_naming_the_ranks_behind():
    job = hung(hung_attempt=1)
    change = decide_stacks(job, "a", stacks_of(r0=WAITING, r1=BEHIND, r2=""), NOW)
    [event] = change.events
    assert event.reason == (
        "stacks of hung attempt 1 on node a: rank 0 in a collective: broadcast (distributed_c10d.py:2730); "
        "rank 1 not in a collective: main (train.py:33); rank 2 no stacks (the worker did not answer) "
        "(did not reach the collective: rank 1)")
    assert event.detail == f"rank 0:\n{WAITING}\nrank 1:\n{BEHIND}\nrank 2:\n(none)"
    assert change.job.event_seq == job.event_seq + 1 and change.job.state is job.state


@pytest.mark.parametrize("job,node,attempt", [
    (hung(), "a", 1),  # not taken for hung
    (hung(hung_attempt=1), "a", 0),  # another attempt's
    (hung(hung_attempt=1), "z", 1),  # not the job's node
])
def test_stacks_not_of_the_hung_attempt_are_ignored(job, node, attempt):
    assert decide_stacks(job, node, stacks_of(attempt, r0=WAITING), NOW) is None


# ------------------------------------------------------------------ the flight recorders' verdict

def pg(enqueued, completed, op="gloo:all_reduce", name="default_pg"):
    return GroupCollectives(pg=name, last_enqueued=enqueued, last_completed=completed, op=op)


def ranks(**kw):
    return {int(k[1:]): HungRank(waits=w, collectives=c) for k, (w, c) in kw.items()}


@pytest.mark.parametrize("found,expected", [
    # rank 1 entered #4 last, ranks 0 and 2 wait in #5: rank 1 never reached it
    (ranks(r0=(True, [pg(5, 4)]), r1=(False, [pg(4, 4)]), r2=(True, [pg(5, 4)])),
     ([1], "collective #5 gloo:all_reduce of group default_pg")),
    # the sequence numbers win over stacks that say nothing (a rank blocked outside torch's code)
    (ranks(r0=(False, [pg(7, 6, "gloo:broadcast")]), r1=(False, [pg(6, 6)])),
     ([1], "collective #7 gloo:broadcast of group default_pg")),
    # two groups, a rank behind in each
    (ranks(r0=(True, [pg(5, 4), pg(2, 1, "gloo:barrier", "sub")]), r1=(True, [pg(4, 4), pg(2, 1, None, "sub")]),
           r2=(True, [pg(5, 4), pg(1, 1, None, "sub")])),
     ([1, 2], "collective #5 gloo:all_reduce of group default_pg, collective #2 gloo:barrier of group sub")),
    # all at one number: nobody is behind by the recorder; the stacks name the one outside
    (ranks(r0=(True, [pg(5, 4)]), r1=(False, [pg(5, 4)])), ([1], "the collective")),
    # the ranks ahead completed their last collective: they do not wait in it
    (ranks(r0=(False, [pg(5, 5)]), r1=(False, [pg(4, 4)])), None),
    # no recorder (off, or no answer): the stacks alone
    (ranks(r0=(True, None), r1=(False, None), r2=(None, None)), ([1], "the collective")),
    (ranks(r0=(True, None), r1=(True, [])), None),
    (ranks(r0=(False, None)), None),
    ({}, None),
])
def test_the_ranks_not_in_the_collective_are_those_behind_in_sequence_else_by_stacks(found, expected):
    assert not_in_collective(found) == expected


def report_of(attempt=1, **texts):
    """Each rank's (stacks, flight-recorder groups)."""
    return StacksReport(job_id="j-abc123", attempt=attempt, ranks=[
        RankStacks(rank=int(k[1:]), text=t, collectives=c) for k, (t, c) in texts.items()])


def test_the_last_nodes_event_compares_every_nodes_ranks_by_sequence():
    """One rank a node: node b's rank 1 sleeps before #5, node a's rank 0 waits in it. The first
    report alone shows nothing; the second names rank 1 by the numbers node a reported."""
    job = hung(hung_attempt=1, hung_ranks={9: HungRank(waits=True)})  # another attempt's, dropped below
    job = decide_hang(job.model_copy(update={"hung_attempt": None}), 7, NOW - 10, NOW).job
    first = decide_stacks(job, "b", report_of(job.attempt - 1, r1=(BEHIND, [pg(4, 4)])), NOW)
    [event] = first.events
    assert event.reason == ("stacks of hung attempt 1 on node b: rank 1 not in a collective: main "
                            "(train.py:33), last entered #4 gloo:all_reduce of group default_pg")
    second = decide_stacks(first.job, "a", report_of(job.attempt - 1, r0=(WAITING, [pg(5, 4)])), NOW)
    [event] = second.events
    assert event.reason == (
        "stacks of hung attempt 1 on node a: rank 0 in a collective: broadcast (distributed_c10d.py:2730), "
        "last entered #5 gloo:all_reduce of group default_pg "
        "(did not reach collective #5 gloo:all_reduce of group default_pg: rank 1)")
    assert sorted(second.job.hung_ranks) == [0, 1]


def test_the_ranks_kept_for_later_reports_are_bounded():
    from service.decide.hangs import MAX_HUNG_GROUPS, MAX_HUNG_RANKS

    job = hung(hung_attempt=1)
    many = [pg(5, 4, name=f"g{i}") for i in range(MAX_HUNG_GROUPS + 3)]
    report = StacksReport(job_id="j-abc123", attempt=1, ranks=[
        RankStacks(rank=r, text="", collectives=many) for r in range(MAX_HUNG_RANKS + 10)])
    kept = decide_stacks(job, "a", report, NOW).job.hung_ranks
    assert sorted(kept) == list(range(MAX_HUNG_RANKS))
    assert all(len(r.collectives) == MAX_HUNG_GROUPS for r in kept.values())
