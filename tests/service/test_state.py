"""The job state machine as a table (pure logic, no I/O)."""

import pytest

from service.decide.cancel import cancel
from service.decide.state import ALLOWED, split_reason, transition
from service.errors import InvalidTransition
from service.models import JobRecord, JobSpec, JobState

S = JobState
NOW = 1000.0


def job(state: JobState) -> JobRecord:
    return JobRecord(id="j-1", spec=JobSpec(name="j", command=["true"]), state=state,
                     created_at=1.0, updated_at=1.0, event_seq=3)


@pytest.mark.parametrize("current", list(S))
@pytest.mark.parametrize("target", list(S))
def test_transition_table(current, target):
    if target in ALLOWED[current]:
        moved, event = transition(job(current), target, "why", NOW)
        assert moved.state is target and moved.reason == "why" and moved.updated_at == NOW
        assert event.seq == 4 and moved.event_seq == 4 and event.state is target
        assert (moved.finished_at == NOW) == target.is_terminal()
    else:
        with pytest.raises(InvalidTransition):
            transition(job(current), target, "why", NOW)


@pytest.mark.parametrize("terminal", [S.SUCCEEDED, S.FAILED, S.CANCELLED])
def test_terminal_states_never_change(terminal):
    assert terminal.is_terminal()
    assert ALLOWED[terminal] == frozenset()
    with pytest.raises(InvalidTransition):
        cancel(job(terminal), NOW)


@pytest.mark.parametrize("state,expected", [
    (S.PENDING, S.CANCELLED), (S.RUNNING, S.CANCELLING), (S.RECOVERING, S.CANCELLING),
])
def test_cancel(state, expected):
    moved, event = cancel(job(state), NOW)
    assert moved.state is expected and event is not None


def test_cancel_twice_is_a_noop():
    moved, event = cancel(job(S.CANCELLING), NOW)
    assert moved.state is S.CANCELLING and event is None


# ------------------------------------------------------------------ one-line reasons

@pytest.mark.parametrize("reason,line,detail", [
    ("node n0 lost", "node n0 lost", None),
    ("node n0: command not found: trian.py\nlast lines:\n[rank0] x", "node n0: command not found: trian.py",
     "last lines:\n[rank0] x"),
    ("  padded\n\n", "padded", None),
    ("x" * 400, "x" * 299 + "…", "x" * 400),
])
def test_split_reason_keeps_one_line_for_the_job_and_the_rest_for_the_event(reason, line, detail):
    assert split_reason(reason) == (line, detail)


def test_a_transition_with_log_lines_gives_the_job_one_line_and_the_event_the_lines():
    why = "node n0: rank 0: ValueError: boom\nlast lines:\n[rank0] a"
    changed, event = transition(job(S.RUNNING), S.FAILED, why, 5.0)
    assert changed.reason == event.reason == "node n0: rank 0: ValueError: boom"
    assert event.detail == "last lines:\n[rank0] a"
